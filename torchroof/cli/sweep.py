"""``torchroof sweep``: step time and tokens/s against batch, context or sequence length."""

from __future__ import annotations

import argparse

from torchroof.cli.common import (
    Subparsers,
    add_quiet,
    base_settings,
    workload_args,
    writable,
    wrote,
)
from torchroof.render.files import SWEEP_OUTPUTS, sweep_output, write_sweep
from torchroof.render.text import sweep_table
from torchroof.studies import SWEEP_KEYS
from torchroof.workloads import regime


def add_parser(commands: Subparsers) -> None:
    """The ``sweep`` command and its flags."""
    swp = commands.add_parser(
        "sweep",
        help="step time and tokens/s against batch/context/seq",
        usage="%(prog)s [model] [--over KEY] [--values V1,V2,...] [options]",
    )
    workload_args(swp)
    swp.add_argument("--over", choices=SWEEP_KEYS, default="batch")
    swp.add_argument(
        "--values", default="1,2,4,8,16,32,64,128,256,512", help="comma-separated sizes"
    )
    swp.add_argument("--csv", metavar="PATH")
    swp.add_argument("--plot", metavar="PATH", help="curve (.png, .svg or .pdf)")
    swp.add_argument("--html", metavar="PATH", help="the curves and every point, interactive")
    add_quiet(swp)


def run(args: argparse.Namespace) -> None:
    from torchroof.studies import sweep

    flags = (("csv", args.csv), ("plot", args.plot), ("html", args.html))
    outputs = [(kind, path) for kind, path in flags if path]
    writable(*(path for _, path in outputs))
    for kind, path in outputs:
        sweep_output(path, kind)  # a plot named .jpg fails before any work
    values = [int(v) for v in args.values.split(",") if v.strip()]
    base = base_settings(args)
    base.pop(args.over, None)
    result = sweep(args.model, args.over, values, **base)
    print(f"torchroof sweep: {args.model} {args.regime} over {args.over}")
    print(sweep_table(result))
    workload = result.points[0].estimate.workload  # as traced (seq resolved)
    assert workload is not None  # a sweep traces a model's workload at every point
    for line in regime(args.regime).sweep_summary(result, args.over, workload):
        print(line)
    for kind, path in outputs:
        write_sweep(result, path, kind)
        wrote(SWEEP_OUTPUTS[kind], path)

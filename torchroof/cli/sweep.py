"""``torchroof sweep``: step time and tokens/s against batch, context or sequence length,
or over a grid of several axes at once (``--over batch=1,8 --over context=1024,8192``)."""

from __future__ import annotations

import argparse
import math

from torchroof.cli.common import (
    Subparsers,
    add_quiet,
    base_settings,
    workload_args,
    writable,
    wrote,
)
from torchroof.render.files import (
    GRID_OUTPUTS,
    SWEEP_OUTPUTS,
    grid_output,
    sweep_output,
    write_grid,
    write_sweep,
)
from torchroof.render.html import check_grid_page
from torchroof.render.text import grid_tables, sweep_table
from torchroof.studies import GRID_KEYS, SWEEP_KEYS, parse_value
from torchroof.workloads import regime

DEFAULT_VALUES = "1,2,4,8,16,32,64,128,256,512"


def add_parser(commands: Subparsers) -> None:
    """The ``sweep`` command and its flags."""
    swp = commands.add_parser(
        "sweep",
        help="step time and tokens/s against batch/context/seq, or over a grid of axes",
        usage="%(prog)s [model] [--over KEY --values V1,V2,... | --over KEY=V1,V2 ...] [options]",
    )
    workload_args(swp)
    swp.add_argument(
        "--over",
        action="append",
        metavar="KEY or KEY=V1,V2",
        help=f"the size to sweep ({', '.join(SWEEP_KEYS)}; default batch) with --values, or "
        "KEY=V1,V2,... repeated for a grid of every combination (KEY also hardware or a "
        "pricing option)",
    )
    swp.add_argument("--values", help=f"comma-separated sizes (default {DEFAULT_VALUES})")
    swp.add_argument("--csv", metavar="PATH", help="one row per point")
    swp.add_argument("--json", metavar="PATH", help="one object per point")
    swp.add_argument(
        "--plot", metavar="PATH", help="curve, or a grid's heat maps (.png, .svg, .pdf)"
    )
    swp.add_argument(
        "--html",
        metavar="PATH",
        help="the curves and every point, interactive (a grid: a slider per axis)",
    )
    add_quiet(swp)


def grid_axes(over: list[str], values: str | None) -> dict[str, list] | None:
    """The grid ``--over KEY=V1,V2`` flags give; None for the one-size form (``--over KEY
    --values ...``). ValueError in one line for a mix of the two forms, an unknown key or
    an empty axis."""
    given = [o for o in over if "=" in o]
    if not given:
        return None
    if len(given) != len(over) or values is not None:
        raise ValueError(
            "--over KEY=V1,V2 names each axis with its values: give every axis that way "
            "(no --values)"
        )
    axes: dict[str, list] = {}
    for text in given:
        key, _, listed = text.partition("=")
        key = key.strip()
        if key not in GRID_KEYS:
            raise ValueError(f"--over {text}: sweep over one of {', '.join(GRID_KEYS)}")
        if key in axes:
            raise ValueError(f"--over {key} is given twice")
        parsed = [parse_value(key, v) for v in listed.split(",") if v.strip()]
        if not parsed:
            raise ValueError(f"--over {text}: no values")
        axes[key] = parsed
    return axes


def run(args: argparse.Namespace) -> None:
    over = args.over or ["batch"]
    axes = grid_axes(over, args.values)
    if axes is None:
        return _run_sweep(args, over)
    from torchroof.studies import sweep_grid

    flags = (("csv", args.csv), ("json", args.json), ("plot", args.plot), ("html", args.html))
    outputs = [path for _, path in flags if path]
    if args.html:
        check_grid_page(math.prod(len(values) for values in axes.values()))
    writable(*outputs)
    for flag, path in flags:  # a plot named .jpg, or --csv grid.png, fails before any work
        if path and grid_output(path, len(axes)) != flag:
            raise ValueError(f"--{flag} {path}: the suffix names another kind of output")
    base = base_settings(args)
    for key in axes:
        base.pop(key, None)
    result = sweep_grid(args.model, axes, **base)
    named = " x ".join(f"{key} ({len(values)})" for key, values in axes.items())
    print(f"torchroof sweep: {args.model} {args.regime} over {named}: {len(result.points)} points")
    print(grid_tables(result))
    for line in result.notes:  # points traced afresh or priced whole, and why
        print(f"note: {line}")
    for path in outputs:
        write_grid(result, path)
        wrote(GRID_OUTPUTS[grid_output(path, len(axes))], path)


def _run_sweep(args: argparse.Namespace, over: list[str]) -> None:
    from torchroof.studies import sweep

    if len(over) > 1:
        raise ValueError("one --over KEY per sweep; for a grid give --over KEY=V1,V2 per axis")
    key = over[0]
    if key not in SWEEP_KEYS:
        raise ValueError(f"--over: invalid choice: {key!r} (choose from {', '.join(SWEEP_KEYS)})")
    if args.json:
        raise ValueError("--json writes a grid: give the sizes as --over KEY=V1,V2")
    flags = (("csv", args.csv), ("plot", args.plot), ("html", args.html))
    outputs = [(kind, path) for kind, path in flags if path]
    writable(*(path for _, path in outputs))
    for kind, path in outputs:
        sweep_output(path, kind)  # a plot named .jpg fails before any work
    values = [int(v) for v in (args.values or DEFAULT_VALUES).split(",") if v.strip()]
    base = base_settings(args)
    base.pop(key, None)
    result = sweep(args.model, key, values, **base)
    print(f"torchroof sweep: {args.model} {args.regime} over {key}")
    print(sweep_table(result))
    workload = result.points[0].estimate.workload  # as traced (seq resolved)
    assert workload is not None  # a sweep traces a model's workload at every point
    for line in regime(args.regime).sweep_summary(result, key, workload):
        print(line)
    for kind, path in outputs:
        write_sweep(result, path, kind)
        wrote(SWEEP_OUTPUTS[kind], path)

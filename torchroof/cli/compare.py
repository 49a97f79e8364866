"""``torchroof compare``: variants of one workload side by side."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from torchroof.cli.common import (
    Subparsers,
    add_quiet,
    base_settings,
    workload_args,
    writable,
    wrote,
)
from torchroof.render.text import layer_deltas, variants_table


def add_parser(commands: Subparsers) -> None:
    """The ``compare`` command and its flags."""
    cmp = commands.add_parser(
        "compare",
        help="variants side by side (--vary KEY=V1,V2,...)",
        usage="%(prog)s [model] --vary KEY=V1,V2 [options]",
    )
    workload_args(cmp)
    cmp.add_argument(
        "--vary",
        action="append",
        required=True,
        metavar="KEY=V1,V2",
        help="estimate argument or config field to vary; repeatable",
    )
    cmp.add_argument("--layers", action="store_true", help="also per-layer deltas vs the first")
    cmp.add_argument("--html", metavar="PATH", help="the variants side by side, interactive")
    add_quiet(cmp)


def run(args: argparse.Namespace) -> None:
    from torchroof.render.files import check_html_path
    from torchroof.studies import compare, parse_value

    if args.html:
        writable(args.html)
        check_html_path(args.html)  # before any tracing
    vary: dict[str, Sequence[Any]] = {}
    for item in args.vary:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--vary takes KEY=V1,V2,..., got {item!r}")
        if key.strip() in vary:
            raise ValueError(
                f"--vary {key.strip()} is given twice; give all its values in one: "
                f"--vary {key.strip()}=V1,V2,..."
            )
        vary[key.strip()] = [parse_value(key.strip(), v) for v in values.split(",") if v.strip()]
    result = compare(args.model, vary, **base_settings(args))
    print(f"torchroof compare: {args.model} {args.regime}")
    print(variants_table(result))
    if args.layers:
        print()
        print(layer_deltas(result))
    if args.html:
        from torchroof.render.html import comparison_html

        comparison_html(result, args.html)
        wrote("the interactive comparison (HTML)", args.html)

"""``torchroof zoo``: trace every causal-LM architecture transformers ships."""

from __future__ import annotations

import argparse
import os

from torchroof.cli.common import Subparsers, add_quiet, positive_int


def add_parser(commands: Subparsers) -> None:
    """The ``zoo`` command and its flags."""
    zoo = commands.add_parser("zoo", help="trace every causal-LM architecture in transformers")
    zoo.add_argument("--regimes", default="prefill,decode,train")
    zoo.add_argument("--arch", action="append", default=None, help="one architecture; repeatable")
    zoo.add_argument("--json", metavar="PATH", default=None)
    zoo.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="worker processes"
    )
    zoo.add_argument("--table", action="store_true", help="print every row as a table")
    add_quiet(zoo)


def run(args: argparse.Namespace) -> None:

    from torchroof.validation import zoo

    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = [r for r in regimes if r not in zoo.ZOO_WORKLOADS]
    if unknown:
        raise ValueError(f"unknown regimes {unknown}; choose from {sorted(zoo.ZOO_WORKLOADS)}")
    zoo.run_and_report(args.arch, regimes, args.jobs, args.json, show_table=args.table)

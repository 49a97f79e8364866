"""The ``torchroof`` command: a thin layer over the Python API that prints its objects."""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence

from torchroof.capture.budget import OpBudgetExceeded
from torchroof.cli import (
    calibrate,
    compare,
    estimate,
    hardware,
    labs,
    models,
    plan,
    serve,
    sweep,
    validate,
    zoo,
)
from torchroof.cli.common import Parser, UsageError, given_dests
from torchroof.hardware import UnknownHardwareError, UnsupportedDtypeError
from torchroof.models.sources import UnknownModelError
from torchroof.progress import reporting

HANDLERS = {
    "estimate": estimate.run,
    "hardware": hardware.run,
    "models": models.run,
    "compare": compare.run,
    "sweep": sweep.run,
    "serve": serve.run,
    "plan": plan.run,
    "roofline": labs.run_roofline,
    "zoo": zoo.run,
    "calibrate": calibrate.run,
    "validate": validate.run,
    "gemm": labs.run_gemm,
    "fusion-bench": labs.run_fusion_bench,
    "lab": labs.run_lab,
}


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="torchroof",
        description="Roofline time budgets for PyTorch models, traced on the meta device.",
    )
    commands = parser.add_subparsers(dest="command", parser_class=Parser)
    for command in (
        estimate,
        compare,
        sweep,
        serve,
        plan,
        calibrate,
        validate,
        zoo,
        labs,
        hardware,
        models,
    ):
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as error:
        print(f"torchroof: error: {error}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    args.given = given_dests(parser, sys.argv[1:] if argv is None else argv)
    try:  # long commands show their progress on stderr unless --quiet
        with reporting(not getattr(args, "quiet", True)):
            HANDLERS[args.command](args)
    except (
        UnknownHardwareError,
        UnknownModelError,
        UnsupportedDtypeError,
        ValueError,
        FileNotFoundError,
        ImportError,
        OpBudgetExceeded,
    ) as error:
        print(f"torchroof: error: {error}", file=sys.stderr)
        return 2
    return 0


def console() -> int:
    """The ``torchroof`` command: :func:`main`, then ``gc.freeze()``
    (docs.python.org/3/library/gc.html): every object alive then, the imported libraries'
    and a traced model's alike, is left out of the garbage collector's last pass as Python
    exits, a pass over hundreds of thousands of objects whose memory the operating system
    takes back with the process anyway. The cost: a reference cycle still waiting for
    collection then has no finalizer run (the command closes its files and workers
    itself). An estimate of Llama-3-70B's decode at TP 8 exits about a second sooner."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    raise SystemExit(console())

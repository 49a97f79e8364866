"""What the commands share: the parser that reports one line, argument types, output checks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn, TypeAlias

from torchroof.config import PricingOptions, Workload, add_flags, flag_group, from_flags
from torchroof.models.sources import DEFAULT_MODEL

DEFAULT_HARDWARE = "h100-sxm"
# the object add_subparsers returns: each command module adds its parser to it
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class UsageError(ValueError):
    """A command line argparse refused: reported as one line, like every bad input."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="do not show progress (by default each stage and its time goes to stderr)",
    )


def workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"shipped config name, config.json or model dir (default {DEFAULT_MODEL})",
    )
    flag_group(parser, "workload").add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"accelerator or cluster name, alias or TOML path (default {DEFAULT_HARDWARE})",
    )
    add_flags(parser, Workload)
    add_flags(parser, PricingOptions)


def base_settings(args: argparse.Namespace) -> dict:
    """Every knob as parsed: the hardware, the workload's fields, the pricing fields."""
    return {
        "hardware": args.hardware,
        **from_flags(args, Workload),
        **from_flags(args, PricingOptions),
    }


def writable(*paths: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done (a bad path
    used to fail after the whole table had printed)."""
    named = [path for path in paths if path]
    resolved = [Path(path).resolve() for path in named]
    for n, full in enumerate(resolved):
        if full in resolved[:n]:
            raise ValueError(
                f"two outputs to one path, {named[n]}: the second would overwrite the first; "
                "give each output its own path"
            )
    for path in paths:
        if not path:
            continue
        target = Path(path)
        folder = target.parent if str(target.parent) else Path(".")
        if target.is_dir():
            raise ValueError(f"cannot write {path}: it is a folder")
        if not folder.is_dir():
            raise ValueError(f"cannot write {path}: no folder {folder}")
        if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
            raise ValueError(f"cannot write {path}: permission denied")


def wrote(what: str, path: str) -> None:
    print(f"torchroof: wrote {what} to {path}", file=sys.stderr)


def check_plot(path: str | None) -> None:
    """Refuse a plot path with an unknown suffix before anything is computed."""
    if path:
        from torchroof.render.plots import check_plot_path

        check_plot_path(path)

"""What the commands share: the parser that reports one line, argument types, output checks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from torchroof.config import PricingOptions, Workload, add_flags, flag_group, from_flags
from torchroof.config.pricing import KERNEL_POLICY_FIELDS
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


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the options written on the command line ``argv`` (``--fusion``,
    ``--fusion=eager`` and the prefix ``--fus`` alike), the command's own parser's included:
    what a runtime's settings must not replace."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                actions += sub._actions
    written = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    options = {o: a.dest for a in actions for o in a.option_strings if o.startswith("--")}
    given = set()
    for word in written:
        if word in options:
            given.add(options[word])
        else:  # argparse takes a unique prefix of a long option (--fus for --fusion)
            given.update(dest for o, dest in options.items() if o.startswith(word))
    return given


def workload_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The workload fields as parsed, with the runtime's defaults for those not written
    (:func:`torchroof.pricing.runtime.workload_defaults`)."""
    from torchroof.pricing.runtime import workload_defaults

    values = from_flags(args, Workload)
    given: set[str] = getattr(args, "given", set())
    written = {k: v for k, v in values.items() if k in given or k == "pp"}
    pricing = PricingOptions(runtime=getattr(args, "runtime", "") or "")
    return {**values, **workload_defaults(pricing, written, regime=values.get("regime"))}


def _written(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` written on the command line (every field where ``main`` did not
    record what was written)."""
    values = from_flags(args, cls)
    given = getattr(args, "given", None)
    return values if given is None else {k: v for k, v in values.items() if k in given}


def pricing_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The pricing fields as parsed; with ``--runtime``, its kernel settings for the kernel
    flags not written (:func:`torchroof.pricing.runtime.with_knobs`)."""
    from torchroof.pricing.runtime import with_knobs

    values = from_flags(args, PricingOptions)
    if not values.get("runtime"):
        return values
    given: set[str] = getattr(args, "given", set())
    written = {k: v for k, v in values.items() if k in given or k == "runtime"}
    resolved = with_knobs(None, written).to_dict()
    return {**values, **{k: resolved[k] for k in KERNEL_POLICY_FIELDS}, **written}


def base_settings(args: argparse.Namespace) -> dict:
    """The hardware and the knobs written on the command line: the others keep their
    defaults, so that each point of a comparison or sweep gets its runtime's kernels and
    workload defaults (``--vary runtime=...``)."""
    written = {**_written(args, Workload), **_written(args, PricingOptions)}
    return {"hardware": args.hardware, **written}


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

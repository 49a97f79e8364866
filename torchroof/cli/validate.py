"""``torchroof validate``: predicted against measured time for a real step on this machine."""

from __future__ import annotations

import argparse

from torchroof.cli.common import Subparsers, add_quiet, positive_int
from torchroof.config import KERNEL_TIMING_MODES, REGIMES
from torchroof.models.sources import DEFAULT_MODEL


def add_parser(commands: Subparsers) -> None:
    """The ``validate`` command and its flags."""
    val = commands.add_parser("validate", help="predicted vs measured for a real step")
    val.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    val.add_argument("--regime", choices=REGIMES, default="prefill")
    val.add_argument("--device", default="cpu")
    val.add_argument(
        "--hardware",
        default=None,
        help="fixed hardware TOML (default: calibrate just before each repeat of the step)",
    )
    val.add_argument(
        "--mode",
        choices=KERNEL_TIMING_MODES,
        default="roofline",
        help="prediction for the kernel table and diagnosis (both modes' ratios are printed)",
    )
    val.add_argument(
        "--repeats", type=positive_int, default=3, help="calibrate + time the step, N times"
    )
    val.add_argument(
        "--iterations", type=positive_int, default=3, help="timed steps per repeat (median)"
    )
    val.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    val.add_argument("--batch", type=positive_int, default=1)
    val.add_argument(
        "--seq",
        type=positive_int,
        default=256,
        help="tokens per sequence; for decode, the cache's context",
    )
    val.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="override num_hidden_layers (CPU default 4)",
    )
    val.add_argument(
        "--hidden", type=positive_int, default=None, help="override hidden_size (CPU default 512)"
    )
    val.add_argument("--json", metavar="PATH")
    add_quiet(val)


def run(args: argparse.Namespace) -> None:
    from torchroof.validation.validate import validate

    overrides = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.hidden:
        overrides["hidden_size"] = args.hidden
    result = validate(
        args.model,
        args.regime,
        device=args.device,
        hardware=args.hardware,
        batch=args.batch,
        seq=args.seq,
        overrides=overrides,
        iterations=args.iterations,
        repeats=args.repeats,
        mode=args.mode,
        threads=args.threads,
    )
    print(result.table())
    print()
    print(result.summary())
    if args.json:
        result.to_json(args.json)

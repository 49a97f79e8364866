"""``torchroof calibrate``: measure this device's ceilings and write them as hardware TOML."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchroof.cli.common import Subparsers, add_quiet
from torchroof.progress import current as current_progress


def add_parser(commands: Subparsers) -> None:
    """The ``calibrate`` command and its flags."""
    cal = commands.add_parser("calibrate", help="measure this device's ceilings -> TOML")
    cal.add_argument("--device", default="cpu", help="cpu or cuda")
    cal.add_argument("-o", "--output", default=None, help="TOML path (default: print it)")
    cal.add_argument("--name", default=None, help="spec name (default: <device>-measured)")
    add_quiet(cal)


def run(args: argparse.Namespace) -> None:
    from torchroof.validation.calibrate import calibrate

    result = calibrate(args.device, progress=lambda m: current_progress().begin(f"measuring {m}"))
    text = result.to_toml(args.name or f"{args.device.replace(':', '-')}-measured")
    print("\n".join(result.lines()))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text)

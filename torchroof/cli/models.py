"""``torchroof models``: the shipped model configs."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from torchroof.cli.common import Subparsers
from torchroof.models.sources import shipped_models


def add_parser(commands: Subparsers) -> None:
    """The ``models`` command."""
    commands.add_parser("models", help="list the shipped model configs")


def run(_args: argparse.Namespace) -> None:
    from torchroof.models.sources import shipped_config_dict

    rows = [
        [name, shipped_config_dict(name)["model_type"], shipped_config_dict(name)["_source"]]
        for name in shipped_models()
    ]
    print(tabulate(rows, headers=["name", "model_type", "source"]))

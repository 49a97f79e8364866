"""The value checks every settings dataclass shares: one of a list, a positive integer, a
finite number, and the fields a saved copy holds that the dataclass lacks."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from torchroof.config.errors import OptionError
from torchroof.config.flags import flag_name


def choose(
    name: str, value: Any, known: Collection[str], error: type[OptionError] = OptionError
) -> None:
    """``value`` one of ``known``; else an error listing them."""
    if value not in known:
        raise error(f"unknown {name} {value!r}; choose one of {', '.join(known)}")


def finite_numbers(options: Any, error: type[OptionError] = OptionError) -> None:
    """Every float field of ``options`` a finite number (nan and inf pass a comparison
    check the wrong way, or price as inf): the field and its flag named."""
    for f in fields(options):
        value = getattr(options, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{f.name} ({flag_name(f)}) must be a finite number, got {value!r}")


def positive_int(name: str, value: Any, error: type[OptionError] = OptionError) -> None:
    """``value`` an int (not a bool) above 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{name} must be a positive integer, got {value!r}")


def unknown_fields(cls: type, saved: Mapping[str, Any]) -> list[str]:
    """The keys of ``saved`` (a dataclass written as its fields) that ``cls`` has no field
    for, sorted: what a file written by another version holds that this one cannot read."""
    return sorted(set(saved) - {f.name for f in fields(cls)})

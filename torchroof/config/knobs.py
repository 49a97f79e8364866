"""Every knob by name, and a dict of knobs split into Workload's and PricingOptions'."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torchroof.config.errors import OptionError
from torchroof.config.pricing import PricingOptions
from torchroof.config.workload import Workload

WORKLOAD_KNOBS = tuple(f.name for f in fields(Workload))
PRICING_KNOBS = tuple(f.name for f in fields(PricingOptions))


def split_knobs(knobs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(workload fields, pricing fields) of ``knobs``; any other name is an error that
    lists every knob."""
    unknown = sorted(set(knobs) - set(WORKLOAD_KNOBS) - set(PRICING_KNOBS))
    if unknown:
        raise OptionError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"options are {', '.join(WORKLOAD_KNOBS + PRICING_KNOBS)}"
        )
    workload = {k: v for k, v in knobs.items() if k in WORKLOAD_KNOBS}
    pricing = {k: v for k, v in knobs.items() if k in PRICING_KNOBS}
    return workload, pricing

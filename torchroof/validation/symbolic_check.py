"""Steps traced once with their sizes as symbols, held to fresh estimates on the zoo's
architectures: a model prepared at one batch and length (:func:`torchroof.prepare`) and
priced at other points must give, at each, the estimate a fresh :func:`torchroof.estimate`
of that point gives (every JSON field) and the figures a grid reads of it
(:meth:`~torchroof.prepared.PreparedModel.metrics`: step time, tokens/s, MFU, traffic,
memory, fit), in both timing modes. What the prepared model did for them (symbolic traces,
points made from them, points priced from kernels planned for every size, and why a point
was traced afresh) is recorded beside.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torchroof.quiet import quiet_imports, quiet_trace

POINTS = ((3, 32), (2, 17), (5, 48), (4, 100), (1, 20), (16, 33))
"""(batch, length) points priced: the first is the one prepared; a batch of 1 broadcasts
differently from the others (a symbolic trace of its own)."""

LENGTH = {"prefill": "seq", "decode": "context"}


@dataclass
class SymbolicCheck:
    """One zoo step priced at :data:`POINTS` from a prepared model, against fresh estimates."""

    points: int = 0  # (point, timing mode) pairs priced
    differences: list[str] = field(default_factory=list)  # where a figure or field differs
    symbolic: int = 0  # symbolic traces the prepared model made
    substituted: int = 0  # traces it made from them
    planned: int = 0  # figures it priced from kernels planned for every size
    notes: list[str] = field(default_factory=list)  # why a point was traced or priced whole


def symbolic_check(architecture: str, regime: str, hardware: str = "h100-sxm") -> SymbolicCheck:
    """Prepare the zoo architecture's ``regime`` step at the first of :data:`POINTS`, price
    every point (its figures, then its estimate) in the pure and the realistic timing mode,
    and compare each with a fresh estimate of the same point."""
    from torchroof.api import estimate
    from torchroof.models.completions import default_config
    from torchroof.prepared import prepare
    from torchroof.report.compare import point_metrics

    length = LENGTH[regime]
    check = SymbolicCheck()
    with warnings.catch_warnings(), quiet_imports(), quiet_trace():
        warnings.simplefilter("ignore")  # no user code runs here, only shipped models
        config = default_config(architecture)
        first: dict[str, Any] = {"batch": POINTS[0][0], length: POINTS[0][1]}
        prepared = prepare(config, regime, **first)
        for batch, size in POINTS:
            knobs: dict[str, Any] = {"batch": batch, length: size}
            for mode in ("roofline", "realistic"):
                label = f"batch={batch}, {length}={size}, mode={mode}"
                figures = prepared.metrics(hardware, mode=mode, **knobs)
                priced = prepared.price(hardware, mode=mode, **knobs)
                fresh = estimate(config, regime, hardware=hardware, mode=mode, **knobs)
                check.points += 1
                if figures != point_metrics(fresh):
                    check.differences.append(f"{label}: figures")
                if priced.to_dict() != fresh.to_dict():
                    check.differences.append(f"{label}: estimate")
    info = prepared.cache_info()
    check.symbolic, check.substituted, check.planned = (
        info.symbolic,
        info.substituted,
        info.planned,
    )
    check.notes = list(prepared.notes)
    return check

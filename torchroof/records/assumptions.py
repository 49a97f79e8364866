"""The values capture had to invent on meta, kept with the trace for the report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AssumptionKind = Literal["scalar", "routing", "selection"]
ASSUMPTION_KINDS: tuple[AssumptionKind, ...] = ("scalar", "routing", "selection")
"""What capture invented: ``scalar``, a ``Tensor.item()`` / ``tolist()`` answer (a mask
check, a step count); ``routing``, which tokens an expert router selects (``nonzero`` or a
boolean mask of a one-hot of expert indices, ``tolist()`` of expert counts): the
balanced-routing answer of :mod:`torchroof.capture.routing`; ``selection``, any other
data-dependent selection (a vocabulary shard's out-of-range tokens), answered with every
row selected."""


@dataclass(frozen=True, slots=True)
class Assumption:
    """A value capture had to invent (e.g. ``Tensor.item()`` on meta), kept for the report."""

    op_index: int
    module: str
    what: str
    kind: AssumptionKind = "scalar"

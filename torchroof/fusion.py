"""Kernels from a trace: which ops a runtime launches together.

The ``eager`` policy is one kernel per op that moves bytes or does arithmetic, which is
what PyTorch eager launches; views and allocation-only ops launch nothing (DESIGN rule 2).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torchroof.counters import Cost, cost_of
from torchroof.records import OpRecord, Phase

FUSION_POLICIES = ("eager",)


@dataclass(frozen=True)
class Kernel:
    """One launched kernel: its member ops and their summed cost."""

    ops: tuple[OpRecord, ...]
    cost: Cost

    @property
    def lead(self) -> OpRecord:
        """The member op that names the kernel: the first one (the only one under eager)."""
        return self.ops[0]

    @property
    def name(self) -> str:
        return self.lead.name

    @property
    def module(self) -> str:
        return self.lead.module

    @property
    def phase(self) -> Phase:
        return self.lead.phase


@dataclass(frozen=True)
class Coverage:
    """How many ops were seen and which had no rule (DESIGN rule 1: listed by name)."""

    ops: int
    uncounted: dict[str, int]


def eager_kernels(
    ops: Iterable[OpRecord], price: Callable[[OpRecord], Cost] = cost_of
) -> tuple[list[Kernel], Coverage]:
    """One kernel per op with non-zero W or Q, in execution order."""
    kernels: list[Kernel] = []
    uncounted: Counter[str] = Counter()
    count = 0
    for op in ops:
        count += 1
        cost = price(op)
        if not cost.counted:
            uncounted[op.name] += 1
        if cost.flops or cost.bytes:
            kernels.append(Kernel((op,), cost))
    return kernels, Coverage(count, dict(uncounted))


def kernels_for(ops: Iterable[OpRecord], policy: str = "eager") -> tuple[list[Kernel], Coverage]:
    """Group ops into kernels under a named fusion policy."""
    if policy == "eager":
        return eager_kernels(ops)
    raise ValueError(f"unknown fusion policy {policy!r}; known: {', '.join(FUSION_POLICIES)}")

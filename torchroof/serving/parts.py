"""A priced decode step split into what a mixed engine step reuses of it: its attention,
its output projection, its routed experts, and the rest; and the grid of batches the rest
is priced at.

The output projection is found in the step's trace: the last GEMM outside the decoder
layers (``lm_head``), with every op after it (a logit scale or soft cap at the model's
root). Token counts above a step timer's ``exact_up_to`` are interpolated between grid
batches :data:`GRID_RATIO` apart.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchroof.config.errors import OptionError
from torchroof.counters import kind_of
from torchroof.models.sources import position_limit
from torchroof.records.trace import Trace
from torchroof.report.estimate import KernelEstimate
from torchroof.report.memory import MemoryFootprint
from torchroof.timing.kernel_shape import GEMM_PACKETS

if TYPE_CHECKING:
    from torchroof.prepared import KernelTimes

GRID_RATIO = 1 + 1 / 16
"""Each grid batch above the exact ones is this many times the last (rounded up). On the
pure roofline a step's time is piecewise linear in its token count between the kinks where
a kernel turns from memory- to compute-bound; realistic mode adds steps where a GEMM's
tiles fill another wave, so interpolating there errs by up to 8.5% (Llama-3-8B on an H100
under vLLM's profile, prompts of 65 to 1,200 tokens)."""


@dataclass(frozen=True)
class DecodeParts:
    """A decode step of batch N priced whole, and the time in it of its attention kernels,
    its output projection, its routed experts' kernels (``experts_s``: those of a module
    named ``experts`` but their collectives) and those collectives (``exchange_s``: the
    all-to-alls)."""

    time_s: float
    attention_s: float
    head_s: float
    memory: MemoryFootprint | None
    experts_s: float = 0.0
    exchange_s: float = 0.0

    @property
    def body_s(self) -> float:
        """Every kernel but attention and the output projection (host overhead included)."""
        return self.time_s - self.attention_s - self.head_s


def split_parts(step: KernelTimes, head: str) -> DecodeParts:
    """``step``'s time, its attention kernels', its output projection's (the kernels from
    the first of ``head``'s module to the end), its routed experts' (their dispatch and
    grouped GEMMs: transformers names the module ``experts``) and their collectives' (the
    all-to-alls), each kernel counted as often as it runs."""
    counts = step.counts
    attention = head_s = experts = exchange = 0.0
    in_head = False
    for kernel, count in zip(step.kernels, counts, strict=True):
        in_head = in_head or kernel.module == head
        if is_attention(kernel):
            attention += count * kernel.time_s
        elif in_head:
            head_s += count * kernel.time_s
        elif "experts" in kernel.module.split(".") and kernel.unit == "network":
            exchange += count * kernel.time_s
        elif "experts" in kernel.module.split("."):
            experts += count * kernel.time_s
    if not in_head:
        raise OptionError(f"the priced step has no kernel of its output projection {head}")
    return DecodeParts(step.time_s, attention, head_s, step.memory, experts, exchange)


def is_attention(kernel: KernelEstimate) -> bool:
    return any(kind_of(name.rsplit(".", 1)[0]) == "attention" for name in kernel.ops)


def head_module(trace: Trace) -> str:
    """The output projection of a decode step: the module of its last GEMM, which must sit
    outside the decoder layers (refused in one line otherwise)."""
    for op in reversed(trace.ops):
        if kind_of(op.packet) == "matmul" or op.packet in GEMM_PACKETS:
            module = op.module
            if module and not any(part.isdigit() for part in module.split(".")):
                return module
            break
    raise OptionError(
        "the prepared decode step ends in no output projection outside its decoder layers: "
        "its logits cannot be priced per sampled row"
    )


def refuse_windows(config: Any) -> None:
    """Refuse a model whose attention is windowed (a sliding window shorter than its
    positions): a step timer prices every layer over each sequence's whole cache."""
    if config is None or getattr(config, "use_sliding_window", True) is False:
        return
    window = getattr(config, "sliding_window", None)
    limit = position_limit(config)
    if isinstance(window, int) and window > 0 and (limit is None or window < limit[1]):
        raise OptionError(
            f"its attention keeps a sliding window of {window:,} tokens: a step timer prices "
            "every layer over each sequence's whole cache, not per window yet"
        )


@functools.lru_cache(maxsize=64)
def _grid(start: int) -> tuple[int, ...]:
    points = [start]
    while points[-1] < 2**24:
        points.append(max(points[-1] + 1, math.ceil(points[-1] * GRID_RATIO)))
    return tuple(points)


def grid_neighbours(count: int, start: int) -> tuple[int, int]:
    """The grid batches (from ``start``) at or just below and at or just above ``count``."""
    grid = _grid(start)
    at = bisect.bisect_left(grid, count)
    if at < len(grid) and grid[at] == count:
        return count, count
    if at >= len(grid):
        raise OptionError(f"a step of {count:,} tokens is beyond the grid's {grid[-1]:,}")
    return grid[at - 1], grid[at]

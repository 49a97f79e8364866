"""The figures a decode step adds to an estimate's summary: weight and KV bytes read, the batch
at which KV reads overtake weight reads, and the largest batch that fits.

The regime sits below the report, so it reads them through the estimate's own properties
(:class:`torchroof.report.estimate.Estimate` computes them in torchroof.report.analysis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torchroof.config import Workload


class Footprint(Protocol):
    @property
    def max_batch(self) -> int: ...


class DecodeEstimate(Protocol):
    """What :func:`decode_analysis` reads of an estimate."""

    @property
    def workload(self) -> Workload | None: ...

    @property
    def weight_bytes_read(self) -> int: ...

    @property
    def kv_bytes_read(self) -> int: ...

    @property
    def kv_crossover_batch(self) -> float: ...

    @property
    def memory(self) -> Footprint | None: ...


@dataclass(frozen=True)
class DecodeAnalysis:
    """The figures a decode step adds to its summary."""

    weight_bytes_read: int
    kv_bytes_read: int
    kv_crossover_batch: float
    cache: str | None  # the workload's cache kind (static / dynamic)
    context: int | None  # tokens already in the cache
    max_batch: int | None  # largest batch that fits at this context; None without a footprint


def decode_analysis(est: DecodeEstimate) -> DecodeAnalysis:
    """The decode figures of ``est`` (the decode regime adds them to its summary)."""
    workload = est.workload
    return DecodeAnalysis(
        weight_bytes_read=est.weight_bytes_read,
        kv_bytes_read=est.kv_bytes_read,
        kv_crossover_batch=est.kv_crossover_batch,
        cache=workload.cache if workload else None,
        context=workload.context if workload else None,
        max_batch=est.memory.max_batch if est.memory is not None else None,
    )

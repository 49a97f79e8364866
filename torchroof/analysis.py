"""What an estimate implies beyond its sums: utilisation, the share of time spent waiting on
memory, throughput, and the decode figures of seed 000 (weight and KV reads, the batch B* at
which the weight GEMMs reach the ridge, the batch at which KV reads overtake weight reads).

Functions of a :class:`torchroof.report.Estimate`, which keeps one-line properties
(``est.mfu``, ``est.ridge_batch``, ...) that call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchroof.report import Estimate


def mfu(est: Estimate) -> float:
    """Model FLOPs utilisation: W / (T · pi_tensor) for the dominant matmul dtype."""
    time_s = est.time_s
    return est.flops / (time_s * est.reference_peak_flops_per_s) if time_s else 0.0


def memory_bound_share(est: Estimate) -> float:
    """Share of the step's time spent in memory-bound kernels."""
    time_s = est.time_s
    memory_s = sum(k.time_s for k in est.kernels if k.bound == "memory")
    return memory_s / time_s if time_s else 0.0


def tokens_per_s(est: Estimate) -> float:
    """Tokens the step processes per second (decode: B / step time)."""
    tokens = est.metadata.get("tokens", 0)
    return tokens / est.time_s if est.time_s and tokens else 0.0


def kv_bytes_read(est: Estimate) -> int:
    """KV-cache bytes read by the step (seed 000: decode reads the whole cache)."""
    return sum(k.read_by.get("kv_cache", 0) for k in est.kernels)


def weight_bytes_read(est: Estimate) -> int:
    """Weight bytes read by the step, every kernel's reads summed."""
    return sum(k.read_by.get("weights", 0) for k in est.kernels)


def ridge_batch(est: Estimate) -> float:
    """B*: the batch at which the weight GEMMs reach the ridge (seed 000: B* = s·I*/2,
    295 for bf16 on an H100) — this step's batch times how far below the ridge its weight
    matmuls sit; infinite when no tensor-unit kernel reads weights."""
    batch = int(est.workload.get("batch", 1))
    weight_flops = sum(
        k.flops for k in est.kernels if k.unit == "tensor" and k.read_by.get("weights")
    )
    if not weight_flops:
        return float("inf")
    ridge = est.reference_peak_flops_per_s / est.hbm_bytes_per_s
    return batch * ridge / (weight_flops / weight_bytes_read(est))


def kv_crossover_batch(est: Estimate) -> float:
    """Batch at which KV-cache reads overtake weight reads (seed 000 "The crossover that ends
    batching": B_cross = s·P / KV bytes per sequence), scaled from this step's batch;
    infinite when the step reads no KV cache."""
    batch = int(est.workload.get("batch", 1))
    per_sequence = kv_bytes_read(est) / batch
    return weight_bytes_read(est) / per_sequence if per_sequence else float("inf")


@dataclass(frozen=True)
class DecodeAnalysis:
    """The figures a decode step adds to its summary."""

    weight_bytes_read: int
    kv_bytes_read: int
    kv_crossover_batch: float
    cache: str | None  # the workload's cache kind (static / dynamic)
    context: int | None  # tokens already in the cache
    max_batch: int | None  # largest batch that fits at this context; None without a footprint


def decode_analysis(est: Estimate) -> DecodeAnalysis:
    """The decode figures of ``est`` (the decode regime adds them to its summary)."""
    workload = est.workload
    return DecodeAnalysis(
        weight_bytes_read=weight_bytes_read(est),
        kv_bytes_read=kv_bytes_read(est),
        kv_crossover_batch=kv_crossover_batch(est),
        cache=workload.get("cache"),
        context=workload.get("context"),
        max_batch=est.memory.max_batch if est.memory is not None else None,
    )

"""What an estimate implies beyond its sums: utilisation, the share of time spent waiting on
memory, throughput, the decode figures (Pope et al. 2022: weight and KV reads, the batch B* at
which the weight GEMMs reach the ridge, the batch at which KV reads overtake weight reads),
and for a multi-GPU step its communication (exposed and hidden) and the network intensity at
each link against that link's ridge (docs/concepts/network-ridges.md).

Functions of a :class:`torchroof.report.estimate.Estimate`, which keeps one-line properties
(``est.mfu``, ``est.ridge_batch``, ...) that call them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchroof.config.parallel_plan import ParallelPlan

if TYPE_CHECKING:
    from torchroof.report.estimate import Estimate, KernelEstimate


def mfu(est: Estimate) -> float:
    """Model FLOPs utilisation: W / (T · pi_tensor) for the dominant matmul dtype. A
    pipelined step's W is its slowest rank's over every micro-batch."""
    time_s = est.time_s
    flops = est.pipeline.rank_flops if est.pipeline is not None else est.flops
    return flops / (time_s * est.reference_peak_flops_per_s) if time_s else 0.0


def memory_bound_share(est: Estimate) -> float:
    """Share of the step's time spent in memory-bound kernels (a pipelined step: of its
    slowest rank's kernels' time, one micro-batch each)."""
    time_s = est.time_s if est.pipeline is None else sum(k.time_s for k in est.kernels)
    memory_s = sum(k.time_s for k in est.kernels if k.bound == "memory")
    return memory_s / time_s if time_s else 0.0


def tokens_per_s(est: Estimate) -> float:
    """Tokens the step processes per second (decode: B / step time). For a parallel step,
    the tokens of the traced rank's model replica: a tensor-parallel group shares them."""
    tokens = est.facts.tokens
    return tokens / est.time_s if est.time_s and tokens else 0.0


def ranks(est: Estimate) -> tuple[int, int]:
    """(GPUs in the step, GPUs sharing one replica's tokens: pp · tp · cp) from the
    workload's plan."""
    workload = est.workload
    plan = workload.parallel_plan if workload else ParallelPlan()
    return plan.world, plan.pp * plan.tp * plan.cp


def tokens_per_s_per_gpu(est: Estimate) -> float:
    """Tokens per second per GPU: the pp · tp · cp GPUs of a pipeline of tensor- and
    context-parallel groups process one replica's tokens, so each GPU is credited
    1/(pp · tp · cp) of them (as torchtitan and Megatron report throughput)."""
    _, shared = ranks(est)
    return tokens_per_s(est) / shared


def cluster_tokens_per_s(est: Estimate) -> float:
    """Tokens per second over every GPU of the step (ranks are symmetric)."""
    world, _ = ranks(est)
    return tokens_per_s_per_gpu(est) * world


def kv_bytes_read(est: Estimate) -> int:
    """KV-cache bytes read by the step (decode reads the whole cache: Pope et al. 2022)."""
    return sum(k.read_by.get("kv_cache", 0) for k in est.kernels)


def weight_bytes_read(est: Estimate) -> int:
    """Weight bytes read by the step, every kernel's reads summed."""
    return sum(k.read_by.get("weights", 0) for k in est.kernels)


def weight_gemm_intensity(est: Estimate) -> float:
    """FLOPs of the tensor-unit kernels that read weights per weight byte the step reads;
    0 when no tensor-unit kernel reads weights."""
    weight_flops = sum(
        k.flops for k in est.kernels if k.unit == "tensor" and k.read_by.get("weights")
    )
    return weight_flops / weight_bytes_read(est) if weight_flops else 0.0


def ridge_batch(est: Estimate) -> float:
    """B*: the batch at which the weight GEMMs reach the ridge (B* = s·I*/2,
    295 for bf16 on an H100) — this step's batch times how far below the ridge its weight
    matmuls sit; infinite when no tensor-unit kernel reads weights."""
    batch = est.workload.batch if est.workload else 1
    intensity = weight_gemm_intensity(est)
    if not intensity:
        return float("inf")
    ridge = est.reference_peak_flops_per_s / est.hbm_bytes_per_s
    return batch * ridge / intensity


def kv_crossover_batch(est: Estimate) -> float:
    """Batch at which KV-cache reads overtake weight reads (docs/concepts/attention-kv.md:
    B_cross = s·P / KV bytes per sequence), scaled from this step's batch;
    infinite when the step reads no KV cache."""
    batch = est.workload.batch if est.workload else 1
    per_sequence = kv_bytes_read(est) / batch
    return weight_bytes_read(est) / per_sequence if per_sequence else float("inf")


@dataclass(frozen=True)
class Communication:
    """A step's communication-stream kernels (collectives and the copies feeding them):
    their time, the part the compute stream waited on (exposed) and the rest (hidden), the
    collectives' time by the link each crossed, and the copies' time."""

    time_s: float
    exposed_s: float
    hidden_s: float
    by_link_s: dict[str, float]  # nvlink / xgmi / network / hierarchical / none
    copies_s: float  # FSDP2's copy-in and chunk-cat, on the communication stream
    step_time_s: float
    latency_s: float = 0.0  # the collectives' alpha terms: what no bandwidth buys back

    @property
    def exposed_share(self) -> float:
        """Share of the step's time the compute stream waited on communication."""
        return self.exposed_s / self.step_time_s if self.step_time_s else 0.0


def collective_lanes(kernels: Iterable[KernelEstimate]) -> set[str]:
    """The streams (torchroof.timing.streams.lane_of) the step's collectives that cross a
    link ran on: a group of one and the copies feeding collectives left out."""
    return {k.lane for k in kernels if k.unit == "network" and k.link not in ("", "none")}


def communication(est: Estimate) -> Communication:
    """Communication time, exposed and hidden (torchroof.timing.streams), over the whole step."""
    time_s = exposed_s = copies_s = latency_s = 0.0
    by_link: dict[str, float] = {}
    # an estimate listing each distinct kernel once with the launches it makes
    # (torchroof.pricing.symbolic_plan.CountedKernels) is read launch by launch, in
    # launch order, each with its own exposed time: the sums a fresh estimate makes
    order = getattr(est, "order", None) or range(len(est.kernels))
    exposed = getattr(est, "copies_exposed_s", None) or [est.kernels[p].exposed_s for p in order]
    for place, k_exposed in zip(order, exposed, strict=True):
        k = est.kernels[place]
        if not k.communication:
            continue
        time_s += k.time_s
        latency_s += k.latency_s
        exposed_s += k_exposed
        if k.unit == "network":
            by_link[k.link] = by_link.get(k.link, 0.0) + k.time_s
        else:
            copies_s += k.time_s
    step_s = est.time_s if est.pipeline is None else kernels_span_s(est)
    return Communication(
        time_s, exposed_s, time_s - exposed_s, by_link, copies_s, step_s, latency_s
    )


def kernels_span_s(est: Estimate) -> float:
    """The listed kernels' own time: compute kernels' time plus the communication they left
    exposed (a pipelined step lists one micro-batch of its slowest rank's stages)."""
    return sum(k.exposed_s if k.communication else k.time_s for k in est.kernels)


@dataclass(frozen=True)
class LinkIntensity:
    """I_net at one link: the step's FLOPs per byte one rank sends across it, and the
    link's ridge (the accelerator's peak over the link's line rate)."""

    wire_bytes: int  # per rank
    intensity: float  # FLOP/B
    ridge: float  # FLOP/B; 0 when the estimate lists none

    @property
    def hides(self) -> bool:
        """I_net >= ridge: the step's compute outlasts the link's bytes at line rate."""
        return self.intensity >= self.ridge


def network_intensity(est: Estimate) -> dict[str, LinkIntensity]:
    """For each link the step's collectives cross, I_net = step FLOPs / bytes one rank sends
    across it, against the link's ridge (docs/concepts/network-ridges.md: communication
    hides behind compute iff I_net >= pi / beta_link; on an H100, 2,198 for NVLink 4 and
    19,788 for 400 Gb/s).

    NB: one figure per link for the whole step, not per collective: which compute a
    collective overlaps is the schedule's question (:func:`communication`)."""
    wire: dict[str, int] = {}
    for k in est.kernels:
        for link, size in k.wire_by_link.items():
            wire[link] = wire.get(link, 0) + size
    flops = est.flops
    return {
        link: LinkIntensity(size, flops / size, est.link_ridges.get(link, 0.0))
        for link, size in wire.items()
        if size
    }


def added(seconds: Iterable[float]) -> float:
    """Times added left to right, one rounding per kernel: what the HTML page adds in
    JavaScript (torchroof/render/assets/report.js), to the last bit; ``sum()`` compensates its
    rounding from Python 3.12 on and would differ in the last digits."""
    total = 0.0
    for value in seconds:
        total += value
    return total

"""Routed experts as routed: the busiest rank's grouped GEMMs and expert all-to-alls, and the
expert weights a batch reaches."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from torchroof.config import PricingOptions
from torchroof.counters.collectives import collective_kind
from torchroof.hardware import HardwareSpec
from torchroof.kernels.fusion import Kernel
from torchroof.report.estimate import KernelEstimate
from torchroof.report.kinds import Boundary
from torchroof.timing.hierarchy import level_rates
from torchroof.timing.roofline import KernelTime


def routed(kernel: Kernel) -> bool:
    """An expert kernel whose work follows the routed tokens: a grouped GEMM, or an
    all-to-all that carries tokens to their experts' ranks; not context parallel's ring
    passing dK, dV to one peer with an all-to-all (a permutation: a send, no tokens)."""
    names = [op.name for op in kernel.ops]
    if any("grouped_mm" in name for name in names):
        return True
    return kernel.cost.unit == "network" and any(
        "all_to_all" in op.name and collective_kind(op) == "all_to_all" for op in kernel.ops
    )


def busiest_rank(
    kernel: KernelEstimate,
    imbalance: float,
    t: KernelTime,
    pricing: PricingOptions,
    spec: HardwareSpec,
    reach: float = 1.0,
) -> KernelEstimate:
    """The kernel on the rank whose experts get ``imbalance`` times the balanced share of
    routed tokens, reading ``reach`` times the balanced experts' weights
    (:mod:`torchroof.pricing.routing`): a grouped GEMM's W and its non-weight bytes scale
    by the imbalance, its weight bytes by the reach (which also changes the traffic it
    reports: fewer experts are read); an expert all-to-all carries ``imbalance`` times the
    rows. The step waits for that rank; FLOPs stay the balanced ones. In realistic mode the
    on-chip levels' bytes scale as its HBM bytes do, and the launch stays."""
    if kernel.unit == "network":
        carried_s = (kernel.network_s - kernel.latency_s) * imbalance  # alpha does not scale
        return replace(
            kernel,
            time_s=max(kernel.time_s, kernel.latency_s + carried_s),
            network_s=kernel.latency_s + carried_s,
        )
    weights = kernel.read_by.get("weights", 0)
    reached = round(weights * reach)
    scaled_bytes = reached + imbalance * (kernel.bytes - weights)
    compute_s = t.compute_s * imbalance
    memory_s = scaled_bytes / t.bandwidth_bytes_per_s
    terms = {"compute": compute_s, "hbm": memory_s}
    if pricing.realistic and pricing.on_chip:
        # balanced weights: the imbalance alone, as before a reach was priced
        level_scale = imbalance * (scaled_bytes / (weights + imbalance * (kernel.bytes - weights)))
        for level, rate in level_rates(spec).items():
            if level in kernel.level_bytes:
                terms[level] = kernel.level_bytes[level] * level_scale / rate
    slowest_memory = max(seconds for name, seconds in terms.items() if name != "compute")
    body = max(compute_s, slowest_memory) if pricing.overlap else compute_s + slowest_memory
    read_by = dict(kernel.read_by)
    if weights:
        read_by["weights"] = reached
    return replace(
        kernel,
        bytes_read=kernel.bytes_read - weights + reached,
        read_by=read_by,
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=body + t.overhead_s,
        bound="compute" if compute_s > memory_s else "memory",
        boundary=cast(Boundary, max(terms, key=terms.__getitem__)),  # compute, hbm or a level
    )

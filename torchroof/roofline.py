"""Roofline timing of one kernel on one accelerator.

seed 000 "Deriving the roofline": T = max(W/pi, Q/beta) when memory traffic and arithmetic
overlap; the no-overlap model T = W/pi + Q/beta (seed 000 §5) is an option. pi is the
ceiling the kernel's unit and dtype can reach (DESIGN rule 4), beta the HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchroof.counters import Cost
from torchroof.hardware import HardwareSpec
from torchroof.options import PricingOptions

Bound = Literal["compute", "memory"]


@dataclass(frozen=True)
class KernelTime:
    """Both lower bounds of one kernel, the time taken, and which pipe binds."""

    peak_flops_per_s: float  # the ceiling used for W (after efficiency)
    bandwidth_bytes_per_s: float  # the ceiling used for Q (after efficiency)
    compute_s: float  # W / pi
    memory_s: float  # Q / beta
    time_s: float
    bound: Bound


def time_kernel(cost: Cost, hardware: HardwareSpec, options: PricingOptions) -> KernelTime:
    """T = max(W/pi, Q/beta) (or the sum without overlap), plus launch overhead."""
    peak = hardware.peak(cost.unit, cost.dtype, allow_tf32=options.allow_tf32)
    peak *= options.compute_efficiency
    bandwidth = hardware.hbm_bytes_per_s.value * options.bandwidth_efficiency
    compute_s = cost.flops / peak if cost.flops else 0.0
    memory_s = cost.bytes / bandwidth
    body = max(compute_s, memory_s) if options.overlap else compute_s + memory_s
    bound: Bound = "compute" if compute_s > memory_s else "memory"
    return KernelTime(peak, bandwidth, compute_s, memory_s, body + options.launch_overhead_s, bound)

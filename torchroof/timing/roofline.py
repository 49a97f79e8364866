"""Timing of one kernel on one accelerator: the pure roofline, or the realistic mode.

The roofline (Williams, Waterman & Patterson 2009): T = max(W/pi, Q/beta) when memory traffic
and arithmetic overlap; the no-overlap model T = W/pi + Q/beta (docs/concepts/roofline.md) is
an option. pi is the ceiling the kernel's unit and dtype can reach (the unit follows the op),
beta the HBM bandwidth. This
pure roofline is the default: a floor.

Whatever the mode, the kernel's hierarchical verdict is named (the hierarchical roofline, Yang,
Kurth & Williams 2020: the smallest of pi, beta_l·I_l over the levels binds; ``boundary``). The
realistic mode (``PricingOptions.mode = "realistic"``) adds what the pure roofline cannot see,
each separately switchable: the on-chip roofs (``on_chip``), wave quantisation
(``waves``), the latency shelf of too little in flight (``latency_shelf``), the achievable
fractions of peak (``achievable``), the launch (``launch``) and, from "pi is the top of a
stack", a fused attention kernel's softmax on the SFU and vector pipes (``softmax_pipes``).
Where the accelerator file lists the measured share of its tensor peak that the runtime's
attention kernel reaches (``[attention_tensor_fraction]``: FlashAttention-2 and -3 and
cuDNN, forward and backward, from their authors' benchmarks), an attention kernel runs at
that share instead (under ``achievable``), softmax included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torchroof.config import PricingOptions, parse_gemm_tile
from torchroof.config.errors import OptionError
from torchroof.counters import Cost
from torchroof.hardware import Figure, HardwareSpec
from torchroof.timing.hierarchy import (
    GemmTile,
    Levels,
    attention_levels,
    choose_tile,
    effective_bandwidth,
    gemm_levels,
    in_flight_bytes,
    level_rates,
    softmax_seconds,
    stream_levels,
    waves,
)
from torchroof.timing.kernel_shape import KernelShape
from torchroof.timing.runtime import StepRuntime

NO_RUNTIME = StepRuntime()

Bound = Literal["compute", "memory"]
# A memory-bound kernel is called latency-bound when too little in flight costs it more
# than a tenth of the bandwidth (a few CTAs short of every SM is still "hbm").
LATENCY_LABEL_SHARE = 0.9


@dataclass(frozen=True)
class KernelTime:
    """Both lower bounds of one kernel, the time taken, and which pipe binds."""

    peak_flops_per_s: float  # the ceiling used for W (after efficiency)
    bandwidth_bytes_per_s: float  # the ceiling used for Q (after efficiency, and in realistic
    # mode the achievable fraction and the latency shelf)
    compute_s: float  # W / pi (realistic: stretched by the waves)
    memory_s: float  # Q / beta
    time_s: float
    bound: Bound
    boundary: str = ""  # compute / hbm / l2 / smem / registers / latency: which term binds
    level_bytes: dict[str, float] | None = None  # bytes at each boundary (hierarchy)
    tile: str = ""  # a GEMM's threadblock tile
    waves: int = 0
    wave_efficiency: float = 1.0
    in_flight_bytes: float = 0.0
    overhead_s: float = 0.0  # launch overhead inside time_s


def _fraction(figure: Figure | None) -> float:
    """An achievable fraction the hardware file lists, else 1."""
    return figure.value if figure is not None else 1.0


def kernel_levels(
    shape: KernelShape | None,
    cost: Cost,
    hardware: HardwareSpec,
    options: PricingOptions,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    out_itemsize: int,
) -> Levels | None:
    """The kernel's bytes at every boundary, its grid and (GEMMs) its tile; None for a part
    whose file lists no SMs and no shared memory (a calibrated CPU: no tiles, no waves)."""
    if shape is None or cost.unit not in ("tensor", "vector", "sfu"):
        return None
    if hardware.compute_units is None or hardware.shared_memory_bytes_per_sm is None:
        return None
    if shape.kind == "gemm":
        fixed = parse_gemm_tile(options.gemm_tile)
        if fixed:
            tile = GemmTile(*fixed)
            needed = tile.smem_bytes(shape.itemsize)
            if needed > hardware.shared_memory_bytes_per_sm.value:
                raise OptionError(
                    f"gemm_tile={options.gemm_tile}: its operand stages need {needed:,} bytes "
                    f"of shared memory, and {hardware.name} has "
                    f"{hardware.shared_memory_bytes_per_sm.value:,.0f} per SM; choose a "
                    "smaller tile or auto"
                )
        else:
            rates = (peak_flops_per_s, bandwidth_bytes_per_s)
            tile = choose_tile(shape, cost.bytes, hardware, *rates, out_itemsize)
        return gemm_levels(shape, cost.bytes, tile, hardware, out_itemsize)
    if shape.kind == "attention":
        return attention_levels(shape, cost.bytes, hardware)
    return stream_levels(shape, cost.bytes)


def _on_chip_seconds(levels: Levels | None, hardware: HardwareSpec) -> dict[str, float]:
    """Each on-chip level's bytes over its rate ({} when the kernel has no levels)."""
    if levels is None:
        return {}
    by_level = levels.by_level()
    return {
        level: by_level[level] / rate
        for level, rate in level_rates(hardware).items()
        if level in by_level
    }


def launch_of(runtime: StepRuntime, hardware: HardwareSpec) -> float | None:
    """One kernel's launch in realistic mode: the runtime's (a CUDA graph's replay, or its
    eager launch), but an eager launch measured on this device (``eager_launch_s``, which
    ``calibrate --from-profile`` writes) in place of the runtime's eager figure, which was
    measured elsewhere; without a runtime, the file's ``launch_overhead_s``."""
    if runtime.launch_s is None:
        figure = hardware.launch_overhead_s
        return figure.value if figure is not None else None
    if not runtime.graph_replayed and hardware.eager_launch_s is not None:
        return hardware.eager_launch_s.value
    return runtime.launch_s


FULL_PRECISION = frozenset({"float32", "float64"})
"""Dtypes no fused FlashAttention-style kernel runs (FlashAttention-2 and -3, cuDNN's fused
attention: fp16, bf16 and fp8; Dao, "FlashAttention-2", 2023): PyTorch's SDPA runs fp32 on
its memory-efficient or math kernel, so a share measured on a half-precision kernel is not
applied to it."""


def measured_attention_share(
    hardware: HardwareSpec,
    options: PricingOptions,
    runtime: StepRuntime,
    backward: bool,
    dtype: str = "",
) -> float | None:
    """The measured share of ``hardware``'s tensor peak a fused attention kernel of
    ``runtime`` runs at, forward or ``backward``: in realistic mode with ``achievable`` under
    a flash policy (a "math" policy writes its scores and runs no such kernel), where the
    accelerator file lists one and the kernel's ``dtype`` is not full precision
    (:data:`FULL_PRECISION`); else None."""
    if not options.realistic or not options.achievable or options.attention != "flash":
        return None
    if dtype.removeprefix("torch.") in FULL_PRECISION:
        return None
    return hardware.attention_share(runtime.attention_kernel, backward)


def _ceilings(
    cost: Cost,
    hardware: HardwareSpec,
    options: PricingOptions,
    shape: KernelShape | None,
    runtime: StepRuntime,
) -> tuple[float, float, float | None]:
    """(pi, beta, the attention kernel's measured share of the peak or None) a kernel is
    timed against: the part's peak for its unit and dtype and its HBM bandwidth, after the
    efficiencies asked for; in realistic mode with ``achievable``, the sustained fractions,
    the runtime's GEMM efficiency, or for the runtime's fused attention kernel its measured
    share, softmax included (:func:`measured_attention_share`)."""
    peak = hardware.peak(
        cost.unit,
        cost.dtype,
        allow_tf32=options.allow_tf32,
        fp16_accumulate=runtime.fp16_accumulate,
    )
    peak *= options.compute_efficiency
    bandwidth = hardware.hbm_bytes_per_s.value * options.bandwidth_efficiency
    measured = None
    if not options.realistic or not options.achievable:
        return peak, bandwidth, measured
    bandwidth *= _fraction(hardware.achievable_hbm_fraction)
    if shape is not None and shape.kind == "attention":
        measured = measured_attention_share(hardware, options, runtime, shape.backward, cost.dtype)
    if measured is not None:
        peak *= measured
    elif cost.unit == "tensor":
        peak *= _fraction(hardware.achievable_tensor_fraction)
        if shape is not None and shape.kind == "gemm":
            peak *= runtime.gemm_efficiency
    return peak, bandwidth, measured


def time_kernel(
    cost: Cost,
    hardware: HardwareSpec,
    options: PricingOptions,
    shape: KernelShape | None = None,
    out_itemsize: int = 2,
    runtime: StepRuntime = NO_RUNTIME,
) -> KernelTime:
    """T = max(W/pi, Q/beta) (or the sum without overlap), plus launch overhead; in
    realistic mode, the switched-on effects on top (module docstring), with the launch, the
    attention kernel and the GEMM library's share of peak of the ``runtime`` running the
    step where its profile gives them."""
    realistic = options.realistic
    peak, bandwidth, measured = _ceilings(cost, hardware, options, shape, runtime)
    attention = shape is not None and shape.kind == "attention"
    levels = kernel_levels(shape, cost, hardware, options, peak, bandwidth, out_itemsize)
    compute_s = cost.flops / peak if cost.flops else 0.0
    if (
        realistic
        and options.softmax_pipes
        and attention
        and measured is None
        and shape is not None
        and levels is not None
    ):
        softmax_s = softmax_seconds(shape, hardware)
        # FlashAttention-3 runs one block's softmax under the next block's matmuls
        # (runtime.softmax_overlapped); FlashAttention-2 runs them one after the other
        compute_s = (
            max(compute_s, softmax_s) if runtime.softmax_overlapped else compute_s + softmax_s
        )
    wave = waves(levels, hardware) if levels is not None else None
    tiled = shape is not None and shape.kind in ("gemm", "attention")
    if realistic and options.waves and wave is not None and tiled and compute_s:
        compute_s /= wave.efficiency
    in_flight = float(cost.bytes)
    effective = bandwidth
    hbm_bytes = float(cost.bytes)
    if levels is not None:
        in_flight = in_flight_bytes(levels, hardware, bandwidth)
        if realistic and options.latency_shelf:
            effective = effective_bandwidth(in_flight, hardware, bandwidth)
        if realistic:  # split-K's fp32 partial sums reach HBM too
            hbm_bytes = levels.hbm
    memory_s = hbm_bytes / effective
    on_chip = _on_chip_seconds(levels, hardware)
    timed_on_chip = on_chip if realistic and options.on_chip else {}
    slowest_memory = max([memory_s, *timed_on_chip.values()])
    body = max(compute_s, slowest_memory) if options.overlap else compute_s + slowest_memory
    # ``boundary``: in realistic mode the term that set the time; in the pure mode the
    # hierarchical verdict (the smallest of pi, beta_l·I_l binds), which the pure
    # time does not charge
    terms = {"compute": compute_s, "hbm": memory_s, **(timed_on_chip if realistic else on_chip)}
    boundary = max(terms, key=terms.__getitem__) if cost.flops or cost.bytes else ""
    if boundary == "hbm" and effective < LATENCY_LABEL_SHARE * bandwidth:
        boundary = "latency"
    # the verdict at the HBM boundary (a GEMM can be compute-bound at HBM and L2-bound
    # on chip, both true); ``boundary`` names the term that binds the time
    bound: Bound = "compute" if compute_s > memory_s else "memory"
    overhead = options.launch_overhead_s
    launch = launch_of(runtime, hardware)
    if realistic and options.launch and launch is not None:
        overhead += launch
    return KernelTime(
        peak,
        effective,
        compute_s,
        memory_s,
        body + overhead,
        bound,
        boundary=boundary,
        level_bytes=levels.by_level() if levels is not None else None,
        tile=levels.tile if levels is not None else "",
        waves=wave.count if wave is not None and tiled else 0,
        wave_efficiency=wave.efficiency if wave is not None and tiled else 1.0,
        in_flight_bytes=in_flight if math.isfinite(in_flight) else float(cost.bytes),
        overhead_s=overhead,
    )

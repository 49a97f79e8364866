"""Trace -> Estimate: price every op, group into kernels, time each on the accelerator."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from torchroof.fusion import kernels_for
from torchroof.hardware import HardwareSpec, get, spec_dtype
from torchroof.records import Trace
from torchroof.report import Estimate, KernelEstimate
from torchroof.roofline import RooflineOptions, time_kernel


def estimate_trace(
    trace: Trace,
    hardware: str | Path | HardwareSpec = "h100-sxm",
    *,
    fusion: str = "eager",
    **options: Any,
) -> Estimate:
    """Price and time every op of ``trace`` on ``hardware``.

    ``options`` are :class:`RooflineOptions` fields (``allow_tf32``, ``overlap``,
    ``compute_efficiency``, ``bandwidth_efficiency``, ``launch_overhead_s``).
    """
    spec = get(hardware)
    roofline = RooflineOptions(**options)
    kernels, coverage = kernels_for(trace.ops, fusion)
    timed: list[KernelEstimate] = []
    tensor_flops: dict[str, int] = defaultdict(int)
    for index, kernel in enumerate(kernels):
        cost = kernel.cost
        t = time_kernel(cost, spec, roofline)
        if cost.unit == "tensor":
            tensor_flops[cost.dtype] += cost.flops
        timed.append(
            KernelEstimate(
                index=index,
                name=kernel.name,
                ops=tuple(op.name for op in kernel.ops),
                module=kernel.module,
                phase=kernel.phase,
                flops=cost.flops,
                bytes_read=cost.bytes_read,
                bytes_written=cost.bytes_written,
                unit=cost.unit,
                dtype=cost.dtype,
                counted=cost.counted,
                peak_flops_per_s=t.peak_flops_per_s,
                compute_s=t.compute_s,
                memory_s=t.memory_s,
                time_s=t.time_s,
                bound=t.bound,
            )
        )
    if tensor_flops:
        reference_dtype = max(tensor_flops, key=tensor_flops.__getitem__)
        reference_peak = spec.tensor_peak(reference_dtype, allow_tf32=roofline.allow_tf32)
        reference_dtype = spec_dtype(reference_dtype)
    else:
        reference_dtype, reference_peak = "fp32", spec.vector_peak("fp32")
    return Estimate(
        hardware=spec.name,
        hardware_display=spec.display_name,
        hbm_bytes_per_s=spec.hbm_bytes_per_s.value,
        reference_peak_flops_per_s=reference_peak,
        reference_dtype=reference_dtype,
        kernels=timed,
        op_count=coverage.ops,
        uncounted=coverage.uncounted,
        assumptions=[
            f"op {a.op_index} ({a.module or 'top level'}): {a.what}" for a in trace.assumptions
        ],
        options={"fusion": fusion, **roofline.to_dict()},
        metadata=dict(trace.metadata),
    )

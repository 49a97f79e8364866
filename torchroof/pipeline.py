"""Trace -> Estimate: price every op, group into kernels, time each on the accelerator.

The stage only; building a model and tracing a workload first is :mod:`torchroof.api`."""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchroof import optimizer_step
from torchroof.counters import Cost
from torchroof.counters.tensors import read_tensors, unique_bytes, written_tensors
from torchroof.errors import OptionError
from torchroof.fusion import Kernel, build_kernels
from torchroof.hardware import HardwareSpec, get, spec_dtype
from torchroof.memory import footprint
from torchroof.options import PricingOptions, split_knobs
from torchroof.records import Trace
from torchroof.report import Estimate, KernelEstimate
from torchroof.roofline import time_kernel

ACTIVATIONS = "activations"


def traffic_by_role(kernel: Kernel, roles: dict[int, str]) -> tuple[dict[str, int], dict[str, int]]:
    """The kernel's (read, written) bytes split by what they hold (weights, activations,
    KV cache, gradients, optimizer state). Where the rule said which tensors its bytes come
    from, that is used; otherwise each side is split in proportion to the unique bytes of
    the tensors it touches, so the parts always sum to the rule's own byte counts."""
    cost = kernel.cost
    sides: list[dict[str, int]] = []
    for explicit, tensors, total in (
        (cost.reads, [t for op in kernel.ops for t in read_tensors(op)], cost.bytes_read),
        (cost.writes, [t for op in kernel.ops for t in written_tensors(op)], cost.bytes_written),
    ):
        if explicit:  # the rule said which tensors its bytes come from
            split: dict[str, int] = defaultdict(int)
            for t, size in explicit:
                split[roles.get(t.storage, ACTIVATIONS)] += size
            sides.append(dict(split))
            continue
        by_role: dict[str, list] = defaultdict(list)
        for t in tensors:
            by_role[roles.get(t.storage, ACTIVATIONS)].append(t)
        sizes = {role: unique_bytes(ts) for role, ts in by_role.items()}
        whole = sum(sizes.values())
        if not whole:
            sides.append({ACTIVATIONS: total} if total else {})
            continue
        sides.append({role: round(total * size / whole) for role, size in sizes.items() if size})
    return sides[0], sides[1]


def _timed(
    index: int, kernel: Kernel, cost: Cost, t: Any, traffic: dict[str, int]
) -> KernelEstimate:
    return KernelEstimate(
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
        read_by=traffic[0],
        written_by=traffic[1],
        flags=kernel.flags,
    )


def estimate_trace(
    trace: Trace,
    hardware: str | Path | HardwareSpec = "h100-sxm",
    pricing: PricingOptions | None = None,
    **knobs: Any,
) -> Estimate:
    """Price and time every op of ``trace`` on ``hardware``.

    ``pricing`` or its fields as keywords (:class:`torchroof.options.PricingOptions`:
    ``fusion``, ``epilogue``, ``loss``, ``attention``, ``on_chip_budget_bytes``,
    ``allow_tf32``, ``overlap``, ``compute_efficiency``, ``bandwidth_efficiency``,
    ``launch_overhead_s``) choose the kernels and how each is timed.
    """
    workload_knobs, pricing_knobs = split_knobs(knobs)
    if workload_knobs:
        raise OptionError(
            f"{', '.join(sorted(workload_knobs))} choose what is traced, not how a trace is "
            "priced: pass them to estimate() or trace_model()"
        )
    pricing = replace(pricing or PricingOptions(), **pricing_knobs)
    with _no_gc():
        return _estimate_trace(trace, hardware, pricing)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: pricing allocates many small objects and nothing
    cyclic, and each full collection would rescan the whole model and trace."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _estimate_trace(
    trace: Trace, hardware: str | Path | HardwareSpec, pricing: PricingOptions
) -> Estimate:
    spec = get(hardware)
    step = optimizer_step.analyse(trace)
    roles = {**step.roles, **trace.roles}
    fused = pricing.fusion == "fused"
    ops = optimizer_step.fused_ops(trace.ops, step) if fused else trace.ops
    kernels, coverage = build_kernels(ops, pricing, roles)
    timed: list[KernelEstimate] = []
    tensor_flops: dict[str, int] = defaultdict(int)
    for index, kernel in enumerate(kernels):
        cost = kernel.cost
        if cost.unit == "tensor":
            tensor_flops[cost.dtype] += cost.flops
        t = time_kernel(cost, spec, pricing)
        timed.append(_timed(index, kernel, cost, t, traffic_by_role(kernel, roles)))
    if tensor_flops:
        reference_dtype = max(tensor_flops, key=tensor_flops.__getitem__)
        reference_peak = spec.tensor_peak(reference_dtype, allow_tf32=pricing.allow_tf32)
        reference_dtype = spec_dtype(reference_dtype)
    else:
        reference_dtype, reference_peak = "fp32", spec.vector_peak("fp32")
    batch = int(trace.facts.workload.get("batch", 1))
    return Estimate(
        hardware=spec.name,
        hardware_display=spec.display_name,
        hbm_bytes_per_s=spec.hbm_bytes_per_s.value,
        reference_peak_flops_per_s=reference_peak,
        reference_dtype=reference_dtype,
        kernels=timed,
        op_count=len(trace.ops),
        uncounted=coverage.uncounted,
        assumptions=[
            *routing_assumptions(trace),
            *cache_assumptions(trace),
            *step.assumptions(pricing.fusion),
            *(f"op {a.op_index} ({a.module or 'top level'}): {a.what}" for a in trace.assumptions),
        ],
        options=pricing.to_dict(),
        metadata=trace.facts.to_dict(),
        memory=footprint(
            trace,
            spec.hbm_capacity_bytes.value,
            batch,
            roles,
            _add_counts(trace.role_bytes, step.role_bytes),
        ),
    )


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


BALANCED_ROUTING = (
    "MoE experts: balanced routing assumed, each of the E experts receives tokens·top_k/E "
    "routed tokens; grouped-GEMM FLOPs are exact for any routing, and the expert weights read "
    "are those of min(E, tokens·top_k) experts"
)


def routing_assumptions(trace: Trace) -> list[str]:
    """The routing assumption, stated once, when the step runs routed experts."""
    routed = any("grouped_mm" in op.name for op in trace.ops) or any(
        a.kind == "routing" for a in trace.assumptions
    )
    return [BALANCED_ROUTING] if routed else []


def cache_assumptions(trace: Trace) -> list[str]:
    """How the model was built when not as asked (text-only), which cache an inference
    step used when it is not the static cache asked for, and how latent attention was
    decoded."""
    facts = trace.facts
    lines = [f"model: {facts.build_note}"] if facts.build_note else []
    if facts.positions:
        lines.append(f"positions: {facts.positions}")
    fallback = facts.cache_fallback
    if fallback:
        kind = facts.cache
        used = "no cache" if kind == "none" else f"the step used a {kind} cache"
        lines.append(f"cache: {used} ({fallback})")
    if facts.mla == "absorbed":
        lines.append(
            "MLA decode: up-projections absorbed, attention over the latent cache (FlashMLA); "
            "mla='expanded' prices transformers' per-step K/V expansion instead"
        )
    return lines

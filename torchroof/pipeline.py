"""Trace -> Estimate: price every op, group into kernels, time each on the accelerator;
and ``estimate()``, which builds the model on meta and traces a workload first."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from torchroof import optimizer_step
from torchroof.capture import OpBudgetExceeded, op_budget
from torchroof.counters import Cost
from torchroof.counters.tensors import read_tensors, unique_bytes, written_tensors
from torchroof.errors import first_line
from torchroof.fusion import Kernel, build_kernels
from torchroof.hardware import HardwareSpec, get, spec_dtype
from torchroof.memory import footprint
from torchroof.options import OptionError, PricingOptions, Workload, WorkloadError, split_knobs
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
    batch = int(trace.metadata.get("workload", {}).get("batch", 1))
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
        metadata=dict(trace.metadata),
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
        a.what.startswith(("nonzero of", "boolean mask", "Tensor.tolist()"))
        for a in trace.assumptions
    )
    return [BALANCED_ROUTING] if routed else []


def cache_assumptions(trace: Trace) -> list[str]:
    """How the model was built when not as asked (text-only), which cache an inference
    step used when it is not the static cache asked for, and how latent attention was
    decoded."""
    lines = [f"model: {trace.metadata['build_note']}"] if trace.metadata.get("build_note") else []
    if trace.metadata.get("positions"):
        lines.append(f"positions: {trace.metadata['positions']}")
    fallback = trace.metadata.get("cache_fallback")
    if fallback:
        kind = trace.metadata.get("cache")
        used = "no cache" if kind == "none" else f"the step used a {kind} cache"
        lines.append(f"cache: {used} ({fallback})")
    if trace.metadata.get("mla") == "absorbed":
        lines.append(
            "MLA decode: up-projections absorbed, attention over the latent cache (FlashMLA); "
            "mla='expanded' prices transformers' per-step K/V expansion instead"
        )
    return lines


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model with every parameter and buffer on meta. The original is never
    touched (a workload sets train mode, gradients, checkpointing on the copy) and no real
    weight is copied: deepcopy is handed meta stand-ins for them."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_meta:
            continue
        stand_in = torch.empty_like(t, device="meta")
        if isinstance(t, torch.nn.Parameter):
            stand_in = torch.nn.Parameter(stand_in, requires_grad=t.requires_grad)
        memo[id(t)] = stand_in
    return copy.deepcopy(model, memo)


def estimate(
    model: Any = "llama-3-8b",
    regime: str | None = None,
    *,
    hardware: str | Path | HardwareSpec = "h100-sxm",
    workload: Workload | None = None,
    pricing: PricingOptions | None = None,
    **knobs: Any,
) -> Estimate:
    """Estimate one step of ``model`` on ``hardware``.

    ``model`` is an ``nn.Module`` (any device: it is traced on a meta copy, its weights are
    never touched), a transformers config, a path to a config.json or model directory, or
    a shipped config name (``torchroof models``). ``regime`` is ``prefill`` (B x seq tokens,
    writing the KV cache), ``decode`` (one token for B sequences against a cache of
    ``context`` tokens) or ``train`` (forward, loss, backward, optimizer step); left out,
    the workload's, else prefill.

    Every other keyword is a field of :class:`torchroof.options.Workload` (``batch``,
    ``seq``, ``context``, ``cache``, ``optimizer``, ``precision``, ``checkpointing``,
    ``mla``, ``dtype``) or of :class:`torchroof.options.PricingOptions` (``fusion``, …),
    or pass the objects. A module keeps its own dtype unless ``dtype`` or ``precision`` is
    given; a config is built in ``dtype`` (bf16).
    """
    workload_knobs, pricing_knobs = split_knobs(knobs)
    spec = get(hardware)  # fail on a bad name before any tracing
    pricing = replace(pricing or PricingOptions(), **pricing_knobs)
    trace = trace_model(model, regime, workload=workload, **workload_knobs)
    return estimate_trace(trace, spec, pricing)


class ModelTraceError(ValueError):
    """The model's own forward or backward failed on meta (a limitation, named in one
    line; the original exception is chained)."""


def trace_model(
    model: Any, regime: str | None = None, *, workload: Workload | None = None, **knobs: Any
) -> Trace:
    """The trace :func:`estimate` prices: ``workload``, or its fields as keywords."""
    workload_knobs, pricing_knobs = split_knobs(knobs)
    if pricing_knobs:
        raise OptionError(
            f"{', '.join(sorted(pricing_knobs))} choose how a trace is priced, not what is "
            "traced: pass them to estimate() or estimate_trace()"
        )
    cast = workload is not None or "dtype" in workload_knobs or "precision" in workload_knobs
    if regime is not None:
        workload_knobs["regime"] = regime
    workload = replace(workload, **workload_knobs) if workload else Workload(**workload_knobs)
    return trace_workload(model, workload, cast_module=cast)


def trace_workload(model: Any, workload: Workload, cast_module: bool = False) -> Trace:
    """Build (or meta-copy) the model and trace one step of ``workload`` on it. A module
    keeps its dtype unless ``cast_module``."""
    from torchroof.models import build_model, check_layers, check_positions, load_config
    from torchroof.workloads import compute_dtype, run_workload

    if isinstance(model, torch.nn.Module):
        label = type(model).__name__
        config = getattr(model, "config", None)
        if config is None:
            raise WorkloadError(
                f"{label} is not a transformers model: the {workload.regime} regime drives a "
                "model's forward with input_ids, labels and a KV cache; trace any other module "
                "by hand: `with torchroof.trace() as t: model(x).sum().backward(); opt.step()` "
                "then `t.estimate(...)` (README, 'A step traced by hand')"
            )
    else:
        label = str(model) if isinstance(model, (str, Path)) else type(model).__name__
        config = load_config(model)
    beyond = None
    if config is not None:  # refused before anything is built
        check_layers(config, name=label)
        # decode: the cache holds ``context`` tokens, the model's maximum (the seed's 70B at
        # 8192); the step's one new token is not counted against it
        length = workload.context if workload.regime == "decode" else workload.seq
        allow = workload.allow_beyond_max_positions
        beyond = check_positions(config, length, allow, name=label)
    if isinstance(model, torch.nn.Module):
        module = meta_copy(model)
        if cast_module:
            module = module.to(compute_dtype(workload))
    else:
        module = build_model(config, compute_dtype(workload))
    try:
        with op_budget(max_ops=workload.max_ops):
            trace = run_workload(module, workload)
    except (WorkloadError, OpBudgetExceeded):
        raise
    except Exception as error:  # noqa: BLE001 - the model's own code failed on meta
        raise ModelTraceError(
            f"{type(module).__name__} could not be traced for {workload.regime}: "
            f"{first_line(error)} (see README, 'Architectures that do not trace')"
        ) from error
    trace.metadata["model"] = label
    if beyond:
        trace.metadata["positions"] = beyond
    return trace

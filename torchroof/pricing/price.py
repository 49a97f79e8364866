"""Trace -> Estimate: price every op, group into kernels, time each on the accelerator, and
lay a multi-GPU step's kernels on a compute and a communication stream.

The stage only; building a model and tracing a workload first is :mod:`torchroof.api`."""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchroof import progress
from torchroof.config.errors import OptionError
from torchroof.config.options import PricingOptions, split_knobs
from torchroof.counters import Cost, kind_of
from torchroof.counters.collectives import collective_kind, group_size, message_bytes
from torchroof.counters.tensors import read_tensors, unique_bytes, written_tensors
from torchroof.hardware import (
    ClusterSpec,
    HardwareSpec,
    available_clusters,
    get,
    get_cluster,
    is_cluster,
    spec_dtype,
)
from torchroof.kernels import optimizer_step
from torchroof.kernels.fusion import Kernel, build_kernels
from torchroof.parallel.pipeline import price as pp_step
from torchroof.parallel.pipeline.price import PipelineTrace
from torchroof.pricing.trace_checks import RULE_ERRORS, check_cluster_fits, unpriceable_op
from torchroof.quant.recipes import check_hardware
from torchroof.records.trace import OpRecord, Trace, dtype_itemsize
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.report.memory import footprint
from torchroof.timing.hierarchy import level_rates
from torchroof.timing.kernel_shape import KernelShape, kernel_shape
from torchroof.timing.network import NETWORK, NO_LINK, collective_time
from torchroof.timing.roofline import KernelTime, time_kernel
from torchroof.timing.streams import schedule, tasks_of

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
    index: int, kernel: Kernel, cost: Cost, t: KernelTime, traffic: tuple[dict[str, int], ...]
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
        first_op=kernel.ops[0].index if kernel.ops else -1,
        boundary=t.boundary,
        level_bytes=dict(t.level_bytes or {}),
        tile=t.tile,
        waves=t.waves,
        wave_efficiency=t.wave_efficiency,
        in_flight_bytes=t.in_flight_bytes,
        overhead_s=t.overhead_s,
    )


class ClusterRequiredError(OptionError):
    """A step with collectives priced on one accelerator: its network time has no link."""


def resolve_hardware(
    hardware: str | Path | HardwareSpec | ClusterSpec,
) -> tuple[HardwareSpec, ClusterSpec | None]:
    """(the accelerator, the cluster or None) for an accelerator or a cluster given by name,
    alias, TOML path or spec: a cluster prices its own accelerator's kernels."""
    if isinstance(hardware, ClusterSpec):
        return hardware.accelerator, hardware
    if isinstance(hardware, HardwareSpec):
        return hardware, None
    if is_cluster(hardware):
        cluster = get_cluster(hardware)
        return cluster.accelerator, cluster
    return get(hardware), None


def estimate_trace(
    trace: Trace | PipelineTrace,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    pricing: PricingOptions | None = None,
    **knobs: Any,
) -> Estimate:
    """Price and time every op of ``trace`` on ``hardware``: an accelerator, or a cluster
    (``dgx-h100``, a cluster TOML or a ClusterSpec) whose accelerator runs the kernels and
    whose links carry the collectives (:func:`time_collective`). A step with collectives
    over more than one rank needs a cluster (:class:`ClusterRequiredError`).

    ``pricing`` or its fields as keywords (:class:`torchroof.config.options.PricingOptions`:
    ``fusion``, ``epilogue``, ``loss``, ``attention``, ``on_chip_budget_bytes``,
    ``allow_tf32``, ``overlap``, ``overlap_communication``, ``compute_efficiency``,
    ``bandwidth_efficiency``, ``launch_overhead_s``) choose the kernels and how each is
    timed. With collectives the step time is the two-stream schedule's
    (:mod:`torchroof.timing.streams`); without, the plain sum of the kernels' times.
    """
    workload_knobs, pricing_knobs = split_knobs(knobs)
    if workload_knobs:
        raise OptionError(
            f"{', '.join(sorted(workload_knobs))} choose what is traced, not how a trace is "
            "priced: pass them to estimate() or trace_model()"
        )
    pricing = replace(pricing or PricingOptions(), **pricing_knobs)
    with _no_gc(), progress.current().ending():
        if isinstance(trace, PipelineTrace):  # one trace per distinct stage + the schedule
            spec, cluster = resolve_hardware(hardware)
            return pp_step.price(
                trace,
                lambda stage: _estimate_trace(stage, cluster or spec, pricing),
                cluster,
                int(spec.hbm_capacity_bytes.value),
            )
        try:
            return _estimate_trace(trace, hardware, pricing)
        except OptionError:
            raise
        except RULE_ERRORS as e:
            named = unpriceable_op(trace)  # the op a rule could not read, if one is to blame
            if named is None:
                raise
            raise named from e


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
    trace: Trace, hardware: str | Path | HardwareSpec | ClusterSpec, pricing: PricingOptions
) -> Estimate:
    spec, cluster = resolve_hardware(hardware)
    if cluster is not None:
        check_cluster_fits(trace.facts.workload, cluster)
    if pricing.routing_imbalance != 1.0 and int(trace.facts.workload.get("ep", 1) or 1) <= 1:
        raise OptionError(
            f"routing_imbalance={pricing.routing_imbalance:g} prices the busiest of the ep "
            "ranks; this step does not shard its experts (ep=1), so its experts get every "
            "routed token whatever the routing: trace it with ep > 1"
        )
    check_hardware(
        str(trace.facts.workload.get("quant", "none")), spec.tensor_flops_per_s, spec.display_name
    )
    step = optimizer_step.analyse(trace)
    roles = {**step.roles, **trace.roles}
    fused = pricing.fusion == "fused"
    ops = optimizer_step.fused_ops(trace.ops, step) if fused else trace.ops
    kernels, coverage = build_kernels(ops, pricing, roles)
    report = progress.current()
    report.begin(f"timing {len(kernels):,} kernels on the {spec.display_name}", len(kernels))
    timed: list[KernelEstimate] = []
    tensor_flops: dict[str, int] = defaultdict(int)
    unpriced: list[int] = []  # group sizes of collectives that need a cluster to be timed
    collectives = 0
    for index, kernel in enumerate(report.track(kernels)):
        cost = kernel.cost
        if cost.unit == "tensor":
            tensor_flops[cost.dtype] += cost.flops
        t = time_kernel(cost, spec, pricing, *_geometry(kernel))
        estimate = _timed(index, kernel, cost, t, traffic_by_role(kernel, roles))
        if cost.unit == "network":
            collectives += 1
            estimate = time_collective(estimate, _collective_op(kernel), t, cluster, unpriced)
        if pricing.routing_imbalance != 1.0 and _routed(kernel):
            estimate = busiest_rank(estimate, pricing.routing_imbalance, t, pricing, spec)
        timed.append(estimate)
    if unpriced:
        raise ClusterRequiredError(_needs_cluster(len(unpriced), max(unpriced), spec))
    step_time_s = None
    if collectives:
        report.begin("scheduling compute and communication on their two streams")
        timed, step_time_s = _scheduled(timed, kernels, pricing)
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
            *routing_assumptions(trace, pricing.routing_imbalance),
            *cache_assumptions(trace),
            *step.assumptions(pricing.fusion),
            *trace_assumption_lines(trace),
        ],
        options=pricing.to_dict(),
        facts=replace(trace.facts),
        memory=footprint(
            trace,
            spec.hbm_capacity_bytes.value,
            batch,
            roles,
            _add_counts(trace.role_bytes, step.role_bytes),
        ),
        cluster=cluster.name if cluster is not None else None,
        link_ridges=_link_ridges(cluster, reference_peak),
        step_time_s=step_time_s,
    )


def _geometry(kernel: Kernel) -> tuple[KernelShape, int]:
    """The kernel's shape (tiles, waves, levels) and its output's bytes per element."""
    lead = kernel.lead
    out = lead.outputs[0].dtype if lead.outputs else "bfloat16"
    return kernel_shape(kernel.ops, lead, kernel.cost), dtype_itemsize(out)


def _routed(kernel: Kernel) -> bool:
    """An expert kernel whose work follows the routed tokens: a grouped GEMM, or an
    all-to-all that carries tokens to their experts' ranks."""
    names = [op.name for op in kernel.ops]
    if any("grouped_mm" in name for name in names):
        return True
    return kernel.cost.unit == "network" and any("all_to_all" in name for name in names)


def busiest_rank(
    kernel: KernelEstimate,
    imbalance: float,
    t: KernelTime,
    pricing: PricingOptions,
    spec: HardwareSpec,
) -> KernelEstimate:
    """The kernel on the rank whose experts get ``imbalance`` times the balanced share of
    routed tokens (issue 14 item 2): a grouped GEMM's W and its non-weight bytes scale by
    it (the expert weights are read once either way); an expert all-to-all carries that
    many times the rows. The step waits for that rank; FLOPs stay the balanced ones. In
    realistic mode the on-chip levels' bytes scale with the rows too, and the launch stays."""
    if kernel.unit == "network":
        carried_s = (kernel.network_s - kernel.latency_s) * imbalance  # alpha does not scale
        return replace(
            kernel,
            time_s=max(kernel.time_s, kernel.latency_s + carried_s),
            network_s=kernel.latency_s + carried_s,
        )
    weights = kernel.read_by.get("weights", 0)
    scaled_bytes = weights + imbalance * (kernel.bytes - weights)
    compute_s = t.compute_s * imbalance
    memory_s = scaled_bytes / t.bandwidth_bytes_per_s
    terms = {"compute": compute_s, "hbm": memory_s}
    if pricing.mode == "realistic" and pricing.on_chip:
        for level, rate in level_rates(spec).items():
            if level in kernel.level_bytes:
                terms[level] = kernel.level_bytes[level] * imbalance / rate
    slowest_memory = max(seconds for name, seconds in terms.items() if name != "compute")
    body = max(compute_s, slowest_memory) if pricing.overlap else compute_s + slowest_memory
    return replace(
        kernel,
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=body + t.overhead_s,
        bound="compute" if compute_s > memory_s else "memory",
        boundary=max(terms, key=terms.__getitem__),
    )


def _collective_op(kernel: Kernel) -> OpRecord:
    """The one collective of a kernel on the ``network`` unit (fusion never groups them)."""
    found = [op for op in kernel.ops if kind_of(op.packet) == "collective"]
    if len(found) != 1:
        raise ValueError(
            f"a network kernel holds {len(found)} collectives ({kernel.name}); expected one"
        )
    return found[0]


def time_collective(
    kernel: KernelEstimate,
    op: OpRecord,
    hbm: KernelTime,  # the roofline's time of its HBM bytes
    cluster: ClusterSpec | None,
    unpriced: list[int],
) -> KernelEstimate:
    """A collective at the network boundary (seed 000 "The next wall"; issue 13 item 3):
    alpha + wire bytes / beta on the link its group's ranks span
    (:func:`torchroof.timing.network.collective_time`), W = 0.

    Its time is max(HBM bytes / beta_hbm, network time): the rank reads what it sends and
    writes what it receives while the bytes cross the link, so the slower of the two pipes
    sets the time. No launch overhead is added: alpha is a measured small-message time,
    launch included. Bound "network" when the link is the slower pipe, else "memory". A
    group of one crosses no link: its HBM time only. Without a cluster, a group of more
    than one rank is noted in ``unpriced`` (its size) and the kernel returned as is, for
    the caller to refuse."""
    ranks = op.arg("group_ranks")
    size = group_size(op)
    if size == 1:
        return replace(kernel, link=NO_LINK)
    if cluster is None:
        unpriced.append(size)
        return kernel
    if not isinstance(ranks, (list, tuple)) or len(ranks) != size:
        raise ValueError(
            f"op {op.index} ({op.name}) has no recorded group ranks (group_ranks={ranks!r}); "
            "trace it again with this torchroof, which records each collective's group"
        )
    net = collective_time(collective_kind(op), message_bytes(op), ranks, cluster)
    wire = {cluster.intra_node.kind: round(net.intra_node_bytes_per_rank)}
    wire[NETWORK] = round(net.network_bytes_per_rank)
    return replace(
        kernel,
        time_s=max(hbm.memory_s, net.time_s),
        bound="network" if net.time_s >= hbm.memory_s else "memory",
        boundary="network" if net.time_s >= hbm.memory_s else "hbm",
        overhead_s=0.0,  # alpha holds the collective's fixed cost
        link=net.link,
        wire_by_link={link: sent for link, sent in wire.items() if sent},
        network_s=net.time_s,
        latency_s=net.alpha_s,
    )


def _needs_cluster(count: int, largest: int, spec: HardwareSpec) -> str:
    """Why a step with collectives cannot be priced on ``spec`` alone, and where it can."""
    clusters = [c.name for c in available_clusters() if c.accelerator.name == spec.name]
    where = (
        f"price it on a cluster: {', '.join(clusters)}"
        if clusters
        else f"price it on a cluster of {spec.name} (none ships: write a cluster TOML, "
        "as hardware/clusters/*.toml)"
    )
    plural = "s" if count > 1 else ""
    return f"this step has {count} collective{plural} over groups of up to {largest} ranks: {where}"


def _scheduled(
    timed: list[KernelEstimate], kernels: list[Kernel], pricing: PricingOptions
) -> tuple[list[KernelEstimate], float]:
    """The kernels with their start, stream and exposed communication, and the step time,
    from the two-stream schedule (:mod:`torchroof.timing.streams`)."""
    tasks = tasks_of(kernels, [k.time_s for k in timed])
    laid = schedule(tasks, overlap=pricing.overlap_communication)
    placed = [
        replace(k, start_s=start, stream=task.stream, exposed_s=exposed, waits_on=before)
        for k, task, start, exposed, before in zip(
            timed, tasks, laid.start_s, laid.exposed_s, laid.waits, strict=True
        )
    ]
    return placed, laid.step_time_s


def _link_ridges(cluster: ClusterSpec | None, reference_peak: float) -> dict[str, float]:
    """FLOPs per byte crossing each of the cluster's links at which it stops binding: the
    step's reference peak over the link's line rate (seed 000 "The next wall", Table 4;
    ClusterSpec.link_ridges at the step's dtype)."""
    if cluster is None:
        return {}
    return {k: reference_peak / link.line_bytes_per_s.value for k, link in cluster.links().items()}


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


BALANCED_ROUTING = (
    "MoE experts: balanced routing assumed, each of the E experts receives tokens·top_k/E "
    "routed tokens; grouped-GEMM FLOPs are exact for any routing, and the expert weights read "
    "are those of min(E, tokens·top_k) experts"
)


def routing_assumptions(trace: Trace, imbalance: float = 1.0) -> list[str]:
    """The routing assumption, stated once, when the step runs routed experts."""
    routed = any("grouped_mm" in op.name for op in trace.ops) or any(
        a.kind == "routing" for a in trace.assumptions
    )
    if not routed:
        return []
    if imbalance == 1.0:
        return [BALANCED_ROUTING]
    return [
        BALANCED_ROUTING
        + f"; the step is priced on the busiest rank, whose experts get {imbalance:g}x the "
        "balanced share (routing_imbalance): its grouped GEMMs and expert all-to-alls scaled"
    ]


def trace_assumption_lines(trace: Trace) -> list[str]:
    """What capture assumed, one line per distinct answer: the first op that needed it,
    and how many more did (a MoE layer's split sizes, answered once per layer)."""
    first: dict[str, Any] = {}
    repeats: dict[str, int] = {}
    for a in trace.assumptions:
        if a.what in first:
            repeats[a.what] += 1
        else:
            first[a.what], repeats[a.what] = a, 0
    lines = []
    for what, a in first.items():
        more = f" and {repeats[what]} more ops like it" if repeats[what] else ""
        lines.append(f"op {a.op_index} ({a.module or 'top level'}){more}: {what}")
    return lines


def cache_assumptions(trace: Trace) -> list[str]:
    """How the model was built when not as asked (text-only), which cache an inference
    step used when it is not the static cache asked for, and how latent attention was
    decoded."""
    facts = trace.facts
    lines = [f"model: {facts.build_note}"] if facts.build_note else []
    if facts.quant:
        lines.append(
            f"quantised: {facts.quant}; the LM head, embeddings and MoE routers keep the "
            "model's dtype"
        )
    kv_dtype = facts.workload.get("kv_dtype", "model")
    if kv_dtype not in ("model", None):
        lines.append(
            f"KV cache in {kv_dtype}: K and V quantised as they are written (per-tensor "
            "scale), read by the attention kernel at 1 B per element and widened in registers"
        )
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

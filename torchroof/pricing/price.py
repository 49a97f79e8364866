"""Trace -> Estimate: price every op, group into kernels, time each on the accelerator, and
lay a multi-GPU step's kernels on a compute and a communication stream.

The stage only, one Trace at a time; building a model, tracing a workload and pricing a
pipelined step's stages is :mod:`torchroof.api`'s."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from torchroof import progress
from torchroof.accuracy.expected import calibration_lines, correction
from torchroof.config import PricingOptions, Workload, split_knobs
from torchroof.config.errors import OptionError
from torchroof.config.routing import parse_routing
from torchroof.counters import Cost, registry_version
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.kernels import optimizer_step
from torchroof.kernels.fp8_saves import fp8_line, fp8_saved_inputs
from torchroof.kernels.fusion import Coverage, Kernel, build_kernels
from torchroof.kernels.regather import (
    Regather,
    regather_line,
    sequence_parallel_gathers,
    with_regathers,
)
from torchroof.kernels.repeats import repeated_kernel_copies
from torchroof.pricing.assumptions import (
    cache_assumptions,
    routing_assumptions,
    trace_assumption_lines,
)
from torchroof.pricing.collectives import (
    ClusterRequiredError,
    collective_op,
    link_ridges,
    needs_cluster,
    time_collective,
)
from torchroof.pricing.experts import busiest_rank, routed
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.offload import NOT_PIPELINED, NOT_SERVING, offload_activations
from torchroof.pricing.residency import (
    fp8_divisors,
    fp8_narrowed_residency,
    kernel_residency,
    regathered_residency,
)
from torchroof.pricing.routing import RoutedRank, grouped_gemm, routed_rank
from torchroof.pricing.runtime import (
    check_runtime,
    fp16_accumulated,
    reference_peak,
    runtime_lines,
    timing_of,
    with_knobs,
)
from torchroof.pricing.trace_checks import check_cluster_fits
from torchroof.pricing.traffic import traffic_by_role
from torchroof.quant.recipes import check_hardware
from torchroof.records.facts import StepFacts
from torchroof.records.tensors import dtype_itemsize
from torchroof.records.trace import Trace
from torchroof.report.analysis import collective_lanes
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.report.kinds import Boundary
from torchroof.report.memory import (
    Residency,
    TransientPeak,
    backward_saved_bytes,
    footprint,
    transient_peak,
)
from torchroof.timing.kernel_shape import KernelShape, kernel_shape
from torchroof.timing.roofline import NO_RUNTIME, KernelTime, time_kernel
from torchroof.timing.runtime import StepRuntime
from torchroof.timing.streams import lanes_line, schedule, tasks_of
from torchroof.timing.tp_overlap import Pipelined, pipelined_line, pipelined_pairs


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
        flags=tuple(str(flag) for flag in kernel.flags),
        first_op=kernel.ops[0].index if kernel.ops else -1,
        boundary=cast(Boundary, t.boundary),  # torchroof.timing.roofline names its terms as str
        level_bytes=dict(t.level_bytes or {}),
        tile=t.tile,
        waves=t.waves,
        wave_efficiency=t.wave_efficiency,
        in_flight_bytes=t.in_flight_bytes,
        overhead_s=t.overhead_s,
    )


def pricing_options(pricing: PricingOptions | None, knobs: dict[str, Any]) -> PricingOptions:
    """``pricing`` (or the defaults) with the pricing knobs given as keywords replaced; a
    workload knob is refused: it chooses what is traced, not how a trace is priced."""
    workload_knobs, pricing_knobs = split_knobs(knobs)
    if workload_knobs:
        raise OptionError(
            f"{', '.join(sorted(workload_knobs))} choose what is traced, not how a trace is "
            "priced: pass them to estimate() or trace_model()"
        )
    return with_knobs(pricing, pricing_knobs)


def check_step(
    workload: Workload | None,
    spec: HardwareSpec,
    cluster: ClusterSpec | None,
    pricing: PricingOptions,
) -> None:
    """Refuse a step the options or the hardware cannot price: a cluster too small for its
    ranks, routing imbalance without sharded experts, activation offload outside a
    single-stage training step, a recipe the accelerator cannot run."""
    check_runtime(pricing, workload)
    if cluster is not None and workload is not None:
        check_cluster_fits(workload, cluster)
    if pricing.routing_imbalance != 1.0 and (workload.ep if workload else 1) <= 1:
        raise OptionError(
            f"routing_imbalance={pricing.routing_imbalance:g} prices the busiest of the ep "
            "ranks; this step does not shard its experts (ep=1), so its experts get every "
            "routed token whatever the routing: trace it with ep > 1"
        )
    if pricing.offload_activations and workload is not None:
        if not workload.trains:
            raise OptionError(f"{NOT_SERVING}, not a {workload.regime} step")
        if workload.pp > 1:  # a pipeline's whole workload (a prepared grid's point)
            raise OptionError(NOT_PIPELINED)
    quant = workload.quant if workload else "none"
    check_hardware(quant, spec.tensor_flops_per_s, spec.display_name)


def time_kernels(
    kernels: list[Kernel],
    roles: dict[int, str],
    spec: HardwareSpec,
    cluster: ClusterSpec | None,
    pricing: PricingOptions,
    runtime: StepRuntime = NO_RUNTIME,
    rank: RoutedRank | None = None,
) -> tuple[list[KernelEstimate], dict[str, int], int, int]:
    """(every kernel timed, the tensor-unit FLOPs by dtype, how many are collectives, how
    many of them a CUDA graph times by NCCL's model), under the ``runtime`` running the
    step, its routed experts as ``rank`` receives them (balanced when None)."""
    report = progress.current()
    report.begin(f"timing {len(kernels):,} kernels on the {spec.display_name}", len(kernels))
    timed: list[KernelEstimate] = []
    tensor_flops: dict[str, int] = defaultdict(int)
    unpriced: list[int] = []  # group sizes of collectives that need a cluster to be timed
    in_graph_ops: list[int] = []  # collectives timed by NCCL's in-graph model
    collectives = 0
    # a repeated layer's kernels repeat: each distinct (work, traffic, unit, dtype, shape)
    # is timed once, time_kernel reading nothing else of a kernel
    times: dict[tuple[object, ...], KernelTime] = {}
    for index, kernel in enumerate(report.track(kernels)):
        cost = kernel.cost
        if cost.unit == "tensor":
            tensor_flops[cost.dtype] += cost.flops
        geometry = _geometry(kernel)
        key = (cost.flops, cost.bytes_read, cost.bytes_written, cost.unit, cost.dtype, *geometry)
        t = times.get(key)
        if t is None:
            t = times[key] = time_kernel(cost, spec, pricing, *geometry, runtime=runtime)
        estimate = _timed(index, kernel, cost, t, traffic_by_role(kernel, roles))
        if cost.unit == "network":
            collectives += 1
            op = collective_op(kernel)
            estimate = time_collective(estimate, op, t, cluster, unpriced, runtime, in_graph_ops)
        if rank is not None and routed(kernel):
            gemm = grouped_gemm(kernel.ops)
            reach = rank.reach(*gemm) if gemm is not None else 1.0
            if rank.imbalance != 1.0 or reach != 1.0:
                estimate = busiest_rank(estimate, rank.imbalance, t, pricing, spec, reach)
        timed.append(estimate)
    if unpriced:
        raise ClusterRequiredError(needs_cluster(len(unpriced), max(unpriced), spec))
    return timed, tensor_flops, collectives, len(in_graph_ops)


@dataclass(frozen=True)
class KernelPlan:
    """What pricing makes of a trace before any accelerator is read: the optimizer step's
    analysis, the roles, the kernels with their W and Q, the ops no rule counted and the
    activations' transient peak. One plan serves every accelerator, cluster, timing mode
    and efficiency the same kernel policy prices it with (:meth:`PricingOptions.kernel_policy`).
    Every estimate priced from a plan shares its kernels, roles and step: read only."""

    step: optimizer_step.OptimizerStep
    roles: dict[int, str]
    kernels: list[Kernel]
    coverage: Coverage
    peak: TransientPeak | None  # None: not worked out (group_kernels)
    # per kernel, the index of the kernel it is a copy of (a repeated layer's; its own index
    # where it is none): None when the step was grouped op by op
    sources: tuple[int, ...] | None = None
    # what the kernels keep where it differs from op by op (None: eager kernels, every op's
    # output kept, and no runtime saving otherwise)
    residency: Residency | None = None
    backward_saved_bytes: int = 0  # what the forward keeps for the backward (plan_kernels)
    # sequence-parallel inputs saved as shards and all-gathered again in the backward
    regathers: tuple[Regather, ...] = ()
    # what the runtime's saved tensors change, one line each (regather_line, fp8_line)
    memory_notes: tuple[str, ...] = ()


PlanCache = dict[tuple[object, ...], KernelPlan]
"""One trace's plans, by kernel policy (and the rule registry's version)."""

MAX_PLANS_PER_TRACE = 8
"""Kernel plans kept per trace (the oldest is dropped past it): a sweep over a kernel
policy field (``on_chip_budget_bytes``, say) would otherwise keep one per value."""


class TracePlans:
    """Kernel plans kept per trace (a pipelined step's stages are one trace each) and kernel
    policy: what a prepared model holds beside each trace, so that pricing a trace again
    on another accelerator, cluster, timing mode or efficiency only times its kernels. A
    trace must not change once priced through it."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Trace, PlanCache]] = {}

    def of(self, trace: Trace) -> PlanCache:
        held = self._held.get(id(trace))
        if held is None or held[0] is not trace:
            held = self._held[id(trace)] = (trace, {})
        return held[1]

    def __len__(self) -> int:
        return sum(len(plans) for _, plans in self._held.values())


def plan_kernels(trace: Trace, pricing: PricingOptions) -> KernelPlan:
    """Group ``trace``'s ops into kernels under ``pricing``'s kernel policy."""
    grouped = group_kernels(trace, pricing)
    peak = transient_peak(trace, grouped.roles, grouped.residency)
    saved = backward_saved_bytes(trace, grouped.roles, grouped.residency)
    return replace(grouped, peak=peak, backward_saved_bytes=saved)


def group_kernels(trace: Trace, pricing: PricingOptions) -> KernelPlan:
    """:func:`plan_kernels` but the transient peak (``peak`` is None)."""
    policy = pricing.kernels_only()
    step = optimizer_step.analyse(trace)
    roles = {**step.roles, **trace.roles}
    fused = policy.fusion == "fused"
    ops = optimizer_step.fused_ops(trace.ops, step) if fused else trace.ops
    built = repeated_kernel_copies(ops, trace.copies, policy, roles) if not step.groups else None
    if built is not None:
        kernels, coverage, sources = built.kernels, built.coverage, built.sources
    else:
        (kernels, coverage), sources = build_kernels(ops, policy, roles), None
    residency = kernel_residency(kernels, roles) if fused else None
    saves = runtime_saves(trace, policy, kernels, sources, residency)
    return KernelPlan(
        step,
        roles,
        saves.kernels,
        coverage,
        None,
        saves.sources,
        saves.residency,
        regathers=saves.regathers,
        memory_notes=saves.notes,
    )


@dataclass(frozen=True)
class RuntimeSaves:
    """A step's kernels, copy sources and residency once the runtime's way of saving
    tensors for the backward is applied, with what it applied (the plan's fields)."""

    kernels: list[Kernel]
    sources: tuple[int, ...] | None
    residency: Residency | None
    regathers: tuple[Regather, ...] = ()
    notes: tuple[str, ...] = ()


def runtime_saves(
    trace: Trace,
    policy: PricingOptions,
    kernels: list[Kernel],
    sources: tuple[int, ...] | None,
    residency: Residency | None,
) -> RuntimeSaves:
    """A training step's sequence-parallel inputs re-gathered in the backward
    (``policy.sequence_parallel_regather``, :mod:`torchroof.kernels.regather`) and its fp8
    layers' inputs saved in fp8 (``policy.save_fp8_inputs``,
    :mod:`torchroof.kernels.fp8_saves`); anything else as it is."""
    workload = trace.facts.workload
    if workload is None or not workload.trains:
        return RuntimeSaves(kernels, sources, residency)
    regathers: tuple[Regather, ...] = ()
    if policy.sequence_parallel_regather and workload.sequence_parallel:
        regathers = tuple(sequence_parallel_gathers(trace.ops, workload.tp))
    narrowed = fp8_saved_inputs(trace.ops) if policy.save_fp8_inputs else {}
    divisors = fp8_divisors(narrowed, regathers)
    if regathers:
        kernels, sources = with_regathers(kernels, sources, regathers, divisors)
        residency = regathered_residency(residency, regathers)
    if narrowed:
        residency = fp8_narrowed_residency(residency, divisors)
    notes = (
        *([regather_line(regathers)] if regathers else []),
        *([fp8_line(narrowed)] if narrowed else []),
    )
    return RuntimeSaves(kernels, sources, residency, regathers, notes)


def cached_plan(trace: Trace, pricing: PricingOptions, plans: PlanCache | None) -> KernelPlan:
    """The trace's kernels under ``pricing``'s kernel policy: from ``plans`` where it holds
    them, else planned (and kept there, the oldest dropped past MAX_PLANS_PER_TRACE)."""
    policy = (registry_version(), *pricing.kernel_policy())
    plan = plans.get(policy) if plans is not None else None
    if plan is None:
        plan = plan_kernels(trace, pricing)
        if plans is not None:
            if len(plans) >= MAX_PLANS_PER_TRACE:
                del plans[next(iter(plans))]
            plans[policy] = plan
    return plan


def price_trace(
    trace: Trace,
    hardware: str | Path | HardwareSpec | ClusterSpec,
    pricing: PricingOptions,
    plans: PlanCache | None = None,
) -> Estimate:
    """Price and time every op of one ``trace`` on ``hardware`` (an accelerator, or a cluster
    whose accelerator runs the kernels and whose links carry the collectives): group the ops
    into kernels, time each, and lay a step with collectives on its streams. ``plans``
    (this trace's, kept by the caller) holds the kernels made under each kernel policy, so
    pricing the same trace again under it times the kernels only."""
    spec, cluster = resolve_hardware(hardware)
    check_step(trace.facts.workload, spec, cluster, pricing)
    factor = correction(pricing.mode, trace.facts.workload)  # refused before any work
    plan = cached_plan(trace, pricing, plans)
    step, roles, kernels = plan.step, plan.roles, plan.kernels
    workload = trace.facts.workload
    runtime = timing_of(pricing, workload)
    rank = routed_rank(
        parse_routing(pricing.routing),
        trace,
        workload.ep if workload else 1,
        pricing.routing_imbalance,
    )
    timed, tensor_flops, collectives, in_graph = time_kernels(
        kernels, roles, spec, cluster, pricing, runtime, rank
    )
    step_time_s = None
    pipelined = Pipelined()
    if collectives:
        progress.current().begin("scheduling compute and communication on their streams")
        pipelined = tp_pairs(kernels, runtime, workload, pricing)
        timed, step_time_s = _scheduled(timed, kernels, pricing, pipelined)
    reference_dtype, reference_flops = reference_peak(tensor_flops, spec, pricing, runtime)
    fp16_acc = fp16_accumulated(runtime, tensor_flops)
    batch = trace.facts.workload.batch if trace.facts.workload else 1
    memory = footprint(
        trace,
        spec.hbm_capacity_bytes.value,
        batch,
        roles,
        zero_one_gradients(add_counts(trace.role_bytes, step.role_bytes), trace.facts),
        peak=plan.peak,
        backward_saved=plan.backward_saved_bytes,
    )
    offload = None
    if pricing.offload_activations:
        link = host_link(spec, cluster)
        offload = offload_activations(
            trace, roles, plan.residency, timed, pricing.offload_activations, link
        )
        freed = offload.bytes - offload.held_bytes
        memory = replace(memory, activations_peak_bytes=memory.activations_peak_bytes - freed)
    estimate = Estimate(
        hardware=spec.name,
        hardware_display=spec.display_name,
        hbm_bytes_per_s=spec.hbm_bytes_per_s.value,
        reference_peak_flops_per_s=reference_flops,
        reference_dtype=reference_dtype,
        kernels=timed,
        op_count=len(trace.ops),
        uncounted=dict(plan.coverage.uncounted),
        assumptions=[
            *runtime_lines(pricing, runtime, collectives > 0, spec, in_graph, fp16_acc, workload),
            *routing_assumptions(trace, rank),
            *zero_assumptions(workload),
            *reduction_assumptions(workload),
            *cache_assumptions(trace),
            *step.assumptions(pricing.fusion),
            *trace_assumption_lines(trace),
            *([offload.line()] if offload else []),
            *plan.memory_notes,
            *([pipelined_line(pipelined.pairs, kernels)] if pipelined.pairs else []),
            *(lanes_line(collective_lanes(timed)) if pricing.overlap_communication else []),
            *calibration_lines(pricing.mode, workload),
        ],
        options=pricing,
        facts=replace(trace.facts),
        memory=memory,
        cluster=cluster.name if cluster is not None else None,
        link_ridges=link_ridges(cluster, reference_flops),
        step_time_s=step_time_s,
        host_overhead_s=runtime.host_overhead_s,
        offload_exposed_s=offload.exposed_s if offload else 0.0,
        fp16_accumulate=fp16_acc,
    )
    return estimate.calibrated(factor)


def host_link(spec: HardwareSpec, cluster: ClusterSpec | None) -> tuple[str, float]:
    """(name, bytes per second each way) of the GPU's link to host memory: the cluster's
    host link where it names one, else the accelerator file's ``pcie`` figure."""
    if cluster is not None and cluster.pcie is not None:
        return cluster.pcie.name, cluster.pcie.line_bytes_per_s.value
    figure = spec.interconnect_bytes_per_s.get("pcie")
    if figure is None:
        raise OptionError(
            f"offload_activations crosses the GPU's host link: {spec.name} gives no pcie "
            "figure (interconnect_bytes_per_s.pcie in its hardware file)"
        )
    return "PCIe", figure.value


def _geometry(kernel: Kernel) -> tuple[KernelShape, int]:
    """The kernel's shape (tiles, waves, levels) and its output's bytes per element."""
    lead = kernel.lead
    out = lead.outputs[0].dtype if lead.outputs else "bfloat16"
    return kernel_shape(kernel.ops, lead, kernel.cost), dtype_itemsize(out)


def tp_pairs(
    kernels: list[Kernel],
    runtime: StepRuntime,
    workload: Workload | None,
    pricing: PricingOptions,
) -> Pipelined:
    """The collectives and GEMMs the runtime runs side by side (its ``tp_comm_overlap``, for
    a sequence-parallel step whose collectives overlap compute at all:
    :mod:`torchroof.timing.tp_overlap`); none otherwise."""
    overlaps = runtime.tp_comm_overlap and pricing.overlap_communication
    if not overlaps or workload is None or not workload.sequence_parallel:
        return Pipelined()
    return pipelined_pairs(kernels, workload.tp)


def _scheduled(
    timed: list[KernelEstimate],
    kernels: list[Kernel],
    pricing: PricingOptions,
    pipelined: Pipelined | None = None,
) -> tuple[list[KernelEstimate], float]:
    """The kernels with their start, stream and exposed communication, and the step time,
    from the schedule on the compute and communication streams
    (:mod:`torchroof.timing.streams`), the ``pipelined`` pairs side by side."""
    pipelined = pipelined or Pipelined()
    pairs = pipelined.pairs
    beside = {i: (b.after, b.until, b.skip) for i, b in pipelined.beside.items()}
    tasks = tasks_of(kernels, [k.time_s for k in timed], beside, [k.link for k in timed])
    laid = schedule(tasks, overlap=pricing.overlap_communication)
    placed = [
        replace(
            k,
            start_s=start,
            stream=task.stream,
            lane=task.lane,
            exposed_s=exposed,
            waits_on=before,
            pipelined_with=pairs.get(i),
        )
        for i, (k, task, start, exposed, before) in enumerate(
            zip(timed, tasks, laid.start_s, laid.exposed_s, laid.waits, strict=True)
        )
    ]
    return placed, laid.step_time_s


def zero_one_gradients(role_bytes: dict[str, int], facts: StepFacts) -> dict[str, int]:
    """``role_bytes`` with every gradient held, under ZeRO-1: DeepSpeed's stage 1 and
    Megatron's distributed optimizer keep the whole gradient buffer (Megatron's
    ``main_grad``, fp32 by default) until the reduce-scatter after backward, where the
    traced program (FSDP2) reduce-scatters each layer's as it is made: the sharded
    gradients times :attr:`StepFacts.whole_gradients` (the dp ranks for dense weights,
    fewer for experts sharded over the ranks holding them; Rajbhandari et al. 2020, ZeRO,
    Sec. 5: P_os keeps gradients whole); where the traced step accumulates them whole itself
    (:attr:`StepFacts.whole_gradients_traced`: ZeRO-1 or DDP whose reduction waits for the
    last micro-batch), only the share FSDP2 does not accumulate (the parameters on no data
    ranks) beside the traced accumulation."""
    if facts.whole_gradients_traced:  # the traced accumulation is the whole buffer
        kept = round(role_bytes.get("gradients", 0) * facts.whole_gradients)
        return {**role_bytes, "gradients": kept}
    if not facts.whole_gradients:
        return role_bytes
    whole = round(role_bytes.get("gradients", 0) * facts.whole_gradients)
    return {**role_bytes, "gradients": whole}


def zero_assumptions(workload: Workload | None) -> list[str]:
    """How a ZeRO stage over the dp ranks (or DDP whose reduction waits for the last
    micro-batch) is run, stated once."""
    if workload is None:
        return []
    if workload.accumulates_whole_gradients and not workload.zero:
        return [
            f"DDP over dp {workload.dp}: gradients accumulated unsharded over the "
            f"{workload.microbatches} micro-batches and all-reduced after the last, held "
            "once (counted in the step's peak; the ones the optimizer reads are views of "
            "them, as Megatron's main_grad)"
        ]
    if not workload.zero:
        return []
    zero, dp, cp = workload.zero, workload.dp, workload.cp
    ranks = f"{dp} ranks" if cp == 1 else f"{dp} x cp {cp} = {dp * cp} ranks"
    sharded = {1: "optimizer state", 2: "optimizer state and gradients"}.get(
        zero, "parameters, gradients and optimizer state"
    )
    if workload.plan.reshards_after_forward:
        how = "gathering each layer's parameters in forward and again in backward"
    elif zero in (1, 2):
        how = (
            "keeping each layer's parameters gathered from its first forward to the end of "
            "the last backward: one all-gather a step, the bytes DeepSpeed and Megatron move "
            "(their all-gather follows the optimizer step)"
        )
    else:
        how = (
            "keeping each layer's parameters gathered from its forward to the end of its "
            "backward: one all-gather a micro-batch"
        )
    deferred = workload.defer_gradient_sync and workload.microbatches > 1
    if workload.microbatches > 1 and not deferred:
        how += (
            f", and a reduce-scatter after each of the {workload.microbatches} micro-batches "
            "(--defer-gradient-sync: one, after the last)"
        )
    else:
        how += ", and one reduce-scatter"
    kept = "; every gradient held until it is reduced" if zero == 1 else ""
    if kept and deferred and workload.reduce_dtype == "bf16":
        kept += (
            ", the unsharded gradients the traced step accumulates in bf16 until its last "
            "micro-batch (counted in its peak; the fp32 copy of the rank's shard its "
            "optimizer reads is made at the optimizer step, after the activations are freed)"
        )
    elif kept and deferred:
        kept += (
            ", the unsharded gradients the traced step accumulates until its last "
            "micro-batch (counted in its peak; the sharded ones the optimizer reads are "
            "views of them, as Megatron's main_grad)"
        )
    elif kept and workload.precision == "mixed" and workload.reduce_dtype == "bf16":
        kept += (
            ", in a bf16 buffer (Megatron's grad_reduce_in_fp32=False; the fp32 copy of "
            "the rank's shard its optimizer reads is made at the optimizer step, after the "
            "activations are freed)"
        )
    return [f"ZeRO-{zero} over dp {dp}: {sharded} sharded, run as FSDP2 over {ranks} {how}{kept}"]


def reduction_assumptions(workload: Workload | None) -> list[str]:
    """The dtype a mixed-precision step reduces its gradients in over the data ranks,
    stated once (nothing for a step that reduces none)."""
    if workload is None or not workload.reduces_mixed_gradients:
        return []
    if workload.reduce_dtype == "fp32":
        how = "the bf16 gradients cast to fp32 before each reduction (FSDP2's reduce_dtype)"
    else:
        how = "as the backward makes them, half the bytes of fp32"
    return [f"gradients reduced over the data-parallel ranks in {workload.reduce_dtype}: {how}"]


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}

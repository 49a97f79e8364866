"""A pipelined step: one trace per distinct stage, priced, laid on the schedule's timeline.

:class:`PipelineTrace` holds what :func:`torchroof.api.trace_workload` traced for a workload
with ``pp`` > 1: each distinct stage once (stages whose layers match share a trace), and
the schedule's action order (:func:`torchroof.parallel.pipeline.schedule.action_order`).
:func:`price`
times each stage's actions from its priced kernels, each activation's trip between two
stages' ranks on the cluster, lays the order on the timeline
(:func:`torchroof.parallel.pipeline.schedule.simulate`) and reports the step as its slowest rank
sees it.

Each action's time is its kernels' (a stage's kernels on the compute stream, plus the
communication its own schedule left exposed: TP all-reduces, FSDP collectives), split at
the op marks the stage's trace keeps (forward, input-gradient and weight-gradient halves).
Work after the backward (the gradient layout, the optimizer step and its collectives) runs
once per step, after the pipeline drains.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torchroof.config.errors import OptionError
from torchroof.parallel.pipeline.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    ActionKind,
    PipelineTimeline,
    simulate,
)
from torchroof.records.facts import StageMarks, StepFacts
from torchroof.records.trace import Trace
from torchroof.report.memory import MemoryFootprint
from torchroof.report.pipeline_step import PipelineStep, RankRow, Span, StageRow
from torchroof.timing.network import collective_time

if TYPE_CHECKING:
    from torchroof.hardware import ClusterSpec
    from torchroof.report.estimate import Estimate, KernelEstimate

NOT_SAVED = (
    "a pipelined step (pp > 1) is one trace per distinct stage and its schedule: saving it "
    "is not supported yet (save the estimate: --json)"
)


@dataclass
class PipelineTrace:
    """Every distinct stage of a pipelined step, traced once, and the schedule to lay them
    on. ``traces`` maps a stage index to its trace; ``traced_as[s]`` is the stage whose
    trace stage ``s`` reuses. ``ranks_per_stage``: the ranks one stage's program spans
    (tp · cp · fsdp · dp); stage s runs on ranks s·ranks_per_stage + ... ."""

    traces: dict[int, Trace]
    traced_as: list[int]
    layers: list[str]  # each stage's description (layers, embedding, head)
    order: dict[int, list[Action]]
    schedule: str
    pp: int
    microbatches: int
    ranks_per_stage: int
    trains: bool
    facts: StepFacts = field(default_factory=StepFacts)
    split_note: str = ""  # how the layers were split where the model has no pp plan

    def save(self, path: Any) -> None:
        raise OptionError(NOT_SAVED)


# FSDP2's parameter all-gathers and the copies around them (into the gather buffer, out
# to the unsharded parameters).
GATHERS = ("c10d._allgather_base_", "fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy")
# FSDP2's gradient reduce-scatter and the copy that fills its input (the unsharded
# gradients, transient: their bytes are not labelled gradients). Sequence parallel's
# reduce-scatters are _c10d_functional ops: not these.
GRADIENT_REDUCTIONS = ("c10d._reduce_scatter_base_", "fsdp.chunk_cat")
# DDP's and HSDP's gradient all-reduce (torch.distributed.all_reduce, in place); a
# tensor-parallel all-reduce in a training step is a functional collective, differentiable
GRADIENT_ALL_REDUCE = "c10d.allreduce_"


def once_per_step(kernel: KernelEstimate, reshard_after_forward: bool) -> bool:
    """Work a training pipeline runs once per step, not once per micro-batch: the gradient
    synchronisation (a communication kernel that carries gradients: FSDP's reduce-scatter
    and the copy that feeds it, HSDP's or DDP's all-reduce, and the cast of gradients reduced
    in fp32 back to the parameters' dtype; torch's schedules hold it until a stage's last
    backward), and FSDP's parameter all-gathers when parameters stay gathered after forward
    (torchtitan's pipelines turn ``reshard_after_forward`` off); with it on, each
    micro-batch gathers again. A tensor-parallel all-reduce carries activations: per
    micro-batch."""
    if any(name.startswith(GRADIENT_REDUCTIONS) for name in kernel.ops):
        return True
    if kernel.phase == "backward" and any(n.startswith(GRADIENT_ALL_REDUCE) for n in kernel.ops):
        return True  # its buffer is the gradients cast to the reduce dtype, not labelled so
    cast = set(kernel.ops) == {"aten._to_copy.default"} and kernel.stream != "communication"
    if cast and set(kernel.written_by) == {"gradients"} and kernel.waits_on:
        return True  # FSDP2 casts the fp32-reduced gradients to the parameters' dtype
    if kernel.stream == "communication":
        carried = {**kernel.read_by}
        for role, size in kernel.written_by.items():
            carried[role] = carried.get(role, 0) + size
        if carried and max(carried, key=carried.__getitem__) == "gradients":
            return True
    return not reshard_after_forward and any(name.startswith(GATHERS) for name in kernel.ops)


@dataclass(frozen=True)
class StageTimes:
    """Seconds of each action of one micro-batch on a stage (F, B, and I + W when the
    backward is split), of the work after the pipeline, and the FLOPs of both."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    input_s: float = 0.0
    weight_s: float = 0.0
    after_s: float = 0.0
    flops: float = 0.0
    after_flops: float = 0.0

    def of(self, kind: ActionKind) -> float:
        """The seconds of one action of ``kind`` (F, B, I or W)."""
        return {
            FORWARD: self.forward_s,
            BACKWARD: self.backward_s,
            BACKWARD_INPUT: self.input_s,
            BACKWARD_WEIGHT: self.weight_s,
        }[kind]


def stage_actions(
    est: Estimate, marks: StageMarks, trains: bool, reshard_after_forward: bool = True
) -> StageTimes:
    """Seconds of each action of one micro-batch (F, B or I + W) and of the work after the
    pipeline (``after``), from a stage's priced kernels and its trace's op marks: a compute
    kernel counts its time, a communication kernel its exposed time. Work a training step
    runs once (:func:`once_per_step`) counts after the pipeline, with the exposure the
    traced micro-batch's schedule gave it. A stage traced with a split backward times a
    whole backward (``B``, which DualPipeV mixes with I and W) as I + W."""
    times = dict.fromkeys((FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, "after"), 0.0)
    flops = dict.fromkeys(times, 0)
    for kernel in est.kernels:
        once = trains and once_per_step(kernel, reshard_after_forward)
        part = "after" if once else _part(kernel, marks, trains)
        times[part] += kernel.exposed_s if kernel.stream == "communication" else kernel.time_s
        flops[part] += kernel.flops
    if marks.input_end is not None:  # no kernel was filed under B: a whole backward is I + W
        times[BACKWARD] = times[BACKWARD_INPUT] + times[BACKWARD_WEIGHT]
    total = float(flops[FORWARD] + flops[BACKWARD] + flops[BACKWARD_INPUT])
    total += flops[BACKWARD_WEIGHT]
    return StageTimes(
        forward_s=times[FORWARD],
        backward_s=times[BACKWARD],
        input_s=times[BACKWARD_INPUT],
        weight_s=times[BACKWARD_WEIGHT],
        after_s=times["after"],
        flops=total,
        after_flops=float(flops["after"]),
    )


def _marks(trace: Trace) -> StageMarks:
    """A stage trace's op marks (none for a trace that is not a pipeline stage's)."""
    return trace.facts.pipeline.marks if trace.facts.pipeline else StageMarks()


def _part(kernel: KernelEstimate, marks: StageMarks, trains: bool) -> str:
    if not trains:
        return FORWARD
    at = kernel.first_op
    if at < (marks.forward_end or 0):
        return FORWARD
    if marks.input_end is not None:
        if at < marks.input_end:
            return BACKWARD_INPUT
        if at < (marks.backward_end or 0):
            return BACKWARD_WEIGHT
    elif at < (marks.backward_end or 0):
        return BACKWARD
    return "after"


def price(
    trace: PipelineTrace,
    price_stage: Callable[[Trace], Estimate],
    cluster: ClusterSpec | None,
    capacity_bytes: int,
) -> Estimate:
    """The pipelined step's estimate: the slowest rank's kernels (one micro-batch of each
    of its stages, then its after-pipeline work), the step time from the schedule, the
    footprint of the rank that holds the most, and the :class:`PipelineStep`."""
    priced = {index: price_stage(t) for index, t in trace.traces.items()}
    count = len(trace.traced_as)
    reshard = trace.facts.workload.plan.reshards_after_forward if trace.facts.workload else True
    actions = {
        s: stage_actions(
            priced[trace.traced_as[s]],
            _marks(trace.traces[trace.traced_as[s]]),
            trace.trains,
            reshard,
        )
        for s in range(count)
    }
    host = {a.stage: rank for rank, listed in trace.order.items() for a in listed}
    activation = max(
        t.facts.pipeline.activation_bytes if t.facts.pipeline else 0 for t in trace.traces.values()
    )
    edges = _transfers(activation, host, trace.ranks_per_stage, trace.pp, cluster)
    factor = next(iter(priced.values())).correction  # the calibrated mode's, as the stages'
    edges = {pair: (seconds * factor, link) for pair, (seconds, link) in edges.items()}
    transfer_s, link = max(edges.values()) if edges else (0.0, "none")

    def duration(action: Action) -> float:
        return actions[action.stage].of(action.kind)

    def transfer(source: int, target: int) -> float:
        return edges[(min(source, target), max(source, target))][0]

    timeline = simulate(trace.order, duration, transfer)
    ranks = _rank_rows(trace, timeline, actions, host)
    step_s = max(r.end_s for r in ranks)
    stages = _stage_rows(trace, priced, actions, host, timeline, activation, capacity_bytes)
    slowest = max(ranks, key=lambda r: r.end_s)
    spans = _spans(timeline, ranks, actions, host, transfer)
    step = PipelineStep(
        schedule=trace.schedule,
        pp=trace.pp,
        microbatches=trace.microbatches,
        stages=tuple(stages),
        ranks=tuple(ranks),
        pipeline_s=timeline.step_time_s,
        step_time_s=step_s,
        bubble_share=timeline.bubble_share,
        transfer_s=transfer_s,
        transfer_link=link,
        slowest_rank=slowest.rank,
        slowest_reason=_why_slowest(slowest, ranks, stages, trace, step_s),
        trains=trace.trains,
        timeline=spans,
        latency_s=sum(r.forward_s for r in stages) + sum(t for t, _ in edges.values()),
    )
    held = {r.rank: timeline.held_peak({s: stages[s].saved_bytes for s in r.stages}) for r in ranks}
    return _estimate(trace, priced, step, slowest, stages, held, capacity_bytes)


def _spans(
    timeline: PipelineTimeline,
    ranks: list[RankRow],
    actions: dict[int, StageTimes],
    host: dict[int, int],
    transfer: Callable[[int, int], float],
) -> tuple[Span, ...]:
    """Every rank's timeline: its actions, the sends that leave it (an activation after a
    forward, a gradient after a backward's input half) and its work after the drain."""
    last = max(host)
    spans = []
    for timed in timeline.actions:
        a = timed.action
        spans.append(Span(timed.rank, a.kind, a.stage, a.microbatch, timed.start_s, timed.end_s))
        target = a.stage + 1 if a.kind == FORWARD else a.stage - 1
        sends = a.kind in (FORWARD, BACKWARD, BACKWARD_INPUT) and 0 <= target <= last
        if sends and host[target] != timed.rank:
            end = timed.end_s + transfer(a.stage, target)
            spans.append(Span(timed.rank, "send", a.stage, a.microbatch, timed.end_s, end))
    for row in ranks:
        after = sum(actions[s].after_s for s in row.stages)
        if after:
            spans.append(Span(row.rank, "after", -1, -1, row.end_s - after, row.end_s))
    return tuple(spans)


def _transfers(
    activation_bytes: int,
    host: dict[int, int],
    ranks_per_stage: int,
    pp: int,
    cluster: ClusterSpec | None,
) -> dict[tuple[int, int], tuple[float, str]]:
    """(seconds, link) of one activation between each pair of consecutive stages: a
    send/recv from pipeline rank r's GPU to rank r'`s (pp is the outermost mesh dimension:
    pipeline rank r's program starts at GPU r · ranks per stage), on the link they share:
    NVLink while both sit in one node, the network once a stage boundary crosses nodes."""
    if cluster is None:
        raise OptionError(
            f"a pipeline of {pp} stages sends activations between GPUs: price it on a cluster "
            "(dgx-h100, ...; `torchroof hardware` lists them)"
        )
    edges = {}
    for stage in range(max(host)):
        source, target = host[stage] * ranks_per_stage, host[stage + 1] * ranks_per_stage
        if source == target:  # a V schedule's turn: one rank holds both stages
            edges[(stage, stage + 1)] = (0.0, "none")
            continue
        sent = collective_time("send_recv", activation_bytes, [source, target], cluster)
        edges[(stage, stage + 1)] = (sent.time_s, sent.link)
    return edges


def _rank_rows(
    trace: PipelineTrace,
    timeline: PipelineTimeline,
    actions: dict[int, StageTimes],
    host: dict[int, int],
) -> list[RankRow]:
    rows = []
    for rank in sorted(trace.order):
        stages = tuple(sorted(s for s, r in host.items() if r == rank))
        last = max((t.end_s for t in timeline.actions if t.rank == rank), default=0.0)
        after = sum(actions[s].after_s for s in stages)
        rows.append(RankRow(rank, stages, timeline.busy_s(rank), last + after))
    return rows


def _stage_rows(
    trace: PipelineTrace,
    priced: dict[int, Estimate],
    actions: dict[int, StageTimes],
    host: dict[int, int],
    timeline: PipelineTimeline,
    activation: int,
    capacity_bytes: int,
) -> list[StageRow]:
    rows = []
    for s, traced in enumerate(trace.traced_as):
        memory = priced[traced].memory
        saved = memory.backward_saved_bytes if memory is not None and trace.trains else 0
        fixed_and_peak = memory.total_bytes if memory is not None else 0
        if memory is not None and not trace.trains:  # each micro-batch's sequences cached
            fixed_and_peak += (trace.microbatches - 1) * memory.kv_cache_bytes
        in_flight = timeline.in_flight(s) if trace.trains else trace.microbatches
        a = actions[s]
        split = a.input_s or a.weight_s  # B = I + W then (stage_actions)
        rows.append(
            StageRow(
                stage=s,
                rank=host[s],
                layers=trace.layers[s],
                traced_as=traced,
                forward_s=a.forward_s,
                backward_s=a.backward_s,
                input_s=a.input_s if split else 0.0,
                weight_s=a.weight_s if split else 0.0,
                after_s=a.after_s,
                flops=int(a.flops),
                after_flops=int(a.after_flops),
                activation_bytes=activation,
                in_flight=in_flight,
                saved_bytes=saved,
                memory_bytes=fixed_and_peak + max(0, in_flight - 1) * saved,
                capacity_bytes=capacity_bytes,
            )
        )
    return rows


def _why_slowest(
    slowest: RankRow,
    ranks: list[RankRow],
    stages: list[StageRow],
    trace: PipelineTrace,
    step_s: float,
) -> str:
    """Which rank ends the step last and why: the most work per micro-batch (which stage
    holds what), or the longest wait (its share of the step idle)."""
    busy = [r.busy_s for r in ranks]
    median = statistics.median(busy)
    held = "; ".join(f"stage {s}: {stages[s].layers}" for s in slowest.stages)
    if slowest.busy_s >= max(busy) and median and slowest.busy_s > median * 1.0001:
        return (
            f"rank {slowest.rank} ({held}) has the most work: {slowest.busy_s / median:.2f}x "
            "the median rank's per step"
        )
    idle = slowest.idle_share(step_s)
    return (
        f"rank {slowest.rank} ({held}) ends last: it waits {idle:.0%} of the step (the "
        f"{trace.schedule} schedule's fill and drain"
        + (", then its optimizer step)" if trace.trains else ")")
    )


def _estimate(
    trace: PipelineTrace,
    priced: dict[int, Estimate],
    step: PipelineStep,
    slowest: RankRow,
    stages: list[StageRow],
    held: dict[int, int],
    capacity_bytes: int,
) -> Estimate:
    """The slowest rank's stages' kernels (one micro-batch each, then the work after the
    pipeline), the schedule's step time, the heaviest rank's footprint."""
    first = priced[trace.traced_as[slowest.stages[0]]]
    kernels: list[KernelEstimate] = []
    for s in slowest.stages:
        base = len(kernels)  # a stage's kernels point at each other by stage-local index
        for kernel in priced[trace.traced_as[s]].kernels:
            partner = kernel.pipelined_with
            kernels.append(
                replace(
                    kernel,
                    index=len(kernels),
                    pipelined_with=None if partner is None else base + partner,
                    waits_on=None
                    if kernel.waits_on is None
                    else tuple(base + j for j in kernel.waits_on),
                )
            )
    footprints = {
        r.rank: _rank_memory(priced, trace, r, stages, held[r.rank], capacity_bytes)
        for r in step.ranks
    }

    def total_bytes(rank: int) -> int:
        footprint = footprints[rank]
        return footprint.total_bytes if footprint else 0

    heaviest = max(footprints, key=total_bytes)
    memory = footprints[heaviest]
    ranks = tuple(
        replace(
            r,
            memory_bytes=total_bytes(r.rank),
            floor_bytes=_floor_bytes(footprints[r.rank], held[r.rank]),
        )
        for r in step.ranks
    )
    step = replace(step, heaviest_rank=heaviest, ranks=ranks)
    assumptions: list[str] = []
    for s in slowest.stages:
        for line in priced[trace.traced_as[s]].assumptions:
            if line not in assumptions:
                assumptions.append(line)
    assumptions.append(
        f"pipeline: torch's {trace.schedule} order over {trace.pp} ranks and "
        f"{trace.microbatches} micro-batch(es), each distinct stage traced once; the kernels "
        f"listed are rank {slowest.rank}'s for one micro-batch"
        + (" (then its gradient sync and optimizer step, once)" if trace.trains else "")
        + "; activations cross between stages as send/recv, overlapped with compute; the "
        f"memory is rank {heaviest}'s, which holds the most"
        + (f"; split: {trace.split_note}" if trace.split_note else "")
    )
    return replace(
        first,
        kernels=kernels,
        op_count=sum(len(t.ops) for t in trace.traces.values()),
        assumptions=assumptions,
        facts=replace(trace.facts),
        memory=memory,
        step_time_s=step.step_time_s,
        pipeline=step,
    )


def _floor_bytes(footprint: MemoryFootprint | None, held: int) -> int:
    """A rank's floor (:meth:`MemoryFootprint.floor_bytes`) with the activations its stages
    keep for the micro-batches in flight at once (``held``; a serving rank's none)."""
    return footprint.floor_bytes(held) if footprint is not None else 0


def _rank_memory(
    priced: dict[int, Estimate],
    trace: PipelineTrace,
    rank: RankRow,
    stages: list[StageRow],
    held: int,
    capacity_bytes: int,
) -> MemoryFootprint | None:
    """A rank's footprint: its stages' weights, gradients, optimizer state, KV cache and
    layer buffers, the larger activation peak, and the activations its stages keep for
    the micro-batches in flight at the rank's fullest moment, beyond the one at the peak."""
    footprints = [priced[trace.traced_as[s]].memory for s in rank.stages]
    if any(f is None for f in footprints):
        return None
    found = [f for f in footprints if f is not None]
    extra = max(0, held - max(stages[s].saved_bytes for s in rank.stages))
    # a serving pipeline caches the K/V of every micro-batch's sequences on every stage
    cached = 1 if trace.trains else trace.microbatches
    return MemoryFootprint(
        weights_bytes=sum(f.weights_bytes for f in found),
        gradients_bytes=sum(f.gradients_bytes for f in found),
        optimizer_state_bytes=sum(f.optimizer_state_bytes for f in found),
        kv_cache_bytes=cached * sum(f.kv_cache_bytes for f in found),
        activations_peak_bytes=max(f.activations_peak_bytes for f in found) + extra,
        capacity_bytes=capacity_bytes,
        batch=found[0].batch * cached,
        layer_buffers_bytes=max(f.layer_buffers_bytes for f in found),
        backward_saved_bytes=sum(f.backward_saved_bytes for f in found),
    )

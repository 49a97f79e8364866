"""A pipelined step traced: torch's action order, the model cut into stages, one trace each."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from torch import nn

from torchroof.config import DEFAULT_PP_SCHEDULE, DEFAULT_VIRTUAL_STAGES, Workload
from torchroof.config.choices import SPLIT_BACKWARD
from torchroof.config.errors import WorkloadError
from torchroof.parallel.pipeline.price import PipelineTrace
from torchroof.parallel.pipeline.schedule import Action, action_order, stages_per_rank
from torchroof.parallel.pipeline.shared import StageKey, current_shared, model_key, share_key
from torchroof.parallel.pipeline.workers import run_shared
from torchroof.parallel.stages import (
    StageSplit,
    make_stage,
    pipeline_layout,
    split_layers,
    stage_key,
)
from torchroof.records.trace import Trace
from torchroof.workloads import regime
from torchroof.workloads.repeated import copied_or_every_layer

PipelineTraceT = TypeVar("PipelineTraceT", bound=PipelineTrace)
Resolve = Callable[[Workload], tuple[Workload, str]]
"""The workload with ``seq`` given, and the note saying why when the model chose it."""
Build = Callable[[Workload], tuple[nn.Module, str, str]]
"""A fresh model on meta for the workload: (the model, its label, the positions note)."""
Run = Callable[[nn.Module, Workload], Trace]
"""The trace of one step of the workload on a model (the regime run under capture)."""


def pipeline_order(workload: Workload, trains: bool) -> tuple[str, dict[int, list[Action]]]:
    """(the schedule, each rank's actions): torch's action order for ``pp_schedule``; an
    inference step runs the forwards of GPipe's. A schedule torch refuses is a
    WorkloadError."""
    schedule = workload.pp_schedule if trains else "gpipe"
    try:
        order = action_order(schedule, workload.pp, workload.microbatches, workload.virtual_stages)
    except ValueError as error:
        raise WorkloadError(str(error)) from error
    if not trains:
        order = {rank: [a for a in listed if a.kind == "F"] for rank, listed in order.items()}
    return schedule, order


def stage_workload(workload: Workload) -> Workload:
    """What each stage traces: one stage, one micro-batch (the pipeline is laid out from
    the stages' traces)."""
    return replace(
        workload,
        pp=1,
        microbatches=1,
        pp_split="",
        pp_schedule=DEFAULT_PP_SCHEDULE,
        virtual_stages=DEFAULT_VIRTUAL_STAGES,
    )


def trace_pipeline(
    workload: Workload,
    *,
    resolve: Resolve,
    build: Build,
    run: Run,
    trace_type: type[PipelineTraceT],
) -> PipelineTraceT:
    """A pipelined step: :func:`pipeline_order`, the decoder layers split into
    pp · stages-per-rank stages (:func:`torchroof.parallel.stages.split_layers`), and each
    distinct stage traced once as rank 0 of its own program (tp, cp, fsdp, dp), one
    micro-batch, on a model from ``build`` run by ``run`` (the caller's: the public API
    builds, checks and runs every step alike), the stages shared out between processes
    (:mod:`torchroof.parallel.pipeline.workers`). A stage whose copied layers' backward
    turns out not to be copyable is traced again running every layer, and says so.
    Returned as ``trace_type``."""
    trains = regime(workload.regime).trains
    schedule, order = pipeline_order(workload, trains)
    count = workload.pp * stages_per_rank(schedule, workload.virtual_stages)
    workload, note = resolve(workload)
    one_stage = stage_workload(workload)
    reference, label, beyond = build(one_stage)
    layout = pipeline_layout(reference)
    split_note = layout.split_note()  # before the reference becomes the first stage
    splits = split_layers(len(layout.layers), count, workload.pipeline_split)
    keys = [stage_key(reference, split) for split in splits]
    traced_as = [keys.index(key) for key in keys]
    split_backward = trains and schedule in SPLIT_BACKWARD

    def stage(split: StageSplit, module: nn.Module | None = None) -> Trace:
        module = build(one_stage)[0] if module is None else module
        return copied_or_every_layer(
            one_stage,
            lambda: run(make_stage(module, split, split_backward), one_stage),
            lambda full: run(make_stage(build(full)[0], split, split_backward), full),
        )

    distinct = [split for split in splits if traced_as[split.index] == split.index]
    shared = current_shared()  # stages another step of the block traced (shared.py)
    shares: dict[int, StageKey] = {}
    held: dict[int, Trace] = {}
    if shared is not None:
        model = model_key(reference)
        shares = {
            s.index: share_key(model, one_stage, s, split_backward, reference) for s in distinct
        }
        found = {i: shared.find(k) for i, k in shares.items()}
        held = {i: trace for i, trace in found.items() if trace is not None}
    missing = [split for split in distinct if split.index not in held]
    jobs = [functools.partial(stage, split) for split in missing]
    if missing:  # the first, here, on the model built
        jobs[0] = functools.partial(stage, missing[0], reference)
    held.update(zip([split.index for split in missing], run_shared(jobs), strict=True))
    traces = {split.index: held[split.index] for split in distinct}
    if shared is not None:
        shared.traced += len(missing)
        shared.reused += len(distinct) - len(missing)
        for index, key in shares.items():
            shared.keep(key, traces[index])
    facts = replace(traces[0].facts, model=label, positions=beyond, defaults=note, pipeline=None)
    facts.workload = workload
    tokens = regime(workload.regime).tokens(workload)
    facts.tokens = tokens if trains else tokens * workload.microbatches
    plan = workload.parallel_plan
    return trace_type(
        traces=traces,
        traced_as=traced_as,
        layers=[split.describe() for split in splits],
        order=order,
        schedule=schedule,
        pp=workload.pp,
        microbatches=workload.microbatches,
        ranks_per_stage=plan.world // plan.pp,
        trains=trains,
        facts=facts,
        split_note=split_note,
    )

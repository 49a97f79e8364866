"""The parallel program a step runs in (issue 13, DESIGN.md "Parallel programs on one CPU").

A workload whose plan spans more than one rank (``tp``, ``fsdp``, ``dp``) is traced as
rank 0 of the real program: a fake process group of ``world`` ranks, the device mesh,
transformers' tensor-parallel plan, then FSDP2 (HSDP when ``dp`` > 1), in torchtitan's
order (``models/llama3/parallelize.py``); then the regime runs its step as it would on one
GPU, and capture records the rank's local ops and its collectives. ``sequence_parallel``
swaps transformers' plan for torchtitan's tensor + sequence parallel one (Llama layout) and
a training step's cross-entropy then runs on the vocabulary shards (:func:`loss_context`).
Every regime runs inside :func:`parallel_program` (the registry enters it); the one regime
named here is decode, whose single new token per sequence cannot be split over ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from torchroof.config.errors import WorkloadError
from torchroof.parallel.expert import (
    apply_expert_parallel,
    expert_mesh,
    shard_experts,
    without_expert_rules,
)
from torchroof.parallel.pipeline.stages import SEQUENCE_MESH
from torchroof.parallel.program import (
    ContextParallelError,
    ParallelPlan,
    apply_context_parallel,
    apply_fsdp,
    apply_sequence_parallel,
    apply_tensor_parallel,
    build_mesh,
    check_tensor_parallel,
    fake_parameters,
    fake_process_group,
)

if TYPE_CHECKING:
    from torchroof.config.options import Workload


def shards_data(plan: ParallelPlan) -> bool:
    """The plan shards or replicates parameters over data ranks (FSDP2 / HSDP)."""
    return plan.fsdp * plan.dp > 1


def describe(plan: ParallelPlan) -> str:
    """``tp 8, fsdp 8 (64 GPUs)``: the plan's dimensions above one; empty for one GPU."""
    dims = zip(plan.mesh_dim_names, plan.mesh_shape, strict=True)
    sizes = [f"{name} {size}" for name, size in dims if size > 1]
    return f"{', '.join(sizes)} ({plan.world} GPUs)" if sizes else ""


def plan_label(workload: Workload) -> str:
    """What a regime's label adds for a parallel step: ``, rank 0 of tp 8 (8 GPUs)``, and
    ``, sequence parallel`` when the tensor-parallel plan is torchtitan's."""
    plan = describe(workload.parallel_plan)
    label = f", rank 0 of {plan}" if plan else ""
    return label + (", sequence parallel" if sequence_parallel(workload) else "")


def sequence_parallel(workload: Workload) -> bool:
    """The step runs torchtitan's tensor + sequence parallel plan (``sequence_parallel``
    with more than one tensor-parallel rank; with one there is nothing to split)."""
    return workload.sequence_parallel and workload.tp > 1


def check_sequence_parallel(workload: Workload) -> None:
    """Refuse a sequence-parallel step whose new tokens do not split evenly over the
    tensor-parallel ranks: a decode step's one token per sequence, or ``seq`` not a
    multiple of ``tp`` (torchtitan asserts the same: its shards are even)."""
    if not sequence_parallel(workload):
        return
    if workload.regime == "decode":
        raise WorkloadError(
            "sequence_parallel splits each sequence's new tokens over the tp ranks; a decode "
            "step has one per sequence: use tensor parallel without sequence parallel"
        )
    if workload.seq % workload.tp:
        raise WorkloadError(
            f"sequence_parallel splits seq={workload.seq} over tp={workload.tp} ranks: "
            "seq must be a multiple of tp"
        )


def loss_context(workload: Workload) -> AbstractContextManager[Any]:
    """Where a training step computes its loss and runs backward: under
    ``torch.distributed.tensor.parallel.loss_parallel()`` when the LM head's logits stay
    split over the vocabulary (sequence parallel), so the cross-entropy runs on each rank's
    V/tp columns (all-reducing row maxima and sums) instead of gathering the logits."""
    if not sequence_parallel(workload):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def check_plan(config: Any, workload: Workload, name: str) -> None:
    """Refuse, before the model is built, a tensor-parallel size its config cannot run
    (no transformers plan, heads that do not divide): one WorkloadError line."""
    try:
        check_tensor_parallel(config, workload.tp)
    except ValueError as error:
        raise WorkloadError(f"{name} cannot run with tp={workload.tp}: {error}") from error
    check_sequence_parallel(workload)


@contextlib.contextmanager
def parallel_program(
    model: torch.nn.Module, workload: Workload, trains: bool = True
) -> Iterator[None]:
    """Make ``model`` (built on meta) rank 0 of ``workload``'s parallel plan for the
    duration of the block: tensor parallel on meta (transformers' plan, or torchtitan's
    with sequence parallel); with FSDP, its parameters become fake tensors on CPU (FSDP2
    refuses meta parameters), so inputs are made on the device of the model's parameters
    (:func:`torchroof.workloads.inputs.input_device`). A one-rank plan leaves the model
    alone. With ``cp`` ranks each forward runs on its load-balanced T/cp tokens and
    attention is torch's ring attention (:func:`torchroof.parallel.program.apply_context_parallel`).
    With ``ep`` ranks the routed experts are sharded over groups of ep consecutive ranks
    and reached by all-to-all (:func:`torchroof.parallel.expert.apply_expert_parallel`;
    the tensor-parallel plan then leaves the experts alone); a training step's FSDP shards
    each experts module over the ranks holding the same experts first, as transformers
    does. An inference step (``trains`` False) shards nothing over dp: each rank holds
    its own batch and the dense weights whole.
    The model is left sharded (a meta copy, used once)."""
    plan = workload.parallel_plan
    if plan.world == 1:
        yield
        return
    check_sequence_parallel(workload)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        sharded = trains and shards_data(plan)
        try:
            if sequence_parallel(workload):
                # the train step's loss runs on vocabulary shards; prefill gathers logits
                apply_sequence_parallel(model, mesh["tp"], loss_parallel=trains)
                setattr(model, SEQUENCE_MESH, mesh["tp"])  # a pipeline stage receives a shard
            elif plan.ep > 1:
                tp_plan = getattr(model, "tp_plan", None) or {}
                ep_plan = getattr(model, "ep_plan", None) or {}
                dense = without_expert_rules(tp_plan, ep_plan)
                apply_tensor_parallel(model, mesh["tp"], plan=dense or None)
            else:
                apply_tensor_parallel(model, mesh["tp"])
            ignored: set[torch.nn.Parameter] = set()
            if plan.ep > 1:
                experts = expert_mesh(plan.world, plan.ep)
                apply_expert_parallel(model, experts["ep"], mesh["tp"])
                if sharded:
                    ignored = shard_experts(model, experts["efsdp"], plan.ep)
            if sharded:
                apply_fsdp(
                    model,
                    mesh,
                    reshard_after_forward=workload.reshard_after_forward,
                    ignored_params=ignored,
                )
        except ValueError as error:
            raise WorkloadError(
                f"{type(model).__name__} cannot run as {describe(plan)}: {error}"
            ) from error
        with contextlib.ExitStack() as step:
            if sharded:
                step.enter_context(fake_parameters(model))
            try:  # context parallel: shards each forward's sequence, ring attention
                step.enter_context(apply_context_parallel(model, mesh["cp"]))
                yield
            except ContextParallelError as error:
                raise WorkloadError(
                    f"{type(model).__name__} cannot run as {describe(plan)}: {error}"
                ) from error

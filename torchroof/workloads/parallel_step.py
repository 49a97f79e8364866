"""The parallel program a step runs in (issue 13, DESIGN.md "Parallel programs on one CPU").

A workload whose plan spans more than one rank (``tp``, ``fsdp``, ``dp``) is traced as
rank 0 of the real program: a fake process group of ``world`` ranks, the device mesh,
transformers' tensor-parallel plan, then FSDP2 (HSDP when ``dp`` > 1), in torchtitan's
order (``models/llama3/parallelize.py``); then the regime runs its step as it would on one
GPU, and capture records the rank's local ops and its collectives. No regime is named here:
every regime runs inside :func:`parallel_program` (the registry enters it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchroof.errors import WorkloadError
from torchroof.parallel import (
    ParallelPlan,
    apply_fsdp,
    apply_tensor_parallel,
    build_mesh,
    check_tensor_parallel,
    fake_parameters,
    fake_process_group,
)

if TYPE_CHECKING:
    from torchroof.options import Workload


def shards_data(plan: ParallelPlan) -> bool:
    """The plan shards or replicates parameters over data ranks (FSDP2 / HSDP)."""
    return plan.fsdp * plan.dp > 1


def describe(plan: ParallelPlan) -> str:
    """``tp 8, fsdp 8 (64 GPUs)``: the plan's dimensions above one; empty for one GPU."""
    dims = zip(plan.mesh_dim_names, plan.mesh_shape, strict=True)
    sizes = [f"{name} {size}" for name, size in dims if size > 1]
    return f"{', '.join(sizes)} ({plan.world} GPUs)" if sizes else ""


def plan_label(workload: Workload) -> str:
    """What a regime's label adds for a parallel step: ``, rank 0 of tp 8 (8 GPUs)``."""
    plan = describe(workload.parallel_plan)
    return f", rank 0 of {plan}" if plan else ""


def check_plan(config: Any, workload: Workload, name: str) -> None:
    """Refuse, before the model is built, a tensor-parallel size its config cannot run
    (no transformers plan, heads that do not divide): one WorkloadError line."""
    try:
        check_tensor_parallel(config, workload.tp)
    except ValueError as error:
        raise WorkloadError(f"{name} cannot run with tp={workload.tp}: {error}") from error


@contextlib.contextmanager
def parallel_program(model: torch.nn.Module, workload: Workload) -> Iterator[None]:
    """Make ``model`` (built on meta) rank 0 of ``workload``'s parallel plan for the
    duration of the block: tensor parallel on meta; with FSDP, its parameters become fake
    tensors on CPU (FSDP2 refuses meta parameters), so inputs are made on the device of the
    model's parameters (:func:`torchroof.workloads.inputs.input_device`). A one-rank plan
    leaves the model alone. The model is left sharded (a meta copy, used once)."""
    plan = workload.parallel_plan
    if plan.world == 1:
        yield
        return
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        try:
            apply_tensor_parallel(model, mesh["tp"])
            apply_fsdp(model, mesh, reshard_after_forward=workload.reshard_after_forward)
        except ValueError as error:
            raise WorkloadError(
                f"{type(model).__name__} cannot run as {describe(plan)}: {error}"
            ) from error
        if shards_data(plan):
            with fake_parameters(model):
                yield
        else:
            yield

"""The parallel program a step runs in: torch.distributed's own, on a fake process group.

A workload whose plan spans more than one rank is traced as rank 0 of the real program: a
fake process group of ``world`` ranks, the device mesh, then each strategy of
:data:`torchroof.parallel.program.STRATEGIES` in torchtitan's order (tensor or sequence
parallel, the routed experts, FSDP2 or HSDP, context parallel around the step); then the
regime runs its step as it would on one GPU, and capture records the rank's local ops and
its collectives. Every regime runs inside :func:`parallel_program` (the registry enters
it); :func:`check_plan` refuses, before anything is built, what the plan cannot run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchroof.capture.symbolic import active_sizes
from torchroof.config.errors import WorkloadError
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.parallel import program
from torchroof.parallel.context import ContextParallelError
from torchroof.parallel.mesh import build_mesh
from torchroof.parallel.program import fake_process_group
from torchroof.parallel.sequence import sequence_parallel
from torchroof.parallel.tensor import check_tensor_parallel

if TYPE_CHECKING:
    from torchroof.config import Workload


def describe(plan: ParallelPlan) -> str:
    """``tp 8, fsdp 8 (64 GPUs)``: the plan's dimensions above one; empty for one GPU."""
    dims = zip(plan.mesh_dim_names, plan.mesh_shape, strict=True)
    sizes = [f"{name} {size}" for name, size in dims if size > 1]
    return f"{', '.join(sizes)} ({plan.world} GPUs)" if sizes else ""


def plan_label(workload: Workload) -> str:
    """What a regime's label adds for a parallel step: ``, rank 0 of tp 8 (8 GPUs)``, and
    ``, sequence parallel`` when the tensor-parallel plan is torchtitan's."""
    plan = describe(workload.plan.given_mesh)
    label = f", rank 0 of {plan}" if plan else ""
    if workload.zero:
        label += f", ZeRO-{workload.zero}"
    return label + (", sequence parallel" if sequence_parallel(workload) else "")


def check_plan(config: Any, workload: Workload, name: str) -> None:
    """Refuse, before the model is built, a tensor-parallel size its config cannot run
    (no transformers plan, heads that do not divide): one WorkloadError line."""
    try:
        check_tensor_parallel(config, workload.tp)
    except ValueError as error:
        raise WorkloadError(f"{name} cannot run with tp={workload.tp}: {error}") from error
    for strategy in program.STRATEGIES:
        strategy.validate(workload)


@contextlib.contextmanager
def parallel_program(
    model: torch.nn.Module,
    workload: Workload,
    after_sharding: Callable[[torch.nn.Module], None] | None = None,
) -> Iterator[None]:
    """Make ``model`` (built on meta) rank 0 of ``workload``'s parallel plan for the
    duration of the block: inside a fake process group of the plan's world, each strategy
    of :data:`torchroof.parallel.program.STRATEGIES` is checked, then applied in order
    (tensor or sequence parallel, experts, FSDP), and the step runs inside the contexts
    they return (FSDP's fake parameters on CPU: inputs are made on the device of the
    model's parameters, :func:`torchroof.workloads.inputs.input_device`; context
    parallel's ring attention). A one-rank plan leaves the model alone. A strategy's
    refusal is one WorkloadError line naming the plan. Whether the step trains is
    ``workload.trains``, which the strategies read (an inference step shards nothing over
    dp). ``after_sharding(model)`` runs once the strategies have sharded it, inside the fake
    group (a serving recipe quantising each rank's shards). The model is left sharded (a
    meta copy, used once)."""
    plan = workload.parallel_plan
    given = describe(workload.plan.given_mesh)  # as the user gave it: dp under ZeRO
    if plan.world == 1:
        if after_sharding is not None:
            after_sharding(model)
        yield
        return
    for strategy in program.STRATEGIES:
        strategy.validate(workload)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        try:
            with _sharded_as_meta(model):
                contexts = [
                    strategy.apply(model, mesh, workload) for strategy in program.STRATEGIES
                ]
        except ValueError as error:
            raise WorkloadError(f"{type(model).__name__} cannot run as {given}: {error}") from error
        if after_sharding is not None:
            after_sharding(model)
        with contextlib.ExitStack() as step:
            try:  # context parallel refuses what its ring attention cannot run as it runs
                for context in contexts:
                    step.enter_context(context)
                yield
            except ContextParallelError as error:
                raise WorkloadError(
                    f"{type(model).__name__} cannot run as {given}: {error}"
                ) from error


@contextlib.contextmanager
def _sharded_as_meta(model: torch.nn.Module) -> Iterator[None]:
    """Inside a capture with symbolic sizes, the strategies shard the meta weights with the
    fake tensor mode off (a weight's shard has no symbolic size, and each op on a fake one
    costs far more), and the capture adopts the shards after."""
    sizes = active_sizes()
    if sizes is None:
        yield
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield
    sizes.adopt(model)

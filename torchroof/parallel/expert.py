"""Expert parallelism: transformers' own all-to-all dispatch on a fake process group.

Parallelism is priced, never re-implemented, and runs as the real program on one CPU: the
routed experts of a MoE model are sharded with transformers'
``apply_expert_parallelism`` and its ``AllToAllEP`` implementation, as
``from_pretrained(distributed_config=DistributedConfig(ep_size=...))`` would do. Each rank
of the EP group then holds E/ep whole experts (``grouped_gemm``: dim 0 of the expert
weights), and each MoE layer's experts module (``ep_dispatch_experts``):

1. counts the (token, expert) rows it sends each expert (``scatter_add_``) and exchanges
   the counts with one small ``all_to_all_single`` (c10d, in place);
2. reads the split sizes back to the host (``tolist``) and sends each row to the rank that
   owns its expert (``all_to_all_single_autograd``, tokens·top_k rows of ``hidden``);
3. runs its local experts (one grouped GEMM per projection on E/ep experts' weights);
4. sends the outputs back with a second all-to-all, and weights and sums them per token.

The backward runs the two token all-to-alls in reverse. On meta the counts and split
sizes are answered under balanced routing (:mod:`torchroof.capture.routing`): every rank sends and
receives tokens·top_k/ep rows per peer. Usage, on a model built on meta::

    with fake_process_group(4):
        mesh = expert_mesh(world=4, ep=4)
        apply_expert_parallel(model, mesh["ep"], mesh["tp"])
        with torchroof.trace() as trace:
            model(ids, labels=ids).loss.backward()

NB: the EP ranks hold different tokens (other batches, or under context parallel other
shares of the sequences: data parallel for everything but the experts);
what keeps the non-expert weights in step across them (FSDP / DDP) is not applied here.
FSDP2 over the dense mesh refuses the expert DTensors ("Cannot concatenate overlapping
meshes"); as transformers' ``apply_fully_sharded_data_parallelism`` does, each
``ep_dispatch_experts`` module must first be ``fully_shard``-ed on the ``efsdp`` axis of
the same mesh as its EP axis (:func:`expert_mesh`), then the rest as usual.
"""

from __future__ import annotations

import contextlib
import re
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchroof.capture.storage import local_shard
from torchroof.parallel.fsdp import FSDP_IGNORED, mixed_reduce_dtype, reduce_policy
from torchroof.parallel.plans import owned_plan
from torchroof.parallel.strategy import Strategy

if TYPE_CHECKING:
    from torchroof.config import Workload

EP_IMPLEMENTATION = "all_to_all"
"""transformers' ``EPImplementationInterface`` entry used: ``AllToAllEP`` (its ``auto``
picks the same for training, and an all-reduce only when the EP group shares one batch)."""
DISPATCH_STYLE = "ep_dispatch_experts"  # the plan's style for an experts module
SHARD_STYLE = "grouped_gemm"  # the plan's style for an expert weight (dim 0 = experts)
EXPERT_MESH_DIMS = ("efsdp", "ep", "tp")
"""transformers' expert view of the world (``distributed/utils.py``): EP innermost, so an EP
group is consecutive ranks; ``efsdp`` the copies of each expert. ``tp`` is a size-1 axis
here: the group of ranks that share a batch, which ``AllToAllEP`` also needs."""


def expert_mesh(world: int, ep: int) -> DeviceMesh:
    """A CPU device mesh of ``world`` ranks, ``(world / ep, ep, 1)`` named
    :data:`EXPERT_MESH_DIMS`: EP groups of ``ep`` consecutive ranks, and a ``tp`` axis of
    one rank. Needs a process group of ``world`` ranks
    (:func:`torchroof.parallel.program.fake_process_group`)."""
    for name, value in (("world", world), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world % ep:
        raise ValueError(f"ep={ep} does not divide the world of {world} ranks")
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise RuntimeError(
            f"expert_mesh needs a process group of {world} ranks: call it inside "
            f"`with fake_process_group({world}):`"
        )
    return init_device_mesh("cpu", (world // ep, ep, 1), mesh_dim_names=EXPERT_MESH_DIMS)


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None
) -> nn.Module:
    """Shard ``model``'s routed experts over ``ep_mesh`` with transformers'
    ``apply_expert_parallelism(..., ep_implementation="all_to_all")`` and the model's
    expert-parallel plan (its config's ``base_model_ep_plan``), or ``plan`` (module or
    parameter name, ``*`` for layer numbers -> ``"grouped_gemm"`` / ``"ep_dispatch_experts"``).
    ``tp_mesh`` is the group of ranks that hold the same batch (one rank without tensor
    parallel). An EP group of one leaves the model as it is. Works on meta.

    Refuses (ValueError): a model with no expert-parallel plan, a plan with no
    ``ep_dispatch_experts`` module, experts that do not divide by the group size."""
    size = ep_mesh.size()
    if size == 1:
        return model
    for name, mesh in (("ep_mesh", ep_mesh), ("tp_mesh", tp_mesh)):
        if mesh.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got {mesh.ndim} dimensions")
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    expanded = _expanded_plan(model, plan, size)
    for name, experts in _dispatched_experts(model, expanded):
        count = _expert_count(name, experts)
        if count % size:
            raise ValueError(
                f"{name} holds {count} experts, which do not divide by ep={size}: each "
                "EP rank holds whole experts"
            )
    apply_expert_parallelism(model, ep_mesh, tp_mesh, expanded, ep_implementation=EP_IMPLEMENTATION)
    return model


def without_expert_rules(tp_plan: dict[str, str], ep_plan: dict[str, str]) -> dict[str, str]:
    """``tp_plan`` less its rules on the modules ``ep_plan`` names and their children
    (Mixtral's ``moe_tp_experts``, ``packed_colwise`` expert weights): with expert
    parallelism the experts are sharded whole, never by tensor parallel (transformers'
    ``_resolve_parallel_plans``: EP rules take precedence). Apply tensor parallel with this
    plan before :func:`apply_expert_parallel`."""
    if not ep_plan:
        return dict(tp_plan)
    is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, ep_plan))})(?:\..+)?").fullmatch
    return {name: style for name, style in tp_plan.items() if not is_expert(name)}


def _expanded_plan(model: nn.Module, given: dict[str, str] | None, size: int) -> dict[str, str]:
    """``given`` or the model's ``ep_plan``, its ``*`` replaced by layer numbers
    (transformers' ``_expand_parallel_plan``): one entry per expert weight and module."""
    name = type(model).__name__
    if not hasattr(model, "_expand_parallel_plan"):
        raise ValueError(
            f"{name} is not a transformers PreTrainedModel: torchroof applies expert "
            "parallelism through transformers (MoE configs ship base_model_ep_plan)"
        )
    wildcard = given if given is not None else getattr(model, "ep_plan", None)
    if not isinstance(wildcard, dict) or not wildcard:
        raise ValueError(
            f"{name} has no ep plan (its config's base_model_ep_plan is empty: no routed "
            f"experts to shard), so it cannot run with ep={size}: pass plan= (module name -> "
            f"'{SHARD_STYLE}' / '{DISPATCH_STYLE}') if it has experts"
        )
    expanded = model._expand_parallel_plan(dict(wildcard))  # type: ignore[operator]
    expanded = owned_plan(model, expanded)  # a pipeline stage's own layers only
    if DISPATCH_STYLE not in expanded.values():
        raise ValueError(
            f"{name}'s ep plan names no module of its own as '{DISPATCH_STYLE}' (the experts "
            f"the tokens are sent to), so ep={size} would shard nothing: plan {wildcard}"
        )
    return expanded


def _dispatched_experts(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module]]:
    return [(name, model.get_submodule(name)) for name, s in plan.items() if s == DISPATCH_STYLE]


def _expert_count(name: str, experts: nn.Module) -> int:
    """Experts of one experts module: its ``num_experts``, else dim 0 of its weights."""
    count: Any = getattr(experts, "num_experts", None)
    if isinstance(count, int):
        return count
    for parameter in experts.parameters(recurse=False):
        return int(parameter.shape[0])
    raise ValueError(f"{name} has neither num_experts nor expert weights to shard")


def shard_experts(
    model: nn.Module,
    efsdp_mesh: DeviceMesh,
    ep: int,
    reshard_after_forward: bool = True,
    replicated: bool = False,
    reduce_dtype: torch.dtype | None = None,
) -> set[nn.Parameter]:
    """FSDP2 over the ranks that hold the same experts (``efsdp``, transformers'
    ``apply_fully_sharded_data_parallelism``): each experts module is one unit, sharded
    before the dense units are (FSDP2 wants a submodule first), their gathered weights freed
    after forward unless ``reshard_after_forward`` is False (ZeRO-1/2, ``--no-reshard-after-
    forward``), or replicated there (``replicated``: DDP, gradients all-reduced); ``ep`` is
    the EP group's size the experts were sharded with; ``reduce_dtype`` as
    :func:`torchroof.parallel.fsdp.apply_fsdp` takes it. With one such rank each
    expert lives on one rank only: nothing to shard; their parameters are returned for
    the dense units to ignore."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dispatched = [
        experts for _, experts in _dispatched_experts(model, _expanded_plan(model, None, 2))
    ]
    if efsdp_mesh.size() == 1:
        return {p for experts in dispatched for p in experts.parameters()}
    precision = reduce_policy(reduce_dtype)
    for experts in dispatched:
        if replicated:  # DDP: each expert whole on the ranks that hold it
            replicate(experts, mesh=efsdp_mesh, **precision)
            continue
        local = min(
            (local_shard(p).shape[0] for p in experts.parameters() if p.dim() > 1), default=0
        )
        extra: dict[str, Any] = dict(precision)
        if local < efsdp_mesh.size():
            # fewer local experts than ranks to shard them over: dim 0 would be padded to a
            # whole expert per rank and every all-gather would carry efsdp of them;
            # torchtitan shards such experts along dim 1 instead (parallelize.py apply_fsdp,
            # its _experts_shard_placement_fn)
            ranks = efsdp_mesh.size()

            def along_rows(param: nn.Parameter, ranks: int = ranks) -> Any:
                # FSDP2 splits dim 1 evenly only; otherwise dim 0, padded (its default)
                splits = param.dim() > 1 and local_shard(param).shape[1] % ranks == 0
                return Shard(1) if splits else None

            extra["shard_placement_fn"] = along_rows
        fully_shard(experts, mesh=efsdp_mesh, reshard_after_forward=reshard_after_forward, **extra)
    return set()


def _apply(model: nn.Module, mesh: DeviceMesh, workload: Workload) -> AbstractContextManager[Any]:
    """The routed experts sharded over groups of ``ep`` consecutive ranks and reached by
    all-to-all (the tensor-parallel plan has left them alone); a training step's FSDP then
    shards each experts module over the ranks holding the same experts first, as
    transformers does (:data:`torchroof.parallel.fsdp.FSDP_IGNORED`: what it leaves out)."""
    plan = workload.parallel_plan
    if plan.ep > 1:
        experts = expert_mesh(plan.world, plan.ep)
        apply_expert_parallel(model, experts["ep"], mesh["tp"])
        if workload.trains and plan.shards_data:
            reshard = workload.plan.reshards_after_forward
            # data ranks that replicate (dp alone, zero 0); where FSDP shards the dense
            # parameters (over the fsdp x cp ranks) the experts are sharded too, over
            # the ranks that hold the same ones (efsdp)
            ddp = plan.fsdp * plan.cp == 1
            ignored = shard_experts(
                model,
                experts["efsdp"],
                plan.ep,
                reshard,
                replicated=ddp,
                reduce_dtype=mixed_reduce_dtype(workload),
            )
            setattr(model, FSDP_IGNORED, ignored)
    return contextlib.nullcontext()


STRATEGY = Strategy(name="expert", apply=_apply)

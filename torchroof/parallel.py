"""Parallel programs on one CPU: torch.distributed's own parallelism on a fake process group.

DESIGN.md "Parallel programs on one CPU": no home-made model of tensor parallelism or FSDP.
The model gets PyTorch's (and transformers') real parallel plans on a process group of N
fake ranks, and capture records the program one rank runs: its local ops at per-rank
shapes and its collectives with their groups (torchroof.capture, torchroof.counters
.collectives). Steps in torchtitan's order (``models/llama3/parallelize.py``), one small
function each::

    plan = ParallelPlan(fsdp=4, tp=2)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        model = ...                                  # built on meta
        apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp(model, mesh)
        with fake_parameters(model):                 # FSDP2 refuses meta parameters
            ids = torch.zeros(batch, seq, dtype=torch.long)
            with torchroof.trace() as trace:
                model(ids, labels=ids).loss.backward()

Rank 0 is the rank traced (ranks are symmetric under these plans).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "fsdp", "cp", "tp")
"""Mesh dimensions, outermost first, as torchtitan orders them: tensor parallel innermost,
so a TP group is consecutive ranks (one node's NVLink domain)."""

FAKE_BACKEND = "fake"
# The attribute apply_tensor_parallel sets on a model: the KV heads one rank holds (a KV
# cache built for the model's rank is this many heads wide).
KV_HEADS_PER_RANK = "torchroof_kv_heads_per_rank"
KEEP_FULL_WEIGHT = "keep_full_weight"  # transformers' FSDP style: no reshard after forward


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks, this process rank 0; its
    collectives return at once (``torch.testing._internal.distributed.fake_pg``). Destroyed
    on exit. Re-entrant: inside a fake group of the same size it is a no-op (the outer one
    destroys it); any other initialised group is an error."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        backend, size = dist.get_backend(), dist.get_world_size()
        if backend == FAKE_BACKEND and size == world_size:
            yield
            return
        raise RuntimeError(
            f"a process group is already initialised (backend {backend!r}, {size} ranks); "
            f"a fake group of {world_size} ranks cannot replace it: leave the outer one first"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelPlan:
    """How many ranks each kind of parallelism spans; the world is their product.

    ``dp``: replicas (HSDP's replicate dimension when ``fsdp`` > 1). ``fsdp``: ranks each
    parameter is sharded over (FSDP2, ZeRO-3). ``cp``: context parallel (sequence shards).
    ``tp``: tensor parallel (the model's ``base_model_tp_plan``).
    """

    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelPlan.{name} must be a positive integer, got {size!r}")

    @property
    def world(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes in :data:`MESH_DIMS` order."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return MESH_DIMS


def build_mesh(plan: ParallelPlan) -> DeviceMesh:
    """The device mesh of ``plan`` on CPU, every dimension named (size-1 ones too, so
    ``mesh["tp"]`` always exists). Needs a process group of ``plan.world`` ranks."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"build_mesh needs a process group of {plan.world} ranks: "
            f"call it inside `with fake_process_group({plan.world}):`"
        )
    if dist.get_world_size() != plan.world:
        raise ValueError(
            f"{plan} spans {plan.world} ranks, but the process group has {dist.get_world_size()}"
        )
    return init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_DIMS)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` with its transformers tensor-parallel plan (or
    ``plan``: module or parameter name, ``*`` for layer numbers, -> transformers style
    name such as ``"colwise"``, ``"rowwise"``, ``"embedding_rowwise"``), through
    transformers' own ``apply_tensor_parallelism``: parameters become DTensor shards and
    each planned module converts its input and output (a row-wise layer's partial sums are
    all-reduced). A TP group of one leaves the model as it is. Works on meta. The KV
    heads each rank then holds are set on the model as :data:`KV_HEADS_PER_RANK`."""
    size = tp_mesh.size()
    if size == 1:
        return model
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    wildcard_plan = _transformers_plan(model, "tp_plan", plan)
    config = getattr(model, "config", None)
    kv_heads = _check_heads_divide(config, wildcard_plan, size) if config is not None else None
    expanded = model._expand_parallel_plan(wildcard_plan)  # type: ignore[operator]
    apply_tensor_parallelism(model, tp_mesh, expanded)
    if isinstance(kv_heads, int):
        setattr(model, KV_HEADS_PER_RANK, kv_heads)
    return model


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    plan: dict[str, str] | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters with FSDP2 ``fully_shard`` over the mesh's ``fsdp``
    dimension (HSDP over ``("dp", "fsdp")`` when ``dp`` > 1), as transformers' FSDP plan
    (``base_model_fsdp_plan``, or ``plan``) groups them: each planned module (a decoder
    layer, the embeddings) is one all-gather / reduce-scatter unit, the final norm and the
    LM head one unit kept unsharded after forward, then the root. ``reshard_after_forward``
    False keeps every unit gathered until backward (ZeRO-2-like: no all-gather in
    backward). A mesh whose ``dp`` and ``fsdp`` are both 1 leaves the model as it is.

    NB: FSDP2 refuses meta parameters at its first forward; run the step inside
    :func:`fake_parameters`."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.fsdp import (
        _resolve_tied_embed_lm_head_plan,
        is_norm_and_head_pair,
    )

    names = mesh.mesh_dim_names or ()
    if "fsdp" not in names or "dp" not in names:
        raise ValueError(f"apply_fsdp needs a mesh from build_mesh (dims {MESH_DIMS}), got {names}")
    replicas, shards = mesh["dp"].size(), mesh["fsdp"].size()
    if replicas * shards == 1:
        return model
    if "cp" in names and mesh["cp"].size() > 1:
        raise ValueError("apply_fsdp does not yet shard over the context-parallel dimension")
    shard_mesh = mesh["dp", "fsdp"] if replicas > 1 else mesh["fsdp"]

    wildcard_plan = _transformers_plan(model, "fsdp_plan", plan)
    expanded = model._expand_parallel_plan(wildcard_plan)  # type: ignore[operator]
    expanded = _resolve_tied_embed_lm_head_plan(expanded, model)
    # FSDP2 needs a submodule sharded before the module that holds it.
    units = sorted(expanded.items(), key=lambda item: item[0].count("."), reverse=True)
    kept = [(name, model.get_submodule(name)) for name, style in units if style == KEEP_FULL_WEIGHT]
    for name, style in units:
        if style != KEEP_FULL_WEIGHT:
            fully_shard(
                model.get_submodule(name),
                mesh=shard_mesh,
                reshard_after_forward=reshard_after_forward,
            )
    if is_norm_and_head_pair(kept, model):
        fully_shard([module for _, module in kept], mesh=shard_mesh, reshard_after_forward=False)
    else:
        for _, module in kept:
            fully_shard(module, mesh=shard_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    return model


@contextlib.contextmanager
def fake_parameters(model: nn.Module, device: str = "cpu") -> Iterator[Any]:
    """Give every parameter and buffer of ``model`` a fake tensor of its shape on ``device``
    (``to_empty`` under a ``FakeTensorMode``: no memory, no values) and keep the mode on:
    tensors made inside (the batch) are fake too. FSDP2 runs on these where it refuses
    meta. Yields the mode. NB: the model holds fake tensors from then on; use it only inside
    such a block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device=device)
        yield mode


def _transformers_plan(
    model: nn.Module, attribute: str, given: dict[str, str] | None
) -> dict[str, str]:
    """``given``, else the model's own transformers plan (``tp_plan``, ``fsdp_plan``); a
    clear error for a model transformers did not build (its plans name its modules)."""
    if not hasattr(model, "_expand_parallel_plan"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers PreTrainedModel: torchroof applies "
            "parallel plans through transformers (its configs ship them)"
        )
    plan = given if given is not None else getattr(model, attribute, None)
    if not isinstance(plan, dict) or not plan:
        kind = attribute.removesuffix("_plan")
        raise ValueError(
            f"{type(model).__name__} has no {attribute} (its config's base_model_{attribute} "
            f"is empty): pass plan= (module name -> transformers {kind} style)"
        )
    return dict(plan)


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Refuse, before any model is built, a ``tp`` that ``config``'s tensor-parallel plan
    cannot run: no plan, or head counts that do not divide (a ValueError naming it)."""
    if tp == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"{type(config).__name__} has no base_model_tp_plan: transformers ships no tensor-"
            "parallel plan for this architecture"
        )
    _check_heads_divide(config, plan, tp)


def _check_heads_divide(config: Any, plan: dict[str, str], tp: int) -> Any:
    """Column-wise q/k/v projections split whole heads: the head counts must divide by tp
    (transformers' ``get_kv_heads_per_rank`` says None when the KV heads do not). Returns
    the KV heads per rank (None when the config does not say)."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"num_attention_heads={heads} does not divide by tp={tp}")
    per_rank = get_kv_heads_per_rank(plan, kv, tp) if isinstance(kv, int) else None
    if isinstance(kv, int) and per_rank is None:
        raise ValueError(
            f"num_key_value_heads={kv} does not divide by tp={tp}: the column-wise k/v "
            "projections would split a head"
        )
    return per_rank

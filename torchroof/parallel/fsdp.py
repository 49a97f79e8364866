"""FSDP2 / HSDP (ZeRO-3 sharding, Rajbhandari et al. 2020), grouped as transformers' plan says."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchroof.config.parallel_plan import MESH_DIMS
from torchroof.parallel.mesh import FSDP_CP
from torchroof.parallel.plans import owned_plan, transformers_plan
from torchroof.parallel.strategy import Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from torchroof.config import Workload

KEEP_FULL_WEIGHT = "keep_full_weight"  # transformers' FSDP style: no reshard after forward
FREE_FULL_WEIGHT = "free_full_weight"  # transformers' FSDP style: reshard after forward
# The attribute a note on how the model was built is kept in (the step's facts show it).
BUILD_NOTE = "torchroof_build_note"
# The attribute expert parallel sets on a model: the parameters FSDP leaves out of its units
# (experts each held by one rank: nothing to shard them over).
FSDP_IGNORED = "torchroof_fsdp_ignored_params"


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    plan: dict[str, str] | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters with FSDP2 ``fully_shard`` over the mesh's ``fsdp``
    dimension (with the ``cp`` ranks under context parallel: :data:`FSDP_CP`; HSDP over
    ``("dp", "fsdp")`` when ``dp`` > 1), as transformers' FSDP plan
    (``base_model_fsdp_plan``, or ``plan``) groups them: each planned module (a decoder
    layer, the embeddings) is one all-gather / reduce-scatter unit, the final norm and the
    LM head one unit kept unsharded after forward, then the root. ``reshard_after_forward``
    False keeps every unit gathered until backward (ZeRO-2-like: no all-gather in
    backward). A mesh whose ``dp`` and ``fsdp`` are both 1 leaves the model as it is.
    ``ignored_params`` stay out of every unit (experts each held by one rank).
    ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``): gradients are cast to
    it before they are reduced and back after (None: reduced in the parameters' dtype).

    NB: FSDP2 refuses meta parameters at its first forward; run the step inside
    :func:`fake_parameters`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.fsdp import (
        _resolve_tied_embed_lm_head_plan,
        is_norm_and_head_pair,
    )

    names = mesh.mesh_dim_names or ()
    if "fsdp" not in names or "dp" not in names:
        raise ValueError(f"apply_fsdp needs a mesh from build_mesh (dims {MESH_DIMS}), got {names}")
    # context-parallel ranks shard with the fsdp ones (torchtitan's dp_shard_cp)
    context = mesh["cp"].size() if "cp" in names else 1
    shard_dim = FSDP_CP if context > 1 else "fsdp"
    replicas, shards = mesh["dp"].size(), mesh["fsdp"].size() * context
    if replicas * shards == 1:
        return model
    with warnings.catch_warnings():  # torch asks to keep the flattened mesh, not slice it
        warnings.simplefilter("ignore", UserWarning)
        shard_mesh = mesh["dp", shard_dim] if replicas > 1 else mesh[shard_dim]

    wildcard_plan = transformers_plan(model, "fsdp_plan", plan)
    expanded = owned_plan(model, model._expand_parallel_plan(wildcard_plan))  # type: ignore[operator]
    expanded = _resolve_tied_embed_lm_head_plan(expanded, model) if expanded else _blocks(model)
    # FSDP2 needs a submodule sharded before the module that holds it.
    units = sorted(expanded.items(), key=lambda item: item[0].count("."), reverse=True)
    ignored = ignored_params or set()
    kept = [(name, model.get_submodule(name)) for name, style in units if style == KEEP_FULL_WEIGHT]

    def shard(modules: nn.Module | list[nn.Module], reshard: bool) -> None:
        odd = _odd_dtype_params(modules, ignored)
        if odd:
            left_out.update(odd)
        skip = ignored | odd
        extra: dict[str, Any] = {"ignored_params": skip} if skip else {}
        extra.update(reduce_policy(reduce_dtype))
        if shards == 1:  # DDP: every parameter whole, gradients all-reduced
            replicate(modules, mesh=mesh["dp"], **extra)
        else:
            fully_shard(modules, mesh=shard_mesh, reshard_after_forward=reshard, **extra)

    left_out: set[nn.Parameter] = set()

    for name, style in units:
        if style != KEEP_FULL_WEIGHT:
            shard(model.get_submodule(name), reshard_after_forward)
    if is_norm_and_head_pair(kept, model):
        shard([module for _, module in kept], False)
    else:
        for _, module in kept:
            shard(module, False)
    shard(model, reshard_after_forward)
    if left_out:
        note = (
            f"FSDP: {len(left_out)} parameters of another dtype than their unit's "
            f"({', '.join(sorted({str(p.dtype) for p in left_out}))}, e.g. router weights) "
            "left unsharded, their gradients not reduced: FSDP2 shards one dtype per unit"
        )
        previous = getattr(model, BUILD_NOTE, "")
        setattr(model, BUILD_NOTE, f"{previous}; {note}" if previous else note)
    return model


def _odd_dtype_params(
    modules: nn.Module | list[nn.Module], ignored: set[nn.Parameter]
) -> set[nn.Parameter]:
    """Parameters a unit would hold beside others of another dtype: FSDP2 all-gathers a
    unit as one flat buffer and refuses mixed original dtypes. The ones outside the unit's
    dominant dtype (by elements; DeepSeek-V3 keeps its router weights in fp32) are left out
    of it, unsharded."""
    from torch.distributed.fsdp import FSDPModule

    roots = modules if isinstance(modules, list) else [modules]
    managed: set[nn.Parameter] = set()
    for root in roots:
        inner = {
            p
            for m in root.modules()
            if m is not root and isinstance(m, FSDPModule)
            for p in m.parameters()
        }
        managed |= {p for p in root.parameters() if p not in inner and p not in ignored}
    sizes: dict[torch.dtype, int] = {}
    for p in managed:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return set()
    dominant = max(sizes, key=sizes.__getitem__)
    return {p for p in managed if p.dtype != dominant}


def _blocks(model: nn.Module) -> dict[str, str]:
    """FSDP units as torchtitan makes them, for a model whose transformers FSDP plan names
    none of its modules (GPT-2's ``transformer.h``, not ``layers``): each block of its
    longest module list, and its input embeddings unless tied to the LM head; the rest goes
    with the root."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1
    ]
    if not lists:
        raise ValueError(
            f"{type(model).__name__}: its FSDP plan names none of its modules and it has no "
            "list of blocks to shard one by one: pass plan= (module name -> FSDP style)"
        )
    name, blocks = max(lists, key=lambda item: len(item[1]))
    units = {f"{name}.{i}": FREE_FULL_WEIGHT for i in range(len(blocks))}
    hf = cast("PreTrainedModel", model)  # the embeddings' accessors are transformers'
    embeddings = hf.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and embeddings is not None and output.weight is embeddings.weight:
        embeddings = None  # tied to the LM head: one parameter, sharded with the root
    for path, module in model.named_modules():
        if embeddings is not None and module is embeddings:
            units[path] = FREE_FULL_WEIGHT
    return units


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


def reduce_policy(reduce_dtype: torch.dtype | None) -> dict[str, Any]:
    """FSDP2's keywords (``fully_shard``, ``replicate``) that reduce gradients in
    ``reduce_dtype`` (its ``MixedPrecisionPolicy``); none where they are reduced in the
    parameters' dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if reduce_dtype is None:
        return {}
    return {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)}


def mixed_reduce_dtype(workload: Workload) -> torch.dtype | None:
    """The dtype a mixed-precision step's bf16 gradients are cast to before they are
    reduced (``reduce_dtype`` fp32); None where they are reduced as they are."""
    if workload.precision == "mixed" and workload.reduce_dtype == "fp32":
        return torch.float32
    return None


def _apply(model: nn.Module, mesh: DeviceMesh, workload: Workload) -> AbstractContextManager[Any]:
    """A training step's parameters sharded over the data ranks (an inference step shards
    nothing over them: each rank holds its own batch and the dense weights whole); the step
    then runs on fake parameters (FSDP2 refuses meta ones)."""
    if not (workload.trains and workload.parallel_plan.shards_data):
        return contextlib.nullcontext()
    apply_fsdp(
        model,
        mesh,
        reshard_after_forward=workload.plan.reshards_after_forward,
        ignored_params=getattr(model, FSDP_IGNORED, set()),
        reduce_dtype=mixed_reduce_dtype(workload),
    )
    return fake_parameters(model)


STRATEGY = Strategy(name="fsdp", apply=_apply)

"""Tensor parallel (Shoeybi et al. 2019): transformers' own plan, on a fake process group."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchroof.models.sources import text_config
from torchroof.parallel.expert import without_expert_rules
from torchroof.parallel.plans import owned_plan, transformers_plan
from torchroof.parallel.strategy import Strategy

if TYPE_CHECKING:
    from torchroof.config import Workload

# The attribute apply_tensor_parallel sets on a model: the KV heads one rank holds (a KV
# cache built for the model's rank is this many heads wide).
KV_HEADS_PER_RANK = "torchroof_kv_heads_per_rank"
# The attribute apply_tensor_parallel sets on a model: (module name -> transformers style,
# the TP mesh), so that a module replaced after sharding gets its style's forward again.
TP_STYLES = "torchroof_tp_styles"


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

    wildcard_plan = transformers_plan(model, "tp_plan", plan)
    config = getattr(model, "config", None)
    kv_heads = check_heads_divide(config, wildcard_plan, size) if config is not None else None
    expanded = owned_plan(model, model._expand_parallel_plan(wildcard_plan))  # type: ignore[operator]
    tied = tied_copies(model, expanded)
    shared = shared_parameters(model)
    apply_tensor_parallelism(model, tp_mesh, {k: v for k, v in expanded.items() if k not in tied})
    retie(model, tp_mesh, expanded, tied)
    check_still_tied(model, shared, expanded)
    setattr(model, TP_STYLES, (dict(expanded), tp_mesh))
    if isinstance(kv_heads, int):
        setattr(model, KV_HEADS_PER_RANK, kv_heads)
    return model


def tied_copies(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The parameters ``plan`` names that are another parameter's tied copy (Gemma's LM head
    is its input embedding: ``named_parameters`` lists the table once, under the embedding),
    each -> the name it is listed under."""
    listed = dict(model.named_parameters())
    owners = {id(param): name for name, param in listed.items()}
    copies = {}
    for name in plan:
        if name in listed:
            continue
        module_name, _, attribute = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        param = module._parameters.get(attribute)
        if param is not None and id(param) in owners:
            copies[name] = owners[id(param)]
    return copies


def retie(
    model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str], tied: dict[str, str]
) -> None:
    """Make each tied copy the sharded parameter it is listed under again (sharding replaces
    a parameter), where the copy's own style shards it the same way; otherwise a ValueError
    naming both (one table cannot hold two layouts)."""
    if not tied:
        return
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for name, owner in tied.items():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        ALL_PARALLEL_STYLES[plan[name]].shard_param(module, attribute, tp_mesh)
        own, shared = module._parameters[attribute], model.get_parameter(owner)
        same = (
            own is not None
            and getattr(own, "placements", None) == getattr(shared, "placements", None)
            and own.shape == shared.shape
        )
        if not same:
            raise ValueError(
                f"{name} is tied to {owner}, and the tensor-parallel plan shards them "
                f"differently ({plan[name]} and {plan.get(owner, 'not at all')}): one "
                "parameter cannot hold both layouts"
            )
        module._parameters[attribute] = shared


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that more than one module holds (a tied LM head)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def check_still_tied(model: nn.Module, shared: list[list[str]], plan: dict[str, str]) -> None:
    """A ValueError where sharding left the names of one parameter holding two (the plan
    shards the embedding but leaves its tied head whole, say): one table, one layout."""
    for group in shared:
        if len({id(model.get_parameter(name)) for name in group}) > 1:
            styles = ", ".join(f"{name}: {plan.get(name, 'not sharded')}" for name in group)
            raise ValueError(
                f"{' and '.join(group)} are one tied parameter, and the tensor-parallel plan "
                f"shards them differently ({styles}): one parameter cannot hold both layouts"
            )


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Refuse, before any model is built, a ``tp`` that ``config``'s tensor-parallel plan
    cannot run: no plan, or head counts that do not divide (a ValueError naming it)."""
    if tp == 1:
        return
    text = text_config(config)
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"{type(config).__name__} has no base_model_tp_plan: transformers ships no tensor-"
            "parallel plan for this architecture"
        )
    check_heads_divide(config, plan, tp)


def check_heads_divide(config: Any, plan: dict[str, str], tp: int) -> Any:
    """Column-wise q/k/v projections split whole heads: the head counts must divide by tp
    (transformers' ``get_kv_heads_per_rank`` says None when the KV heads do not). Returns
    the KV heads per rank (None when the config does not say)."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    text = text_config(config)
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


def _apply(model: nn.Module, mesh: DeviceMesh, workload: Workload) -> AbstractContextManager[Any]:
    """transformers' plan over the mesh's ``tp`` dimension; with expert parallel, the plan
    less its rules on the experts (they are sharded whole). Sequence parallel applies its
    own plan instead (:mod:`torchroof.parallel.sequence`)."""
    if not workload.sequence_parallel:  # with one tp rank there is nothing to shard
        plan = None
        if workload.ep > 1:
            tp_plan = getattr(model, "tp_plan", None) or {}
            ep_plan = getattr(model, "ep_plan", None) or {}
            plan = without_expert_rules(tp_plan, ep_plan) or None
        apply_tensor_parallel(model, mesh["tp"], plan=plan)
    return contextlib.nullcontext()


STRATEGY = Strategy(name="tensor", apply=_apply)

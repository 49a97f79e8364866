"""Sequence parallel: torchtitan's tensor + sequence parallel plan for a Llama-layout model,
and any dense model's own transformers tensor-parallel plan run on the sequence."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchroof.config.errors import WorkloadError
from torchroof.parallel.plans import not_owned, owned_plan, transformers_plan
from torchroof.parallel.stages import SEQUENCE_MESH, pipeline_layout
from torchroof.parallel.strategy import Strategy
from torchroof.parallel.tensor import KV_HEADS_PER_RANK, check_heads_divide

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from torchroof.config import Workload


# Module names of the Llama layout torchtitan's sequence-parallel plan is written for (as
# transformers names them): the model's embedding, final norm and head, and per decoder layer
# exactly these children, the attention's four projections and the MLP's three.
LLAMA_LAYER_CHILDREN = frozenset(
    {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
)
LLAMA_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def apply_sequence_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True
) -> nn.Module:
    """Shard a Llama-layout ``model`` over ``tp_mesh`` with torchtitan's tensor + sequence
    parallel plan (``models/llama3/infra/parallelize.py`` ``apply_tp``), through
    ``parallelize_module``: between layers the residual stream is split along the sequence
    (``Shard(1)``): the embedding's partial sums are reduce-scattered onto it, the norms run
    on each rank's T/tp tokens (``SequenceParallel``), the attention and the MLP all-gather
    their input (``PrepareModuleInput`` Shard(1) -> Replicate) and their row-wise output
    projections reduce-scatter back (``RowwiseParallel(output_layouts=Shard(1))``): each
    all-reduce of plain tensor parallel becomes a reduce-scatter plus an all-gather. The LM
    head all-gathers the final norm's tokens; with ``loss_parallel`` its logits stay split
    over the vocabulary (``Shard(-1)``, a DTensor) for a cross-entropy run under
    ``torch.distributed.tensor.parallel.loss_parallel()``, else they are gathered whole
    (generation samples from the whole vocabulary). The residual stream stays a DTensor of
    global shape (torchtitan's uses local tensors), so transformers' mask and positions see
    all T tokens. Attention reshapes with ``-1`` heads, so it runs on the rank's local heads
    as it does under transformers' plan; the KV heads per rank are set as
    :data:`KV_HEADS_PER_RANK`. A TP group of one leaves the model as it is. Works on meta.

    Refuses (ValueError) a model whose modules do not follow the Llama layout
    (:func:`check_llama_layout`) or whose heads do not divide by the group."""
    size = tp_mesh.size()
    if size == 1:
        return model
    from torch.distributed.tensor import Placement, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        layers = check_llama_layout(model)
    except ValueError as not_llama:
        return apply_plan_sequence_parallel(model, tp_mesh, not_llama, loss_parallel)
    config = getattr(model, "config", None)
    kv_heads = None
    if config is not None:
        kv_heads = check_heads_divide(config, {"layers.*.self_attn.k_proj": "colwise"}, size)
    embedding, head = model.get_submodule("model.embed_tokens"), model.get_submodule("lm_head")
    tied = not not_owned(head) and head.weight is getattr(embedding, "weight", None)
    ends = _end_styles(loss_parallel)
    # a pipeline stage shards only the ends it owns
    owned = {n: style for n, style in ends.items() if not not_owned(model.get_submodule(n))}
    if owned:
        parallelize_module(model, tp_mesh, owned)
    if tied:  # both vocabulary-sharded (Shard(0) of the same V x d table): one parameter
        head.weight = embedding.weight
    gathered: dict[str, Placement] = {"hidden_states": Replicate()}
    for layer in layers:
        parallelize_module(layer, tp_mesh, _layer_styles(gathered))
    all_reduce_replicated_grads(model, tp_mesh)
    if isinstance(kv_heads, int):
        setattr(model, KV_HEADS_PER_RANK, kv_heads)
    return model


# transformers' tensor-parallel styles (``base_model_tp_plan``) as sequence parallel runs
# them: a column-wise layer takes the gathered sequence and keeps its output columns local;
# a row-wise one reduce-scatters its partial sums onto the sequence; the "gather output" /
# "split input" pair (Phi-3's fused projections) gathers the columns and splits them again.
SEQUENCE_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "replicated_with_grad_allreduce",
)


def apply_plan_sequence_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, why: Exception, loss_parallel: bool = True
) -> nn.Module:
    """Sequence parallel for a model not laid out as Llama, from its transformers
    tensor-parallel plan (Korthikanti et al. 2022, §4.2.2: between the tensor-parallel
    regions each rank holds T/tp tokens): every decoder layer's planned projections sharded
    as :data:`SEQUENCE_STYLES` says, each child that holds them gathering its input
    sequence first (:func:`_gathers_its_input`), every other child with parameters (the
    norms) running on the rank's tokens (``SequenceParallel``), and the ends as the Llama
    plan's: the token embedding reduce-scattered onto the sequence, the final norms on it,
    the LM head gathering it. A ValueError (``why``, the Llama check's, and what the plan
    has that this cannot shard: MoE experts) for a model it cannot run."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    try:
        plan = transformers_plan(model, "tp_plan", None)
        layout = pipeline_layout(model)
    except (ValueError, WorkloadError) as error:
        raise ValueError(f"{why}; {error}") from error
    paths = {id(m): path for path, m in model.named_modules()}
    list_path = paths[id(layout.layers)]
    prefix = f"{list_path}.*."
    layer_plan = {k.removeprefix(prefix): v for k, v in plan.items() if k.startswith(prefix)}
    unknown = {k: v for k, v in layer_plan.items() if v not in SEQUENCE_STYLES}
    if unknown or not layer_plan:
        what = ", ".join(f"{k} ({v})" for k, v in unknown.items()) or "no layer"
        raise ValueError(
            f"{why}; nor can its tensor-parallel plan run sequence parallel: it shards "
            f"{what} (use tensor parallel without sequence parallel)"
        )
    config = getattr(model, "config", None)
    kv_heads = None
    if config is not None:
        kv_heads = check_heads_divide(config, plan, tp_mesh.size())
    sequence = Shard(1)
    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
        ),
    }
    hf = cast("PreTrainedModel", model)  # a transformers causal LM (its plan says so)
    embedding = hf.get_input_embeddings()
    head = hf.get_output_embeddings()
    llama_ends = _end_styles(loss_parallel)  # the same styles, by the modules' roles
    ends: dict[str, Any] = {}
    for module, style in ((embedding, "model.embed_tokens"), (head, "lm_head")):
        if module is not None and not not_owned(module):
            ends[paths[id(module)]] = llama_ends[style]
    for after in layout.after:  # the final norm(s)
        module = getattr(layout.owner, after)
        if not not_owned(module) and next(module.parameters(), None) is not None:
            ends[paths[id(module)]] = llama_ends["model.norm"]
    owned_ends = not not_owned(head) and not not_owned(embedding)
    head_weight, embedding_weight = getattr(head, "weight", None), getattr(embedding, "weight", 0)
    tied = owned_ends and head_weight is embedding_weight
    layers = [layer for layer in layout.layers if not not_owned(layer)]
    plans = [_layer_plan(layer, layer_plan, styles, why) for layer in layers]  # refuse first
    if ends:
        parallelize_module(model, tp_mesh, ends)
    if tied:
        head.weight = embedding.weight  # both vocabulary-sharded: one parameter
    for layer, (own, holders) in zip(layers, plans, strict=True):
        for child_name, child in layer.named_children():
            if child_name in holders:
                child.register_forward_pre_hook(_gathers_its_input, with_kwargs=True)
        parallelize_module(layer, tp_mesh, own)
    all_reduce_replicated_grads(model, tp_mesh)
    if isinstance(kv_heads, int):
        setattr(model, KV_HEADS_PER_RANK, kv_heads)
    return model


def all_reduce_replicated_grads(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The plan's ``replicated_with_grad_allreduce`` entries (Qwen3's per-head q/k norms,
    which see only the rank's heads) as transformers applies them: each rank's gradient
    all-reduced over the group after it accumulates."""
    plan = getattr(model, "tp_plan", None) or {}
    wanted = {k: v for k, v in plan.items() if v == "replicated_with_grad_allreduce"}
    if not wanted or not hasattr(model, "_expand_parallel_plan"):
        return
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    expanded = owned_plan(model, model._expand_parallel_plan(wanted))  # type: ignore[operator]
    apply_tensor_parallelism(model, tp_mesh, expanded)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _layer_plan(
    layer: nn.Module, layer_plan: dict[str, str], styles: dict[str, Any], why: Exception
) -> tuple[dict[str, Any], set[str]]:
    """(the styles one decoder layer takes, the children that gather their input): its
    planned projections that it has, each child holding some (they must end in a row-wise
    layer, which puts the output back on the sequence), and every other child with
    parameters on the rank's tokens (it must be a leaf, a norm: a module of several
    layers left whole would mix tokens across the sequence shards). A ValueError for a
    layer that cannot run so (``why``, the Llama check's, first)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    own: dict[str, Any] = {}
    holders: dict[str, list[str]] = {}
    for key, style in layer_plan.items():
        if style in styles and _has(layer, key):
            own[key] = styles[style]
            holders.setdefault(key.split(".", 1)[0], []).append(style)
    for child_name, child in layer.named_children():
        if child_name in holders:
            if not any(style.startswith("rowwise") for style in holders[child_name]):
                raise ValueError(
                    f"{why}; nor can its tensor-parallel plan run sequence parallel: "
                    f"{child_name} has no row-wise layer to return its output to the sequence"
                )
        elif next(child.parameters(), None) is not None:
            if next(child.children(), None) is not None:
                raise ValueError(
                    f"{why}; nor can its tensor-parallel plan run sequence parallel: "
                    f"{child_name} holds layers its plan does not shard"
                )
            own[child_name] = SequenceParallel()
    return own, set(holders)


def _gathers_its_input(
    _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Before a block that holds column-wise layers (attention, MLP): its sequence-sharded
    inputs all-gathered (``Shard(1)`` -> ``Replicate``), as torchtitan's
    ``PrepareModuleInput`` does for Llama's, whichever argument carries them."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gathered(value: Any) -> Any:
        if isinstance(value, DTensor) and Shard(1) in value.placements:
            return value.redistribute(value.device_mesh, [Replicate()])
        return value

    return tuple(gathered(a) for a in args), {k: gathered(v) for k, v in kwargs.items()}


def _end_styles(loss_parallel: bool) -> dict[str, Any]:
    """torchtitan's styles for the model's ends: the embedding's partial sums
    reduce-scattered onto the sequence, the final norm on the rank's tokens, the LM head
    gathering them (its logits split over the vocabulary with ``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    logits = (Shard(-1), False) if loss_parallel else (Replicate(), True)
    sequence = Shard(1)  # (B, T, d): the residual stream split along T between layers
    return {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=sequence, output_layouts=logits[0], use_local_output=logits[1]
        ),
    }


def _layer_styles(gathered: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's styles for one decoder layer: the norms on the rank's tokens, attention
    and MLP gathering their input (``gathered``: the attention's keyword layouts) and
    reduce-scattering their row-wise output projections back onto the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence = Shard(1)
    return {
        "input_layernorm": SequenceParallel(),
        # the decoder layer passes hidden_states by keyword
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": sequence},
            desired_input_kwarg_layouts=gathered,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
    }


def check_llama_layout(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a model laid out as transformers' Llama (``model.embed_tokens``
    an embedding, ``model.layers.*`` with exactly ``input_layernorm``, ``self_attn`` (linear
    ``q/k/v/o_proj``), ``post_attention_layernorm`` and ``mlp`` (linear ``gate/up/down_proj``),
    ``model.norm``, a linear ``lm_head``), checked by module name, not model type; a
    ValueError naming the first module that differs. A pipeline stage's modules it does not
    own (transformers' ``PipelineIdentityLayer``) are skipped: its own layers are returned."""
    name = type(model).__name__

    def module(path: str, kind: type[nn.Module] | None = None) -> nn.Module:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            found = None
        if found is None or (kind is not None and not isinstance(found, kind)):
            what = f"an nn.{kind.__name__} " if kind is not None else ""
            raise ValueError(
                f"sequence parallel follows torchtitan's Llama plan, which needs {what}"
                f"{path!r}; {name} has no such module (only models laid out as transformers' "
                "Llama take it: use tensor parallel without sequence parallel)"
            )
        return found

    for path, kind in (("model.embed_tokens", nn.Embedding), ("lm_head", nn.Linear)):
        try:
            found = model.get_submodule(path)
        except AttributeError:
            found = None
        if not not_owned(found):  # a pipeline stage checks only the ends it owns
            module(path, kind)
    module("model.norm")
    every = list(module("model.layers").children())
    if not every:
        raise ValueError(f"{name}.model.layers holds no decoder layer")
    layers = []
    for index, layer in enumerate(every):
        if not_owned(layer):  # another pipeline stage's
            continue
        layers.append(layer)
        children = {child for child, _ in layer.named_children()}
        if children != LLAMA_LAYER_CHILDREN:
            raise ValueError(
                f"sequence parallel follows torchtitan's Llama plan: {name}.model.layers."
                f"{index} holds {', '.join(sorted(children))}, not exactly "
                f"{', '.join(sorted(LLAMA_LAYER_CHILDREN))} (use tensor parallel without "
                "sequence parallel)"
            )
        for projection in LLAMA_ATTENTION_PROJECTIONS:
            module(f"model.layers.{index}.self_attn.{projection}", nn.Linear)
        for projection in LLAMA_MLP_PROJECTIONS:
            module(f"model.layers.{index}.mlp.{projection}", nn.Linear)
    return layers


def sequence_parallel(workload: Workload) -> bool:
    """The step runs torchtitan's tensor + sequence parallel plan (``sequence_parallel``
    with more than one tensor-parallel rank; with one there is nothing to split)."""
    return workload.sequence_parallel and workload.tp > 1


def check_sequence_parallel(workload: Workload) -> None:
    """Refuse a sequence-parallel step whose new tokens do not split evenly over the
    tensor-parallel ranks: a decode step's one token per sequence, or a rank's share of
    ``seq`` (seq / cp under context parallel) not a multiple of ``tp`` (torchtitan asserts
    the same: its shards are even)."""
    if not sequence_parallel(workload):
        return
    if workload.shape.facts.tokens_per_sequence is not None:  # decode: one new token each
        raise WorkloadError(
            "sequence_parallel splits each sequence's new tokens over the tp ranks; a decode "
            "step has one per sequence: use tensor parallel without sequence parallel"
        )
    assert workload.seq is not None, "seq is resolved before the plan is checked"
    seq, cp, tp = workload.seq, workload.cp, workload.tp
    if seq % (cp * tp) == 0:
        return
    if cp > 1:
        raise WorkloadError(
            f"sequence_parallel splits each cp rank's seq / cp = {seq // cp} tokens over "
            f"tp={tp} ranks: seq must be a multiple of cp x tp = {cp * tp}"
        )
    raise WorkloadError(
        f"sequence_parallel splits seq={seq} over tp={tp} ranks: seq must be a multiple of tp"
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


def _apply(model: nn.Module, mesh: DeviceMesh, workload: Workload) -> AbstractContextManager[Any]:
    """torchtitan's tensor + sequence parallel plan over the mesh's ``tp`` dimension, in
    place of transformers' (a training step's loss then runs on the vocabulary shards;
    prefill gathers its logits), and the mesh set on the model: a pipeline stage receives
    its activation as a sequence shard."""
    if sequence_parallel(workload):
        apply_sequence_parallel(model, mesh["tp"], loss_parallel=workload.trains)
        setattr(model, SEQUENCE_MESH, mesh["tp"])
    return contextlib.nullcontext()


STRATEGY = Strategy(name="sequence", validate=check_sequence_parallel, apply=_apply)

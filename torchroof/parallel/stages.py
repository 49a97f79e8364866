"""One pipeline stage of a transformers model, run by the ordinary regimes.

A model with ``pp`` stages is split as transformers splits it
(``transformers.distributed.pipeline_parallel``): the decoder layers its
``base_model_pp_plan`` names (``layers``) are divided into contiguous runs, the remainder
going one layer each to the first stages (``PipelineStage.layer_range_for_rank``), or as the
user gives them; the embedding goes with the first stage, the final norm and the LM head
with the last. A stage is the whole model with every module it does not own replaced by
transformers' ``PipelineIdentityLayer`` (so the model's own forward, masks, positions and
cache run unchanged), and a forward that:

- on every stage but the first, takes the activation the previous stage sends as
  ``inputs_embeds`` (an empty (B, T, d) tensor, T the rank's tokens: T/cp under context
  parallel, T/(cp·tp) with sequence parallel too: a receive, no work);
- on every stage but the last, returns the base model's last hidden state (what it sends)
  as the output's ``loss``, so a training step's backward starts from the gradient the next
  stage sends back (:func:`stage_backward`, an empty tensor of the output's shape).

A training step's backward is run by :func:`stage_backward`: whole (``B``), or split as
zero-bubble schedules (Qi et al. 2023) run it, by torch's own ``stage_backward_input``
(gradients of the stage's input, ``I``) then ``stage_backward_weight`` (its weights'
gradients, ``W``). The op
index where each action ends is kept in the trace's facts (``pipeline``), so pricing can
time each action the schedule lays out.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from torchroof.capture.mode import Capture
from torchroof.capture.storage import local_shard
from torchroof.config.errors import WorkloadError, first_line
from torchroof.models.sources import text_config
from torchroof.records.facts import (  # the trace's op marks, by name
    BACKWARD_END,
    FORWARD_END,
    INPUT_END,
    StageFacts,
    StageMarks,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STAGE_ATTRIBUTE = "torchroof_pipeline_stage"
LAYOUT_ATTRIBUTE = "torchroof_pipeline_layout"  # the model's PipelineLayout, once found
SEQUENCE_MESH = "torchroof_sequence_mesh"  # set on a model under sequence parallel


@dataclass(frozen=True)
class StageSplit:
    """Stage ``index`` of ``count``: its decoder layers, and whether it holds the
    embedding (first) or the final norm and LM head (last)."""

    index: int
    count: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def describe(self) -> str:
        span = f"layers {self.layers.start}-{self.layers.stop - 1}" if self.layers else "no layer"
        ends = [*(["embedding"] if self.first else []), *(["norm + head"] if self.last else [])]
        return span + (f" + {' + '.join(ends)}" if ends else "")


def split_layers(layers: int, stages: int, given: tuple[int, ...] = ()) -> list[StageSplit]:
    """``layers`` decoder layers over ``stages`` stages: ``given`` layer counts (one per
    stage, summing to ``layers``), else transformers' even split, the remainder one layer
    each to the first stages. A WorkloadError when a stage would hold no layer or the
    counts do not add up."""
    if given:
        if len(given) != stages or sum(given) != layers or min(given) < 0:
            raise WorkloadError(
                f"pp_split gives {len(given)} stages of {'+'.join(map(str, given))} = "
                f"{sum(given)} layers; the step has {stages} stages and {layers} layers"
            )
        counts = list(given)
    else:
        if layers < stages:
            raise WorkloadError(
                f"{layers} decoder layers cannot fill {stages} pipeline stages: lower pp"
            )
        per, extra = divmod(layers, stages)
        counts = [per + (i < extra) for i in range(stages)]
    splits, start = [], 0
    for index, count in enumerate(counts):
        splits.append(StageSplit(index, stages, range(start, start + count)))
        start += count
    return splits


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(the base model, the name of its decoder-layer list, the list) as its
    ``base_model_pp_plan`` names them; a WorkloadError for a model without one."""
    plan = decoder_pp_plan(model)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(plan, dict) or base is None:
        raise WorkloadError(
            f"{type(model).__name__} has no base_model_pp_plan: transformers ships no "
            "pipeline split for this architecture"
        )
    for name in plan:
        found = getattr(base, name, None)
        if isinstance(found, nn.ModuleList):
            return base, name, found
    raise WorkloadError(f"{type(model).__name__}'s pp plan names no list of decoder layers")


@dataclass(frozen=True)
class PipelineLayout:
    """Where a causal LM's pipeline split falls: ``owner`` holds the decoder-layer list
    ``list_name`` (``layers``) between the modules its forward runs before it (``before``:
    the embeddings, the first stage's) and after it (``after``: the final norm, the last
    stage's); ``base`` is the base model a stage runs for its hidden states. ``derived``:
    read off the module tree and the order a forward calls it in, for a model without a
    ``base_model_pp_plan``."""

    base: nn.Module
    owner: nn.Module
    list_name: str
    layers: nn.ModuleList
    before: tuple[str, ...]
    after: tuple[str, ...]
    derived: str = ""  # how a derived split was found (empty: the model's pp plan)
    layer_outputs: int = 0  # a derived layer's return: 0 a tensor, n a tuple of n

    def split_note(self) -> str:
        """A derived split, stated: which modules go with the first stage, which with the
        last (empty for a split from the model's pp plan)."""
        if not self.derived:
            return ""
        first = [
            n for n in self.before if not _every_stage_runs(getattr(self.owner, n), self.derived)
        ]
        every = [n for n in self.before if n not in first]
        return (
            f"{self.derived} (no base_model_pp_plan): {', '.join(first) or 'nothing'} on the "
            f"first stage, {', '.join([*self.after, 'the head'])} on the last"
            + (f", {', '.join(every)} on every stage" if every else "")
        )


def pipeline_layout(model: nn.Module) -> PipelineLayout:
    """The model's :class:`PipelineLayout`: from its ``base_model_pp_plan`` (the names before
    the layer list are its embeddings, those after its final norm), else derived
    (:func:`_derived_layout`). A WorkloadError when neither finds one list of layers."""
    known = getattr(model, LAYOUT_ATTRIBUTE, None)
    if isinstance(known, PipelineLayout):  # derived once (a forward): every stage key reads it
        return known
    plan = decoder_pp_plan(model)
    if plan is None:
        layout = _derived_layout(model)
    else:
        base, list_name, layers = decoder_layers(model)
        names = list(plan)
        at = names.index(list_name)
        before, after = tuple(names[:at]), tuple(names[at + 1 :])
        layout = PipelineLayout(base, base, list_name, layers, before, after)
    setattr(model, LAYOUT_ATTRIBUTE, layout)
    return layout


def _derived_layout(model: nn.Module) -> PipelineLayout:
    """A model without a ``base_model_pp_plan`` (GPT-2, OPT, Bloom, Falcon, GPT-J, ...): its
    decoder layers are the base model's one outermost ``nn.ModuleList`` of blocks of one
    class; the list's parent holds the ends, and which run before and which after the
    layers is read from the order one forward calls them in (a 2-token forward on meta:
    registration order misleads, OPT registers its final norm before its layers). A
    WorkloadError for a model with no such list or with several (an encoder and a
    decoder)."""
    name = type(model).__name__
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or not hasattr(model, "get_output_embeddings"):
        raise WorkloadError(
            f"{name} has no base_model_pp_plan and is not a causal LM with a base model: "
            "no pipeline split for it"
        )
    found: list[tuple[str, nn.ModuleList]] = []
    for path, module in base.named_modules():
        if any(path.startswith(f"{outer}.") for outer, _ in found):
            continue  # a list inside a block (experts)
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            if len({type(m) for m in module}) == 1:
                found.append((path, module))
    if len(found) != 1:
        lists = ", ".join(path for path, _ in found) or "none"
        raise WorkloadError(
            f"{name} has no base_model_pp_plan, and a pipeline splits one list of decoder "
            f"layers: it has {len(found)} ({lists})"
        )
    path, layers = found[0]
    owner_path, _, list_name = path.rpartition(".")
    owner = base.get_submodule(owner_path) if owner_path else base
    outside = _held_outside(base, owner_path)
    if outside:
        raise WorkloadError(
            f"{name} has no base_model_pp_plan, and its base model holds {', '.join(outside)} "
            f"beside {owner_path}, which holds its layers: no pipeline split for it"
        )
    order, outputs = _call_order(model, owner)
    if list_name not in order:
        raise WorkloadError(f"{name}'s forward never runs {path}: no pipeline split for it")
    at = order.index(list_name)
    described = f"{type(base).__name__}.{path} split as its forward runs it"
    return PipelineLayout(
        base,
        owner,
        list_name,
        layers,
        tuple(order[:at]),
        tuple(order[at + 1 :]),
        described,
        outputs,
    )


def _held_outside(base: nn.Module, owner_path: str) -> list[str]:
    """The modules with parameters beside the path from ``base`` to the module holding the
    layers (BertGeneration's embeddings beside its encoder): a split of the owner's
    children would leave them on every stage."""
    held: list[str] = []
    module, prefix = base, ""
    for part in owner_path.split(".") if owner_path else ():
        for child_name, child in module.named_children():
            if child_name != part and next(child.parameters(), None) is not None:
                held.append(prefix + child_name)
        module, prefix = getattr(module, part), f"{prefix}{part}."
    return held


def _call_order(model: nn.Module, owner: nn.Module) -> tuple[list[str], int]:
    """The names of ``owner``'s children in the order ``model``'s forward first calls them,
    on a batch of one 2-token sequence (a meta model allocates nothing), and what its first
    decoder layer returns (0: a tensor; n: a tuple of n, the hidden states first)."""
    order: list[str] = []
    outputs: list[int] = []
    hooks = []
    for child_name, child in owner.named_children():

        def note(_module: nn.Module, _args: Any, child_name: str = child_name) -> None:
            if child_name not in order:
                order.append(child_name)

        # a list of layers is iterated, not called: its first layer's call stands for it
        called = child[0] if isinstance(child, nn.ModuleList) and len(child) else child
        hooks.append(called.register_forward_pre_hook(note))
        if called is not child:

            def returned(_module: nn.Module, _args: Any, output: Any) -> None:
                outputs.append(len(output) if isinstance(output, tuple) else 0)

            hooks.append(called.register_forward_hook(returned))
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    try:  # under capture: meta's data-dependent questions (.item()) are answered
        with torch.no_grad(), Capture():
            model(input_ids=ids, use_cache=False)
    except Exception as error:  # noqa: BLE001 - the model's own forward failed on meta
        raise WorkloadError(
            f"{type(model).__name__} has no base_model_pp_plan, and a forward run to find its "
            f"split failed: {type(error).__name__}: {first_line(error)}"
        ) from error
    finally:
        for hook in hooks:
            hook.remove()
    return order, outputs[0] if outputs else 0


def layer_signature(model: nn.Module, index: int) -> tuple[Any, ...]:
    """What makes decoder layer ``index`` cost what it costs: its parameters' names, shapes
    and dtypes, and its entry in the config's ``layer_types`` (sliding or full attention).
    Stages whose layers have equal signatures trace the same."""
    layers = pipeline_layout(model).layers
    layer = layers[index]
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
    kinds = getattr(_text_config(model), "layer_types", None)
    kind = kinds[index] if isinstance(kinds, (list, tuple)) and index < len(kinds) else None
    return (type(layer).__name__, params, kind)


def stage_key(model: nn.Module, split: StageSplit) -> tuple[Any, ...]:
    """Stages with equal keys run the same ops: the same ends and layers of equal
    signatures (:func:`layer_signature`)."""
    return (split.first, split.last, tuple(layer_signature(model, i) for i in split.layers))


@dataclass
class StageState:
    """What a traced stage remembers while the regime runs it."""

    split: StageSplit
    split_backward: bool
    received: torch.Tensor | None = None  # the activation the previous stage sent
    sent: torch.Tensor | None = None  # the activation this stage sends on
    marks: dict[str, int] = field(default_factory=dict)

    def facts(self) -> StageFacts:
        boundary = self.received if self.received is not None else self.sent
        return StageFacts(
            stage=self.split.index,
            stages=self.split.count,
            layers=(self.split.layers.start, self.split.layers.stop),
            marks=StageMarks(**self.marks),
            activation_bytes=_bytes(boundary),
        )


def _bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = local_shard(tensor)
    return local.numel() * local.element_size()


def make_stage(model: nn.Module, split: StageSplit, split_backward: bool = False) -> nn.Module:
    """Turn ``model`` (a transformers causal LM on meta) into pipeline stage ``split``, in
    place: modules it does not own become identities, its forward receives and sends
    activations (module docstring). Returns the model; its :class:`StageState` is set as
    :data:`STAGE_ATTRIBUTE`."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    layout = pipeline_layout(model)
    layers = layout.layers
    for index in range(len(layers)):
        if index not in split.layers:
            skipped = SkippedLayer(layout.layer_outputs) if layout.derived else None
            layers[index] = skipped or PipelineIdentityLayer()
    hf = cast("PreTrainedModel", model)  # a transformers causal LM
    head = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    for name in layout.before:  # the embeddings: the first stage's
        module = getattr(layout.owner, name)
        tied = split.last and head_weight is not None and module_weight(module) is head_weight
        if not split.first and not tied and not _every_stage_runs(module, layout.derived):
            setattr(layout.owner, name, _stand_in(module, layout.derived))
    for name in layout.after:  # the final norm: the last stage's
        if not split.last:
            setattr(layout.owner, name, PipelineIdentityLayer())
    if not split.last and head is not None:
        hf.set_output_embeddings(PipelineIdentityLayer())
    state = StageState(split, split_backward)
    setattr(model, STAGE_ATTRIBUTE, state)
    _wrap_forward(model, layout.base, state)
    return model


def _every_stage_runs(module: nn.Module, derived: str) -> bool:
    """In a derived split, a module before the layers that holds no parameter and is no
    dropout (rotary embeddings: the positions' cos and sin every layer reads) runs on every
    stage, as the modules a pp plan leaves out do."""
    if not derived or isinstance(module, nn.Dropout):
        return False
    return next(module.parameters(), None) is None


def module_weight(module: nn.Module) -> Any:
    return getattr(module, "weight", None)


class SkippedLayer(nn.Module):
    """Another stage's decoder layer: its input hidden states back, in the structure the
    real layer returns (``outputs``: 0 a tensor; n a tuple of n, the rest None, as Bloom's,
    Falcon's and MPT's layers return their cache and attention weights beside it), as
    transformers' ``PipelineIdentityLayer`` does for layers that return a tensor."""

    def __init__(self, outputs: int = 0) -> None:
        super().__init__()
        self.outputs = outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            hidden = args[0]
        elif "hidden_states" in kwargs:
            hidden = kwargs["hidden_states"]
        else:
            raise WorkloadError(
                "a decoder layer another pipeline stage owns was called without its hidden "
                f"states (keywords {', '.join(kwargs)}): no pipeline split for this model"
            )
        if not self.outputs:
            return hidden
        return (hidden, *([None] * (self.outputs - 1)))


class AddedNothing(nn.Module):
    """A later stage's stand-in for an embedding its forward adds to the received
    activation (GPT-2's and OPT's learned positions): zeros of the embedding's output
    shape, one tensor of (..., d) where the first stage looked rows up."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width, self.dtype = width, dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = args[0] if args else next(iter(kwargs.values()))
        return torch.zeros(*first.shape, self.width, dtype=self.dtype, device=first.device)


def _stand_in(module: nn.Module, derived: str) -> nn.Module:
    """What a stage without the embeddings runs in their place: transformers'
    ``PipelineIdentityLayer`` (returns its first argument); for an ``nn.Embedding`` of a
    derived split, whose output the forward adds to the received activation, zeros of its
    width (a model with a pp plan only looks up tokens, which a stage given
    ``inputs_embeds`` never calls)."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    if derived and isinstance(module, nn.Embedding):
        return AddedNothing(module.embedding_dim, module.weight.dtype)
    return PipelineIdentityLayer()


def decoder_pp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's ``base_model_pp_plan`` (module name -> its inputs and outputs, in order),
    from its text config or its own; None when it has none."""
    plan = getattr(_text_config(model), "base_model_pp_plan", None)
    plan = plan or getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    return dict(plan) if isinstance(plan, dict) else None


def _text_config(model: nn.Module) -> Any:
    return text_config(getattr(model, "config", None))


def _wrap_forward(model: nn.Module, base: nn.Module, state: StageState) -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward
    signature = inspect.signature(original)
    hidden = cast("PreTrainedModel", model).config.get_text_config().hidden_size

    @functools.wraps(original)  # its signature: regimes read the forward's parameters
    def stage_forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        bound.update(bound.pop("kwargs", {}) or {})
        if not state.split.first:
            ids = bound.pop("input_ids", None)
            if ids is None:
                raise WorkloadError("a pipeline stage is driven with input_ids")
            dtype = next(base.parameters()).dtype
            mesh = getattr(model, SEQUENCE_MESH, None)  # sequence parallel: T/tp each
            tokens = ids.shape[1] // (mesh.size() if mesh is not None else 1)
            received = torch.empty(
                ids.shape[0],
                tokens,
                hidden,
                dtype=dtype,
                device=ids.device,
                requires_grad=torch.is_grad_enabled() and model.training,
            )
            state.received = received
            bound["inputs_embeds"] = _sequence_sharded(received, mesh)
        if state.split.last:
            return original(**bound)
        inner = {k: v for k, v in bound.items() if k not in ("labels", "logits_to_keep")}
        out = base(**inner)
        state.sent = out.last_hidden_state
        cache = getattr(out, "cache", None)  # transformers 5's name (past_key_values before)
        return CausalLMOutputWithPast(loss=out.last_hidden_state, cache=cache)

    model.forward = stage_forward


def _sequence_sharded(local: torch.Tensor, mesh: Any) -> Any:
    """Under sequence parallel the residual stream between layers is a DTensor split along
    the sequence (``Shard(1)``, global shape): what a stage receives is this rank's T/tp
    tokens of it. Without, the tensor itself."""
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False)


def stage_of(model: nn.Module) -> StageState | None:
    return getattr(model, STAGE_ATTRIBUTE, None)


def stage_backward(model: nn.Module, loss: torch.Tensor, capture: Capture) -> None:
    """The backward a training step runs: ``loss.backward()`` for a whole model; for a
    pipeline stage, from the loss (last stage) or from the gradient the next stage sends
    (an empty tensor of the sent activation's shape), whole or split into torch's
    ``stage_backward_input`` and ``stage_backward_weight``; the op count where each part
    ends is marked."""
    state = stage_of(model)
    if state is None:
        loss.backward()
        return
    state.marks[FORWARD_END] = len(capture.trace.ops)
    grads = None if state.split.last else [torch.empty_like(loss)]
    if not state.split_backward:
        loss.backward(None if grads is None else grads[0])
        state.marks[BACKWARD_END] = len(capture.trace.ops)
        return
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    if state.received is None:  # the first stage: no input gradient, W is the whole
        state.marks[INPUT_END] = state.marks[FORWARD_END]  # backward (torch's stage does so)
        loss.backward(None if grads is None else grads[0])
        state.marks[BACKWARD_END] = len(capture.trace.ops)
        return
    inputs = [state.received]
    weights = [p for p in model.parameters() if p.requires_grad]
    _, groups = stage_backward_input([loss], grads, inputs, iter(weights))
    state.marks[INPUT_END] = len(capture.trace.ops)
    stage_backward_weight(iter(weights), groups)
    state.marks[BACKWARD_END] = len(capture.trace.ops)


def per_microbatch(model: nn.Module, capture: Capture) -> None:
    """What ran since the backward ended belongs to each micro-batch's backward (mixed
    precision's accumulation into the fp32 gradients): a stage's backward mark moves past
    it, so a pipeline charges it once per micro-batch."""
    state = stage_of(model)
    if state is not None and BACKWARD_END in state.marks:
        state.marks[BACKWARD_END] = len(capture.trace.ops)


def record_stage(model: nn.Module, trace: Any) -> None:
    """Keep the stage's facts in the trace (``trace.facts.pipeline``)."""
    state = stage_of(model)
    if state is not None:
        trace.facts.pipeline = state.facts()


def release_stage(model: nn.Module) -> None:
    """Let go of the activations a stage received and sent, once its trace is made or has
    failed: each holds its autograd graph, whose hooks hold the model and the capture, a
    cycle through autograd's C++ nodes that Python's collector does not see (kept, every
    stage traced stayed in memory: a search's workers grew by tens of thousands of objects
    a layout)."""
    state = stage_of(model)
    if state is not None:
        state.received = state.sent = None


def owned_layers(model: nn.Module) -> range | None:
    """The decoder layers a pipeline stage owns (None: every layer)."""
    state = stage_of(model)
    return state.split.layers if state is not None else None

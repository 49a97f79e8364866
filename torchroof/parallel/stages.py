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
  ``inputs_embeds`` (an empty (B, T, d) tensor: a receive, no work);
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
from torchroof.config.errors import WorkloadError
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


def layer_signature(model: nn.Module, index: int) -> tuple[Any, ...]:
    """What makes decoder layer ``index`` cost what it costs: its parameters' names, shapes
    and dtypes, and its entry in the config's ``layer_types`` (sliding or full attention).
    Stages whose layers have equal signatures trace the same."""
    _, _, layers = decoder_layers(model)
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

    base, list_name, layers = decoder_layers(model)
    for index in range(len(layers)):
        if index not in split.layers:
            layers[index] = PipelineIdentityLayer()
    hf = cast("PreTrainedModel", model)  # a transformers causal LM
    tied = getattr(hf.config, "tie_word_embeddings", False)
    head = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plan = list(decoder_pp_plan(model) or ())
    at = plan.index(list_name)
    for name in plan[:at]:  # the embeddings: the first stage's
        if not split.first and not (tied and split.last and name == "embed_tokens"):
            setattr(base, name, PipelineIdentityLayer())
    for name in plan[at + 1 :]:  # the final norm: the last stage's
        if not split.last:
            setattr(base, name, PipelineIdentityLayer())
    if not split.last and head is not None:
        hf.set_output_embeddings(PipelineIdentityLayer())
    state = StageState(split, split_backward)
    setattr(model, STAGE_ATTRIBUTE, state)
    _wrap_forward(model, base, state)
    return model


def decoder_pp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's ``base_model_pp_plan`` (module name -> its inputs and outputs, in order),
    from its text config or its own; None when it has none."""
    plan = getattr(_text_config(model), "base_model_pp_plan", None)
    plan = plan or getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    return dict(plan) if isinstance(plan, dict) else None


def _text_config(model: nn.Module) -> Any:
    config: Any = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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


def owned_layers(model: nn.Module) -> range | None:
    """The decoder layers a pipeline stage owns (None: every layer)."""
    state = stage_of(model)
    return state.split.layers if state is not None else None

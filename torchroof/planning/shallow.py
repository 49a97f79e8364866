"""A training layout priced from two shallow copies of its model, for a search that prices
hundreds of layouts.

A model whose decoder layers are all alike (one class, the same attributes and parameter
shapes: Llama, Qwen, Mistral) trains a step in which each layer adds the same kernels on
the same streams, the same traffic and the same bytes kept: the step's figures are affine
in its layers. Rank 0 of a layout without a pipeline runs every layer, so its trace grows
with the model (Llama-3-70B's 80 layers, each run on meta where sequence parallel's
activations keep its layers from being copied); it is priced instead on copies of the
model with 2 and 3 layers, each traced and priced as :func:`torchroof.estimate` would
(except that the 3-layer copy does not run a third micro-batch to compare with its
second where the 2-layer copy's matched:
:func:`~torchroof.workloads.microbatches.held_once`), and every figure f carried to the
model's L layers along the line through them:
f(L) = f(3) + (L - 3) x (f(3) - f(2)). MFU is carried as MFU x step time (the step's
FLOPs over the peak: affine); tokens/s is the step's tokens over the carried time. A
pipeline of s stages, whose stages hold q = L // s layers or one more (at least
:data:`STAGE_DEEP`, or :data:`STAGE_LEAST`: see the end), is priced on copies with 2 and
3 layers a stage (and the same stages one more), carried over q - 3 more: each stage's
actions grow along a line, and so does the schedule's time where one path through it
stays the longest.

The step time, traffic, exposed communication and memory carried so equal the full
model's to about 1e-13 for Llama-3-70B on 256 GPUs (FSDP with and without sequence
parallel, FSDP with context parallel, DDP with ZeRO-1 and full recompute; 1F1B pipelines
of 2 and 4 stages in time and traffic); the interleaved schedule's time fell 6e-4 short
(another path through the schedule is longer at full depth; a zero-bubble V schedule fell
0.8% short on a small model). In the tests, on layouts of a 12-layer model and pipelines of
16 to 32 layers, the times agree to 1e-6 and the memory exactly.

The memory is a lower bound, except under a schedule of several stages a rank. Each moment of
the step holds bytes affine in the layers, and the footprint is the fullest of them, so
the line through two shallow depths lies below it at L where the fullest moment changes
between them and L (a maximum of lines lies above its chords beyond them). Each rank's
memory is carried on two lines, its footprint's and its floor's (:func:`rank_memory`: what
its fullest moment must hold, the transients aside), and the memory is the largest of
them: for Llama-3-70B, the carried footprint of a pipeline's first stage fell 11-40% short
(the embedding's moment leads in the copies, the activations of the micro-batches in
flight at full depth), the floor 0.9-1.3%. A rank of several stages (interleaved 1F1B) is
no such maximum: its footprint adds its stages' largest activation peak to their largest
layer buffers, taken at different moments, which can trade places with the depth, so its
carried memory can also exceed the full model's (+2.3% and +3.9% for ZeRO-1 with full
recompute). A search prices its fastest plans again at full depth
(:mod:`torchroof.planning.search`, ``confirm``). A step that checkpoints every Nth layer
only, or a quantised one, is priced whole (:func:`priced_from_copies`), as is a pipeline
whose stages hold fewer than :data:`STAGE_DEEP` layers (:data:`STAGE_LEAST` under
interleaved 1F1B whose ranks hold :data:`STAGE_DEEP`: its copies' stages are the same
ranks' 1F1B copies' ones, traced once in a search).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from torchroof.capture.layer_calls import INDEX_ATTRIBUTES, structure_key
from torchroof.config import PricingOptions
from torchroof.config.choices import SPLIT_BACKWARD, schedule_stages_per_rank
from torchroof.config.errors import first_line
from torchroof.models.sources import build_model, text_config
from torchroof.parallel.stages import decoder_layers
from torchroof.planning.layouts import TrainingLayout
from torchroof.prepared import prepare
from torchroof.report.compare import point_metrics
from torchroof.report.estimate import Estimate
from torchroof.workloads.microbatches import held_once

SHALLOW = (2, 3)
"""Decoder layers of the two shallow copies: with 1 and 2, the memory carried for
Llama-3-70B at FSDP 16 x TP 8 x CP 2 on 256 GPUs fell 5.6% short of the full model's (its
largest moment changes between them); with 2 and 3 it was exact."""

CARRIED = (
    "step_time_s",
    "exposed_communication_s",
    "weight_bytes",
    "kv_bytes",
    "activation_bytes",
)
"""Figures carried along the line as they are (seconds and bytes of the step); the memory is
carried rank by rank (:func:`rank_memory`)."""


DEEP = 12
"""Decoder layers from which a model is priced from its copies, about where they break even
for a small model (nine layouts of a 12-layer Llama of d = 128: 8.5 s from copies, 7.4 s
whole; a 6-layer one: 190 s against 170 s for 138 layouts); Llama-3-70B's 80 layers cost
about ten times as much whole as from its copies."""

STAGE_DEEP = 8
"""Layers a pipeline stage holds from which a pipelined layout is priced from copies (of 2
and 3 layers a stage): each distinct stage is traced once either way, so the copies gain
where a stage holds several times their layers. Llama-3-70B at pp 8 (10 layers a stage):
2.1-2.6 s from copies, 3.7 s whole (break-even near 6 layers a stage); at pp 2 (40 a
stage): 1.3 s against 6.6 s."""

STAGE_LEAST = 4
"""Layers each stage of a schedule with several stages a rank (interleaved 1F1B) holds at
least to be priced from copies where its ranks hold :data:`STAGE_DEEP` layers or more: its
copies run the stage programs of the same ranks' 1F1B copies (2 and 3 layers a stage),
which a search prices beside it and traces once
(:mod:`torchroof.parallel.pipeline.shared`). Alone, such copies cost more than the layout
whole (Llama-3-70B at pp 8 interleaved, 5 layers a stage: 4.1 s from copies, 2.5 s whole;
beside 1F1B, the 0.3 s of pricing); carried, its step time agreed to 1e-14 and its memory
within -0.9% to +3.9% for three such layouts on 256 GPUs."""


def step_priced_whole(layers: int | None, workload: dict[str, Any], offload: int = 0) -> str | None:
    """Why every layout of a ``layers``-layer model's step with the other ``workload``
    fields is priced whole (one line), or None: a model under :data:`DEEP` layers; a
    quantised step (its MFU is over the peak of the dtype with the most FLOPs, which can
    change with the depth: the LM head stays in bf16 under fp8); a step that checkpoints
    every Nth layer only (its figures step with the layers' parity, not along a line); one
    priced with ``offload`` layers' activations offloaded (a copy may hold fewer, and what
    a forward keeps for its backward is then no floor of its memory)."""
    if not isinstance(layers, int) or layers < DEEP:
        return f"a model of fewer than {DEEP} layers costs about what copies of 2 and 3 would"
    if workload.get("quant", "none") != "none":
        return "a quantised step (its MFU's peak can change with the depth)"
    if workload.get("checkpoint_every", 1) != 1:
        return "a step that checkpoints every Nth layer only (its figures step with the parity)"
    if offload:
        return "a step that offloads activations (a copy may hold fewer layers than it offloads)"
    return None


def offloaded(pricing: PricingOptions | None, pricing_knobs: dict[str, Any]) -> int:
    """The decoder layers whose activations a search's pricing offloads (0 for a value
    that is no count of layers: pricing refuses it in its own words)."""
    given = pricing_knobs.get("offload_activations")
    if given is None and pricing is not None:
        given = pricing.offload_activations
    return given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else 0


def priced_from_copies(
    layers: int, layout: TrainingLayout, workload: dict[str, Any], offload: int = 0
) -> bool:
    """Whether ``layout`` of a ``layers``-layer model, with the step's other ``workload``
    fields and ``offload`` layers' activations offloaded, is priced from shallow copies:
    where :func:`step_priced_whole` finds no reason to price the step whole (and every
    layer runs alike, :func:`alike_layers`, which the search checks once), without a
    pipeline, or with one whose stages hold at least :data:`STAGE_DEEP` layers each (split
    as transformers splits them; no ``pp_split`` given), or, with several stages a rank
    whose backward is not split, whose ranks hold that many and stages
    :data:`STAGE_LEAST`."""
    if step_priced_whole(layers, workload, offload) is not None:
        return False
    stages = copy_stages(layout)
    if stages == 1:
        return True
    if "pp_split" in workload:
        return False
    if layers // stages >= STAGE_DEEP:
        return True
    several = stages > layout.pp and layout.pp_schedule not in SPLIT_BACKWARD
    return several and layers // layout.pp >= STAGE_DEEP and layers // stages >= STAGE_LEAST


def copy_stages(layout: TrainingLayout) -> int:
    """The pipeline stages of ``layout``'s step (1 without a pipeline)."""
    if layout.pp == 1:
        return 1
    return layout.pp * schedule_stages_per_rank(layout.pp_schedule, layout.virtual_stages)


def alike_layers(config: Any) -> str | None:
    """Why ``config``'s model cannot be priced from shallow copies (one line), or None
    where its decoder layers are all alike and a copy with fewer of them builds the same
    layer: same class, attributes and parameter shapes (built on meta, no memory)."""
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return "its config states no num_hidden_layers"
    full = _decoder_layers(config, layers)
    if isinstance(full, str):
        return full
    if len({structure_key(layer) for layer in full}) > 1:
        return "its decoder layers are not all alike"
    for depth in SHALLOW:
        copied = _decoder_layers(shallow_config(config, depth), depth)
        if isinstance(copied, str) or {_plain_key(x) for x in copied} != {_plain_key(full[0])}:
            return f"a copy of it with {depth} layers builds other layers"
    return None


def _decoder_layers(config: Any, layers: int) -> list[torch.nn.Module] | str:
    """The ``layers`` decoder layers of ``config``'s model built on meta, or why they are
    not found (a model that does not build, no decoder-layer list, another count)."""
    try:
        with torch.device("meta"):
            model = build_model(config, torch.bfloat16)
        _, _, found = decoder_layers(model)
    except Exception as error:  # noqa: BLE001 - any refusal: the model is priced whole
        return first_line(error)
    if len(found) != layers:
        return f"its decoder-layer list holds {len(found)} layers, not {layers}"
    return list(found)


def _plain_key(layer: torch.nn.Module) -> tuple[Any, ...]:
    """A layer as two models' layers compare: every submodule's class and plain attributes
    (not its index), every parameter's shape and dtype."""
    modules = tuple(
        (
            name,
            type(module).__name__,
            tuple(
                (attr, value)
                for attr, value in sorted(vars(module).items())
                if isinstance(value, (bool, int, float, str, type(None)))
                and attr not in INDEX_ATTRIBUTES
            ),
        )
        for name, module in layer.named_modules()
    )
    parameters = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
    return modules, parameters


def shallow_config(config: Any, layers: int) -> Any:
    """A copy of ``config`` with ``layers`` decoder layers: its layer count, and each
    per-layer list (one entry a layer, all alike: ``layer_types``) cut to it; a list of
    the full length whose entries differ (token ids) is not per-layer and is kept."""
    copied = copy.deepcopy(config)
    text = text_config(copied)
    full = text.num_hidden_layers
    for name, value in list(vars(text).items()):
        if (
            isinstance(value, (list, tuple))
            and len(value) == full > layers
            and all(entry == value[0] for entry in value)
        ):
            setattr(text, name, type(value)(value[:layers]))
    text.num_hidden_layers = layers
    return copied


def shallow_metrics(
    config: Any,
    layout: TrainingLayout,
    seq: int,
    hardware: Any,
    workload: dict[str, Any],
    pricing: PricingOptions | None,
    pricing_knobs: dict[str, Any],
) -> dict[str, Any] | None:
    """``layout``'s figures (:func:`~torchroof.report.compare.point_metrics`'s) carried
    from its model's two shallow copies to its full depth (see the module), with
    ``shallow``: the copies' layers; None where a pipeline's copies find its slowest rank
    in different places (the figures read off it would join two ranks: priced whole)."""
    stages = copy_stages(layout)
    # L = q x stages + r layers: the first r stages hold q + 1 (torchroof.parallel.stages.
    # split_layers), so copies of k x stages + r layers hold k + 1 and k, one more a stage
    # with each k
    whole, extra = divmod(text_config(config).num_hidden_layers, stages)
    priced = []
    with held_once():  # the deeper copy trusts the shallower one's third micro-batch
        for layers in SHALLOW:
            prepared = prepare(
                shallow_config(config, layers * stages + extra),
                "train",
                seq=seq,
                **workload,
                **layout.knobs(),
            )
            priced.append(prepared.price(hardware, pricing=pricing, **pricing_knobs))
    if len({e.pipeline.slowest_rank for e in priced if e.pipeline is not None}) > 1:
        return None
    low, high = (point_metrics(e) for e in priced)
    steps = whole - SHALLOW[1]

    def carry(name: str) -> Any:
        return high[name] + steps * (high[name] - low[name])

    out = dict(high)
    for name in CARRIED:
        out[name] = carry(name)
    lines = [rank_memory(e) for e in priced]  # each rank's (footprint, floor), per copy
    out["memory_bytes"] = max(
        lines[1][rank][i] + steps * (lines[1][rank][i] - lines[0][rank][i])
        for rank in lines[1]
        for i in (0, 1)
    )
    time = out["step_time_s"]
    tokens = high["tokens_per_s"] * high["step_time_s"]  # the step's, at any depth
    out["tokens_per_s"] = tokens / time
    # per GPU of a replica's pp x tp x cp (analysis.tokens_per_s_per_gpu): the same ratio
    out["tokens_per_s_per_gpu"] = high["tokens_per_s_per_gpu"] * high["step_time_s"] / time
    flops_time = high["mfu"] * high["step_time_s"]  # the step's FLOPs over the peak
    out["mfu"] = (flops_time + steps * (flops_time - low["mfu"] * low["step_time_s"])) / time
    capacity = priced[1].memory.capacity_bytes if priced[1].memory else None
    out["fits"] = out["memory_bytes"] <= capacity if capacity is not None else high["fits"]
    out["shallow"] = [layers * stages + extra for layers in SHALLOW]
    return out


def rank_memory(estimate: Estimate) -> dict[int, tuple[int, int]]:
    """Each rank's (footprint, floor) in ``estimate``: the bytes of its fullest moment,
    and what that moment holds at least (weights, gradients, optimizer state, KV cache and
    the activations kept for the backward of each micro-batch in flight); rank 0's alone
    without a pipeline."""
    step = estimate.pipeline
    if step is not None:
        return {r.rank: (r.memory_bytes, r.floor_bytes) for r in step.ranks}
    memory = estimate.memory
    if memory is None:
        return {0: (0, 0)}
    return {0: (memory.total_bytes, memory.floor_bytes(memory.backward_saved_bytes))}

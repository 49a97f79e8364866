"""A training layout without a pipeline priced from two shallow copies of its model, for a
search that prices hundreds of layouts.

A model whose decoder layers are all alike (one class, the same attributes and parameter
shapes: Llama, Qwen, Mistral) trains a step in which each layer adds the same kernels on
the same streams, the same traffic and the same bytes kept: the step's figures are affine
in its layers. Rank 0 of a layout without a pipeline runs every layer, so its trace grows
with the model (Llama-3-70B's 80 layers, each run on meta where sequence parallel's
activations keep its layers from being copied); it is priced instead on copies of the
model with 2 and 3 layers, each traced and priced as :func:`torchroof.estimate` would,
and every figure f carried to the model's L layers along the line through them:
f(L) = f(3) + (L - 3) x (f(3) - f(2)). MFU is carried as MFU x step time (the step's
FLOPs over the peak: affine); tokens/s is the step's tokens over the carried time.

The step time, traffic, exposed communication and memory carried so equal the full
model's to about 1e-13 for Llama-3-70B on 256 GPUs (FSDP with and without sequence
parallel, FSDP with context parallel, DDP with ZeRO-1 and full recompute); on four layouts
of a 12-layer model in the tests, the times to 1e-6, the weights' traffic and the memory
exactly, the activations' traffic to 1e-3 (context parallel's ring moves a few bytes more
or less with the depth). The memory peak is the largest of several
moments of the step (the end of the forward, the loss), each affine in the layers, so the
line through two shallow depths lies below it at L where the largest moment changes
between them and L (a maximum of lines lies above its chords beyond them): a search prices
its fastest plans again at full depth (:mod:`torchroof.planning.search`, ``confirm``). A
step that checkpoints every Nth layer only, or a quantised one, is priced whole
(:func:`priced_from_copies`), as is a pipelined layout: each distinct stage is traced once,
holding L / pp layers, which costs about what the copies would.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from torchroof.capture.layer_calls import INDEX_ATTRIBUTES, structure_key
from torchroof.config import PricingOptions
from torchroof.config.errors import first_line
from torchroof.models.sources import build_model, text_config
from torchroof.parallel.stages import decoder_layers
from torchroof.planning.layouts import TrainingLayout
from torchroof.prepared import prepare
from torchroof.report.compare import point_metrics

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
    "memory_bytes",
)
"""Figures carried along the line as they are (seconds and bytes of the step)."""


DEEP = 12
"""Decoder layers from which a model is priced from its copies, about where they break even
for a small model (nine layouts of a 12-layer Llama of d = 128: 8.5 s from copies, 7.4 s
whole; a 6-layer one: 190 s against 170 s for 138 layouts); Llama-3-70B's 80 layers cost
about ten times as much whole as from its copies."""


def step_priced_whole(layers: int | None, workload: dict[str, Any]) -> str | None:
    """Why every layout of a ``layers``-layer model's step with the other ``workload``
    fields is priced whole (one line), or None: a model under :data:`DEEP` layers; a
    quantised step (its MFU is over the peak of the dtype with the most FLOPs, which can
    change with the depth: the LM head stays in bf16 under fp8); a step that checkpoints
    every Nth layer only (its figures step with the layers' parity, not along a line)."""
    if not isinstance(layers, int) or layers < DEEP:
        return f"a model of fewer than {DEEP} layers costs about what copies of 2 and 3 would"
    if workload.get("quant", "none") != "none":
        return "a quantised step (its MFU's peak can change with the depth)"
    if workload.get("checkpoint_every", 1) != 1:
        return "a step that checkpoints every Nth layer only (its figures step with the parity)"
    return None


def priced_from_copies(layers: int, layout: TrainingLayout, workload: dict[str, Any]) -> bool:
    """Whether ``layout`` of a ``layers``-layer model, with the step's other ``workload``
    fields, is priced from shallow copies: without a pipeline, where
    :func:`step_priced_whole` finds no reason to price the step whole (and every layer
    runs alike, :func:`alike_layers`, which the search checks once)."""
    return layout.pp == 1 and step_priced_whole(layers, workload) is None


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
) -> dict[str, Any]:
    """``layout``'s figures (:func:`~torchroof.report.compare.point_metrics`'s) carried
    from its model's two shallow copies to its full depth (see the module), with
    ``shallow``: the copies' layers."""
    priced = []
    for layers in SHALLOW:
        prepared = prepare(
            shallow_config(config, layers), "train", seq=seq, **workload, **layout.knobs()
        )
        estimate = prepared.price(hardware, pricing=pricing, **pricing_knobs)
        capacity = estimate.memory.capacity_bytes if estimate.memory else None
        priced.append(point_metrics(estimate))
    low, high = priced
    steps = text_config(config).num_hidden_layers - SHALLOW[1]

    def carry(name: str) -> Any:
        return high[name] + steps * (high[name] - low[name])

    out = dict(high)
    for name in CARRIED:
        out[name] = carry(name)
    time = out["step_time_s"]
    tokens = high["tokens_per_s"] * high["step_time_s"]  # the step's, at any depth
    out["tokens_per_s"] = tokens / time
    # per GPU of a replica's pp x tp x cp (analysis.tokens_per_s_per_gpu): the same ratio
    out["tokens_per_s_per_gpu"] = high["tokens_per_s_per_gpu"] * high["step_time_s"] / time
    flops_time = high["mfu"] * high["step_time_s"]  # the step's FLOPs over the peak
    out["mfu"] = (flops_time + steps * (flops_time - low["mfu"] * low["step_time_s"])) / time
    out["fits"] = out["memory_bytes"] <= capacity if capacity is not None else high["fits"]
    out["shallow"] = list(SHALLOW)
    return out

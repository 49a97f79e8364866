"""A lower bound on what one GPU holds under a training layout, known before anything is
traced: a layout whose bound already exceeds the GPU's memory cannot fit, and is left out
before it is priced.

Rank 0 holds the decoder layers of its pipeline stages: under a split of L layers into
p x v stages (the remainder to the first stages, as transformers and torchtitan split),
at least v x floor(L / (p x v)) of them, each parameter split at most tp x fsdp x cp ways
(FSDP shards over the data and context ranks together, as torchtitan's ``dp_shard_cp``;
x ep for a MoE's experts, counted as if every parameter were an expert's: a bound from
below).
Per parameter it keeps at least its weights (fp32 masters under mixed precision, else the
precision's width; Micikevicius et al. 2018, "Mixed Precision Training") and, for Adam
and SGD with momentum, the optimizer's moments (fp32 under mixed precision; torch.optim
keeps them in the parameters' dtype), sharded over fsdp, and from ZeRO stage 1 on over
the replicas too, the masters with them (Rajbhandari et al. 2020, "ZeRO"). Embeddings, norms
outside the layers, gradients, activations and buffers are left out: each only adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchroof.config.errors import OptionError
from torchroof.models.sources import build_model
from torchroof.planning.layouts import TrainingLayout
from torchroof.workloads.train import FUSED_OPTIMIZERS

PRECISION_BYTES = {"mixed": 4, "fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes a parameter's kept weights take per precision (mixed keeps fp32 masters)."""


@dataclass(frozen=True)
class LayerParameters:
    """The parameters of a model's decoder layers: how many layers, how many in all."""

    layers: int
    parameters: int


def layer_parameters(config: Any) -> LayerParameters:
    """Count the parameters of ``config``'s decoder layers on the meta device (no memory):
    every parameter under a numbered module (``model.layers.7``)."""
    with torch.device("meta"):
        model = build_model(config, torch.bfloat16)
    numbered = 0
    indices: set[str] = set()
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        digits = [i for i, part in enumerate(parts) if part.isdigit()]
        if digits:
            numbered += parameter.numel()
            indices.add(".".join(parts[: digits[0] + 1]))
    return LayerParameters(len(indices), numbered)


def memory_floor(
    layout: TrainingLayout,
    counts: LayerParameters,
    precision: str = "mixed",
    optimizer: str = "adamw",
) -> int:
    """Bytes rank 0 holds at least under ``layout`` (weights and optimizer moments of its
    decoder layers; see the module)."""
    if not counts.layers:
        return 0
    stages = layout.pp * layout.virtual_stages
    held = layout.virtual_stages * (counts.layers // stages)
    split = layout.tp * layout.fsdp * layout.cp * layout.ep  # FSDP shards over fsdp x cp
    parameters = counts.parameters * held // counts.layers // split
    width = PRECISION_BYTES.get(precision)
    if width is None:
        raise OptionError(f"unknown precision {precision!r} (known: {', '.join(PRECISION_BYTES)})")
    replicas = layout.dp if layout.zero >= 1 else 1  # ZeRO shards optimizer state over them
    # mixed precision's fp32 masters are optimizer state (ZeRO shards them); otherwise the
    # parameters themselves, whole on every replica
    weights = width * parameters // replicas if precision == "mixed" else width * parameters
    fused = FUSED_OPTIMIZERS.get(optimizer)
    moments = 0
    if fused is not None and not fused.eight_bit and fused.moment_dtype is None:
        moments = fused.moments * width * parameters // replicas
    return weights + moments

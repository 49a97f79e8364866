"""Decode: one new token for each of B sequences against a cache already holding
``context`` tokens (decode is a memory workload, Pope et al. 2022: the weights and the
whole cache are read once per step)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchroof.capture.symbolic import step_size
from torchroof.models.sources import model_dtype
from torchroof.records.trace import Trace
from torchroof.records.units import gib
from torchroof.workloads.decode_figures import decode_analysis
from torchroof.workloads.inference import inference_step, kv_label
from torchroof.workloads.inputs import context_of, kv_shape, model_config
from torchroof.workloads.parallel_step import plan_label
from torchroof.workloads.spec import TARGET, Regime

if TYPE_CHECKING:
    from torchroof.config import Workload


def trace_decode(models: Mapping[str, torch.nn.Module], workload: Workload) -> Trace:
    """One new token for each of B sequences against a cache already holding N tokens."""
    model = models[TARGET]
    model.eval()
    return inference_step(model, workload, new=1, filled=step_size("context", context_of(workload)))


def label(model: str, w: Workload) -> str:
    label = f"{model} decode, batch {w.batch}, context {w.context}, {w.cache} cache, {w.dtype}"
    return label + kv_label(w) + plan_label(w)


def sweep_summary(result: Any, over: str, w: Workload) -> list[str]:
    """Over batch, where the weight GEMMs reach the ridge and where KV reads overtake the
    weight reads (docs/concepts/attention-kv.md)."""
    if over != "batch":
        return []
    return [
        f"B* (weight GEMMs reach the ridge): {result.ridge_batch:.0f}; "
        f"KV reads overtake weight reads at batch {result.kv_crossover_batch:.0f} "
        f"(context {w.context})"
    ]


def summary(est: Any) -> list[str]:
    """What the step reads per token generated, and where batching stops paying (the KV
    crossover, docs/concepts/attention-kv.md)."""
    decode = decode_analysis(est)
    return [
        f"decode: weights read {decode.weight_bytes_read / 1e9:.2f} GB, KV read "
        f"{decode.kv_bytes_read / 1e9:.3f} GB per step ({decode.cache} cache); "
        f"KV reads overtake weight reads at batch {decode.kv_crossover_batch:.0f}"
    ]


def memory_summary(est: Any) -> list[str]:
    """The largest batch that fits, or, where the weights (and what else does not grow with
    the batch) alone do not fit, that and by how much."""
    memory = est.memory
    if memory is not None and memory.fixed_bytes >= memory.capacity_bytes:
        fixed_only = memory.fixed_bytes == memory.weights_bytes
        what = "the weights alone" if fixed_only else "the weights and FSDP's buffers alone"
        short = memory.fixed_bytes - memory.capacity_bytes
        return [
            f"no decode batch fits: {what} ({gib(memory.fixed_bytes)}) do not fit in "
            f"{gib(memory.capacity_bytes)}: {gib(short)} short"
        ]
    decode = decode_analysis(est)
    return [f"largest decode batch that fits at context {decode.context}: {decode.max_batch}"]


def real_step(
    model: torch.nn.Module, workload: Workload, device: str, steps: int
) -> Callable[[], None]:
    """One token per call appended to a static cache already holding ``context`` tokens,
    sized for ``steps`` calls."""
    from transformers import StaticCache

    batch, context = workload.batch, context_of(workload)
    model.eval()
    kv_heads, head_dim = kv_shape(model)
    dtype = next(model.parameters()).dtype
    cache = StaticCache(config=model_config(model), max_cache_len=context + steps)
    cache.early_initialization(batch, kv_heads, head_dim, dtype, torch.device(device))
    # a static cache's layers (transformers types them as every kind a cache may hold)
    layers: list[Any] = list(cache.layers)
    for layer in layers:  # the cache already holds `context` tokens
        layer.cumulative_length.fill_(context)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    position = torch.full((batch, 1), context, device=device)

    def decode() -> None:
        with torch.no_grad():
            model(ids, cache=cache, position_ids=position, use_cache=True, logits_to_keep=1)

    return decode


REGIME = Regime(
    name="decode",
    help="one token for each of B sequences against a cache of context tokens",
    trace=trace_decode,
    tokens=lambda w: w.batch,
    # the cache holds ``context`` tokens, at most the model's maximum; the step's one new
    # token, at index ``context``, may go one past it (priced, with a note saying so)
    positions=context_of,
    new_positions=1,
    knobs=("cache", "mla"),  # the cache it decodes against; latent attention's form
    compute_dtype=lambda w: model_dtype(w.dtype),
    label=label,
    real_step=real_step,
    summary=summary,
    memory_summary=memory_summary,
    sweep_summary=sweep_summary,
    batching=True,
)

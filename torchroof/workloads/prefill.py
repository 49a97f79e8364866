"""Prefill: B sequences of ``seq`` tokens through the model, writing their K/V into the
cache a generation then decodes against (prefill and decode: Pope et al. 2022)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from torchroof.capture.symbolic import step_size
from torchroof.models.sources import model_dtype
from torchroof.records.trace import Trace
from torchroof.workloads.inference import inference_step, kv_label
from torchroof.workloads.inputs import random_ids, seq_of
from torchroof.workloads.parallel_step import plan_label
from torchroof.workloads.spec import TARGET, Regime

if TYPE_CHECKING:
    from torchroof.config import Workload


def trace_prefill(models: Mapping[str, torch.nn.Module], workload: Workload) -> Trace:
    """B sequences of T tokens, writing their K/V into the cache."""
    model = models[TARGET]
    model.eval()
    return inference_step(model, workload, new=step_size("seq", seq_of(workload)), filled=0)


def label(model: str, w: Workload) -> str:
    label = f"{model} prefill, batch {w.batch} x {w.seq} tokens, {w.dtype}"
    return label + kv_label(w) + plan_label(w)


def real_step(
    model: torch.nn.Module, workload: Workload, device: str, steps: int
) -> Callable[[], None]:
    """The prefill forward on a real device, logits of the last token only."""
    ids = random_ids(model, workload.batch, seq_of(workload), device)
    model.eval()

    def prefill() -> None:
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)

    return prefill


REGIME = Regime(
    name="prefill",
    help="B x seq tokens through the model, writing the KV cache",
    trace=trace_prefill,
    tokens=lambda w: w.batch * seq_of(w),
    knobs=("cache",),  # the cache it writes
    positions=seq_of,
    compute_dtype=lambda w: model_dtype(w.dtype),
    label=label,
    real_step=real_step,
)

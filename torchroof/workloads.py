"""Drive a model through a step under capture.

Issue 2 ships the prefill forward; decode and training steps build on the same capture.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from torchroof.capture import trace
from torchroof.records import Trace


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def trace_prefill(model: torch.nn.Module, batch: int, seq: int) -> Trace:
    """B sequences of T tokens through the model, under ``no_grad``, last-token logits only
    (what generation needs) when the model supports ``logits_to_keep``."""
    _check_positive(batch=batch, seq=seq)
    device = next(model.parameters()).device
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    kwargs: dict[str, Any] = {"use_cache": False}
    params = inspect.signature(model.forward).parameters
    last_logits = "logits_to_keep" in params
    if last_logits:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad(), trace() as recorded:
        model(ids, **kwargs)
    recorded.metadata.update(
        {"workload": "prefill", "batch": batch, "seq": seq, "last_token_logits": last_logits}
    )
    return recorded

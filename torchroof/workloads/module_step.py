"""A plain ``nn.Module`` (no transformers config) driven on inputs the caller gives: its
forward (``prefill``), or a training step: the forward, a loss, the real autograd backward
and the workload's optimizer step, priced as :mod:`torchroof.workloads.train` prices a
causal LM's (the same fused kernel, fp32 masters and gradients when mixed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchroof.capture.mode import Capture
from torchroof.config.errors import WorkloadError
from torchroof.records.trace import Trace
from torchroof.workloads.train import train_module

if TYPE_CHECKING:
    from torchroof.config import Workload

# The regimes a plain module runs, and why decode is not one of them.
MODULE_REGIMES = ("prefill", "train")
NO_DECODE = (
    "decode needs a model with a KV cache (a transformers causal LM); a plain nn.Module "
    "runs prefill (its forward on the inputs given) or train"
)


def module_loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """``loss_fn(output)``; without one, the output if it is a scalar, else its sum (the
    first tensor of a tuple or a model output with ``.loss`` / ``.logits``)."""
    if loss_fn is not None:
        return loss_fn(output)
    for name in ("loss", "logits"):
        found = getattr(output, name, None)
        if isinstance(found, torch.Tensor):
            output = found
            break
    if isinstance(output, (tuple, list)):
        output = next((t for t in output if isinstance(t, torch.Tensor)), None)
    if not isinstance(output, torch.Tensor):
        raise WorkloadError(
            f"the module returned {type(output).__name__}, not a tensor: pass loss_fn= to "
            "turn its output into the loss"
        )
    return output if output.dim() == 0 else output.sum()


def trace_module_step(
    module: torch.nn.Module,
    inputs: Sequence[Any],
    workload: Workload,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Trace:
    """One step of ``module`` (on meta) on ``inputs`` (on meta): ``prefill`` is the forward
    under ``no_grad``; ``train`` the forward, the loss, backward and the optimizer step."""
    if workload.regime not in MODULE_REGIMES:
        raise WorkloadError(NO_DECODE)
    if workload.regime == "prefill":
        module.eval()
        with Capture() as trace, torch.no_grad():
            module(*inputs)
        return trace
    return train_module(module, lambda: module_loss(module(*inputs), loss_fn), workload)

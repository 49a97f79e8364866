"""Context parallel: each rank runs its share of the sequence, with torch's ring attention."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchroof.parallel.strategy import Strategy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from torchroof.config import Workload

CONTEXT_PARALLEL_ATTENTION = "torchroof_context_parallel"
"""The transformers attention implementation :func:`apply_context_parallel` registers."""
# Forward arguments of a transformers causal LM that run along the sequence (dim 1).
SEQUENCE_ARGUMENTS = ("input_ids", "position_ids", "labels", "inputs_embeds")


class ContextParallelError(ValueError):
    """A step that context parallel cannot run (raised while the step runs)."""


@contextlib.contextmanager
def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> Iterator[nn.Module]:
    """For the block, run ``model`` as one rank of context parallel over ``cp_mesh``, with
    torch's own ring attention (``torch.distributed.tensor.experimental``'s
    ``_context_parallel``), as torchtitan does for long sequences:

    - each forward's sequence arguments (:data:`SEQUENCE_ARGUMENTS`; position ids made for
      the whole sequence when not given) are sharded along the sequence by torch's
      ``_context_parallel_shard`` with its head-tail load balancer (rank r holds chunks r
      and 2·cp - 1 - r of 2·cp), so every layer runs on T/cp tokens;
    - attention (a transformers attention function registered as
      :data:`CONTEXT_PARALLEL_ATTENTION`) calls ``aten._scaled_dot_product_flash_attention``
      on the rank's q, k, v as sequence-sharded DTensors, which torch's context-parallel
      dispatcher runs as ring attention: the local causal block, then for each other rank's
      K/V a non-causal block (half the queries or half the keys, load-balanced), merged by
      log-sum-exp. K and V travel as torch's default rotater sends them: one
      ``all_gather_into_tensor`` of the rank's concatenated K and V per layer forward; the
      backward gathers them again and passes dK, dV round the ring with ``cp``
      ``all_to_all_single`` permutations (fp32). Capture records these as collectives on
      the cp group.

    transformers builds no mask for a registered attention function: the ring is causal
    by construction. Refused (:class:`ContextParallelError`): a sequence that does not
    split into 2·cp equal chunks, an attention mask, sliding windows, soft-capping, a
    non-causal model. The model is restored on exit. A group of one leaves it alone."""
    size = cp_mesh.size()
    if size == 1:
        yield model
        return
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from transformers import AttentionInterface

    if not hasattr(model, "set_attn_implementation"):
        raise ContextParallelError(
            f"{type(model).__name__} is not a transformers PreTrainedModel: context parallel "
            "replaces its attention through transformers' AttentionInterface"
        )

    def ring_attention(
        module: nn.Module,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        check_ring_attention(module, attention_mask, kwargs, tokens=size * query.shape[2])
        if key.shape[2] != query.shape[2]:
            raise ContextParallelError(
                f"ring attention attends the rank's {query.shape[2]} queries to its own as "
                f"many keys; {key.shape[2]} came (a cache holding other tokens)"
            )
        return _ring_attention(cp_mesh, query, key, value, scaling, dropout), None

    def shard_sequence(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return _shard_sequence(cp_mesh, model, args, kwargs)

    AttentionInterface.register(CONTEXT_PARALLEL_ATTENTION, ring_attention)
    hf = cast("PreTrainedModel", model)  # it has set_attn_implementation
    previous = hf.config._attn_implementation
    hf.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)
    hook = model.register_forward_pre_hook(shard_sequence, with_kwargs=True)
    # torch keeps these as module globals; _context_parallel_shard sets both
    saved = (ring._cp_options.enable_load_balance, ring._dispatch_mode)
    ring._enable_context_parallel_dispatcher()
    try:
        yield model
    finally:
        ring._disable_context_parallel_dispatcher()
        ring._cp_options.enable_load_balance, ring._dispatch_mode = saved
        hook.remove()
        hf.set_attn_implementation(previous)


def check_ring_attention(
    module: nn.Module, attention_mask: Any, kwargs: dict[str, Any], tokens: int
) -> None:
    """Refuse what torch's load-balanced ring attention does not compute: a mask (padding,
    packed documents), a sliding window shorter than the sequence's ``tokens``, logit
    soft-capping, a non-causal layer."""
    name = type(module).__name__
    if attention_mask is not None:
        raise ContextParallelError(
            f"{name}: context parallel's ring attention is causal over whole sequences; it "
            "takes no attention mask (padding or packed documents)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < tokens:
        raise ContextParallelError(
            f"{name} attends within a sliding window of {window} tokens, shorter than the "
            f"{tokens}-token sequence: torch's ring attention has no window"
        )
    if kwargs.get("softcap") is not None:
        raise ContextParallelError(
            f"{name} soft-caps its logits (softcap={kwargs['softcap']}): torch's ring "
            "attention does not"
        )
    if getattr(module, "is_causal", True) is False:
        raise ContextParallelError(
            f"{name} is not causal: torch's load-balanced ring attention is causal only"
        )


def _ring_attention(
    cp_mesh: DeviceMesh, query: Any, key: Any, value: Any, scale: float | None, dropout: float
) -> Any:
    """Flash attention on the rank's (B, H, T/cp, d) q and (B, H_kv, T/cp, d) k, v as
    DTensors sharded along the sequence: torch's context-parallel dispatcher runs the ring.
    Returns the rank's output as (B, T/cp, H, d), as transformers' attention functions do."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = [
        DTensor.from_local(t, cp_mesh, [Shard(2)], run_check=False) for t in (query, key, value)
    ]
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    out = flash(*sharded, dropout, True, False, scale=scale)[0]
    return out.to_local().transpose(1, 2)


def _shard_sequence(
    cp_mesh: DeviceMesh, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's arguments with each of :data:`SEQUENCE_ARGUMENTS` replaced by this
    rank's load-balanced shard (torch's ``_context_parallel_shard`` with its head-tail
    balancer); position ids for the whole sequence are made first when not given (as
    torchtitan shards its RoPE table with the batch)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _context_parallel_shard,
        _HeadTailLoadBalancer,
    )

    values = dict(kwargs)
    if args:  # input_ids given by position
        values["input_ids"], args = args[0], args[1:]
    if values.get("attention_mask") is not None:
        raise ContextParallelError(
            "context parallel's ring attention takes no attention mask (padding or packed "
            "documents): pass none"
        )
    reference = values.get("input_ids")
    if reference is None:
        reference = values.get("inputs_embeds")
    if not isinstance(reference, torch.Tensor) or reference.dim() < 2:
        raise ContextParallelError(
            "context parallel needs input_ids or inputs_embeds of (B, T, ...)"
        )
    batch, length = reference.shape[:2]
    size = cp_mesh.size()
    if length % (2 * size):
        raise ContextParallelError(
            f"context parallel splits each sequence into 2 x cp = {2 * size} equal chunks "
            f"(torch's head-tail load balancing); {length} tokens do not divide"
        )
    if values.get("position_ids") is None and "position_ids" in _forward_parameters(model):
        positions = torch.arange(length, device=reference.device)
        values["position_ids"] = positions.unsqueeze(0).expand(batch, -1)
    names = [n for n in SEQUENCE_ARGUMENTS if isinstance(values.get(n), torch.Tensor)]
    balancer = _HeadTailLoadBalancer(length, size, reference.device)
    shards = _context_parallel_shard(
        cp_mesh, [values[n] for n in names], [1] * len(names), balancer
    )
    values.update(zip(names, shards, strict=True))
    return args, values


def _forward_parameters(model: nn.Module) -> Any:
    return inspect.signature(model.forward).parameters


def _apply(model: nn.Module, mesh: DeviceMesh, _workload: Workload) -> AbstractContextManager[Any]:
    """The step runs as one rank of the mesh's ``cp`` dimension: each forward on its
    load-balanced T/cp tokens, attention as torch's ring attention; one rank leaves it
    alone (:func:`apply_context_parallel`, entered with the step)."""
    return _ring_step(model, mesh)


@contextlib.contextmanager
def _ring_step(model: nn.Module, mesh: DeviceMesh) -> Iterator[nn.Module]:
    """:func:`apply_context_parallel` over ``mesh["cp"]``, the sub-mesh taken as the step
    begins (inside the contexts entered before it)."""
    with apply_context_parallel(model, mesh["cp"]) as ranked:
        yield ranked


STRATEGY = Strategy(name="context", apply=_apply)

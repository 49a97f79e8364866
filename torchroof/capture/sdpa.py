"""SDPA substitution: the fused attention kernel a GPU launches, in place of meta's math path.

Meta runs the math path (bmm + an S x S softmax); the record is the flash (or memory-efficient)
kernel, forward and backward.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch

from torchroof.capture.storage import StorageIds
from torchroof.records.ops import OpRecord, Phase
from torchroof.records.tensors import TensorMeta, TensorRef
from torchroof.records.trace import Trace

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


@dataclass
class SdpaGroup:
    """Autograd sequence interval of one SDPA call, so its backward can be replaced too."""

    first_seq: int
    end_seq: int
    forward: OpRecord
    # the same call re-run by activation checkpointing before its backward: the backward
    # reads the recomputed q, k, v, o and log-sum-exp (the forward's were not kept)
    recomputed: OpRecord | None = None
    backward_done: bool = False


class SdpaSubstitution:
    """Runs ``F.scaled_dot_product_attention`` unrecorded and records the flash (or, with a
    mask, memory-efficient) kernel instead; its backward likewise, once autograd reaches it.
    ``flash_gradients``: the storages the skipped math-path backward made (dq, dk, dv)."""

    def __init__(
        self,
        trace: Trace,
        storage: StorageIds,
        context: Callable[[], tuple[Phase, str, Any]],
        unrecorded: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._trace = trace
        self._storage = storage
        self._context = context
        self._unrecorded = unrecorded
        self._groups: list[SdpaGroup] = []
        self._group_starts: list[int] = []
        self.flash_gradients: set[int] = set()
        # selective checkpointing that saves attention's output (torchtitan's per-op policy):
        # a recomputed call is not a kernel, its output is the forward's
        self.keep_forward_outputs = False

    def __bool__(self) -> bool:
        """True once a call with a backward to replace was recorded."""
        return bool(self._groups)

    def run(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """Run SDPA (unrecorded) and record the fused kernel a GPU would launch instead.

        FlashAttention is an IO algorithm (Dao et al. 2022): S and P stay on chip, so the
        record is ``_scaled_dot_product_flash_attention`` (or ``_efficient_`` when a mask is
        given), with K/V at their own ``h_kv`` heads: no ``repeat_kv`` copies. K/V read from
        a quantised cache (fp8, int8) are recorded at their stored width: the kernel reads
        them at 1 B per element and dequantises in registers (vLLM's and TensorRT-LLM's fp8
        KV).
        """
        params = dict(zip(_SDPA_ARGS, args, strict=False))
        params.update(kwargs)
        context = self._context()
        first_seq = torch._C._autograd._get_sequence_nr()
        with self._unrecorded():
            wide_args, wide_kwargs = widened_kv(args, kwargs)
            out = func(*wide_args, **wide_kwargs)
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                # The flash kernel writes o as (B, L, H, d) in memory, so the caller's
                # ``o.transpose(1, 2).contiguous()`` is free on a GPU; give o that layout.
                out = out.transpose(1, 2).contiguous().transpose(1, 2)
        end_seq = torch._C._autograd._get_sequence_nr()
        phase, module, _ = context
        if phase == "recompute" and self.keep_forward_outputs:
            kept = self._recomputed_group(module)
            if kept is not None:  # the math path re-ran unrecorded, as autograd needs it
                # no kernel: the output and log-sum-exp are the forward's, kept; the
                # backward reads them with the recomputed q, k and v
                self._storage.bind(out, kept.forward.outputs[0].storage)
                again = self._forward_record(params, out, phase, module)
                kept.recomputed = replace(again, outputs=kept.forward.outputs)
                return out
        forward = self._forward_record(params, out, phase, module)
        self._trace.ops.append(forward)
        if phase == "recompute":
            self._attach_recompute(forward)
        if end_seq > first_seq and isinstance(out, torch.Tensor) and out.requires_grad:
            group = SdpaGroup(first_seq, end_seq, forward)
            self._group_starts.append(first_seq)
            self._groups.append(group)
            out.register_hook(lambda grad, group=group: self._backward(group, grad))
        return out

    def _forward_record(
        self, params: dict[str, Any], out: Any, phase: Phase, module: str
    ) -> OpRecord:
        query, key, value = params["query"], params["key"], params["value"]
        mask = params.get("attn_mask")
        batch_heads_q = tuple(query.shape[:-1])
        logsumexp = self._storage.synthetic_meta(batch_heads_q, torch.float32)
        common = {
            "dropout_p": float(params.get("dropout_p", 0.0)),
            "is_causal": bool(params.get("is_causal", False)),
            "scale": params.get("scale"),
        }
        tensors = [query, key, value] + ([mask] if mask is not None else [])
        inputs = [self._storage.tensor_meta(t) for t in tensors]
        refs = {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2)}
        if mask is None:
            name = "aten._scaled_dot_product_flash_attention.default"
        else:
            name = "aten._scaled_dot_product_efficient_attention.default"
            refs["attn_bias"] = TensorRef(3)
        return OpRecord(
            len(self._trace.ops),
            name,
            tuple(inputs),
            (self._storage.tensor_meta(out), logsumexp),
            {**refs, **common},
            module,
            phase,
            synthetic=True,
        )

    def _attach_recompute(self, recomputed: OpRecord) -> None:
        """Pair a recomputed SDPA call with the forward call it repeats: the latest one of
        the same module whose backward has not run (checkpointing recomputes a block just
        before its backward, in the forward's order)."""
        group = self._recomputed_group(recomputed.module)
        if group is not None:
            group.recomputed = recomputed

    def _recomputed_group(self, module: str) -> SdpaGroup | None:
        """The forward call of ``module`` a recompute repeats (see :meth:`_attach_recompute`)."""
        for group in reversed(self._groups):
            forward = group.forward
            if forward.module == module and forward.phase == "forward":
                if not group.backward_done and group.recomputed is None:
                    return group
        return None

    def group_of(self, node: Any) -> SdpaGroup | None:
        """The SDPA call whose math-path backward the autograd node ``node`` belongs to."""
        seq = node._sequence_nr()
        at = bisect.bisect_right(self._group_starts, seq) - 1
        if at >= 0 and seq < self._groups[at].end_seq:
            return self._groups[at]
        return None

    def _backward(self, group: SdpaGroup, grad: torch.Tensor) -> None:
        group.backward_done = True
        forward = group.recomputed or group.forward
        query, key, value = forward.inputs[:3]
        out, logsumexp = forward.outputs
        grad_meta = self._storage.tensor_meta(grad)
        dq, dk, dv = (
            self._storage.synthetic_meta(t.shape, getattr(torch, t.dtype))
            for t in forward.inputs[:3]
        )
        inputs: tuple[TensorMeta, ...] = (grad_meta, query, key, value, out, logsumexp)
        args: dict[str, Any] = {
            "grad_out": TensorRef(0),
            "query": TensorRef(1),
            "key": TensorRef(2),
            "value": TensorRef(3),
            "out": TensorRef(4),
            "logsumexp": TensorRef(5),
            "dropout_p": forward.args["dropout_p"],
            "is_causal": forward.args["is_causal"],
            "scale": forward.args["scale"],
        }
        if "attn_bias" in forward.args:
            name = "aten._scaled_dot_product_efficient_attention_backward.default"
            inputs = inputs + (forward.inputs[3],)
            args["attn_bias"] = TensorRef(6)
        else:
            name = "aten._scaled_dot_product_flash_attention_backward.default"
        self._trace.ops.append(
            OpRecord(
                len(self._trace.ops),
                name,
                inputs,
                (dq, dk, dv),
                args,
                forward.module,
                "backward",
                synthetic=True,
            )
        )


def widened_kv(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """SDPA's arguments with K/V stored narrower than the query (a quantised cache) cast to
    the query's dtype: torch's SDPA wants one dtype, the kernel being modelled dequantises
    in registers. Unchanged otherwise."""
    positional, named = list(args), dict(kwargs)
    dtype = (positional[0] if positional else named["query"]).dtype
    for position, name in ((1, "key"), (2, "value")):
        if name in named and named[name].dtype != dtype:
            named[name] = named[name].to(dtype)
        elif position < len(positional) and positional[position].dtype != dtype:
            positional[position] = positional[position].to(dtype)
    return tuple(positional), named

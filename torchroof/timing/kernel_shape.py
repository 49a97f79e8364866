"""The problem shape of one kernel, for the hierarchical roofline and realistic mode.

The HBM roofline needs only a kernel's totals (W, Q). The boundaries inside the chip and the
effects the roofline cannot see (docs/concepts/honest-numbers.md: wave
quantisation, too little in flight) need its geometry: how a GEMM's output splits into
tiles, how many query blocks an attention kernel runs, how many elements a streaming kernel
walks. This module reads that geometry off the kernel's lead op; nothing here is timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torchroof.counters import Cost, kind_of
from torchroof.counters.attention import (
    AttentionShape,
    attention_backward_flops,
    attention_forward_flops,
)
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import dtype_itemsize

ShapeKind = Literal["gemm", "attention", "stream"]

# FlashAttention (Dao et al. 2022): B_r = B_c = 128 query / key rows per block (the counters'
# figure); FlashAttention-3's consumer warpgroups each own 64 query rows.
ATTENTION_BLOCK_ROWS = 128
ATTENTION_WARPGROUP_ROWS = 64
# One CTA of a streaming (elementwise / reduction) kernel covers this many elements: 128
# threads x 8 elements, Inductor's usual XBLOCK of 1024.
STREAM_ELEMENTS_PER_CTA = 1024
# Tensor-core ops that are GEMMs but not declared "matmul" (they are "opaque" to fusion):
# scaled, integer, grouped and packed-weight GEMMs, matrix-vector products. A convolution
# is not one here (its implicit GEMM is not modelled): it streams.
GEMM_PACKETS = frozenset(
    {
        "aten._scaled_mm",
        "aten._int_mm",
        "aten._grouped_mm",
        "aten.mv",
        "aten.addmv",
        "torchroof.int4_weight_mm",
        "torchroof.mxfp4_weight_mm",
        "torchroof.nvfp4_mm",
        "torchroof.packed_grouped_mm",
    }
)


@dataclass(frozen=True)
class KernelShape:
    """Geometry of one kernel.

    gemm: ``batch`` independent (m x k) @ (k x n) products (k inferred from W = 2·b·m·n·k);
    attention: ``batch`` = batch x query heads, ``m`` query rows, ``n`` key rows, ``k`` head
    dim, ``kept`` the share of (query, key) pairs computed (causal < 1), ``backward``;
    stream: ``elements`` in its largest tensor (one pass, no tiles).
    """

    kind: ShapeKind
    itemsize: int  # bytes per operand element
    batch: int = 1
    m: int = 0
    n: int = 0
    k: int = 0
    elements: int = 0
    kept: float = 1.0
    backward: bool = False
    value_dim: int = 0  # attention: V's head dim (MLA's differs from the QK dim)
    kv_batch: int = 0  # attention: batch x K/V heads (GQA: fewer than ``batch``)


def _gemm(lead: OpRecord, cost: Cost) -> KernelShape | None:
    """(b, m, n, k) of a matmul-class op from its output and W = 2·b·m·n·k: true for mm,
    addmm, bmm, baddbmm, _scaled_mm, grouped and packed GEMMs alike."""
    if not lead.outputs or not cost.flops:
        return None
    out = lead.outputs[0].shape
    if len(out) < 2:
        m, n = 1, out[-1] if out else 1
        batch = 1
    else:
        m, n = out[-2], out[-1]
        batch = math.prod(out[:-2])
    if not m or not n:
        return None
    k = max(1, round(cost.flops / (2 * batch * m * n)))
    operands = [t for t in lead.inputs if len(t.shape) >= 2]
    itemsize = min((dtype_itemsize(t.dtype) for t in operands), default=2)
    return KernelShape("gemm", itemsize, batch=batch, m=m, n=n, k=k)


def _attention(lead: OpRecord, cost: Cost) -> KernelShape | None:
    q, k, v = lead.tensor("query"), lead.tensor("key"), lead.tensor("value")
    if q is None or k is None or v is None or len(q.shape) != 4:
        return None
    blhd = lead.name.startswith(("aten._flash_attention", "aten._efficient_attention"))
    shape = (AttentionShape.from_blhd if blhd else AttentionShape.from_bhld)(q, k, v)
    if not shape.pairs or not shape.heads:
        return None
    backward = "backward" in lead.name
    # the kept share of the (query, key) pairs follows from W against every pair's W
    full = (attention_backward_flops if backward else attention_forward_flops)(shape, False)
    kept = min(1.0, cost.flops / full) if full else 1.0
    kv_heads = k.shape[2] if blhd else k.shape[-3]
    return KernelShape(
        "attention",
        dtype_itemsize(q.dtype),
        batch=shape.batch * shape.heads,
        m=shape.q_len,
        n=shape.kv_len,
        k=shape.head_dim,
        kept=kept,
        backward=backward,
        value_dim=shape.value_dim,
        kv_batch=shape.batch * kv_heads,
    )


def kernel_shape(ops: tuple[OpRecord, ...], lead: OpRecord, cost: Cost) -> KernelShape:
    """The geometry of the kernel whose members are ``ops`` and whose lead op is ``lead``;
    a kernel on the tensor cores that is neither a GEMM nor attention by shape, and every
    vector kernel, streams its largest tensor once."""
    if cost.unit == "tensor":
        kind = kind_of(lead.packet)
        found = None
        if kind == "attention":
            found = _attention(lead, cost)
        elif kind == "matmul" or lead.packet in GEMM_PACKETS:
            found = _gemm(lead, cost)
        if found is not None:
            return found
    tensors = [t for op in ops for t in (*op.inputs, *op.outputs)]
    largest = max(tensors, key=lambda t: t.numel, default=None)
    if largest is None:
        return KernelShape("stream", 4, elements=0)
    return KernelShape("stream", dtype_itemsize(largest.dtype), elements=largest.numel)

"""Scaled dot-product attention kernels (flash, efficient, cuDNN, CPU flash, math).

Dao et al. 2022 (FlashAttention) and docs/concepts/attention-kv.md:
W = 4·N²·d per head (QKᵀ and PV, FMA = 2); the fused kernel's compulsory Q reads q, k, v
once and writes o (and the fp32 log-sum-exp) once; S and P never touch HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchroof.counters.cost import Cost
from torchroof.counters.registry import register
from torchroof.counters.tensors import tensor_arg, unique_bytes

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention call, in the (batch, heads, length, dim) convention."""

    batch: int
    heads: int  # query heads; K/V may have fewer (GQA), their bytes come from their own shape
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int

    @classmethod
    def from_bhld(cls, q: TensorMeta, k: TensorMeta, v: TensorMeta) -> AttentionShape:
        *batch, heads, q_len, head_dim = q.shape
        kv_len, value_dim = k.shape[-2], v.shape[-1]
        b = 1
        for size in batch:
            b *= size
        return cls(b, heads, q_len, kv_len, head_dim, value_dim)

    @classmethod
    def from_blhd(cls, q: TensorMeta, k: TensorMeta, v: TensorMeta) -> AttentionShape:
        """Layout of ``_flash_attention_forward`` / ``_efficient_attention_forward``."""
        b, q_len, heads, head_dim = q.shape
        return cls(b, heads, q_len, k.shape[1], head_dim, v.shape[-1])

    @property
    def pairs(self) -> int:
        """(query, key) score pairs per head."""
        return self.q_len * self.kv_len


def causal_fraction(q_len: int, kv_len: int, *, aligned_to_end: bool = False) -> float:
    """The exact share of (query, key) pairs a causal mask keeps, for every shape.

    Causal masking (Dao 2023, FlashAttention-2): restricting attention to the lower
    triangle halves W of the attention kernel, and the flash kernel skips the blocks the mask
    removes entirely. Here the pairs are counted exactly, one formula for every shape:
    query row i (0-based) keeps the keys j <= i + offset, that is min(max(i + 1 + offset,
    0), kv_len) of them. offset = 0 is what SDPA's ``is_causal`` means (PyTorch documents
    the mask ``tril(ones(q_len, kv_len))``, aligned to the top-left, and the efficient
    kernel's ``custom_mask_type`` 1); offset = kv_len - q_len with ``aligned_to_end``: the
    q rows are the last q positions of the kv_len keys (a prefill onto a cache, flash-attn's
    own ``causal``, ``custom_mask_type`` 2; when q_len > kv_len the first q_len - kv_len
    rows see no key). Summing the rows, with
    keep(n) = sum(min(t, kv_len) for t = 1..n) and keep(n) = 0 for n <= 0:

        kept = keep(offset + q_len) - keep(offset)
        keep(n) = n(n + 1)/2 for n <= kv_len, kv_len(kv_len + 1)/2 + (n - kv_len)·kv_len beyond

    A square mask (q_len = kv_len = n) keeps n(n + 1)/2 of n² pairs, (n + 1)/(2n): the
    usual "halves W" plus the diagonal, 1/(2n) more (N = 4096: 0.5001). One query aligned
    to the end (a decode step) keeps every key. NB: the kernel itself computes whole tiles
    on the diagonal, (N/B + 1)/(2N/B) of the pairs for B-row tiles; the count here is the
    pairs the mask keeps, the work no causal kernel can avoid.
    """
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"attention lengths must be >= 0, got q_len={q_len}, kv_len={kv_len}")
    if q_len == 0 or kv_len == 0:
        return 0.0  # no pairs: nothing to keep (and W is 0 whatever the share)

    def keep(n: int) -> int:
        """Keys kept by rows that see 1, 2, ..., n keys, each capped at kv_len (0 if n <= 0)."""
        if n <= 0:
            return 0
        if n <= kv_len:
            return n * (n + 1) // 2
        return kv_len * (kv_len + 1) // 2 + (n - kv_len) * kv_len

    offset = kv_len - q_len if aligned_to_end else 0
    return (keep(offset + q_len) - keep(offset)) / (q_len * kv_len)


def attention_forward_flops(shape: AttentionShape, causal: bool) -> int:
    """QKᵀ (2·Lq·Lk·d) plus PV (2·Lq·Lk·dv) per head; W = 4N²d when dv = d (Dao et al. 2022)"""
    flops = 2 * shape.batch * shape.heads * shape.pairs * (shape.head_dim + shape.value_dim)
    return round(flops * causal_fraction(shape.q_len, shape.kv_len)) if causal else flops


def attention_backward_flops(shape: AttentionShape, causal: bool) -> int:
    """Recompute S (2·Lq·Lk·d), dV (2·Lq·Lk·dv), dP (2·Lq·Lk·dv), dQ and dK (2·Lq·Lk·d each).

    FlashAttention's backward recomputes S rather than storing it, so W is 2.5x the forward
    for d = dv: two matmuls forward, five backward (Dao 2023, FlashAttention-2).
    """
    flops = 2 * shape.batch * shape.heads * shape.pairs * (3 * shape.head_dim + 2 * shape.value_dim)
    return round(flops * causal_fraction(shape.q_len, shape.kv_len)) if causal else flops


def score_matrix_bytes(shape: AttentionShape, itemsize: int) -> int:
    """The naive kernel's S and P round trips: 4 · s · Lq · Lk per head (Dao et al. 2022)."""
    return 4 * itemsize * shape.batch * shape.heads * shape.pairs


def _qkv(op: OpRecord) -> tuple[TensorMeta, TensorMeta, TensorMeta]:
    return tensor_arg(op, "query"), tensor_arg(op, "key"), tensor_arg(op, "value")


def _bias(op: OpRecord) -> list[TensorMeta]:
    bias = op.tensor("attn_bias") or op.tensor("attn_mask")
    return [bias] if bias is not None else []


def _fused_attention_cost(op: OpRecord, layout: str, backward: bool) -> Cost:
    """A fused kernel reads q, k, v (K/V at their own h_kv heads), any bias and, in backward,
    dO, o and the log-sum-exp once; it writes o and the lse (forward) or dq, dk, dv."""
    q, k, v = _qkv(op)
    shape = (AttentionShape.from_bhld if layout == "bhld" else AttentionShape.from_blhd)(q, k, v)
    causal = bool(op.arg("is_causal", False)) or bool(op.arg("custom_mask_type", 0))
    reads = [q, k, v, *_bias(op)]
    if backward:
        flops = attention_backward_flops(shape, causal)
        saved = ("grad_out", "grad_out_", "out", "logsumexp")
        reads += [t for name in saved if (t := op.tensor(name)) is not None]
        writes = list(op.outputs[:3])  # dq, dk, dv
    else:
        flops = attention_forward_flops(shape, causal)
        writes = list(op.outputs[:2])  # o, logsumexp; the rest are RNG / debug scalars
    return Cost(flops, unique_bytes(reads), unique_bytes(writes), "tensor", q.dtype)


@register(
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable",
    kind="attention",
)
def sdpa_forward(op: OpRecord) -> Cost:
    """Fused attention forward (compulsory bytes, Q = 4·s·N·d per head; Dao et al. 2022)."""
    return _fused_attention_cost(op, "bhld", backward=False)


@register(
    "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_efficient_attention_backward",
    "aten._scaled_dot_product_cudnn_attention_backward",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    "aten._scaled_dot_product_fused_attention_overrideable_backward",
    kind="attention",
)
def sdpa_backward(op: OpRecord) -> Cost:
    """Fused attention backward (S is recomputed, never stored; Dao et al. 2022)."""
    return _fused_attention_cost(op, "bhld", backward=True)


@register("aten._flash_attention_forward", "aten._efficient_attention_forward", kind="attention")
def flash_forward_blhd(op: OpRecord) -> Cost:
    """Lower-level flash/efficient forward in (batch, length, heads, dim) layout."""
    return _fused_attention_cost(op, "blhd", backward=False)


@register("aten._flash_attention_backward", "aten._efficient_attention_backward", kind="attention")
def flash_backward_blhd(op: OpRecord) -> Cost:
    """Lower-level flash/efficient backward in (batch, length, heads, dim) layout."""
    return _fused_attention_cost(op, "blhd", backward=True)


@register(
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_attention_math_for_mps",
    kind="attention",
)
def sdpa_math(op: OpRecord) -> Cost:
    """Naive attention: S and P are written and read back, four N² round trips per head.

    Standard attention (Dao et al. 2022, Algorithm 0): W = 4N²d, Q = 4s(Nd + N²), I -> d/s.
    The math path computes every pair, so a causal mask saves nothing here.
    """
    return materialized_attention_cost(op)


def materialized_attention_cost(op: OpRecord) -> Cost:
    """The naive kernel chain for a fused attention op: S and P written to HBM and read back.

    Standard attention (Dao et al. 2022, Algorithm 0): the forward adds four N² round trips per
    head (write S, read S, write P, read P), W = 4N²d, Q = 4s(Nd + N²), I -> d/s; every
    pair is computed, so a causal mask saves nothing. NB: the backward is taken as six N²
    passes (read P, write and read dP, write dS, read dS twice for dQ and dK), a count of
    this project's own.
    """
    q, k, v = _qkv(op)
    backward = "backward" in op.name
    layout = (
        "blhd"
        if op.name.startswith(("aten._flash_attention", "aten._efficient_attention"))
        else "bhld"
    )
    shape = (AttentionShape.from_bhld if layout == "bhld" else AttentionShape.from_blhd)(q, k, v)
    per_pass = score_matrix_bytes(shape, q.itemsize) // 4  # s · Lq · Lk per head
    if backward:
        flops = attention_backward_flops(shape, causal=False)
        saved = ("grad_out", "grad_out_", "out")
        reads = [q, k, v, *_bias(op)] + [t for n in saved if (t := op.tensor(n)) is not None]
        writes = list(op.outputs[:3])
        read, written = unique_bytes(reads) + 4 * per_pass, unique_bytes(writes) + 2 * per_pass
    else:
        flops = attention_forward_flops(shape, causal=False)
        read = unique_bytes([q, k, v, *_bias(op)]) + 2 * per_pass
        written = unique_bytes(op.outputs[:1]) + 2 * per_pass
    return Cost(flops, read, written, "tensor", q.dtype)


@register("torchroof.mla_decode_attention", kind="attention")
def mla_decode_attention(op: OpRecord) -> Cost:
    """Multi-head latent attention decode over the latent cache, weights absorbed (the
    FlashMLA kernel; DeepSeek-V2 §2.1.2): every head's query, already multiplied into the
    latent space, scores against the one cached latent ``c`` (r dims) with its rope key
    (d_r dims) and averages ``c`` itself. W = 2·b·h·Lq·N·(r + d_r) + 2·b·h·Lq·N·r; Q reads
    the queries, the latent and the rope cache once (one "KV head" shared by all heads,
    the compulsory bytes of docs/concepts/compulsory-bytes.md) and writes the latent-space
    output."""
    query, latent, rope = tensor_arg(op, "query"), tensor_arg(op, "latent"), tensor_arg(op, "rope")
    *batch, heads, q_len, _ = query.shape
    b = 1
    for size in batch:
        b *= size
    kv_len, rank = latent.shape[-2], latent.shape[-1]
    pairs = b * heads * q_len * kv_len
    flops = 2 * pairs * (rank + rope.shape[-1]) + 2 * pairs * rank
    reads = [query, latent, rope]
    return Cost(flops, unique_bytes(reads), unique_bytes(op.outputs[:1]), "tensor", query.dtype)

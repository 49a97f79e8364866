"""Attention of a mixed engine step: one ragged kernel per layer for the decodes, one for
the prefill chunks, each over every sequence's own cache.

A serving engine's attention backend takes the step's sequences with their own lengths
(FlashInfer's batch decode and batch prefill wrappers, FlashAttention's variable-length
kernel; vLLM and SGLang pass them as ragged batches), so a layer's attention does the sum
of its sequences' work in one launch (two where decodes and chunks run separate kernels,
as FlashInfer's do). Per sequence, with H query heads, H_kv K/V heads, head dims d and d_v
(docs/concepts/attention-kv.md, Dao et al. 2022 for the fused kernel's compulsory bytes):

- W = 2·H·(d + d_v)·pairs, pairs = the (query, key) pairs the causal mask keeps: a decode
  keeps all ``context + 1``; a chunk of n tokens on c cached keeps the rows aligned to the
  end of its c + n keys (flash-attn's causal,
  :func:`~torchroof.counters.attention.causal_fraction`);
- Q reads q (n·H·d), K and V (every cached and new key, (c + n)·H_kv·(d + d_v)) once, at
  their stored widths, and writes o (n·H·d_v) and the fp32 log-sum-exp (n·H).

The geometry each layer runs (heads per rank, K/V heads, dims, dtypes, whether its decode
kernel takes each K/V head's query group as rows, as transformers' ``pack_gqa`` and
FlashInfer's GQA decode do) is read off the layer's attention op in a traced decode step.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2: :mod:`torchroof.models.mla`) runs
two ways, as vLLM's MLA backends run it:

- decodes over the latent cache with the up-projections absorbed (FlashMLA): every head's
  query scores against one shared latent of r + d_r dims per token and averages its first
  r: H query heads on one K/V head, d = r + d_r, d_v = r, the latent read once per key (V
  is part of K);
- prefill chunks longer than a few tokens in the compute-lighter expanded form: the cached
  latents of each chunk's context are gathered, expanded through ``kv_b_proj`` (a GEMM of
  c x r by r x H·(d_nope + d_v)) and assembled into per-head keys
  (:func:`expand_kernels`), then ordinary attention runs with H K/V heads of
  d = d_nope + d_r and d_v (DeepSeek-V2 section 2.1.2; vLLM's ``MLACommonImpl`` prefill
  path). The chunk's own new rows are projected in the step's body, priced from the
  absorbed decode at N tokens: the same FLOPs as expanding them, its memory-bound
  absorption matmuls a little dearer than the one expanding GEMM (a few percent of a
  prefill-heavy step's body). A verification, a draft head's pass or a prompt's last few
  tokens, up to :data:`~torchroof.serving.composition.SHORT_QUERY` tokens, run in the
  decode kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchroof.config.errors import OptionError
from torchroof.counters import Cost
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import dtype_itemsize
from torchroof.serving.composition import SequenceWork, causal_pairs
from torchroof.timing.kernel_shape import KernelShape

LOG_SUM_EXP_BYTES = 4  # the fused kernel's fp32 log-sum-exp, one per query row and head

RAGGED_OPS = frozenset(
    {
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
    }
)


@dataclass(frozen=True)
class AttentionGeometry:
    """One layer's attention on one rank, as a traced decode step ran it; layers alike but
    for their module compare equal (a step times each kind once)."""

    module: str = field(compare=False)
    query_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    query_dtype: str
    kv_dtype: str
    packed: bool  # the decode kernel's rows are a K/V head's query group (GQA packing)
    latent: bool = False  # V is K's first value_dim dims, stored once (MLA's latent cache)
    prefill: AttentionGeometry | None = None  # the form prefill chunks run, where another
    expand_width: int = 0  # MLA: the expanded K_nope and V dims per cached token (all heads)

    @property
    def group(self) -> int:
        return self.query_heads // self.kv_heads

    @property
    def kv_width(self) -> int:
        """Cached dims per token and K/V head: K and V, or the latent once."""
        return self.head_dim if self.latent else self.head_dim + self.value_dim


MLA_OP = "torchroof.mla_decode_attention.default"


def mla_geometry(op: OpRecord, context: int, config: Any) -> AttentionGeometry:
    """The geometry of an absorbed MLA decode kernel (``query`` [b, H, 1, r + d_r], the
    ``latent`` [b, 1, N, r] and ``rope`` key [b, 1, N, d_r] cache), with the expanded form
    its prefill chunks run, from the model's head dims (``config``)."""
    q, latent, rope = op.tensor("query"), op.tensor("latent"), op.tensor("rope")
    if q is None or latent is None or rope is None or latent.shape[-2] != context + 1:
        raise OptionError(f"{op.module}: its latent attention is not over the whole cache")
    nope = getattr(config, "qk_nope_head_dim", None)
    value = getattr(config, "v_head_dim", None)
    if not isinstance(nope, int) or not isinstance(value, int):
        raise OptionError(f"{op.module}: latent attention without qk_nope_head_dim, v_head_dim")
    heads, rank, rotary = q.shape[1], latent.shape[-1], rope.shape[-1]
    expanded = AttentionGeometry(
        module=op.module,
        query_heads=heads,
        kv_heads=heads,
        head_dim=nope + rotary,
        value_dim=value,
        query_dtype=q.dtype,
        kv_dtype=q.dtype,  # the expanded K and V are written in the compute dtype
        packed=False,
    )
    return AttentionGeometry(
        module=op.module,
        query_heads=heads,
        kv_heads=1,
        head_dim=rank + rotary,
        value_dim=rank,
        query_dtype=q.dtype,
        kv_dtype=latent.dtype,
        packed=True,
        latent=True,
        prefill=expanded,
        expand_width=heads * (nope + value),
    )


def decode_geometry(op: OpRecord, context: int, config: Any = None) -> AttentionGeometry:
    """The geometry of ``op``, a decode step's attention (one new token per sequence over
    ``context`` cached); a layer this module cannot price is refused in one line."""
    if op.name == MLA_OP:
        return mla_geometry(op, context, config)
    q, k, v = op.tensor("query"), op.tensor("key"), op.tensor("value")
    if op.name not in RAGGED_OPS or q is None or k is None or v is None or len(q.shape) != 4:
        raise OptionError(
            f"{op.module}: {op.packet} is not priced per sequence yet (the mixed-step "
            "function prices scaled dot-product attention over a full cache)"
        )
    _, heads, rows, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if kv_len != context + 1:
        raise OptionError(
            f"{op.module} attends over {kv_len} keys at context {context}, not every cached "
            "token and the new one (a sliding window or a cache of its own): not priced "
            "per sequence yet"
        )
    packed = rows > 1  # one new token: more query rows than that are a packed GQA group
    return AttentionGeometry(
        module=op.module,
        query_heads=heads * rows if packed else heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        value_dim=v.shape[-1],
        query_dtype=q.dtype,
        kv_dtype=k.dtype,
        packed=packed,
    )


def decode_kernel(
    layer: AttentionGeometry, decodes: Sequence[SequenceWork]
) -> tuple[Cost, KernelShape]:
    """(cost, geometry) of one ragged decode kernel over ``decodes`` (one new token each)."""
    return ragged_decode(layer, len(decodes), sum(work.length for work in decodes))


def ragged_decode(layer: AttentionGeometry, count: int, keys: int) -> tuple[Cost, KernelShape]:
    """(cost, geometry) of one ragged decode kernel over ``count`` sequences of one new
    token each, ``keys`` cached and new keys in all."""
    cost = _cost(layer, count, keys, keys)
    if layer.packed:
        rows, batch = layer.group, count * layer.kv_heads
    else:
        rows, batch = 1, count * layer.query_heads
    shape = KernelShape(
        "attention",
        dtype_itemsize(layer.query_dtype),
        batch=batch,
        m=rows,
        n=round(keys / count),
        k=layer.head_dim,
        kept=1.0,
        value_dim=layer.value_dim,
        kv_batch=count * layer.kv_heads,
    )
    return cost, shape


def chunk_kernel(
    layer: AttentionGeometry, chunks: Sequence[SequenceWork]
) -> tuple[Cost, KernelShape]:
    """(cost, geometry) of one ragged prefill kernel over ``chunks``, each causal over its
    cached and new keys; the geometry is the chunks' mean (rows, keys) per sequence."""
    rows = sum(work.new_tokens for work in chunks)
    keys = sum(work.length for work in chunks)
    pairs = sum(causal_pairs(work.new_tokens, work.length) for work in chunks)
    return ragged_prefill(layer, len(chunks), rows, keys, pairs)


def ragged_prefill(
    layer: AttentionGeometry, count: int, rows: int, keys: int, pairs: int
) -> tuple[Cost, KernelShape]:
    """(cost, geometry) of one ragged prefill kernel over ``count`` chunks of ``rows``
    new tokens, ``keys`` cached and new keys and ``pairs`` kept (query, key) pairs in all."""
    cost = _cost(layer, rows, keys, pairs)
    m, n = max(1, round(rows / count)), max(1, round(keys / count))
    shape = KernelShape(
        "attention",
        dtype_itemsize(layer.query_dtype),
        batch=count * layer.query_heads,
        m=m,
        n=n,
        k=layer.head_dim,
        kept=min(1.0, pairs / (count * m * n)),
        value_dim=layer.value_dim,
        kv_batch=count * layer.kv_heads,
    )
    return cost, shape


def expand_kernels(layer: AttentionGeometry, cached: int) -> list[tuple[Cost, KernelShape]]:
    """(cost, geometry) of the kernels expanding ``cached`` latent rows (the chunks' cached
    context) into every head's K and V before the expanded attention, as vLLM's
    ``_compute_prefill_context`` runs them: the cache gathered into a workspace in the
    compute dtype ([cached, r + d_r], read at the cache's width), the GEMM through
    ``kv_b_proj`` ([cached, r] x [r, H·(d_nope + d_v)]), and K assembled from K_nope and
    the rope key broadcast to every head ([cached, H, d_nope + d_r])."""
    assert layer.prefill is not None
    rank, width, heads = layer.value_dim, layer.expand_width, layer.query_heads
    rotary = layer.head_dim - rank
    nope = layer.prefill.head_dim - rotary
    sq, skv = dtype_itemsize(layer.query_dtype), dtype_itemsize(layer.kv_dtype)
    dtype = layer.query_dtype
    latent = cached * (rank + rotary)
    gather = Cost(0, latent * skv, latent * sq, "vector", dtype)
    gemm = Cost(
        2 * cached * rank * width,
        cached * rank * sq + rank * width * sq,
        cached * width * sq,
        "tensor",
        dtype,
    )
    keys = cached * heads * (nope + rotary)
    assemble = Cost(0, (cached * heads * nope + cached * rotary) * sq, keys * sq, "vector", dtype)
    return [
        (gather, KernelShape("stream", sq, elements=latent)),
        (gemm, KernelShape("gemm", sq, batch=1, m=cached, n=width, k=rank)),
        (assemble, KernelShape("stream", sq, elements=keys)),
    ]


def _cost(layer: AttentionGeometry, rows: int, keys: int, pairs: int) -> Cost:
    """W and Q of attention with ``rows`` query tokens, ``keys`` K/V tokens read and
    ``pairs`` (query token, key) pairs kept, summed over a kernel's sequences."""
    h, hkv, d, dv = layer.query_heads, layer.kv_heads, layer.head_dim, layer.value_dim
    sq, skv = dtype_itemsize(layer.query_dtype), dtype_itemsize(layer.kv_dtype)
    read = rows * h * d * sq + keys * hkv * layer.kv_width * skv
    written = rows * h * dv * sq + rows * h * LOG_SUM_EXP_BYTES
    return Cost(2 * h * (d + dv) * pairs, read, written, "tensor", layer.query_dtype)

"""Multi-head latent attention decoded the way serving runtimes decode it.

transformers' DeepSeek-style attention (DeepSeek-V2/V3, Kimi, GLM-MoE-lite, LongCat, …)
caches the latent ``c`` and the rope key, then expands them through ``kv_b_proj`` into
per-head K and V for the whole context at every step. FlashMLA, vLLM and SGLang decode
with the up-projections absorbed instead (DeepSeek-V2 §2.1.2): the query is multiplied
into the latent space (``q · W_UK``), attention runs over the latent cache itself, and the
latent output is projected out (``· W_UV``). Both compute the same attention; the absorbed
form reads N·(r + d_r) cache elements per layer and step instead of materialising
N·h·(d_nope + d_r + d_v).

``absorbed_mla(model, capture)`` switches a model's MLA layers to that form for the traced
step: their ``expand_kv`` hands the latent through unexpanded and their attention call
becomes q-absorption (a batched matmul), one ``torchroof.mla_decode_attention`` kernel
and the ``W_UV`` projection.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from torchroof.capture.mode import Capture
from torchroof.quant.kv_cache import dequantise

ATTENTION_NAME = "torchroof_mla_absorbed"
_ACTIVE: list[Capture] = []


def mla_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` that cache a latent and expand it per step."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "expand_kv") and hasattr(m, "kv_b_proj") and hasattr(m, "kv_lora_rank")
    ]


def absorbable(layer: torch.nn.Module) -> bool:
    """Dense MLA only: a sparse-attention indexer (DeepSeek-V3.2's DSA, GLM-MoE-DSA,
    HY-V4, …) picks top-k tokens and attention sinks add a term, neither of which the
    absorbed kernel here models; those layers keep transformers' expanded path."""
    return not hasattr(layer, "indexer") and getattr(layer, "sinks", None) is None


def _per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[b, h, L, d] @ [h, d, e] -> [b, h, L, e] as one batched matmul over heads, the
    weight read once (a plain broadcast matmul would copy it for every sequence)."""
    b, h, length, d = x.shape
    rows = x.transpose(0, 1).reshape(h, b * length, d)
    return torch.bmm(rows, weight).view(h, b, length, -1).transpose(0, 1)


def _latent_passthrough(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[Any, Any]:
    return kv_nope, k_rot


def absorbed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the latent cache with W_UK and W_UV absorbed.

    ``query`` is [b, h, Lq, d_nope + d_r] (rope applied), ``latent`` [b, 1, N, r] and
    ``rope_key`` [b, 1, N, d_r] are the cache as the layer returns it, in the model's dtype
    or quantised (fp8: FlashMLA's fp8 cache, read at 1 B per element). Returns the
    attention output as [b, Lq, h, d_v], like every transformers attention function."""
    capture = _ACTIVE[-1]
    layer: Any = module  # transformers' MLA attention: its sizes are plain attributes
    nope, rank = layer.qk_nope_head_dim, layer.kv_lora_rank
    heads = query.shape[1]
    weight = layer.kv_b_proj.weight.view(heads, nope + layer.v_head_dim, rank)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]  # [h, d_nope, r], [h, d_v, r]
    q_nope, q_rope = query.split([nope, query.shape[-1] - nope], dim=-1)
    q_absorbed = torch.cat([_per_head(q_nope, w_uk), q_rope], dim=-1)  # [b, h, Lq, r + d_r]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    with capture.unrecorded():  # the kernel's result, computed but recorded as one op below
        # a quantised cache (fp8, int8) is dequantised in registers: its bytes are read narrow
        latent_values = latent.to(query.dtype)
        scores = torch.matmul(q_absorbed[..., :rank], latent_values.transpose(-1, -2))
        scores = scores + torch.matmul(q_rope, rope_key.to(query.dtype).transpose(-1, -2))
        scores = scores * scale
        if attention_mask is not None:
            mask = attention_mask[..., : latent.shape[-2]]
            scores = (
                scores.masked_fill(~mask, float("-inf"))
                if mask.dtype == torch.bool
                else scores + mask
            )
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out_latent = torch.matmul(probs, latent_values)  # [b, h, Lq, r]
    phase, where, _ = capture.context()
    capture.record_synthetic(
        "torchroof.mla_decode_attention.default",
        {"query": q_absorbed, "latent": latent, "rope": rope_key},
        {"scale": scale},
        phase=phase,
        module=where,
        outputs=(capture.tensor_meta(out_latent),),
    )
    out = _per_head(out_latent, w_uv.transpose(-1, -2))  # [b, h, Lq, d_v]
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def absorbed_mla(model: torch.nn.Module, capture: Capture) -> Iterator[bool]:
    """Inside: the model's MLA layers decode over the latent with absorbed projections
    (yields whether the model has any). Outside: the model is as it was."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    layers: list[Any] = mla_layers(model)  # their expand_kv and config are set below
    if not layers or not all(absorbable(layer) for layer in layers):
        yield False
        return
    configs = {id(m.config): m.config for m in layers if hasattr(m, "config")}
    previous = {key: c._attn_implementation for key, c in configs.items()}
    AttentionInterface.register(ATTENTION_NAME, absorbed_attention)
    # the masks stay those of the implementation the model had (layers such as a sparse
    # indexer read them)
    first = next(iter(previous.values()), "sdpa")
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS[first])
    for layer in layers:
        layer.expand_kv = _latent_passthrough
    for config in configs.values():
        config._attn_implementation = ATTENTION_NAME
    _ACTIVE.append(capture)
    try:
        yield True
    finally:
        _ACTIVE.pop()
        for layer in layers:
            del layer.expand_kv
        for key, config in configs.items():
            config._attn_implementation = previous[key]


@contextlib.contextmanager
def dequantised_latents(model: torch.nn.Module, kv_dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: the model's MLA layers widen a latent cache stored in ``kv_dtype`` (fp8,
    int8) back to the model's dtype before transformers expands it through
    ``kv_b_proj`` (a recorded cast of the latent and rope cache, vLLM's gather-and-dequant
    before an MLA prefill over cached context). Nothing changes for ``kv_dtype`` None."""
    layers = mla_layers(model) if kv_dtype is not None else []
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    for layer in layers:
        layer.expand_kv = _dequantising(layer.expand_kv, dtype)
    try:
        yield
    finally:
        for layer in layers:
            del layer.expand_kv


def _dequantising(expand: Any, dtype: torch.dtype) -> Any:
    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[Any, Any]:
        if kv_nope.dtype != dtype:
            kv_nope, k_rot = dequantise(kv_nope, dtype), dequantise(k_rot, dtype)
        return expand(kv_nope, k_rot)

    return expand_kv

"""A quantised KV cache: K and V stored at 1 byte per element, the way serving
runtimes keep them (vLLM's and TensorRT-LLM's fp8 KV cache, TensorRT-LLM's int8 one).

The new K/V of a step are scaled by a per-tensor scale and cast when they are written into
the cache (one pointwise kernel, fused with the op that produced them); the attention kernel
reads the narrow cache and dequantises in registers, so its K/V bytes are 1 B per element
while its FLOPs run on the query's tensor cores. The KV crossover (docs/concepts/attention-kv.md):
KV bytes = 2 · s · N · d_head · h_kv · L per sequence, and quantising the cache (fewer cached
bytes per entry) halves s, so B_cross doubles and decode attention's I = 2/s doubles. A
consumer that is not an attention kernel (transformers' per-step MLA expansion) dequantises
first, a recorded cast.

NB: the scale is one calibrated number per tensor (vLLM's ``k_scale`` / ``v_scale``); its
value changes no FLOP or byte, so it is a constant here and not a tensor in the cache.
"""

from __future__ import annotations

import torch

from torchroof.config.choices import KV_DTYPES
from torchroof.config.errors import WorkloadError
from torchroof.quant.recipes import KV_TORCH_DTYPES

KV_SCALE = 1.0  # the per-tensor scale: K/V are divided by it on write, multiplied on read


def narrow_dtype(kv_dtype: str) -> torch.dtype | None:
    """The cache's storage dtype for ``kv_dtype`` (None: the model's own); a clear error for
    an unknown name."""
    if kv_dtype not in KV_DTYPES:
        raise WorkloadError(f"kv_dtype={kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_TORCH_DTYPES.get(kv_dtype)


def quantise(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K/V on their way into the cache: scaled and cast (vLLM ``reshape_and_cache``)."""
    return (states * (1.0 / KV_SCALE)).to(dtype)


def dequantise(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K/V widened back to the model's ``dtype`` for a consumer that is not an
    attention kernel (the kernel itself reads the narrow cache)."""
    return states.to(dtype) * KV_SCALE


def is_kv_storage(tensor: torch.Tensor) -> bool:
    """A tensor a cache may hold its state in: floating point, or int8 K/V."""
    return tensor.is_floating_point() or tensor.dtype == torch.int8

"""transformers caches on meta: a cache built already holding ``filled`` tokens, the state
tensors a cache object holds, and the caches hybrids and recurrent models need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchroof.capture.mode import Capture
from torchroof.capture.symbolic import sized
from torchroof.parallel.stages import owned_layers
from torchroof.quant.kv_cache import is_kv_storage, quantise
from torchroof.workloads.inputs import kv_shape, model_config, model_param_dtype, text_config


def build_kv_cache(
    model: torch.nn.Module,
    batch: int,
    capacity: int,
    filled: int,
    kind: str,
    capture: Capture,
    kv_dtype: torch.dtype | None = None,
) -> Any:
    """A transformers cache on meta, already holding ``filled`` tokens (no prefill is run).

    ``static`` preallocates ``capacity`` slots and writes new tokens in place (what paged
    and static-cache runtimes do). Its layers allocate on their first update, from the
    model's own K/V shapes (MLA's wider keys, per-layer head counts), without the
    allocation being recorded. ``dynamic`` is HF's ``DynamicCache``, which ``cat``s the
    whole cache every step; it is filled up front from the config's KV shape. With
    ``kv_dtype`` (fp8, int8) the cache holds K/V in that dtype and quantises what is
    written into it (:func:`quantise_on_write`).
    """
    from transformers import DynamicCache, StaticCache

    text_config(model)  # a clear error for a module without a transformers config
    config = model_config(model)
    if kind == "static":
        static = StaticCache(config=config, max_cache_len=capacity)
        for layer in static.layers:
            _allocate_unrecorded(layer, capture)
        quantise_on_write(static, kv_dtype)
        return static
    kv_heads, head_dim = kv_shape(model)
    dtype = kv_dtype or model_param_dtype(model)
    cache = DynamicCache(config=config)
    quantise_on_write(cache, kv_dtype)
    stage = owned_layers(model)  # a pipeline stage caches its own layers
    # transformers types the layers as every kind a cache may hold; these are a dynamic
    # cache's attention layers (one of another kind refuses as transformers makes it)
    layers: list[Any] = list(cache.layers)
    for index, layer in enumerate(layers):
        window = getattr(layer, "sliding_window", None)
        length = min(filled, window - 1) if window else filled
        length = length if stage is None or index in stage else 0
        layer.lazy_initialization(
            *(torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device="meta"),) * 2
        )
        layer.keys = torch.empty(batch, kv_heads, length, head_dim, dtype=dtype, device="meta")
        layer.values = torch.empty(batch, kv_heads, length, head_dim, dtype=dtype, device="meta")
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = filled
    return cache


def quantise_on_write(cache: Any, kv_dtype: torch.dtype | None) -> None:
    """Make every attention layer of ``cache`` store its K/V in ``kv_dtype`` (None: leave
    the cache as it is): the new K/V are scaled and cast as they are written (a recorded
    pointwise op), so a static layer allocates in ``kv_dtype`` on its first update and
    returns the narrow cache to the attention. Recurrent state (conv, SSM) keeps its dtype.
    """
    from transformers.cache_utils import CacheLayerMixin

    if kv_dtype is None:
        return
    for layer in cache.layers:
        if isinstance(layer, CacheLayerMixin):  # not recurrent-only or placeholder layers
            # the layer's own bound method, wrapped in place on this cache's layer
            layer.update = _quantising(layer.update, kv_dtype)  # type: ignore[method-assign]


def _quantising(write: Callable[..., Any], kv_dtype: torch.dtype) -> Callable[..., Any]:
    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
        keys, values = quantise(key_states, kv_dtype), quantise(value_states, kv_dtype)
        return write(keys, values, *args, **kw)

    return update


def _allocate_unrecorded(layer: Any, capture: Capture) -> None:
    """Make a cache layer's lazy allocation invisible to the trace and label its tensors
    as KV cache (the cache exists before the step; allocating it is not the step's work)."""
    original = getattr(layer, "lazy_initialization", None)
    if original is None:  # placeholder layers (KV shared with another layer) hold nothing
        return

    def initialise(*args: Any, **kwargs: Any) -> None:
        with capture.unrecorded():
            original(*args, **kwargs)
        capture.mark(state_tensors(layer), "kv_cache")

    layer.lazy_initialization = initialise


_CACHE_OUTPUTS = ("past_key_values", "cache", "cache_params", "state", "past_buckets_states")


def returned_cache(output: Any) -> Any:
    for name in _CACHE_OUTPUTS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def state_tensors(cache: Any, depth: int = 4) -> list[torch.Tensor]:
    """Every floating (or int8 K/V) tensor a cache object holds, at any nesting (a
    transformers Cache's layers, a recurrent model's conv/SSM/RNN states in dicts, lists or
    attributes)."""
    found: dict[int, torch.Tensor] = {}

    def walk(value: Any, level: int) -> None:
        if isinstance(value, torch.Tensor):
            if is_kv_storage(value):
                found.setdefault(id(value), value)
        elif level <= 0 or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, level - 1)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, level - 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
            for item in vars(value).values():
                walk(item, level - 1)

    walk(cache, depth)
    return list(found.values())


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage()._cdata: sized(t.untyped_storage().nbytes()) for t in tensors}
    return sum(storages.values())


def recurrent_only_cache(model: torch.nn.Module) -> Any:
    """A ``DynamicCache`` for a hybrid whose config has no attention layer (Bamba,
    GraniteMoeHybrid at their defaults: Mamba layers only), or None for any other model.

    Their forward still builds the full-attention mask, which asks the cache for its
    sequence length, and a cache of only linear-attention layers refuses (transformers
    raises "can only be called on Attention layers"), the model's own cache included.
    No layer reads that mask, so the cache answers as an empty attention cache would."""
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    try:
        probe = DynamicCache(config=model_config(model))
    except Exception:  # noqa: BLE001 - a config transformers cannot size a cache for
        return None
    if not probe.layers or any(isinstance(layer, CacheLayerMixin) for layer in probe.layers):
        return None

    class RecurrentOnlyCache(DynamicCache):
        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

        def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
            return query_length, 0

    return RecurrentOnlyCache(config=model_config(model))


def attention_only_static_cache(model: torch.nn.Module) -> bool:
    from transformers import StaticCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    text_config(model)  # a clear error for a module without a transformers config
    try:
        cache = StaticCache(config=model_config(model), max_cache_len=1)
    except Exception:  # noqa: BLE001 - a config transformers cannot size a cache for
        return False
    return not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def caches_attention_kv(model: torch.nn.Module) -> bool:
    """Whether the model's cache has an attention layer holding K/V (False: recurrent state
    only, Mamba); True when transformers cannot size a cache for its config (unknown)."""
    from transformers import StaticCache
    from transformers.cache_utils import CacheLayerMixin

    try:
        cache = StaticCache(config=model_config(model), max_cache_len=1)
    except Exception:  # noqa: BLE001 - a config transformers cannot size a cache for
        return True
    return any(isinstance(layer, CacheLayerMixin) for layer in cache.layers)

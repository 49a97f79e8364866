"""The inputs a step feeds a transformers model on meta: token ids, labels, positions and
the forward arguments each architecture takes them in; the KV shape its config implies."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, cast

import torch

from torchroof.capture.storage import local_shard
from torchroof.config.errors import WorkloadError
from torchroof.models.mla import mla_layers
from torchroof.parallel.tensor import KV_HEADS_PER_RANK
from torchroof.quant.kv_cache import narrow_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from torchroof.config import Workload


def seq_of(workload: Workload) -> int:
    """The step's ``seq``: a left-out one is given its default before any regime runs
    (:func:`torchroof.workloads.registry.run_workload`)."""
    assert workload.seq is not None, "seq is resolved before a regime runs"
    return workload.seq


def context_of(workload: Workload) -> int:
    """The tokens a decode step's cache holds: ``context``, which follows ``seq`` when left
    out (and so is resolved with it)."""
    assert workload.context is not None, "context is resolved with seq before a regime runs"
    return workload.context


def model_config(model: torch.nn.Module) -> PreTrainedConfig:
    """The transformers config of a model transformers built (``model.config``)."""
    return cast("PreTrainedConfig", model.config)


# -- inference ------------------------------------------------------------------------------
def text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise WorkloadError(
            f"{type(model).__name__} has no transformers config: prefill with a KV cache and "
            "decode need a transformers causal LM (trace other modules with torchroof.trace())"
        )
    return config.get_text_config(decoder=True)


def kv_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(KV heads, head dim) from the config, the KV heads one rank holds when the model is
    tensor-parallel (:func:`torchroof.parallel.tensor.apply_tensor_parallel` records them); a
    clear error when the config lacks them."""
    text = text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if heads is None or hidden is None:
        raise WorkloadError(
            f"config {type(text).__name__} has no num_attention_heads / hidden_size: "
            "cannot size a KV cache for it"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return getattr(model, KV_HEADS_PER_RANK, kv_heads), head_dim


def random_ids(model: torch.nn.Module, batch: int, length: int, device: str) -> torch.Tensor:
    """Real token ids on ``device`` for a step run for real (``torchroof validate``)."""
    config: Any = model.config
    return torch.randint(0, config.vocab_size, (batch, length), device=device)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the step's inputs are made: the device of the model's (local) parameters,
    meta, or CPU fake tensors for a model sharded by FSDP (which refuses meta)."""
    param = next(model.parameters(), None)
    return local_shard(param).device if param is not None else torch.device("meta")


def token_ids(model: torch.nn.Module, batch: int, length: int) -> torch.Tensor:
    """Input ids on the model's device (:func:`input_device`): [batch, length], or
    [batch · codebooks, length] for a decoder over parallel audio codebooks (MusicGen)."""
    codebooks = getattr(getattr(model, "config", None), "num_codebooks", None) or 1
    device = input_device(model)
    return torch.zeros(batch * codebooks, length, dtype=torch.long, device=device)


def labels_for(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Labels for ``ids``: the ids themselves; [batch, length, codebooks] for MusicGen."""
    codebooks = getattr(model.config, "num_codebooks", None) or 1
    if codebooks == 1:
        return ids
    return ids.view(-1, codebooks, ids.shape[-1]).transpose(1, 2)


def model_param_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params", "state", "past_buckets_states")


def forward_parameters(model: torch.nn.Module) -> Any:
    """The names ``model.forward`` accepts."""
    return inspect.signature(model.forward).parameters


def cache_argument(params: Any) -> str | None:
    """The forward argument (of ``params``) a model takes its cache or recurrent state in."""
    return next((name for name in _CACHE_ARGUMENTS if name in params), None)


def forward_kwargs(model: torch.nn.Module, positions: torch.Tensor, cache: Any) -> dict[str, Any]:
    params = forward_parameters(model)
    kwargs: dict[str, Any] = {"use_cache": True}
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    name = cache_argument(params)
    if cache is not None and name is not None:
        kwargs[name] = cache
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1  # generation needs the last token's logits only
    batch, length = positions.shape  # (B, T)
    kwargs.update(patch_inputs(model, batch, length, params))
    return kwargs


def patch_inputs(
    model: torch.nn.Module, batch: int, length: int, params: Any = None
) -> dict[str, Any]:
    """A byte-latent model (BLT) groups bytes into patches where a small LM's entropy
    spikes, which meta cannot evaluate: it is given fixed patches of ``patch_size`` bytes
    (BLT's static patching), the same count of patches as its mean patch size gives."""
    config = getattr(model, "config", None)
    size = getattr(config, "patch_size", None)
    if not size:
        return {}
    takes = "patch_lengths" in (params if params is not None else forward_parameters(model))
    if not (takes or hasattr(config, "patching_mode")):
        return {}
    patches = -(-length // size)
    return {"patch_lengths": torch.full((batch, patches), size, dtype=torch.long, device="meta")}


def kv_bytes_per_token(model: torch.nn.Module, kv_dtype: str = "model") -> int:
    """K and V of one token across all layers: 2 · s · h_kv · d_head · L (Pope et al. 2022), s the
    model's dtype or the cache's ``kv_dtype`` (fp8, int8: 1 B).

    Multi-head latent attention (DeepSeek-V2/V3) caches one latent per token and MLA
    layer instead: s · (kv_lora_rank + qk_rope_head_dim) · L_MLA.
    """
    text = text_config(model)
    itemsize = (narrow_dtype(kv_dtype) or model_param_dtype(model)).itemsize
    latent = getattr(text, "kv_lora_rank", None)
    if latent:
        rope = getattr(text, "qk_rope_head_dim", 0) or 0
        # hybrids (Kimi-Linear, Bailing) have latent attention in some layers only
        layers = len(mla_layers(model)) or text.num_hidden_layers
        return itemsize * (latent + rope) * layers
    kv_heads, head_dim = kv_shape(model)
    return 2 * itemsize * kv_heads * head_dim * text.num_hidden_layers

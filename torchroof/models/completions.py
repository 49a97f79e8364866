"""Default-config completion: transformers' own default configs, made buildable.

A few default configs in transformers (5.24) leave fields None that their modeling code
needs, or fail their own validator. The zoo builds every architecture from its default
config, so this stage fills what is missing without breaking the config's invariants.

``complete_config(config)`` returns a config that builds with
``AutoModelForCausalLM.from_config`` and runs.  It only fills fields that are ``None`` or
missing (never overrides a set value), except where a sub-config must be chosen.
Generic rules run first; the per-model table after them holds the values that cannot be
derived from the config itself, each with its source.

``CONSTRUCTION_OVERRIDES`` holds kwargs for model types whose *default* config raises in
``AutoConfig.for_model`` itself (so no config object exists to complete); pass them to
``AutoConfig.for_model(model_type, **CONSTRUCTION_OVERRIDES[model_type])`` (or use
``default_config(model_type)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# model_type -> kwargs for AutoConfig.for_model: the default config violates its own validator.
CONSTRUCTION_OVERRIDES: dict[str, dict[str, Any]] = {
    # Gemma4AssistantConfig.validate_architecture requires its text_config to have
    # hidden_size_per_layer_input == 0 and vocab_size_per_layer_input == 0 (the assistant has no
    # per-layer-input embeddings), but the default text_config is the default Gemma4TextConfig
    # (256 / 262144).  Setting them to 0 is what the validator demands (source: the validator,
    # transformers/models/gemma4_assistant/configuration_gemma4_assistant.py).
    # NB: the model still cannot run from input_ids alone: its forward requires the backbone's
    # inputs_embeds (B, L, 2*backbone_hidden_size) and shared_kv_states; see REPORT.md.
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}


def default_config(model_type: str) -> Any:
    """``AutoConfig.for_model(model_type)`` with construction overrides, then completed."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **CONSTRUCTION_OVERRIDES.get(model_type, {}))
    return complete_config(config)


def _unset(config: Any, name: str) -> bool:
    """``name`` is a field of ``config`` whose value is None."""
    try:
        return name in vars(config) and vars(config)[name] is None
    except TypeError:
        return False


def _raw(config: Any, name: str) -> Any:
    """The stored value, without the heterogeneous-config guard that raises on global reads of
    per-layer attributes (gemma4_text and friends); None when absent or unreadable."""
    try:
        if name in vars(config):
            return vars(config)[name]
    except TypeError:
        pass
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and the like
        return None


def _set(config: Any, name: str, value: Any) -> None:
    # object.__setattr__ would skip transformers' attribute_map; plain setattr is what a user does.
    setattr(config, name, value)


def _causal_lm_subconfig(config: Any) -> Any:
    """G1: the sub-config the causal-LM class is built from, when it is not the config itself.

    transformers' auto factory already swaps a composite config for its ``text_config`` when
    ``model_class.config_class`` is the text sub-config; this does the same for any sub-config
    name (musicgen / musicgen_melody: ``decoder``)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ImportError):
        return config
    wanted = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name, sub_class in (getattr(config, "sub_configs", None) or {}).items():
        if sub_class is wanted and isinstance(getattr(config, name, None), wanted):
            return getattr(config, name)
    return config


def causal_lm_sub_config(config: Any) -> tuple[Any, Any] | None:
    """G1 for the builder: (causal-LM class, sub-config to build it from), or None when the
    config itself is what the class takes.

    ``AutoModelForCausalLM.from_config(MusicgenConfig)`` instantiates MusicgenForCausalLM with
    the composite config, but the class needs MusicgenDecoderConfig, and AutoModelForCausalLM
    rejects the decoder config itself (it is not in the mapping): build with the class,
    ``cls._from_config(sub, dtype=dtype)``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    sub = _causal_lm_subconfig(config)
    if sub is config or getattr(config, "text_config", None) is sub:
        return None  # transformers' auto factory already swaps in a text_config
    return model_class, sub


def _complete_attention_shape(cfg: Any) -> None:
    """G2 / G3: head_dim and num_key_value_heads left None.

    Every modeling file that reads them falls back to these values when the attribute is
    absent (``getattr(config, "head_dim", hidden_size // num_attention_heads)``; MHA when no
    GQA count is given); a None present on the config defeats that fallback."""
    heads = _raw(cfg, "num_attention_heads")
    hidden = _raw(cfg, "hidden_size")
    if not isinstance(heads, int) or heads <= 0:
        return
    if _unset(cfg, "head_dim") and isinstance(hidden, int) and hidden % heads == 0:
        _set(cfg, "head_dim", hidden // heads)
    if _unset(cfg, "num_key_value_heads"):
        _set(cfg, "num_key_value_heads", heads)


def _complete_layer_types(cfg: Any) -> None:
    """G4: layer_types None where the model indexes it (lfm2_moe).

    Inferred exactly as transformers' cache does for a config without layer_types
    (cache_utils.get_layer_types_and_kwargs): sliding_window -> sliding_attention,
    attention_chunk_size -> chunked_attention, else full_attention.  Only applied to the
    model types listed in _LAYER_TYPES_FROM_CACHE_RULE, because for other configs a None
    layer_types is legitimate (the model derives layer kinds from other fields)."""
    n = _raw(cfg, "num_hidden_layers")
    if not _unset(cfg, "layer_types") or not isinstance(n, int):
        return
    if _raw(cfg, "sliding_window") is not None:
        kind = "sliding_attention"
    elif _raw(cfg, "attention_chunk_size") is not None:
        kind = "chunked_attention"
    else:
        kind = "full_attention"
    _set(cfg, "layer_types", [kind] * n)


# lfm2_moe: Lfm2MoeConfig never fills layer_types, but Lfm2MoeModel indexes
# config.layer_types[i].  The sibling Lfm2Config fills it as "full_attention" for every layer
# when full_attn_idxs is not given (configuration_lfm2.py), which is the same answer as G4.
# (The public LiquidAI/LFM2-8B-A1B has 24 layers with attention at [2, 6, 10, 14, 18, 21] and
# conv elsewhere; that pattern does not fit the default 32 layers, so it is not used.)
_LAYER_TYPES_FROM_CACHE_RULE = {"lfm2_moe"}


def _fill(cfg: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        if _raw(cfg, name) is None:
            _set(cfg, name, value)


def _complete_deepseek_v2(cfg: Any) -> None:
    """DeepSeek-V2: V2-Lite's routing, and an expert width the grouped GEMM takes."""
    # Source: deepseek-ai/DeepSeek-V2-Lite config.json (the checkpoint named in
    # DeepseekV2Config's docstring): num_experts_per_tok=6, n_group=1, topk_group=1
    # (with n_routed_experts=64, n_shared_experts=2, topk_method="greedy", already default).
    _fill(cfg, {"num_experts_per_tok": 6, "n_group": 1, "topk_group": 1})
    # The one override of a set value: the default moe_intermediate_size=1407 is an odd
    # width that no released checkpoint uses (V2-Lite: 1408, V2: 1536) and that the default
    # experts kernel (torch._grouped_mm) rejects on any device ("stride along 0 dim to be
    # multiple of 16 bytes, got 1407").  Use V2-Lite's 1408, consistent with the routing
    # values above.  (Alternative that keeps 1407: config._experts_implementation = "eager".)
    if getattr(cfg, "moe_intermediate_size", None) == 1407:
        _set(cfg, "moe_intermediate_size", 1408)


def _complete_dots1(cfg: Any) -> None:
    """dots.llm1: the released checkpoints' experts."""
    # Source: rednote-hilab/dots.llm1.base / .inst config.json (checkpoint named in
    # Dots1Config's docstring): n_routed_experts=128, n_shared_experts=2,
    # num_experts_per_tok=6.  (n_group / topk_group are null there; default 1 is kept.)
    _fill(cfg, {"n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6})


def _complete_qwen4_exp_text(cfg: Any) -> None:
    """Qwen4-Exp text: the QSA indexer's five fields (also reached for qwen4_exp via its
    text_config)."""
    # Every indexed_attention layer builds a QSA indexer, which needs all five indexer_*
    # fields; the default config leaves them None.  Source: the released Qwen/Qwen4-Exp
    # text config as replicated by third-party loaders (indexer_n_heads=4,
    # indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
    # indexer_compress_ratio=4).  Invariants checked by
    # Qwen4ExpTextConfig.validate_architecture: kv_heads == 1, budget % ratio == 0, and
    # rotary_dim (= head_dim * partial_rotary_factor) <= indexer_head_dim.  The release uses
    # partial_rotary_factor 0.25 (rotary_dim 64); the default config has factor 1.0, so
    # rotary_dim = head_dim = 256 > 128: indexer_head_dim is raised to rotary_dim to keep
    # that invariant without touching rope_parameters.
    prf = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    rotary_dim = int(cfg.head_dim * prf)
    _fill(
        cfg,
        {
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": max(128, rotary_dim),
            "indexer_budget": 2048,
            "indexer_compress_ratio": 4,
        },
    )


def _complete_dbrx(cfg: Any) -> None:
    """DBRX: rope_theta copied down to attn_config, and the released qkv clip."""
    # DbrxAttention.__init__ reads config.attn_config.rope_theta (stored, never used in the
    # forward), but DbrxAttentionConfig has no such field; the rotary embedding takes theta
    # from the top-level rope_parameters.  Copy it down so both agree.
    attn = cfg.attn_config
    if getattr(attn, "rope_theta", None) is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        _set(attn, "rope_theta", theta)
    # clip_qkv=None means "no clipping" per the docstring, but DbrxAttention calls
    # qkv.clamp(min=None, max=None), which torch rejects.  Source for the value:
    # databricks/dbrx-base and dbrx-instruct config.json attn_config
    # {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000}.
    if getattr(attn, "clip_qkv", None) is None:
        _set(attn, "clip_qkv", 8)


def _complete_cohere_compass_text(cfg: Any) -> None:
    """Cohere Compass text: layer types missing from rope_parameters are NoPE."""
    # rope_parameters is keyed by layer type (per-layer RoPE, None = NoPE layer,
    # "allow per layer rope with optional NoPE layers" in CohereCompassTextConfig), but the
    # default is {} while every layer is full_attention -> KeyError.  A layer type missing
    # from the dict is completed as NoPE (None): that is the only value the config family
    # defines without inventing a theta, and it is the Cohere2 / Command-A convention for
    # full-attention layers (RoPE only on sliding layers).
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" not in rp and "rope_type" not in rp:
        for layer_type in dict.fromkeys(cfg.layer_types):
            rp.setdefault(layer_type, None)


def _complete_blt(cfg: Any) -> None:
    """BLT: as many cache slots as its deepest sub-model."""
    # BltModel.forward builds DynamicCache(config=self.config) on the top-level BltConfig,
    # which has no num_hidden_layers (the layer counts live in the encoder / global /
    # decoder sub-configs, each indexing the shared cache from layer 0).  The cache needs
    # as many slots as the deepest sub-model: max of the sub-configs' num_hidden_layers.
    if getattr(cfg, "num_hidden_layers", None) is None:
        depths = [
            getattr(getattr(cfg, name, None), "num_hidden_layers", 0) or 0
            for name in ("encoder_config", "global_config", "decoder_config")
        ]
        _set(cfg, "num_hidden_layers", max(depths))


# The completions, by model type: what a default config of that type leaves unusable.
_COMPLETIONS: dict[str, Callable[[Any], None]] = {
    "deepseek_v2": _complete_deepseek_v2,
    "dots1": _complete_dots1,
    "qwen4_exp_text": _complete_qwen4_exp_text,
    "dbrx": _complete_dbrx,
    "cohere_compass_text": _complete_cohere_compass_text,
    "blt": _complete_blt,
}


def _per_model(model_type: str, cfg: Any) -> None:
    """Complete ``cfg`` as its model type needs (:data:`_COMPLETIONS`); others are left."""
    complete = _COMPLETIONS.get(model_type)
    if complete is not None:
        complete(cfg)


def complete_config(config: Any) -> Any:
    """Fill what a default config leaves None / missing so the causal LM builds and runs."""
    model_type = getattr(config, "model_type", "")

    # The configs to patch: the config and its decoder text config (if a composite).
    targets = [config]
    try:
        text = config.get_text_config(decoder=True)
        if text is not config:
            targets.append(text)
    except Exception:  # noqa: BLE001 - ambiguous / odd composites: patch the top level only
        pass

    for cfg in targets:
        # G2 / G3: ministral, hunyuan_v1_dense, hunyuan_v1_moe (head_dim); nemotron (kv heads).
        _complete_attention_shape(cfg)
        if (_raw(cfg, "model_type") or model_type) in _LAYER_TYPES_FROM_CACHE_RULE:
            _complete_layer_types(cfg)  # G4
        _per_model(_raw(cfg, "model_type") or model_type, cfg)
    return config

"""Shared helpers: small HF models built on meta (no weights), traced as a user would."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)

# The tiny Llama the parallel tests shard (tests/test_parallel*.py): d = 256, 4 heads of 64,
# 2 KV heads, MLP 512, vocab 1024, 2 layers; every count they assert is derived from it.
PARALLEL_LLAMA = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=1024,
    num_hidden_layers=2,
)

# The tiny Llama the ZeRO and gradient-reduction tests train (tests/test_zero.py,
# tests/test_gradient_reduction.py): d = 64, 2 layers, vocabulary 128, 90,432 parameters.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)

# A tiny Mixtral the expert tests build: d = 64, 8 experts of FFN 128 (gate-up 64 -> 256,
# down 128 -> 64), top-2, 2 layers, 4 heads of 16 (2 KV heads), vocab 128.
TINY_MIXTRAL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=128,
)

# A tiny DeepSeek-V3 (latent attention and routed experts) the MLA tests build: latent 32,
# rope key 8, 4 heads of nope 16 + rope 8 (V 16), 8 experts of which 2 per token, layer 0 dense.
TINY_MLA = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    vocab_size=512,
)

# A tiny Jamba (Mamba layers with one attention layer and routed experts) the hybrid tests
# build: layer 1 attends (2 K/V heads of 16 dims) and routes to 2 of 4 experts, layer 0 is
# Mamba (d_state 8, d_conv 4, expand 2).
TINY_JAMBA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_period=2,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    num_experts=4,
    num_experts_per_tok=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    vocab_size=512,
)


def small_llama(layers: int = 4):
    """The Llama config the repeated-layer tests copy: d = 128, 4 heads of 32, 2 KV heads,
    MLP 352, vocab 1000, ``layers`` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=4096,
    )


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """examples/<name>.py loaded from its path (examples are not a package), registered under
    its name so its dataclasses resolve their module; loaded once per process."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Six model families, at a size that traces in well under a second each.
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(SMALL),
    "mistral": dict(SMALL),
    "qwen2": dict(SMALL),
    "gemma": dict(SMALL, head_dim=32),
    "gemma2": dict(SMALL, head_dim=32),
    "phi3": dict(SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=128),
}


def meta_causal_lm(model_type: str, dtype: torch.dtype = torch.bfloat16, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**FAMILY_CONFIGS[model_type], **overrides})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


@pytest.fixture
def tiny_llama():
    return meta_causal_lm("llama").eval()


@pytest.fixture
def meta_lm():
    """``meta_lm("llama", **overrides)`` builds a small causal LM on meta."""
    return meta_causal_lm


@pytest.fixture
def collector_at_each_step(monkeypatch):
    """Whether Python's cyclic garbage collector was on at each engine step scheduled
    (``Scheduler.schedule`` watched), in order."""
    import gc

    from torchroof.serving.scheduler import Scheduler

    seen: list[bool] = []
    schedule = Scheduler.schedule

    def watched(self, now):
        seen.append(gc.isenabled())
        return schedule(self, now)

    monkeypatch.setattr(Scheduler, "schedule", watched)
    return seen

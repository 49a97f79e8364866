"""Shared helpers: small HF models built on meta (no weights), traced as a user would."""

from __future__ import annotations

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

# The six families issue 2 names, at a size that traces in well under a second each.
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

"""A guard for the zoo: diverse architectures, built from their default configs at full
depth on meta, trace every regime with every op priced. A regression in any of them
(a new failure, a new uncounted op) fails here before the full zoo is rerun."""

import pytest

from torchroof.validation.zoo import replay_check, run_one

DIVERSE = [
    # dense decoders (MHA, GQA, parallel blocks, ALiBi, soft-capping)
    *("llama", "gpt2", "gemma2", "phi3", "olmo2", "falcon", "gpt_neox", "opt", "bloom"),
    *("cohere", "mistral", "qwen3"),
    # mixture of experts (grouped GEMMs, shared experts, sinks)
    *("mixtral", "qwen2_moe", "olmoe", "gpt_oss"),
    # multi-head latent attention
    "deepseek_v3",
    # state-space models
    *("mamba", "mamba2"),
    # hybrids: attention with SSM / linear attention / recurrences / short convolutions
    *("jamba", "qwen3_next", "falcon_h1", "recurrent_gemma", "zamba2", "minimax", "lfm2"),
    # encoder-decoders (decode with self- and cross-attention caches) and an encoder stack
    *("bart", "t5", "bert"),
]


# The cache each one's decode step uses: a silent drop from the static cache to the
# model's own (or to recomputing the context) is a regression too.
DECODE_CACHE = {"minimax": "model", "bart": "encoder-decoder", "t5": "encoder-decoder"}


# Architectures whose layers are all copied from one of each kind (the rest run some or
# all layers: a layer that keeps state of its own, a cache that grows as layers run).
COPIED = set(DIVERSE) - {"zamba2", "minimax"}


@pytest.mark.parametrize("architecture", DIVERSE)
def test_architecture_traces_every_regime_fully_priced(architecture):
    """Training traced as the zoo does; prefill and decode traced twice, running every
    layer and copying repeated ones, held to each other op for op and priced."""
    train = run_one(architecture, "train")
    assert train.ok, f"{architecture} train: {train.error}"
    assert train.uncounted == {} and train.ops > 0, f"{architecture} train: {train.uncounted}"
    checks = {regime: replay_check(architecture, regime) for regime in ("prefill", "decode")}
    for regime, check in checks.items():
        assert check.difference == "", f"{architecture} {regime}: {check.difference}"
        assert check.uncounted == {}, f"{architecture} {regime}: {check.uncounted}"
    assert checks["decode"].cache == DECODE_CACHE.get(architecture, "static")
    if architecture in COPIED:  # e.g. "32 repeated layers, 1 distinct kind: 1 traced, 31 copied"
        assert "copied" in checks["prefill"].repeated_layers, checks["prefill"].repeated_layers


def test_failures_are_rows_with_one_line():
    row = run_one("no_such_architecture", "prefill")
    assert not row.ok and "\n" not in row.error and row.error

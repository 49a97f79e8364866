"""A guard for the zoo: diverse architectures, built from their default configs at full
depth on meta, trace every regime with every op priced. A regression in any of them
(a new failure, a new uncounted op) fails here before the full zoo is rerun."""

import pytest

from torchroof.validation.zoo import run_one, summary

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


@pytest.mark.parametrize("architecture", DIVERSE)
def test_architecture_traces_every_regime_fully_priced(architecture):
    rows = [run_one(architecture, regime) for regime in ("prefill", "decode", "train")]
    for row in rows:
        assert row.ok, f"{architecture} {row.regime}: {row.error}"
        assert row.uncounted == {}, f"{architecture} {row.regime}: {row.uncounted}"
        assert row.ops > 0
    assert rows[1].cache == DECODE_CACHE.get(architecture, "static")
    assert summary(rows)["all_regimes_ok_and_fully_priced"] == 1


def test_failures_are_rows_with_one_line():
    row = run_one("no_such_architecture", "prefill")
    assert not row.ok and "\n" not in row.error and row.error

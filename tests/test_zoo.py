"""A guard for the zoo: diverse architectures, built from their default configs at full
depth on meta, trace every regime with every op priced (dense, GQA, MoE, MLA-style, SSM,
hybrid linear attention)."""

import pytest

from torchroof.zoo import run_one, summary

DIVERSE = ["llama", "mixtral", "deepseek_v3", "mamba", "qwen3_next", "gpt2"]


@pytest.mark.parametrize("architecture", DIVERSE)
def test_architecture_traces_every_regime_fully_priced(architecture):
    rows = [run_one(architecture, regime) for regime in ("prefill", "decode", "train")]
    for row in rows:
        assert row.ok, f"{architecture} {row.regime}: {row.error}"
        assert row.uncounted == {}, f"{architecture} {row.regime}: {row.uncounted}"
        assert row.ops > 0
    assert summary(rows)["all_regimes_ok_and_fully_priced"] == 1


def test_failures_are_rows_with_one_line():
    row = run_one("no_such_architecture", "prefill")
    assert not row.ok and "\n" not in row.error and row.error

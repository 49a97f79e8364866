"""Steps traced once with their sizes as symbols, held to fresh estimates: the checked-in
results of examples/symbolic_check.py on the zoo's 29 architectures (prefill and decode,
six points each in both timing modes, every figure and every estimate field equal), two of
them rerun live, and the quantised and narrow-cache steps of a small Llama."""

import json
from pathlib import Path

import pytest
from conftest import small_llama

import torchroof
from torchroof.report.compare import point_metrics
from torchroof.studies import sweep_grid

RESULTS = json.loads((Path(__file__).parent / "data" / "symbolic_check.json").read_text())
ROWS = {(r["architecture"], r["regime"]): r for r in RESULTS}
# traced at every size: a kernel that wants concrete sizes on meta (Bloom's ALiBi prefill,
# the hybrids' scans and convolutions), a symbolic trace that a second point traced afresh
# refuses (latent attention with routed experts, Jamba's prefill, MiniMax, BART), or one
# whose decisions no point near it keeps (DeepSeek-V3's prefill)
NOT_SYMBOLIC = {
    ("bloom", "prefill"),
    ("jamba", "prefill"),
    *(
        (a, r)
        for a in ("deepseek_v3", "mamba2", "qwen3_next", "falcon_h1")
        for r in ("prefill", "decode")
    ),
    *(
        (a, r)
        for a in ("recurrent_gemma", "zamba2", "minimax", "bart")
        for r in ("prefill", "decode")
    ),
}


def test_the_checked_in_results_cover_every_step_and_agree():
    assert len(RESULTS) == 29 * 2
    assert all(r["points"] == 12 for r in RESULTS)  # six points, two timing modes
    assert [k for k, r in ROWS.items() if r["differences"]] == []
    assert {k for k, r in ROWS.items() if r["symbolic"] == 0} == NOT_SYMBOLIC
    assert all(r["notes"] for k, r in ROWS.items() if k in NOT_SYMBOLIC)  # each says why
    # the dense decoders: two symbolic traces (batch 1, and the rest), every point's trace
    # made from them and every point's figures planned (6 points x 2 modes)
    for architecture in ("llama", "gpt2", "mistral", "qwen3", "opt"):
        for regime in ("prefill", "decode"):
            row = ROWS[(architecture, regime)]
            assert (row["symbolic"], row["substituted"], row["planned"]) == (2, 6, 12), row


@pytest.mark.parametrize("architecture, regime", [("llama", "decode"), ("qwen2_moe", "prefill")])
def test_a_rerun_matches_the_checked_in_result(architecture, regime):
    """A dense decoder, and routed experts with a shared expert."""
    from torchroof.validation.symbolic_check import symbolic_check

    check = symbolic_check(architecture, regime)
    row = ROWS[(architecture, regime)]
    assert check.differences == []
    assert (check.symbolic, check.substituted, check.planned) == (
        row["symbolic"],
        row["substituted"],
        row["planned"],
    )


@pytest.mark.parametrize(
    "knobs",
    [
        {"quant": "int8-weight"},
        {"quant": "fp8-rowwise"},
        {"quant": "int4-weight"},
        {"kv_dtype": "fp8"},
        {"cache": "dynamic"},
    ],
)
def test_quantised_and_cache_variants_equal_fresh_estimates(knobs):
    config = small_llama(8)
    grid = sweep_grid(config, {"batch": [1, 3], "context": [20, 300]}, regime="decode", **knobs)
    assert grid.notes == []  # every point made from a symbolic trace and priced from a plan
    for point in grid.points:
        fresh = torchroof.estimate(config, "decode", **knobs, **point.values)
        assert point.metrics == point_metrics(fresh), (knobs, point.values)

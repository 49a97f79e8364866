"""MoE routing as priced: balanced, expected (uniform random top-k) and a measured
histogram change the expert weights each grouped GEMM reads, never its FLOPs."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from conftest import TINY_MIXTRAL
from transformers import MixtralConfig

import torchroof
from torchroof.config import PricingOptions
from torchroof.config.errors import OptionError
from torchroof.config.routing import HISTOGRAM, parse_routing
from torchroof.pricing.routing import expected_experts

MIXTRAL = TINY_MIXTRAL  # conftest: d 64, 8 experts of FFN 128, top-2, 2 layers
E, TOP_K, D, FFN, LAYERS = 8, 2, 64, 128, 2
BF16 = 2
# one layer's experts: gate-up 8 x 256 x 64 and down 8 x 64 x 128, bf16
GATE_UP_BYTES, DOWN_BYTES = E * 2 * FFN * D * BF16, E * D * FFN * BF16  # 262,144 and 131,072


def _brute_force(experts: int, top_k: int, tokens: int) -> Fraction:
    """The mean number of distinct experts over every equally likely way ``tokens`` tokens
    each pick ``top_k`` distinct experts."""
    choices = list(itertools.combinations(range(experts), top_k))
    total = count = 0
    for picks in itertools.product(choices, repeat=tokens):
        total += len(set().union(*picks))
        count += 1
    return Fraction(total, count)


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(4, 2, 2), (5, 2, 3), (6, 3, 2)])
def test_expected_experts_is_the_mean_over_every_routing(experts, top_k, tokens):
    # E=4, k=2, T=2 by hand: 4·(1 - (1/2)^2) = 3; the enumeration of the 36 equally likely
    # pairs of 2-subsets agrees, and so for the other two
    shares = [1 / experts] * experts
    assert expected_experts(tokens, top_k, shares) == pytest.approx(
        float(_brute_force(experts, top_k, tokens))
    )
    assert expected_experts(2, 2, [0.25] * 4) == pytest.approx(3.0)


def test_expected_experts_at_one_token_and_at_a_large_batch():
    # one token reaches exactly its k experts; Mixtral (8, top-2) at 4 tokens:
    # 8·(1 - 0.75^4) = 8 · 0.68359375 = 5.46875; at 64 tokens every expert is all but sure
    assert expected_experts(1, 2, [1 / 8] * 8) == pytest.approx(2.0)
    assert expected_experts(4, 2, [1 / 8] * 8) == pytest.approx(5.46875)
    assert expected_experts(64, 2, [1 / 8] * 8) == pytest.approx(8.0, abs=1e-7)
    # a skewed histogram reaches fewer: two tokens of top-1 over 4 experts reach
    # 4·(1 - 0.75^2) = 1.75 uniformly, 2·(1 - 0.5^2) = 1.5 when two experts get it all
    assert expected_experts(2, 1, [0.25] * 4) == pytest.approx(1.75)
    assert expected_experts(2, 1, [0.5, 0.5, 0, 0]) == pytest.approx(1.5)
    with pytest.raises(OptionError, match="exceeds 1/top_k"):
        expected_experts(3, 2, [0.7, 0.1, 0.1, 0.1])  # a token cannot pick one expert twice


def test_routing_option_parses_every_form_and_refuses_the_rest(tmp_path):
    assert parse_routing("expected").kind == "expected"
    given = parse_routing("3, 1")
    assert given.kind == HISTOGRAM and given.shares == (0.75, 0.25) and given.source == "given"
    path = tmp_path / "counts.txt"
    path.write_text("1\n1\n2\n", encoding="utf-8")
    assert parse_routing(str(path)).shares == (0.25, 0.25, 0.5)
    # options hold the file's shares, not its name: a saved estimate needs no file
    assert PricingOptions(routing=str(path)).routing == "0.25,0.25,0.5"
    for bad, needle in [
        ("uniform", "routing is balanced, expected, or a histogram"),
        ("1,-1", "non-negative finite shares"),
        ("0, 0", "positive total"),
    ]:
        with pytest.raises(OptionError, match=needle):
            PricingOptions(routing=bad)


def _grouped(est) -> list:
    return [k for k in est.kernels if any("grouped_mm" in o for o in k.ops)]


def test_expected_routing_reads_the_experts_a_decode_batch_reaches():
    # decode, batch 4: 8 routed rows reach min(8, 8) = 8 experts under balanced routing,
    # 5.46875 expected: each forward grouped GEMM reads 5.46875/8 of its experts' weights
    # (gate-up 262,144 B -> 179,200 B, down 131,072 B -> 89,600 B); FLOPs do not change
    config = MixtralConfig(**MIXTRAL)
    base = dict(batch=4, context=64, hardware="h100")
    balanced = torchroof.estimate(config, "decode", **base)
    expected = torchroof.estimate(config, "decode", routing="expected", **base)
    assert expected.flops == balanced.flops
    before, after = _grouped(balanced), _grouped(expected)
    assert len(before) == len(after) == 2 * LAYERS
    assert sorted(k.read_by["weights"] for k in before) == [DOWN_BYTES] * 2 + [GATE_UP_BYTES] * 2
    assert sorted(k.read_by["weights"] for k in after) == [89_600] * 2 + [179_200] * 2
    for b, a in zip(before, after, strict=True):
        assert b.bytes_read - a.bytes_read == b.read_by["weights"] - a.read_by["weights"]
    saved = sum(
        b.read_by["weights"] - a.read_by["weights"] for b, a in zip(before, after, strict=True)
    )
    assert balanced.weight_bytes_read - expected.weight_bytes_read == saved
    assert expected.time_s < balanced.time_s
    assert any("E·(1 - (1 - k/E)^tokens)" in a and "top-2 of 8" in a for a in expected.assumptions)
    # one token reaches its 2 experts either way: balanced and expected agree
    one = dict(base, batch=1)
    assert torchroof.estimate(config, "decode", routing="expected", **one).time_s == (
        pytest.approx(torchroof.estimate(config, "decode", **one).time_s)
    )


def test_a_histogram_sets_the_busiest_expert_rank():
    # ep 4 over 8 experts, shares 2,2,1,1,1,1,1,1 (of 10): the first group holds 0.4 of the
    # rows, 1.6x its balanced quarter, so its grouped GEMMs take 1.6x the balanced compute
    config = MixtralConfig(**MIXTRAL)
    base = dict(hardware="dgx-h100", batch=2, seq=16, dp=4, ep=4)
    balanced = torchroof.estimate(config, "prefill", **base)
    skewed = torchroof.estimate(config, "prefill", routing="2,2,1,1,1,1,1,1", **base)
    pairs = [
        (b, s)
        for b, s in zip(balanced.kernels, skewed.kernels, strict=True)
        if any("grouped_mm" in o for o in b.ops)
    ]
    assert pairs
    for b, s in pairs:
        assert s.compute_s == pytest.approx(1.6 * b.compute_s)
    assert any("1.6x the balanced share" in a for a in skewed.assumptions)
    with pytest.raises(OptionError, match="give one"):
        torchroof.estimate(
            config, "prefill", routing="2,2,1,1,1,1,1,1", routing_imbalance=1.2, **base
        )
    with pytest.raises(OptionError, match="has 4 shares but the model routes over 8"):
        torchroof.estimate(config, "prefill", routing="1,1,1,1", hardware="h100", batch=2, seq=16)


def test_a_prepared_grid_prices_the_routing_asked():
    # the planned grid (metrics) would time kernels under balanced routing: a routing
    # other than balanced is priced from the point's own trace, the same as price()
    config = MixtralConfig(**MIXTRAL)
    prepared = torchroof.prepare(config, "decode", batch=3, context=32)
    metrics = prepared.metrics("h100", routing="expected")
    priced = prepared.price("h100", routing="expected")
    balanced = prepared.price("h100")
    assert metrics["step_time_s"] == pytest.approx(priced.time_s)
    assert metrics["weight_bytes"] == priced.weight_bytes_read
    assert priced.time_s < balanced.time_s

"""Attention rules (Dao et al. 2022, FlashAttention; the KV cache and GQA: Pope et al. 2022,
Ainslie et al. 2023)."""

import pytest
import torch
import torch.nn.functional as F
from torchroof.counters import cost_of
from torchroof.counters.attention import causal_fraction

import torchroof

N, D, S = 4096, 128, 2  # sequence, head dim, bf16 bytes


def _sdpa_ops(q, k, v, **kwargs):
    with torchroof.trace() as t:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        if out.requires_grad:
            out.sum().backward()
    return t.ops


def _meta(*shape, grad=False):
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta", requires_grad=grad)


def test_flash_forward_compulsory_bytes_and_causal_halving():
    q, k, v = (_meta(1, 1, N, D) for _ in range(3))
    full = cost_of(next(op for op in _sdpa_ops(q, k, v) if "attention" in op.name))
    causal = cost_of(
        next(op for op in _sdpa_ops(q, k, v, is_causal=True) if "attention" in op.name)
    )
    # W = 4·N²·d per head = 4·4096²·128 = 8,589,934,592 FLOP
    assert full.flops == 4 * N * N * D == 8_589_934_592
    # Q = 4·s·N·d (q, k, v read, o written) = 4,194,304 bytes, plus the fp32
    # log-sum-exp (4·N = 16,384 bytes) the flash kernel also writes
    assert full.bytes == 4 * S * N * D + 4 * N
    # I = 8,589,934,592 / (4,194,304 + 16,384) = 2040.2, the compulsory N/s = 2048 less the lse
    assert full.intensity == 8_589_934_592 / 4_210_688
    # causal: the mask keeps N(N + 1)/2 of the N² score pairs, so W = 4·N²·d·(N + 1)/(2N)
    # = 2·N·(N + 1)·d = 2·4096·4097·128 (the usual half, 4,294,967,296, plus the diagonal's
    # 2·N·d = 1,048,576); the compulsory bytes stay (every q, k, v element is still read once)
    assert causal.flops == 2 * N * (N + 1) * D == 4_296_015_872
    assert causal.bytes == full.bytes


def test_sdpa_is_recorded_as_one_flash_kernel_not_the_math_decomposition():
    q, k, v = (_meta(2, 8, 256, 64) for _ in range(3))
    ops = _sdpa_ops(q, k, v, is_causal=True)
    names = [op.name for op in ops]
    assert names == ["aten._scaled_dot_product_flash_attention.default"]
    assert ops[0].synthetic and ops[0].arg("is_causal") is True


def test_gqa_reads_kv_at_kv_heads_without_repeat_copies():
    # 32 query heads share 8 K/V heads (g = 4); no repeat_kv clone is recorded
    q = _meta(1, 32, 1024, 128)
    k, v = _meta(1, 8, 1024, 128), _meta(1, 8, 1024, 128)
    ops = _sdpa_ops(q, k, v, enable_gqa=True)
    assert [op.name for op in ops] == ["aten._scaled_dot_product_flash_attention.default"]
    cost = cost_of(ops[0])
    assert cost.flops == 4 * 32 * 1024 * 1024 * 128
    q_bytes = 32 * 1024 * 128 * 2
    kv_bytes = 2 * 8 * 1024 * 128 * 2  # K and V at h_kv = 8 heads
    assert cost.bytes_read == q_bytes + kv_bytes
    assert cost.bytes_written == q_bytes + 32 * 1024 * 4  # o + fp32 log-sum-exp


def test_decode_attention_intensity_is_two_g_over_s():
    # one query token against a cache of N tokens, g = 64/8 = 8 (Llama-3-70B)
    q = _meta(1, 64, 1, 128)
    k, v = _meta(1, 8, 8192, 128), _meta(1, 8, 8192, 128)
    cost = cost_of(_sdpa_ops(q, k, v, enable_gqa=True)[0])
    # W = 4·N·d·h = 4·8192·128·64 = 268,435,456 (one query row: no causal mask to apply)
    assert cost.flops == 4 * 8192 * 128 * 64 == 268_435_456
    # Q = K and V at h_kv heads, 2·s·N·d·h_kv = 33,554,432, plus q and o (64·128·2 each)
    # and the fp32 lse (64·4)
    assert cost.bytes == 2 * 2 * 8192 * 128 * 8 + 2 * 64 * 128 * 2 + 64 * 4 == 33_587_456
    # I = 268,435,456 / 33,587,456 = 7.992: 2g/s = 8 (Llama-3-70B's g = 8 in bf16: I = 8)
    # less the q/o/lse bytes
    assert cost.intensity == 268_435_456 / 33_587_456


def test_masked_sdpa_is_the_efficient_kernel_and_reads_the_bias():
    q, k, v = (_meta(1, 4, 128, 64) for _ in range(3))
    mask = torch.empty(1, 1, 128, 128, dtype=torch.bool, device="meta")
    ops = _sdpa_ops(q, k, v, attn_mask=mask)
    assert ops[0].name == "aten._scaled_dot_product_efficient_attention.default"
    cost = cost_of(ops[0])
    assert cost.bytes_read == 3 * 4 * 128 * 64 * 2 + 128 * 128  # q, k, v + bool mask once


def test_flash_backward_replaces_the_decomposition_backward():
    q, k, v = (_meta(1, 4, 512, 64, grad=True) for _ in range(3))
    ops = _sdpa_ops(q, k, v, is_causal=True)
    attention = [op for op in ops if "attention" in op.name]
    assert [op.name for op in attention] == [
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_backward.default",
    ]
    assert attention[1].phase == "backward"
    forward, backward = cost_of(attention[0]), cost_of(attention[1])
    # causal 512 x 512: 512·513/2 = 131,328 kept pairs per head, 4 heads, d = dv = 64;
    # forward 2·4·131,328·(64 + 64) = 134,479,872
    assert forward.flops == 2 * 4 * (512 * 513 // 2) * (64 + 64) == 134_479_872
    # backward recomputes S and forms dV, dP, dQ, dK: 2·4·131,328·(3·64 + 2·64) = 336,199,680,
    # 2.5x the forward
    assert backward.flops == 2 * 4 * (512 * 513 // 2) * (3 * 64 + 2 * 64) == 336_199_680
    # no bmm / softmax of the math path leaked into the backward
    assert not any(
        op.name in ("aten.bmm.default", "aten._softmax_backward_data.default") for op in ops
    )


def test_causal_fraction_square_is_half_plus_the_diagonal():
    # tril(ones(4, 4)) keeps 1 + 2 + 3 + 4 = 10 of 16 pairs: (n + 1)/(2n) = 5/8, not 1/2
    assert causal_fraction(4, 4) == 10 / 16
    assert causal_fraction(4, 4, aligned_to_end=True) == 10 / 16  # the same mask when square
    assert causal_fraction(1, 1) == 1.0  # one query, one key: the diagonal is everything
    # N = 4096: 4097 / 8192 = 0.5001220703125 (causal "halves W", exactly)
    assert causal_fraction(4096, 4096) == 4097 / 8192


def test_causal_fraction_rectangular():
    # PyTorch's is_causal is top-left aligned, tril(ones(2, 4)): rows keep 1 and 2 keys,
    # 3 of 8 pairs
    assert causal_fraction(2, 4) == 3 / 8
    # tril(ones(4, 2)): rows keep 1, 2, 2, 2 -> 7 of 8
    assert causal_fraction(4, 2) == 7 / 8
    # aligned to the end (2 new tokens after 2 cached: a prefill onto a cache): rows keep
    # 3 and 4 keys -> 7 of 8
    assert causal_fraction(2, 4, aligned_to_end=True) == 7 / 8
    # 4 queries on 2 keys, aligned to the end: rows keep 0, 0, 1, 2 -> 3 of 8
    assert causal_fraction(4, 2, aligned_to_end=True) == 3 / 8


def test_causal_fraction_one_query():
    # a decode step: one query aligned to the end of 8192 keys sees every key
    assert causal_fraction(1, 8192, aligned_to_end=True) == 1.0
    # PyTorch's is_causal with one query keeps key 0 only (why HF decodes with is_causal off)
    assert causal_fraction(1, 8192) == 1 / 8192


@pytest.mark.parametrize("aligned_to_end", [False, True])
def test_causal_fraction_equals_the_mask_torch_builds(aligned_to_end):
    # the closed form against the mask itself: tril with the diagonal at offset 0
    # (top-left) or kv - q (end-aligned), for every shape up to 12 x 12
    for q_len in range(1, 13):
        for kv_len in range(1, 13):
            offset = kv_len - q_len if aligned_to_end else 0
            kept = int(torch.ones(q_len, kv_len).tril(diagonal=offset).sum())
            assert causal_fraction(q_len, kv_len, aligned_to_end=aligned_to_end) == kept / (
                q_len * kv_len
            ), (q_len, kv_len)


def test_causal_fraction_edge_cases():
    assert causal_fraction(0, 16) == 0.0 and causal_fraction(16, 0) == 0.0  # no pairs
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        causal_fraction(-1, 4)


def test_rectangular_causal_sdpa_is_priced_at_the_kept_pairs():
    # 2 queries on 4 keys with is_causal: 3 of 8 pairs (top-left), 2 heads, d = dv = 32:
    # W = 2·2·3·(32 + 32) = 768
    q, k, v = _meta(1, 2, 2, 32), _meta(1, 2, 4, 32), _meta(1, 2, 4, 32)
    cost = cost_of(_sdpa_ops(q, k, v, is_causal=True)[0])
    assert cost.flops == 2 * 2 * 3 * (32 + 32) == 768


def test_math_policy_records_the_decomposition():
    q, k, v = (_meta(1, 2, 64, 32) for _ in range(3))
    with torchroof.trace(flash_attention=False) as t:
        F.scaled_dot_product_attention(q, k, v)
    names = {op.name for op in t.ops}
    assert "aten.bmm.default" in names and not any("flash" in n for n in names)

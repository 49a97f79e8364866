"""Attention rules (seed 000 "Attention from first principles", "FlashAttention is an IO
algorithm", "Attention III: KV cache, GQA")."""

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
    # I ≈ N/s per head (seed: "linear in sequence length")
    assert full.intensity == pytest.approx(N / S, rel=5e-3)
    # causal: half the score pairs, so half the FLOPs; the compulsory bytes stay (every
    # q, k, v element is still read once)
    assert causal.flops == full.flops // 2
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
    # W = 4·N·d·h, Q ≈ 2·s·N·d·h_kv  ->  I = 2g/s = 8 (seed 000: "Llama-3-70B ... I = 8")
    assert cost.intensity == pytest.approx(8, rel=0.01)


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
    # backward recomputes S and forms dV, dP, dQ, dK: 2·Lq·Lk·(3d + 2d) = 2.5x forward
    assert backward.flops == pytest.approx(2.5 * forward.flops)
    # no bmm / softmax of the math path leaked into the backward
    assert not any(
        op.name in ("aten.bmm.default", "aten._softmax_backward_data.default") for op in ops
    )


def test_causal_fraction_for_unequal_lengths():
    assert causal_fraction(4, 4) == 0.5
    # top-left aligned tril(ones(2, 4)): rows keep 1 and 2 keys -> 3 of 8 pairs
    assert causal_fraction(2, 4) == 3 / 8
    # tril(ones(4, 2)): rows keep 1, 2, 2, 2 -> 7 of 8
    assert causal_fraction(4, 2) == 7 / 8


def test_math_policy_records_the_decomposition():
    q, k, v = (_meta(1, 2, 64, 32) for _ in range(3))
    with torchroof.trace(flash_attention=False) as t:
        F.scaled_dot_product_attention(q, k, v)
    names = {op.name for op in t.ops}
    assert "aten.bmm.default" in names and not any("flash" in n for n in names)

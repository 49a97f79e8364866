"""Matmul rules against worked numbers (W = 2MNK, compulsory Q: NVIDIA, Matrix Multiplication
Background User's Guide), traced through the real capture on meta tensors."""

import math

import pytest
import torch
from torchroof.counters import cost_of
from torchroof.hardware import get

import torchroof


def _single(fn, *tensors):
    with torchroof.trace() as t:
        fn(*tensors)
    kernels = [op for op in t.ops if cost_of(op).bytes]
    assert len(kernels) == 1, [op.name for op in t.ops]
    return kernels[0], cost_of(kernels[0])


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_square_gemm_4096_bf16_matches_seed():
    op, cost = _single(torch.mm, _meta(4096, 4096), _meta(4096, 4096))
    assert op.name == "aten.mm.default"
    # W = 2·n³ = 2·4096³ = 137,438,953,472 FLOP (137 GFLOP)
    assert cost.flops == 2 * 4096**3 == 137_438_953_472
    # Q = s·(MK + KN + MN) = 2·3·4096² = 100,663,296 bytes (100.7 MB)
    assert cost.bytes == 100_663_296
    # I = 2n/(3s) = n/3 = 1365.33 (1365 FLOP/byte)
    assert cost.intensity == pytest.approx(4096 / 3)
    assert cost.unit == "tensor" and cost.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("tokens", "intensity", "bound"),
    [
        (32768, 3641, "compute"),  # training / prefill
        (512, 455, "compute"),  # short prompt, "compute, barely"
        (64, 63, "memory"),  # decode batch 64
        (1, 1.0, "memory"),  # decode batch 1: a GEMV
    ],
)
def test_seed_table2_projection_regimes(tokens, intensity, bound):
    d = 8192
    op, cost = _single(torch.mm, _meta(tokens, d), _meta(d, d))
    # I = 2·M·d² / [s·(2·M·d + d²)] = 2Md / [s(2M + d)]
    assert cost.intensity == pytest.approx(2 * tokens * d / (2 * (2 * tokens + d)))
    assert round(cost.intensity, 0 if intensity > 10 else 2) == pytest.approx(intensity, rel=2e-3)
    est = torchroof.estimate_trace(_trace_of(op), "h100-sxm")
    assert est.kernels[0].bound == bound  # against the H100 ridge of 295


def _trace_of(op):
    return torchroof.Trace(ops=[op])


def test_bmm_and_baddbmm_count_every_batch():
    _, cost = _single(torch.bmm, _meta(8, 64, 32), _meta(8, 32, 16))
    assert cost.flops == 2 * 8 * 64 * 16 * 32  # 2·B·M·N·K = 524,288
    # reads 8·64·32 + 8·32·16 elements, writes 8·64·16, 2 bytes each
    assert cost.bytes == 2 * (8 * 64 * 32 + 8 * 32 * 16 + 8 * 64 * 16)
    _, cost = _single(torch.baddbmm, _meta(8, 64, 16), _meta(8, 64, 32), _meta(8, 32, 16))
    assert cost.flops == 2 * 8 * 64 * 16 * 32 + 8 * 64 * 16  # + the bias epilogue


def test_linear_with_bias_is_addmm_with_broadcast_bias_read_once():
    x, w, b = _meta(32, 64), _meta(128, 64), _meta(128)
    op, cost = _single(torch.nn.functional.linear, x, w, b)
    assert op.name == "aten.addmm.default"
    assert cost.flops == 2 * 32 * 128 * 64 + 32 * 128
    # bias (128) is read once although it is broadcast over 32 rows
    assert cost.bytes_read == 2 * (32 * 64 + 128 * 64 + 128)
    assert cost.bytes_written == 2 * 32 * 128


def test_conv2d_forward_and_backward_match_torch_flop_formula():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.empty(2, 3, 16, 16, device="meta", requires_grad=True)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1, device="meta")
    with torchroof.trace() as t:
        conv(x).sum().backward()
    with FlopCounterMode(display=False) as counter:
        conv(x).sum().backward()
    conv_ops = [op for op in t.ops if "convolution" in op.name]
    assert [op.phase for op in conv_ops] == ["forward", "backward"]
    # forward: 2 · (2·8·16·16 outputs) · (3·3·3 MACs each) = 221,184, + 4,096 bias adds
    assert cost_of(conv_ops[0]).flops == 2 * (2 * 8 * 16 * 16) * 27 + 2 * 8 * 16 * 16
    torch_total = counter.get_total_flops()
    ours = sum(cost_of(op).flops for op in conv_ops)
    bias_terms = 2 * 8 * 16 * 16 * 2  # forward bias add + backward bias gradient
    assert ours - bias_terms == torch_total


def test_fp32_matmul_runs_on_vector_units_unless_tf32_allowed():
    op, _ = _single(
        torch.mm, _meta(1024, 1024, dtype=torch.float32), _meta(1024, 1024, dtype=torch.float32)
    )
    h100 = get("h100")
    plain = torchroof.estimate_trace(_trace_of(op), h100)
    tf32 = torchroof.estimate_trace(_trace_of(op), h100, allow_tf32=True)
    assert plain.kernels[0].peak_flops_per_s == pytest.approx(66.9e12)
    assert tf32.kernels[0].peak_flops_per_s == pytest.approx(494.7e12)
    # 2·1024³ FLOP at 66.9 TF/s vs at 494.7 TF/s
    assert plain.time_s / tf32.time_s == pytest.approx(494.7 / 66.9)
    assert math.isclose(plain.flops, 2 * 1024**3)


def test_triangular_solve_counts_n_squared_per_column():
    a, b = _meta(4, 64, 64, dtype=torch.float32), _meta(4, 64, 16, dtype=torch.float32)
    op, cost = _single(lambda x, y: torch.linalg.solve_triangular(x, y, upper=False), a, b)
    # 4 matrices · 64² · 16 columns = 262,144 FLOPs (half of a dense 2·n²·k product)
    assert cost.flops == 4 * 64 * 64 * 16 == 262_144
    assert cost.unit == "tensor"
    assert cost.bytes == 4 * (4 * 64 * 64 + 2 * 4 * 64 * 16)  # read A and B, write X

"""Packed low-bit linear layers (torchroof/quant/packed_weights.py) and their cost rules
(counters/quantized.py): W = 2MNK, Q compulsory, a packed operand read at its stored width,
and the fp4 peak on Blackwell only (NVIDIA Blackwell datasheet)."""

import pytest
import torch
from conftest import PARALLEL_LLAMA
from torch import nn
from torchroof.counters import cost_of, kind_of
from torchroof.hardware import UnsupportedDtypeError

import torchroof
from torchroof.api import meta_copy
from torchroof.quant.packed_weights import (
    PACKED_QUANTS,
    apply_packed_weights,
    dequantize_int4,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    pack_nibbles,
    quantize_int4,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_nibbles,
)

K, N = 4096, 14336  # Llama 3 8B's gate/up projection
CODES = K * N // 2  # 4-bit codes, two per byte: 29,360,128 B
X_BF16 = K * 2  # one token in: 8,192 B
OUT_BF16 = N * 2  # one token out: 28,672 B
GEMV_FLOPS = 2 * K * N  # 2MNK at M = 1: 117,440,512
H100_HBM, B200_HBM, B200_FP4 = 3.35e12, 8e12, 9e15


def _packed_linear(quant, m=1, bias=False):
    """One Linear(4096 -> 14336) packed on meta and traced on x [m, 4096] bf16."""
    model = nn.Sequential(nn.Linear(K, N, bias=bias, device="meta", dtype=torch.bfloat16))
    assert apply_packed_weights(model, quant) == 1
    x = torch.empty(m, K, device="meta", dtype=torch.bfloat16)
    with torch.no_grad(), torchroof.trace() as t:
        model(x)
    return t


def _op(trace, name):
    (op,) = [op for op in trace.ops if op.name == f"torchroof.{name}.default"]
    return op, cost_of(op)


@pytest.mark.parametrize(
    "quant, op_name, scale_bytes",
    [
        # bf16 scale and zero per 128 along K: 4096/128 · 14336 · 2 values · 2 B = 1,835,008
        ("int4-weight", "int4_weight_mm", K // 128 * N * 2 * 2),
        # one e8m0 byte per 32 along K: 4096/32 · 14336 · 1 B = 1,835,008 (the same bytes)
        ("mxfp4-weight", "mxfp4_weight_mm", K // 32 * N),
    ],
)
def test_weight_only_decode_gemv_reads_half_a_byte_per_weight(quant, op_name, scale_bytes):
    t = _packed_linear(quant)
    op, cost = _op(t, op_name)
    assert kind_of(op.packet) == "opaque"
    assert cost.flops == GEMV_FLOPS == 117_440_512
    assert (cost.unit, cost.dtype) == ("tensor", "bfloat16")  # x's dtype: weight-only
    # Q = codes + scales + x = 29,360,128 + 1,835,008 + 8,192 = 31,203,328 read
    assert cost.bytes_read == CODES + scale_bytes + X_BF16 == 31_203_328
    assert cost.bytes_written == OUT_BF16 == 28_672
    # the packed tensors are weights, held at their stored width: 29,360,128 + 1,835,008
    assert t.role_bytes == {"weights": CODES + scale_bytes}
    est = t.estimate("h100-sxm")
    (kernel,) = est.kernels
    assert est.uncounted == {}
    # memory bound: (31,203,328 + 28,672) B / 3.35 TB/s = 9.323 us
    assert kernel.bound == "memory"
    assert kernel.time_s == pytest.approx(31_232_000 / H100_HBM)


def test_int4_bias_is_read_by_the_gemm():
    _, cost = _op(_packed_linear("int4-weight", bias=True), "int4_weight_mm")
    # as above plus the bf16 bias: 31,203,328 + 14336 · 2 = 31,232,000
    assert cost.bytes_read == 31_203_328 + N * 2


def test_nvfp4_decode_gemv_quantises_x_then_runs_on_fp4_tensor_cores():
    t = _packed_linear("nvfp4")
    quantize, q_cost = _op(t, "quantize_nvfp4")
    # reads x (8,192 B), writes 4096/2 = 2,048 B of codes and 4096/16 = 256 e4m3 scales;
    # 3 FLOPs per element (abs, compare, multiply): 12,288
    assert (q_cost.bytes_read, q_cost.bytes_written) == (X_BF16, 2_048 + 256)
    assert (q_cost.flops, q_cost.unit) == (3 * K, "vector")
    assert kind_of(quantize.packet) == "reduction"  # fused into its producer (a norm)

    mm, cost = _op(t, "nvfp4_mm")
    assert kind_of(mm.packet) == "opaque"
    assert cost.flops == GEMV_FLOPS
    assert (cost.unit, cost.dtype) == ("tensor", "float4_e2m1fn_x2")
    # codes 29,360,128 + e4m3 scales 4096/16 · 14336 = 3,670,016 + the fp32 tensor scale 4
    # + xq 2,048 + xs 256 = 33,032,452
    weight_bytes = CODES + K // 16 * N + 4
    assert cost.bytes_read == weight_bytes + 2_048 + 256 == 33_032_452
    assert cost.bytes_written == OUT_BF16
    assert t.role_bytes == {"weights": weight_bytes}

    est = t.estimate("b200")
    gemm = next(k for k in est.kernels if k.name == mm.name)
    assert gemm.peak_flops_per_s == B200_FP4  # the fp4 dense peak, 9 PF
    # memory bound at M = 1: (33,032,452 + 28,672) B / 8 TB/s = 4.133 us
    assert gemm.time_s == pytest.approx((33_032_452 + 28_672) / B200_HBM)


def test_nvfp4_prefill_gemm_is_timed_at_the_fp4_peak():
    t = _packed_linear("nvfp4", m=4096)
    gemm = next(k for k in t.estimate("b200").kernels if k.name == "torchroof.nvfp4_mm.default")
    # W = 2 · 4096 · 14336 · 4096 = 481,036,337,152; / 9e15 = 53.4 us, against
    # Q ≈ 33.0 MB weights + 8.4 MB xq + 1.0 MB xs + 117.4 MB out = 159.9 MB / 8e12 = 20 us
    assert gemm.flops == 2 * 4096 * N * K == 481_036_337_152
    assert gemm.bound == "compute"
    assert gemm.time_s == pytest.approx(481_036_337_152 / B200_FP4)


def test_nvfp4_on_an_h100_names_the_missing_fp4_tensor_cores():
    t = _packed_linear("nvfp4")
    with pytest.raises(UnsupportedDtypeError, match=r"H100 SXM5 80GB has no fp4 tensor cores"):
        t.estimate("h100-sxm")


def _decoder_only(module, fqn):
    return isinstance(module, nn.Linear) and not fqn.endswith("lm_head")


# PARALLEL_LLAMA: d = 256, 4 heads of 64, 2 KV heads, MLP 512, 2 layers. Per layer:
# q 256·256 + k 256·128 + v 256·128 + o 256·256 + gate/up 2 · 256·512 + down 512·256
# = 65,536 + 32,768 + 32,768 + 65,536 + 262,144 + 131,072 = 589,824 weights
DECODER_WEIGHTS = 2 * 589_824
TOKENS = 8


@pytest.mark.parametrize(
    "quant, gemm, hardware",
    [
        ("int4-weight", "int4_weight_mm", "h100-sxm"),
        ("mxfp4-weight", "mxfp4_weight_mm", "h100-sxm"),
        ("nvfp4", "nvfp4_mm", "b200"),
    ],
)
def test_a_packed_llama_traces_with_every_op_counted(meta_lm, quant, gemm, hardware):
    model = meta_lm("llama", **PARALLEL_LLAMA).eval()
    # 7 linears per layer · 2 layers; the LM head is left out by the filter
    assert apply_packed_weights(model, quant, _decoder_only) == 14
    assert isinstance(model.lm_head, nn.Linear)
    ids = torch.zeros(1, TOKENS, dtype=torch.long, device="meta")
    positions = torch.arange(TOKENS, device="meta")[None]
    with torch.no_grad(), torchroof.trace() as t:
        model(input_ids=ids, position_ids=positions, use_cache=False)
    gemms = [op for op in t.ops if op.name == f"torchroof.{gemm}.default"]
    assert len(gemms) == 14
    # 2 · M · (sum of N·K) = 2 · 8 · 1,179,648 = 18,874,368
    assert sum(cost_of(op).flops for op in gemms) == 2 * TOKENS * DECODER_WEIGHTS == 18_874_368
    for fusion in ("eager", "fused"):
        assert t.estimate(hardware, fusion=fusion).uncounted == {}


def test_fused_policy_quantises_inside_the_norm_kernel(meta_lm):
    """The q, k, v inputs are quantised in the RMSNorm's kernel (TensorRT-LLM fuses the
    quantisation into the preceding norm): the bf16 normed activation never reaches HBM."""
    model = meta_lm("llama", **PARALLEL_LLAMA).eval()
    apply_packed_weights(model, "nvfp4", _decoder_only)
    ids = torch.zeros(1, TOKENS, dtype=torch.long, device="meta")
    positions = torch.arange(TOKENS, device="meta")[None]
    with torch.no_grad(), torchroof.trace() as t:
        model(input_ids=ids, position_ids=positions, use_cache=False)
    est = t.estimate("b200", fusion="fused")
    norm = next(k for k in est.kernels if "aten.rsqrt.default" in k.ops)  # layer 0's input
    assert norm.ops.count("torchroof.quantize_nvfp4.default") == 3  # q, k and v inputs
    # reads h (8 · 256 · 2 = 4,096 B) and the norm weight (512 B); writes per projection
    # codes 8 · 256/2 = 1,024 B and scales 8 · 256/16 = 128 B: 3 · 1,152 = 3,456 B
    assert (norm.bytes_read, norm.bytes_written) == (4_096 + 512, 3 * 1_152)


def test_meta_copy_of_a_packed_model_keeps_packed_meta_weights():
    model = nn.Sequential(nn.Linear(256, 64, bias=True))
    apply_packed_weights(model, "nvfp4")
    copy = meta_copy(model)
    original = dict(model.named_parameters())
    copied = dict(copy.named_parameters())
    assert sorted(copied) == [
        "0.bias",
        "0.packed_weight",
        "0.weight_scale",
        "0.weight_tensor_scale",
    ]
    for name, p in copied.items():
        assert p.is_meta and not p.requires_grad
        assert (p.shape, p.dtype) == (original[name].shape, original[name].dtype)
    assert not original["0.packed_weight"].is_meta  # the original is untouched
    assert meta_copy(copy)[0].packed_weight.dtype == torch.uint8  # meta buffers copy too


@pytest.mark.parametrize("quant", PACKED_QUANTS)
def test_meta_layout_matches_the_real_packing(quant):
    real = nn.Sequential(nn.Linear(256, 48))
    meta = nn.Sequential(nn.Linear(256, 48, device="meta"))
    apply_packed_weights(real, quant)
    apply_packed_weights(meta, quant)
    layout = [(n, p.shape, p.dtype) for n, p in real.named_parameters()]
    assert layout == [(n, p.shape, p.dtype) for n, p in meta.named_parameters()]


# -- numerics of the layouts (the reference kernels a real device runs) -----------------------


def test_nibbles_pack_even_index_low():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]  # torchao's pack_uint4 order
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_int4_round_trips_a_representable_weight():
    # every group holds codes 0..15 once, low = -0.25, scale 1/16: w = low + q/16, so
    # zero = low + 8 · scale = 0.25 and the packing is exact
    torch.manual_seed(0)
    codes = torch.stack([torch.randperm(16) for _ in range(4 * 256 // 16)]).reshape(4, 256)
    weight = (-0.25 + codes / 16).to(torch.bfloat16)
    packed, scale_and_zero = quantize_int4(weight)
    assert (packed.shape, scale_and_zero.shape) == ((4, 128), (2, 4, 2))
    assert scale_and_zero[..., 0].eq(1 / 16).all() and scale_and_zero[..., 1].eq(0.25).all()
    assert torch.equal(dequantize_int4(packed, scale_and_zero), weight.float())


def test_mxfp4_round_trips_a_representable_weight():
    # e2m1 values times 2^e per block of 32, each block holding a 6 · 2^e: amax's exponent
    # floor(log2 6) + e = 2 + e, minus e2m1's 2, recovers e (byte e + 127)
    torch.manual_seed(0)
    values = e2m1_decode(torch.randint(0, 16, (4, 64), dtype=torch.uint8))
    values[:, ::32] = 6.0
    exponents = torch.tensor([[-3.0, 2.0]] * 4)
    weight = values * torch.exp2(exponents).repeat_interleave(32, dim=1)
    packed, scales = quantize_mxfp4(weight)
    assert scales.tolist() == [[124, 129]] * 4
    assert torch.equal(dequantize_mxfp4(packed, scales), weight)


def test_nvfp4_activation_quantiser_round_trips_a_representable_input():
    # blocks of 16 with amax 6 · 2^e: scale amax/6 = 2^e is exact in e4m3
    torch.manual_seed(0)
    values = e2m1_decode(torch.randint(0, 16, (3, 32), dtype=torch.uint8))
    values[:, ::16] = -6.0
    x = values * torch.tensor([0.25, 4.0]).repeat_interleave(16)
    packed, scales = quantize_nvfp4(x.to(torch.bfloat16))
    assert (packed.dtype, scales.dtype) == (torch.uint8, torch.float8_e4m3fn)
    assert scales.float().tolist() == [[0.25, 4.0]] * 3
    assert torch.equal(dequantize_nvfp4(packed, scales), x)


@pytest.mark.parametrize(
    "quant, tolerance",
    # relative error of the output: 16 int4 levels per group, 8 e2m1 magnitudes per block
    [("int4-weight", 0.1), ("mxfp4-weight", 0.2), ("nvfp4", 0.2)],
)
def test_a_packed_layer_computes_the_linear_it_replaced(quant, tolerance):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64))
    x = torch.randn(2, 3, 256)
    expected = model(x)
    apply_packed_weights(model, quant)
    got = model(x)
    assert got.shape == (2, 3, 64)
    error = ((got - expected).norm() / expected.norm()).item()
    # the nibbles read in the wrong order give an error near 1.3, not < 0.2
    assert error < tolerance


# -- bad input -----------------------------------------------------------------------------------


def test_a_layer_off_the_int4_group_is_named():
    model = nn.Sequential(nn.Linear(2880, 64, device="meta"))  # 2880 = 22.5 · 128
    with pytest.raises(ValueError, match=r"0 has in_features 2880, not a multiple of 128"):
        apply_packed_weights(model, "int4-weight")
    assert isinstance(model[0], nn.Linear)  # nothing replaced


def test_unknown_quant_is_refused():
    with pytest.raises(ValueError, match=r"unknown packed quant 'int3'"):
        apply_packed_weights(nn.Sequential(nn.Linear(128, 16)), "int3")


def test_a_cast_scale_is_refused_by_the_op():
    model = nn.Sequential(nn.Linear(256, 64, device="meta"))
    apply_packed_weights(model, "nvfp4")
    model.to(torch.bfloat16)  # casts the e4m3 and fp32 scales too
    x = torch.empty(1, 256, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"nvfp4_mm: ws must be float8_e4m3fn \[64, 16\]"):
        model(x)


def test_a_mismatched_input_is_refused_by_the_op():
    model = nn.Sequential(nn.Linear(256, 64, device="meta"))
    apply_packed_weights(model, "int4-weight")
    x = torch.empty(1, 128, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"int4_weight_mm: x has K = 128, .* has K = 256"):
        model(x)

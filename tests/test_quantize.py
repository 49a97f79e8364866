"""Quantised linear layers: torchao's recipes applied to the real model on meta,
the dequantising prologue and the two-pass tensorwise scale in the fused policy, the
recipe checks, and what narrowing the datatype does (the datasheets' per-datatype peaks;
decode is a GEMV, Pope et al. 2022)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import PARALLEL_LLAMA, TINY_MIXTRAL, TINY_MLA
from torchroof.hardware import UnsupportedDtypeError, get
from transformers import LlamaConfig

import torchroof
from torchroof.config import PricingOptions, Workload
from torchroof.config.choices import QUANTS
from torchroof.config.errors import WorkloadError
from torchroof.kernels.fusion import build_kernels
from torchroof.quant.recipes import RECIPES, float8_training, quantize_model

# Llama-3-8B (torchroof/models/configs/llama-3-8b.json): d = 4096, 32 layers, 32 query and 8 KV
# heads
# of 128, MLP 14336, vocabulary 128256.
# Decoder linear parameters per layer: q 4096·4096 + k 1024·4096 + v 1024·4096 + o 4096·4096
# + gate, up, down 3 · 14336·4096 = 41,943,040 + 176,160,768 = 218,103,808; x 32 layers:
LINEAR_PARAMS = 32 * 218_103_808  # 6,979,321,856
HEAD_PARAMS = 128_256 * 4096  # 525,336,576, kept in bf16
NORM_BYTES = (2 * 32 + 1) * 4096 * 2  # 65 RMSNorm weights in bf16: 532,480
EMBED_ROW_BYTES = 4096 * 2  # the one embedding row a batch-1 decode step gathers
# Output channels per layer (torchao int8 keeps one fp32 scale per output channel):
# q 4096 + k 1024 + v 1024 + o 4096 + gate 14336 + up 14336 + down 4096 = 43,008.
CHANNELS = 32 * 43_008


@pytest.fixture(scope="module")
def decode_8b():
    """Llama-3-8B decode at batch 1, context 128 (little KV), per recipe, on an H100."""
    cache: dict[str, torchroof.Estimate] = {}

    def get_estimate(quant: str) -> torchroof.Estimate:
        if quant not in cache:
            cache[quant] = torchroof.estimate(
                "llama-3-8b", "decode", batch=1, context=128, quant=quant, hardware="h100-sxm"
            )
        return cache[quant]

    return get_estimate


def test_fp8_decode_reads_half_the_decoder_weights(decode_8b):
    bf16, fp8 = decode_8b("none"), decode_8b("fp8")
    head = 2 * HEAD_PARAMS
    # bf16: every weight at 2 B, plus the norms and one embedding row.
    assert bf16.weight_bytes_read == 2 * LINEAR_PARAMS + head + NORM_BYTES + EMBED_ROW_BYTES
    # fp8: decoder linears at 1 B plus one fp32 per-tensor scale each (224 x 4 B); the head
    # stays bf16: 6,979,321,856 + 896 + 1,050,673,152 + 532,480 + 8,192 = 8,030,536,576.
    assert fp8.weight_bytes_read == LINEAR_PARAMS + 224 * 4 + head + NORM_BYTES + EMBED_ROW_BYTES
    assert fp8.memory.weights_bytes < 0.57 * bf16.memory.weights_bytes


def test_int8_and_int4_weights_read_at_their_stored_width(decode_8b):
    head = 2 * HEAD_PARAMS
    int8 = decode_8b("int8-weight")
    # int8 codes (1 B) + one fp32 scale per output channel: 6,979,321,856 + 5,505,024.
    assert int8.weight_bytes_read == (
        LINEAR_PARAMS + 4 * CHANNELS + head + NORM_BYTES + EMBED_ROW_BYTES
    )
    int4 = decode_8b("int4-weight")
    # two codes per byte + a bf16 scale and zero (4 B) per group of 128 along K:
    # 3,489,660,928 + 218,103,808 = 3,707,764,736 (about a quarter of bf16, plus scales).
    assert int4.weight_bytes_read == (
        LINEAR_PARAMS // 2 + LINEAR_PARAMS // 128 * 4 + head + NORM_BYTES + EMBED_ROW_BYTES
    )
    # Decode is a GEMV (Pope et al. 2022): memory-bound, so time follows the bytes.
    bf16 = decode_8b("none")
    assert int4.time_s / bf16.time_s == pytest.approx(int4.bytes / bf16.bytes, rel=0.01)


def test_weight_only_dequantisation_is_inside_the_gemm(decode_8b):
    """The fused policy folds torchao's int8 -> bf16 widening into the matmul: no kernel
    writes a bf16 copy of a weight; eager launches the widening on its own."""
    int8 = decode_8b("int8-weight")
    up = [k for k in int8.kernels if k.module == "model.layers.0.mlp.up_proj"]
    gemm = next(k for k in up if k.unit == "tensor")
    # the int8 codes; torchao applies the per-channel scale after the product (a kernel of
    # its own unless epilogue=True)
    assert gemm.read_by["weights"] == 14336 * 4096
    assert all(k.written_by.get("activations", 0) < 14336 * 4096 for k in up)


def test_eager_runs_the_widening_as_its_own_kernel(tiny_llama):
    quantize_model(tiny_llama, "int8-weight", trains=False)
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    with torch.no_grad(), torchroof.trace() as t:
        tiny_llama(ids)
    eager, _ = build_kernels(t.ops, PricingOptions(fusion="eager"), t.roles)
    fused, _ = build_kernels(t.ops, PricingOptions(fusion="fused"), t.roles)
    # SMALL: hidden 128, MLP 256: up_proj's int8 weight is 256 x 128 = 32,768 B; widened to
    # bf16 it is 65,536 B, written by a cast kernel under eager only.
    widen = [
        k for k in eager if k.module.endswith("layers.0.mlp.up_proj") and k.cost.unit != "tensor"
    ]
    assert any(k.cost.bytes_written == 65_536 for k in widen)
    gemm = next(
        k for k in fused if k.module.endswith("layers.0.mlp.up_proj") and k.cost.unit == "tensor"
    )
    assert {op.name.split(".")[1] for op in gemm.ops} >= {"_to_copy", "mm"}
    # reads: int8 weight 32,768 + x (4 tokens x 128 x 2 B = 1,024); writes 4 x 256 x 2 B.
    assert gemm.cost.bytes_read == 32_768 + 1_024
    assert gemm.cost.bytes_written == 2_048


def test_fp8_does_not_lower_the_decode_ridge_batch(decode_8b):
    """B* = s·I*/2, and narrowing the datatype scales s and pi together. bf16 on
    an H100: I* = 989.4 / 3.35 = 295.3, s = 2: B* = 295. fp8: I* = 1978.9 / 3.35 = 590.7,
    s = 1: B* = 295 for the decoder's GEMMs; the bf16 LM head pulls the whole step's weight
    intensity to 2·(6,979,321,856 + 525,336,576) / 8,030,536,576 = 1.869 FLOP/B, so
    B* = 590.7 / 1.869 = 316. Weight-only int8 halves s but not pi: B* falls to ~158."""
    bf16, fp8, int8 = decode_8b("none"), decode_8b("fp8"), decode_8b("int8-weight")
    assert bf16.ridge_batch == pytest.approx(295.35, rel=1e-3)
    weight_flops = 2 * (LINEAR_PARAMS + HEAD_PARAMS)
    ridge_fp8 = 1978.9e12 / 3.35e12
    assert fp8.ridge_batch == pytest.approx(ridge_fp8 / (weight_flops / fp8.weight_bytes_read))
    assert fp8.ridge_batch == pytest.approx(316.05, rel=1e-3)
    assert int8.ridge_batch == pytest.approx(bf16.ridge_batch / 1.87, rel=0.01)


def _float8_linear_kernels(recipe: str, m: int, k: int, n: int) -> list:
    linear = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="meta"))
    linear = linear.to(torch.bfloat16)
    float8_training(linear, recipe)
    x = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
    with torch.no_grad(), torchroof.trace() as t:
        linear(x)
    kernels, _ = build_kernels(t.ops, PricingOptions(fusion="fused"), t.roles)
    return [kernel for kernel in kernels if kernel.cost.bytes or kernel.cost.flops]


def test_float8_tensorwise_reads_each_operand_twice():
    """torchao's tensorwise scaling of y = x W^T (x [M, K], W [N, K], bf16): an amax of the
    whole tensor (a scalar: no block holds it, so Inductor splits the reduction and the
    cast that needs it reads the tensor again), then the cast to fp8, then _scaled_mm:
      amax(x) 2MK, cast(x) 2MK + MK, amax(W) 2NK, cast(W) 2NK + NK,
      _scaled_mm MK + NK + 2 scales (8 B) read, 2MN written.
    Against the bf16 GEMM (2MK + 2NK + 2MN) that is 4MK + 4NK more (plus the scalars)."""
    m, k, n = 512, 1024, 2048
    kernels = _float8_linear_kernels("tensorwise", m, k, n)
    total = sum(kernel.cost.bytes for kernel in kernels)
    scalars = sum(kernel.cost.bytes for kernel in kernels if kernel.cost.bytes < 64)
    expected = 2 * m * k + 3 * m * k + 2 * n * k + 3 * n * k + (m * k + n * k + 8) + 2 * m * n
    assert total - scalars == pytest.approx(expected, abs=64)
    extra = total - (2 * m * k + 2 * n * k + 2 * m * n)
    assert extra == pytest.approx(4 * m * k + 4 * n * k, abs=96)
    gemm = next(kernel for kernel in kernels if kernel.cost.unit == "tensor")
    assert gemm.cost.dtype == "float8_e4m3fn" and gemm.cost.flops == 2 * m * n * k


def test_float8_rowwise_scales_in_one_pass_per_row():
    """Rowwise scaling: an amax per row of x (K = 1024 elements, on chip) fuses with the
    cast, one pass over x: 2MK read + MK written + M fp32 scales; the weight's amax runs down
    its columns (one per output channel) and is a split reduction of its own, then its cast."""
    m, k, n = 512, 1024, 2048
    kernels = _float8_linear_kernels("rowwise", m, k, n)
    x_cast = [kernel for kernel in kernels if kernel.cost.bytes_read == 2 * m * k]
    assert x_cast and x_cast[0].cost.bytes_written == m * k + 4 * m


def test_fp8_training_keeps_the_work_and_runs_it_on_fp8_tensor_cores(meta_lm):
    """Float8 changes the bytes and the ceiling, never W of the GEMMs."""
    counts = {}
    for quant in ("none", "fp8"):
        model = meta_lm("llama", num_hidden_layers=1)
        workload = Workload(regime="train", batch=1, seq=64, quant=quant)
        trace = torchroof.trace_workload(model, workload)
        est = trace.estimate("h100-sxm")
        counts[quant] = {
            k.dtype: sum(x.flops for x in est.kernels if x.unit == "tensor" and x.dtype == k.dtype)
            for k in est.kernels
            if k.unit == "tensor"
        }
    # The decoder's 7 linear layers move from bf16 to fp8 (e4m3 forward, e5m2 gradients);
    # the LM head stays bf16; the total tensor FLOPs are unchanged.
    assert sum(counts["none"].values()) == sum(counts["fp8"].values())
    assert set(counts["fp8"]) >= {"float8_e4m3fn", "bfloat16"}


def test_recipes_and_their_errors():
    assert QUANTS[0] == "none" and set(QUANTS[1:]) == set(RECIPES)
    with pytest.raises(WorkloadError, match="serving recipe"):
        Workload(regime="train", quant="int4-weight")
    with pytest.raises(WorkloadError, match="training step keeps no KV cache"):
        Workload(regime="train", kv_dtype="fp8")
    with pytest.raises(WorkloadError, match="sequence parallel runs torchtitan's"):
        Workload(regime="prefill", quant="int8-weight", tp=2, sequence_parallel=True)
    Workload(regime="decode", quant="int8-weight", tp=2)  # each rank quantises its shards
    with pytest.raises(WorkloadError, match="unknown quant"):
        Workload(regime="decode", quant="int3")
    Workload(regime="train", quant="fp8", tp=2)  # Float8 training layers do shard


def test_a_part_without_the_format_is_refused_before_tracing():
    with pytest.raises(UnsupportedDtypeError, match="fp8 tensor cores.*A100"):
        torchroof.estimate("llama-3-8b", "decode", quant="fp8", hardware="a100-sxm")
    with pytest.raises(UnsupportedDtypeError, match="fp4 tensor cores.*H100"):
        torchroof.estimate("llama-3-8b", "decode", quant="nvfp4", hardware="h100-sxm")
    assert "fp4" in get("b200").tensor_flops_per_s


def test_a_saved_quantised_trace_is_refused_on_a_part_without_the_format(tmp_path, meta_lm):
    # hidden 256: a 128 x 128 weight's per-tensor scale would look like torchao's 128 x 128
    # block scale (both one element) and torchao then asks for 1 x 128 activation scales
    model = meta_lm("llama", **PARALLEL_LLAMA)
    trace = torchroof.trace_workload(model, Workload(regime="decode", context=16, quant="fp8"))
    path = tmp_path / "fp8.json"
    trace.save(path)
    loaded = torchroof.Trace.load(path)
    assert loaded.estimate("h100-sxm").time_s == pytest.approx(trace.estimate("h100-sxm").time_s)
    with pytest.raises(UnsupportedDtypeError, match="fp8"):
        loaded.estimate("a100-sxm")


def test_compare_varies_the_recipe_in_one_table(meta_lm):
    from torchroof.studies import compare

    result = compare(
        meta_lm("llama", **PARALLEL_LLAMA),
        {"quant": ["none", "fp8", "int4-weight"]},
        regime="decode",
        hardware="h100-sxm",
        context=64,
    )
    weights = [variant.estimate.weight_bytes_read for variant in result.variants]
    # PARALLEL_LLAMA: hidden 256, MLP 512, 2 KV heads of 64, 2 layers: linears per layer
    # 256·256 + 2·128·256 + 256·256 + 3·512·256 = 589,824 params. bf16 2 B; fp8 1 B plus a
    # 4 B scale per linear (7 per layer); int4 0.5 B + 4 B per group of 128.
    linear = 2 * 589_824
    assert weights[0] - weights[1] == 2 * linear - (linear + 2 * 7 * 4)
    assert weights[0] - weights[2] == 2 * linear - (linear // 2 + linear // 128 * 4)


def test_layers_that_do_not_fit_the_groups_keep_the_model_dtype_and_are_named():
    """int4's scale groups are 128 along K: a 576-wide model (SmolLM's shape) has q, k, v
    and gate/up projections with in_features 576 = 4.5 x 128, left in bf16; down_proj
    (in_features 1536 = 12 x 128) is quantised."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=1024,
    )
    est = torchroof.estimate(config, "decode", context=64, quant="int4-weight")
    line = next(a for a in est.assumptions if a.startswith("quantised:"))
    # per layer: q, k, v, o (in 576) and gate, up (in 576) skipped = 6; x 2 layers = 12
    assert "12 left in the model's dtype" in line and "multiple of 128" in line
    packed = [k for k in est.kernels if "int4_weight_mm" in k.name]
    assert len(packed) == 2  # the two down_proj layers


def test_latent_attention_decodes_with_a_serving_recipe(meta_lm):
    """Absorbed MLA reads kv_b_proj's weight directly, so the recipes leave it wide; the
    other projections are quantised (DeepSeek-V3's shapes, 2 layers)."""
    from torchroof.models.sources import load_config

    config = load_config("deepseek-v3")
    config.num_hidden_layers, config.first_k_dense_replace = 2, 1
    est = torchroof.estimate(config, "decode", context=256, quant="int8-weight")
    kv_b = [k for k in est.kernels if k.module.endswith("kv_b_proj")]
    assert all(k.dtype == "bfloat16" for k in kv_b)
    q_b = [k for k in est.kernels if k.module.endswith("q_b_proj") and k.unit == "tensor"]
    # q_b_proj: 1536 -> 128 heads x 192 = 24,576 outputs, int8: 1 B per weight
    assert q_b and q_b[0].read_by["weights"] == 1536 * 24_576


def test_compare_refuses_a_recipe_the_part_cannot_run_before_tracing(monkeypatch, meta_lm):
    import importlib

    # the module: torchroof.studies, the attribute, is the function
    compare_module = importlib.import_module("torchroof.studies")

    def no_tracing(*_, **__):
        raise AssertionError("traced before the hardware was checked")

    monkeypatch.setattr(compare_module, "_trace", no_tracing)
    with pytest.raises(UnsupportedDtypeError, match="fp8 tensor cores"):
        compare_module.compare(
            meta_lm("llama", **PARALLEL_LLAMA),
            {"quant": ["none", "fp8"]},
            regime="decode",
            hardware="a100-sxm",
        )


def test_moe_experts_are_packed_and_read_at_their_stored_width():
    """Mixtral-8x7B decode at batch 1: top-2 routing sends S = 2 rows, which reach 2 of the
    8 experts (balanced routing, as for _grouped_mm). int8 gate_up codes [8, 28672, 4096]
    at 1 B: 939,524,096 B, of which 2/8 are read = 234,881,024, plus the fp32 per-channel
    scales [8, 28672] x 2/8 = 229,376 B."""
    est = torchroof.estimate(
        "mixtral-8x7b", "decode", batch=1, context=128, quant="int8-weight", hardware="h100-sxm"
    )
    grouped = [k for k in est.kernels if "packed_grouped_mm" in k.name]
    assert len(grouped) == 2 * 32  # gate_up and down in each of 32 layers
    gate_up = grouped[0]
    assert gate_up.read_by["weights"] == 234_881_024 + 229_376
    assert gate_up.flops == 2 * 2 * 28_672 * 4096 and gate_up.dtype == "bfloat16"
    # 45.1 G expert parameters at 1 B instead of 2: the weights held fall from 93.4 to 47.0 GB
    assert est.memory.weights_bytes == pytest.approx(47.0e9, rel=0.01)
    line = next(a for a in est.assumptions if a.startswith("quantised:"))
    assert "64 3-D MoE expert weights" in line


def test_experts_sharded_by_ep_quantise_each_ranks_experts(meta_lm):
    """Mixtral-8x7B, one layer, decode on dp 2 x ep 2 in fp8: rank 0 holds 4 of the 8
    experts, and the recipe packs those (as vLLM loads an fp8 checkpoint's experts split
    over its expert-parallel ranks): gate-up codes [4, 28672, 4096], down [4, 4096, 14336].
    Weights per GPU fall by the experts' bytes, 4 x (28672 x 4096 + 4096 x 14336) =
    704,643,072 at 2 B -> 1 B, less their fp32 scales 4 x (28672 + 4096) x 4 = 524,288
    (704,118,784), and the attention's 41,943,040 weights at 2 B -> 1 B plus one 4 B scale
    per layer (41,943,024): 746,061,808 B in all."""
    from torchroof.models.sources import load_config

    config = load_config("mixtral-8x7b")
    config.num_hidden_layers = 1
    knobs = {"context": 64, "ep": 2, "dp": 2, "hardware": "dgx-h100"}
    wide = torchroof.estimate(config, "decode", **knobs)
    est = torchroof.estimate(config, "decode", quant="fp8", **knobs)
    assert wide.memory.weights_bytes - est.memory.weights_bytes == 746_061_808
    grouped = [k for k in est.kernels if "packed_grouped_mm" in k.name]
    assert len(grouped) == 2
    # the routed rows reach 2 of the 4 local experts: half the codes and scales are read
    assert grouped[0].read_by["weights"] == (4 * 28_672 * 4096 + 4 * 28_672 * 4) // 2
    line = next(a for a in est.assumptions if a.startswith("quantised:"))
    assert "2 3-D MoE expert weights in the same format" in line and "kept" not in line
    trace = torchroof.trace_model(config, "decode", batch=2, context=32, ep=2, dp=2, quant="fp8")
    codes = Counter(
        tuple(op.tensor("codes").shape) for op in trace.ops if "packed_grouped_mm" in op.name
    )
    assert set(codes) == {(4, 28_672, 4096), (4, 4096, 14_336)}


def test_routers_and_directly_read_weights_stay_wide(meta_lm):
    """A router that subclasses nn.Linear (Phi-MoE) keeps its own forward, and Mamba's
    dt_proj (whose weight Jamba reads directly) keeps its dtype: both trace under int4."""
    from transformers import JambaConfig, PhimoeConfig

    sizes = dict(
        num_hidden_layers=2,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    for config in (PhimoeConfig(**sizes), JambaConfig(**sizes)):
        est = torchroof.estimate(config, "decode", context=32, quant="int4-weight")
        assert [k for k in est.kernels if "int4_weight_mm" in k.name]
        assert not [
            k
            for k in est.kernels
            if "int4_weight_mm" in k.name and "gate" == k.module.rsplit(".", 1)[-1]
        ]


def test_the_packed_grouped_gemm_refuses_a_mismatched_input():
    from torchroof.quant.packed_experts import _pack

    weight = torch.empty(8, 256, 512, device="meta", dtype=torch.bfloat16)  # [E, out, in]
    packed = _pack(weight, "int8-weight", transposed=False)
    offs = torch.empty(8, device="meta", dtype=torch.int32)
    x = torch.empty(4, 512, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected"):  # not transposed to [E, in, out]
        torch.nn.functional.grouped_mm(x, packed, offs=offs)
    out = torch.nn.functional.grouped_mm(x, packed.transpose(-2, -1), offs=offs)
    assert tuple(out.shape) == (4, 256)
    with pytest.raises(ValueError, match="K = 512"):
        torch.ops.torchroof.packed_grouped_mm(
            x[:, :100], packed.codes, packed.scales, offs, "int8-weight", "bfloat16"
        )


# A tiny Llama the int4 groups of 128 fit after a tensor-parallel split of 2: d 256, FFN 512,
# 4 heads of 64 (2 KV heads), 2 layers.
TP_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def test_serving_recipes_quantise_each_tensor_parallel_shard():
    # tp 2: each rank holds half of every decoder layer: q 128x256, k and v 64x256 (column
    # shards), o 256x128 (a row shard), gate and up 256x256, down 256x256: 294,912 bf16
    # elements, 589,824 B. int4 stores them at 1/2 B (147,456 B) with a bf16 scale and zero
    # per 128 of K per output row: q 2x128, k and v 2x64, o 1x256, gate and up 2x256,
    # down 2x256 groups = 2,304 groups x 4 B = 9,216 B: 156,672 B a layer.
    config = LlamaConfig(**TP_LLAMA)
    sizes = dict(batch=2, context=64, tp=2)
    wide = torchroof.trace_model(config, "decode", **sizes)
    packed = torchroof.trace_model(config, "decode", quant="int4-weight", **sizes)
    layers = TP_LLAMA["num_hidden_layers"]
    wide_est, packed_est = wide.estimate("dgx-h100"), packed.estimate("dgx-h100")
    saved = layers * (294_912 * 2 - 156_672)
    assert wide_est.memory.weights_bytes - packed_est.memory.weights_bytes == saved
    # each GEMM multiplies its rank's K: 256 for the five column shards and down (the row
    # shard of K 512), 128 for o (the row shard of K 256)
    ks = Counter(op.tensor("x").shape[-1] for op in packed.ops if "int4_weight_mm" in op.name)
    assert ks == {256: 6 * layers, 128: layers}

    # the row shards' partial sums are all-reduced as in bf16: as many all-reduces, of the
    # same bytes (a packed layer's through DTensor's functional all-reduce, a torch
    # Linear's through c10d's in place)
    def collectives(est) -> list[tuple[bool, int]]:
        return [
            (any("all_reduce" in o or "allreduce" in o for o in k.ops), k.bytes)
            for k in est.kernels
            if k.unit == "network"
        ]

    assert collectives(packed_est) == collectives(wide_est)
    assert len(collectives(wide_est)) >= 2 * layers  # o and down in each layer


def test_fp8_serving_with_tensor_parallel_halves_each_ranks_decoder_weights():
    # torchao's fp8 weights of the same shards: 294,912 B a layer instead of 589,824, plus
    # its per-tensor fp32 scales (a few bytes a layer)
    config = LlamaConfig(**TP_LLAMA)
    base = dict(batch=2, context=64, tp=2, hardware="dgx-h100")
    wide = torchroof.estimate(config, "decode", **base)
    fp8 = torchroof.estimate(config, "decode", quant="fp8", **base)
    saved = wide.memory.weights_bytes - fp8.memory.weights_bytes
    assert saved == pytest.approx(2 * 294_912, abs=2 * 7 * 8)


def test_a_sharded_layer_keeps_its_bias_and_its_style():
    # attention biases (Qwen2-like): the row-parallel o_proj adds its bias after the
    # all-reduce, so the bias stays a replicated DTensor; the weights shrink as without
    # bias, 294,912 x 2 - 156,672 = 433,152 B for the one layer
    config = LlamaConfig(**{**TP_LLAMA, "num_hidden_layers": 1}, attention_bias=True)
    sizes = dict(batch=2, context=64, tp=2, hardware="dgx-h100")
    wide = torchroof.estimate(config, "decode", **sizes)
    packed = torchroof.estimate(config, "decode", quant="int4-weight", **sizes)
    assert wide.memory.weights_bytes - packed.memory.weights_bytes == 433_152
    # the same all-reduces, of the same bytes, as bf16: the bias is added once, after
    assert [k.bytes for k in packed.kernels if k.unit == "network"] == [
        k.bytes for k in wide.kernels if k.unit == "network"
    ]


def test_latent_attention_and_experts_quantise_their_shards():
    # DeepSeek-V2's latent attention: kv_a_proj_with_mqa's style (mla_kv_a_proj) reads the
    # model's config from the layer, so the packed layer that replaces it gets it back;
    # Mixtral's experts under tp 2 pack their shards: gate-up [8, 256, 64] column-split to
    # [8, 128, 64], down [8, 64, 128] row-split to [8, 64, 64]
    from transformers import DeepseekV2Config, MixtralConfig

    # kv_lora_rank 56 + rope 8 = 64 outputs, a width the recipe's GEMM takes (40 is not)
    fields = {k: v for k, v in TINY_MLA.items() if k != "first_k_dense_replace"}
    v2 = DeepseekV2Config(**{**fields, "kv_lora_rank": 56})
    assert v2.base_model_tp_plan.get("layers.*.self_attn.kv_a_proj_with_mqa") == "mla_kv_a_proj"
    trace = torchroof.trace_model(v2, "prefill", batch=1, seq=32, tp=2, quant="mxfp4-weight")
    assert any("mxfp4_weight_mm" in op.name and "kv_a_proj" in op.module for op in trace.ops)
    trace = torchroof.trace_model(
        MixtralConfig(**TINY_MIXTRAL), "decode", batch=2, context=32, tp=2, quant="int8-weight"
    )
    codes = Counter(
        tuple(op.tensor("codes").shape) for op in trace.ops if "packed_grouped_mm" in op.name
    )
    assert set(codes) == {(8, 128, 64), (8, 64, 64)}

"""A quantised KV cache (kv_dtype): K and V are cast to fp8 / int8 as they are written
into the cache, the attention kernel reads them at 1 B per element and computes at the query's
dtype, and the decode figures (KV reads, the KV crossover batch, the footprint and the largest
batch that fits) follow the narrow cache."""

from __future__ import annotations

import pytest
from conftest import SMALL, TINY_JAMBA, TINY_MLA
from transformers import AutoConfig

import torchroof
from torchroof.config import Workload
from torchroof.config.errors import WorkloadError
from torchroof.models.sources import build_model
from torchroof.render import text
from torchroof.workloads import kv_bytes_per_token, regime

# Llama-3-8B (shipped config): 32 layers, 8 KV heads of 128 dims, 32 query heads, bf16.
LAYERS, KV_HEADS, HEAD_DIM, HEADS = 32, 8, 128, 32
BATCH, CONTEXT = 8, 8192
SLOTS = CONTEXT + 1  # the static cache holds the context and the new token's slot
NARROW = {"fp8": "float8_e4m3fn", "int8": "int8"}


@pytest.fixture(scope="module")
def llama_decode() -> dict[str, tuple[torchroof.Trace, torchroof.Estimate]]:
    """Llama-3-8B decode, batch 8, context 8192 on an H100, with the cache in bf16, fp8, int8."""
    found = {}
    for kv_dtype in ("model", *NARROW):
        trace = torchroof.trace_model(
            "llama-3-8b", "decode", batch=BATCH, context=CONTEXT, kv_dtype=kv_dtype
        )
        found[kv_dtype] = (trace, trace.estimate("h100-sxm"))
    return found


def _attention_kernels(est: torchroof.Estimate) -> list:
    return [k for k in est.kernels if "scaled_dot_product" in k.name]


@pytest.mark.parametrize("kv_dtype", list(NARROW))
def test_attention_reads_the_narrow_cache_at_one_byte_and_computes_in_bf16(llama_decode, kv_dtype):
    wide = _attention_kernels(llama_decode["model"][1])
    narrow = _attention_kernels(llama_decode[kv_dtype][1])
    assert len(wide) == len(narrow) == LAYERS
    # K and V of every layer, 8 sequences of 8,193 slots of 8 heads x 128 dims:
    # bf16 2 (K, V) x 32 x 8 x 128 x 8,193 x 8 x 2 B = 8,590,983,168 B per step; the new
    # token's slot is in the cache the kernel reads, so the narrow cache is exactly half
    bf16 = 2 * LAYERS * KV_HEADS * HEAD_DIM * SLOTS * BATCH * 2
    assert bf16 == 8_590_983_168
    assert sum(k.read_by["kv_cache"] for k in wide) == bf16
    assert sum(k.read_by["kv_cache"] for k in narrow) == bf16 // 2 == 4_295_491_584
    assert llama_decode[kv_dtype][1].kv_bytes_read == bf16 // 2
    # the kernel dequantises in registers: its FLOPs are the same and run on the bf16 tensor
    # cores: QK^T and PV per layer 2 x 8 seq x 32 heads x 8,193 keys x (128 + 128)
    assert {k.dtype for k in narrow} == {"bfloat16"}
    assert [k.flops for k in narrow] == [k.flops for k in wide]
    assert narrow[0].flops == 2 * BATCH * HEADS * SLOTS * (HEAD_DIM + HEAD_DIM) == 1_073_872_896


@pytest.mark.parametrize("kv_dtype", list(NARROW))
def test_new_kv_are_cast_on_write_and_written_at_one_byte(llama_decode, kv_dtype):
    trace, est = llama_decode[kv_dtype]
    casts = [
        op
        for op in trace.ops
        if op.name == "aten._to_copy.default" and op.outputs[0].dtype == NARROW[kv_dtype]
    ]
    # one cast of the new K and one of the new V per layer: [8 seq, 8 heads, 1 token, 128]
    assert len(casts) == 2 * LAYERS
    assert {op.outputs[0].shape for op in casts} == {(BATCH, KV_HEADS, 1, HEAD_DIM)}
    # written into the cache in place: 2 x 32 x 8 seq x 8 heads x 128 x 1 B = 524,288 B
    written = sum(k.written_by.get("kv_cache", 0) for k in est.kernels)
    wide = sum(k.written_by.get("kv_cache", 0) for k in llama_decode["model"][1].kernels)
    assert written == 2 * LAYERS * BATCH * KV_HEADS * HEAD_DIM == wide // 2 == 524_288


@pytest.mark.parametrize("kv_dtype", list(NARROW))
def test_footprint_crossover_and_largest_batch_follow_the_narrow_cache(llama_decode, kv_dtype):
    wide, narrow = llama_decode["model"][1], llama_decode[kv_dtype][1]
    # the footprint's KV cache: 2 x 32 x 8 x 128 x 8,193 slots x 8 seq x (2 B | 1 B)
    assert wide.memory.kv_cache_bytes == 8_590_983_168
    assert narrow.memory.kv_cache_bytes == 8_590_983_168 // 2 == 4_295_491_584
    # KV crossover: weight bytes read / KV bytes per sequence. A layer holds
    # q, o 4,096^2 + k, v 1,024 x 4,096 + MLP 3 x 4,096 x 14,336 + 2 norms 4,096 = 218,112,000
    # parameters; weights read: 2 B x (32 layers x 218,112,000 + final norm 4,096 + LM head
    # 128,256 x 4,096) plus the 8 embedding rows gathered (8 x 4,096 x 2 B) = 15,009,914,880 B,
    # the same in both; KV per sequence 8,590,983,168 / 8 (bf16) or half that:
    # 13.98 -> 27.95, exactly doubled
    layer = 2 * 4_096**2 + 2 * 1_024 * 4_096 + 3 * 4_096 * 14_336 + 2 * 4_096
    assert layer == 218_112_000
    weights = 2 * (LAYERS * layer + 4_096 + 128_256 * 4_096) + BATCH * 4_096 * 2
    assert narrow.weight_bytes_read == wide.weight_bytes_read == weights == 15_009_914_880
    assert wide.kv_crossover_batch == pytest.approx(weights / (8_590_983_168 / BATCH))
    assert narrow.kv_crossover_batch == pytest.approx(2 * wide.kv_crossover_batch)
    assert round(narrow.kv_crossover_batch, 2) == 27.95
    # largest batch: (80 GiB - weights 16,060,522,496 B) / per-sequence (KV + the activation
    # peak of 2,117,632 B at batch 8): 69,838,823,424 / 1,074,137,600 = 65.02 -> 65 in bf16,
    # / 537,201,152 = 130.005 -> 130 with the cache at 1 B
    assert narrow.memory.activations_peak_bytes == wide.memory.activations_peak_bytes
    assert wide.memory.activations_peak_bytes == 2_117_632
    assert wide.memory.max_batch == 69_838_823_424 // ((8_590_983_168 + 2_117_632) // 8) == 65
    assert narrow.memory.max_batch == 69_838_823_424 // ((4_295_491_584 + 2_117_632) // 8)
    assert narrow.memory.max_batch == 130
    summary = text.summary(narrow)
    assert "KV reads overtake weight reads at batch 28" in summary
    assert f"largest decode batch that fits at context {CONTEXT}: 130" in summary


def test_label_and_bytes_per_token_name_the_cache_dtype():
    w = Workload("decode", batch=8, context=8192, kv_dtype="fp8")
    label = regime("decode").label("llama-3-8b", w)
    assert label == "llama-3-8b decode, batch 8, context 8192, static cache, bf16, fp8 KV cache"
    model = build_model(AutoConfig.for_model("llama", **SMALL))
    # 2 (K, V) x 2 KV heads x 32 dims x 2 layers x (2 B | 1 B)
    assert kv_bytes_per_token(model) == 2 * 2 * 32 * 2 * 2 == 512
    assert kv_bytes_per_token(model, "fp8") == kv_bytes_per_token(model, "int8") == 256


def test_prefill_writes_the_cache_narrow():
    bf16 = torchroof.estimate(AutoConfig.for_model("llama", **SMALL), "prefill", seq=64)
    fp8 = torchroof.estimate(
        AutoConfig.for_model("llama", **SMALL), "prefill", seq=64, kv_dtype="fp8"
    )
    # 2 (K, V) x 2 layers x 2 KV heads x 32 dims x 64 tokens x 1 B = 16,384 B
    assert fp8.memory.kv_cache_bytes == 2 * 2 * 2 * 32 * 64 == bf16.memory.kv_cache_bytes // 2
    assert fp8.kv_bytes_read == 16_384


def test_dynamic_cache_concatenates_in_the_narrow_dtype():
    kw = dict(batch=2, context=99, cache="dynamic")
    bf16 = torchroof.estimate(AutoConfig.for_model("llama", **SMALL), "decode", **kw)
    fp8 = torchroof.estimate(AutoConfig.for_model("llama", **SMALL), "decode", kv_dtype="fp8", **kw)
    # the cache after the step: 2 (K, V) x 2 layers x 2 seq x 2 heads x 32 x 100 tokens x 1 B
    assert fp8.memory.kv_cache_bytes == 2 * 2 * 2 * 2 * 32 * 100 == 51_200
    assert bf16.memory.kv_cache_bytes == 2 * 51_200
    # the cat reads the 99 cached tokens, the attention the 100 it returns, all at 1 B:
    # 2 x 2 x 2 x 2 x 32 x (99 + 100) = 101,888
    assert fp8.kv_bytes_read == 2 * 2 * 2 * 2 * 32 * (99 + 100) == bf16.kv_bytes_read // 2


def test_absorbed_mla_reads_an_fp8_latent_cache():
    config = AutoConfig.for_model("deepseek_v3", **TINY_MLA)
    trace = torchroof.trace_model(config, "decode", batch=2, context=100, kv_dtype="fp8")
    est = trace.estimate("h100-sxm")
    (op, *_) = [op for op in trace.ops if op.name == "torchroof.mla_decode_attention.default"]
    assert op.tensor("latent").dtype == op.tensor("rope").dtype == "float8_e4m3fn"
    assert op.tensor("query").dtype == "bfloat16"
    # the latent (32) and rope key (8) of 101 slots, 2 sequences, 2 layers, at 1 B (FlashMLA's
    # fp8 cache): 2 x 2 x 40 x 101 = 16,160 B, read once by the attention kernels
    attention = [k for k in est.kernels if k.name.startswith("torchroof.mla_decode")]
    assert {k.dtype for k in attention} == {"bfloat16"}
    assert sum(k.read_by["kv_cache"] for k in attention) == 2 * 2 * 40 * 101 == 16_160
    assert est.memory.kv_cache_bytes == 16_160


def test_expanded_mla_widens_the_latent_before_expanding_it():
    config = AutoConfig.for_model("deepseek_v3", **TINY_MLA)
    trace = torchroof.trace_model(
        config, "decode", batch=2, context=100, kv_dtype="fp8", mla="expanded"
    )
    widened = [
        op
        for op in trace.ops
        if op.name == "aten._to_copy.default"
        and op.inputs[0].dtype == "float8_e4m3fn"
        and op.outputs[0].dtype == "bfloat16"
    ]
    # per layer the latent [2, 1, 101, 32] and the rope key [2, 1, 101, 8]
    assert (
        sorted(op.outputs[0].shape for op in widened)
        == [(2, 1, 101, 8)] * 2 + [(2, 1, 101, 32)] * 2
    )


def test_hybrid_quantises_attention_kv_not_the_recurrent_state():
    config = AutoConfig.for_model("jamba", **TINY_JAMBA)
    est = torchroof.estimate(config, "decode", context=31, kv_dtype="fp8")
    # attention layer: K and V of 32 slots, 2 heads of 16 dims, 1 B: 2 x 32 x 2 x 16 = 2,048;
    # the mamba layer's conv [1, 128, 4] bf16 = 1,024 and SSM [1, 128, 8] fp32 = 4,096 as they were
    assert est.memory.kv_cache_bytes == 2_048 + 1_024 + 4_096


def test_tensor_parallel_shards_the_narrow_cache_by_heads():
    kw = dict(batch=4, context=255, tp=2, hardware="dgx-h100")
    config = dict(SMALL, hidden_size=256, num_attention_heads=4, intermediate_size=512)
    bf16 = torchroof.estimate(AutoConfig.for_model("llama", **config), "decode", **kw)
    fp8 = torchroof.estimate(
        AutoConfig.for_model("llama", **config), "decode", kv_dtype="fp8", **kw
    )
    # rank 0 holds 1 of the 2 KV heads: 2 (K, V) x 2 layers x 1 head x 64 dims x 256 slots
    # x 4 seq x 1 B = 262,144 B, half of bf16's
    assert fp8.memory.kv_cache_bytes == 2 * 2 * 1 * 64 * 256 * 4 == 262_144
    assert bf16.memory.kv_cache_bytes == 2 * 262_144
    assert fp8.kv_bytes_read == 262_144


def test_pipeline_stages_quantise_their_own_layers():
    kw = dict(batch=4, context=255, pp=2, microbatches=2, hardware="dgx-h100")
    bf16 = torchroof.estimate(AutoConfig.for_model("llama", **SMALL), "decode", **kw)
    fp8 = torchroof.estimate(AutoConfig.for_model("llama", **SMALL), "decode", kv_dtype="fp8", **kw)
    # each stage caches its one layer for both micro-batches of 4 sequences (each rank holds
    # them all): 2 micro-batches x 2 (K, V) x 1 layer x 2 KV heads x 32 dims x 256 slots x 4
    # x 1 B = 262,144 B, half of bf16's; one micro-batch's attention reads half of that
    assert fp8.memory.kv_cache_bytes == 2 * 2 * 1 * 2 * 32 * 256 * 4 == 262_144
    assert bf16.memory.kv_cache_bytes == 2 * 262_144
    assert fp8.kv_bytes_read == 131_072 == bf16.kv_bytes_read // 2


@pytest.mark.parametrize(
    ("model_type", "config", "knobs", "message"),
    [
        ("deepseek_v3", TINY_MLA, {"cache": "dynamic"}, "needs cache='static'"),
        ("gemma2", dict(SMALL, head_dim=32), {}, "runs as 'eager', not SDPA"),
        (
            "mamba",
            dict(hidden_size=64, state_size=16, num_hidden_layers=2, vocab_size=512),
            {},
            "caches no attention K/V",
        ),
        (
            "t5",
            dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, vocab_size=512),
            {},
            "encoder-decoder keeps its caches itself",
        ),
    ],
)
def test_a_step_that_cannot_keep_a_quantised_cache_is_refused(model_type, config, knobs, message):
    with pytest.raises(WorkloadError, match=message):
        torchroof.estimate(
            AutoConfig.for_model(model_type, **config),
            "decode",
            context=31,
            kv_dtype="fp8",
            **knobs,
        )


def test_training_keeps_no_kv_cache_to_quantise():
    with pytest.raises(WorkloadError, match="training step keeps no KV cache"):
        Workload("train", kv_dtype="fp8")

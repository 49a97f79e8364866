"""Prefill, decode and training workloads, memory fit (decode is a GEMV and the KV crossover:
Pope et al. 2022; optimizer bytes: docs/concepts/optimizer-bytes.md)."""

import re

import pytest
import torch

import torchroof
from torchroof.config import Workload, WorkloadError
from torchroof.models.sources import ModelBuildError, UnknownModelError, build_model, load_config
from torchroof.render import text
from torchroof.workloads import kv_bytes_per_token


@pytest.fixture(scope="module")
def llama70_decode_b1():
    return torchroof.estimate("llama-3-70b", "decode", batch=1, context=128, hardware="h100-sxm")


@pytest.fixture(scope="module")
def llama70_decode_b64_8k():
    return torchroof.estimate("llama-3-70b", "decode", batch=64, context=8192, hardware="h100")


# Llama-3-70B's parameters: per layer q and o 8192² (67,108,864 each), k and v 8192·1024
# (8,388,608 each), gate, up and down 3·8192·28672 (704,643,072), two RMSNorm weights
# (16,384): 855,654,400; x 80 layers = 68,452,352,000; + embedding and untied head
# 2·128,256·8192 (1,050,673,152 each) + the final norm 8192 = 70,553,706,496 parameters.
LLAMA70_PARAMS = 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)
LLAMA70_PARAMS += 2 * 128_256 * 8192 + 8192
# Weights read per decode step: all but the embedding table, of which the step gathers one
# 8192-wide row per sequence: 2·(70,553,706,496 − 1,050,673,152) + B·8192·2 bytes
LLAMA70_WEIGHTS_READ_B1 = 2 * (LLAMA70_PARAMS - 128_256 * 8192) + 8192 * 2


def test_llama70b_decode_batch1_is_a_weight_read(llama70_decode_b1):
    est = llama70_decode_b1
    assert LLAMA70_PARAMS == 70_553_706_496
    # 70,553,706,496 parameters x 2 B = 141.1 GB held
    assert est.memory.weights_bytes == 2 * LLAMA70_PARAMS == 141_107_412_992
    assert est.weight_bytes_read == LLAMA70_WEIGHTS_READ_B1 == 139_006_083_072
    # KV: 129 cached tokens (128 + the new one) read, K and V, 80 layers, 8 heads of 128,
    # 2 B: 129·2·80·8·128·2 = 42,270,720; plus the new token written, 2·80·8·128·2 = 327,680
    assert est.kv_bytes_read == 129 * 327_680 == 42_270_720
    traffic = est.traffic()
    assert traffic["kv_cache"] == 42_270_720 + 327_680
    # activations: hidden states, norms, the q/k/v/MLP intermediates and one row of
    # logits, 59,076,849 B (0.04% of the step; pinned here so a change shows)
    assert traffic == {
        "weights": 139_006_083_072,
        "kv_cache": 42_598_400,
        "activations": 59_076_849,
    }
    # every kernel is memory-bound, so T = Q/β = 139,107,758,321 B / 3.35e12 B/s = 41.525 ms
    # (the round 140 GB / 3.35 TB/s = 41.8 ms counts the embedding table, 2.1 GB, as read)
    assert est.memory_bound_share == 1.0
    assert est.bytes == 139_006_083_072 + 42_598_400 + 59_076_849 == 139_107_758_321
    assert est.time_s == pytest.approx(139_107_758_321 / 3.35e12, rel=1e-12)
    assert f"{est.time_s * 1e3:.4f}" == "41.5247"
    # one sequence: 1 / 41.525 ms = 24.08 tokens/s (about 24)
    assert est.tokens_per_s == 1 / est.time_s


def test_llama70b_kv_cache_and_crossover(llama70_decode_b64_8k):
    model = build_model(load_config("llama-3-70b"))
    # 2 (K, V) · 2 B · 80 layers · 8 KV heads · 128 = 327,680 bytes per token
    assert kv_bytes_per_token(model) == 2 * 2 * 80 * 8 * 128 == 327_680
    # 8192 tokens: 327,680 · 8192 = 2,684,354,560 B, 2.68 GB per sequence
    assert kv_bytes_per_token(model) * 8192 == 2_684_354_560
    est = llama70_decode_b64_8k
    # the step reads each sequence's cache once: 64 · 327,680 · 8193 (context + new token)
    assert est.kv_bytes_read == 64 * 327_680 * 8193 == 171_819_663_360
    # weights read: as at batch 1, with 64 gathered embedding rows instead of one
    weights_read = LLAMA70_WEIGHTS_READ_B1 + 63 * 8192 * 2
    assert est.weight_bytes_read == weights_read == 139_007_115_264
    # B_cross = weights read / KV read per sequence = 139,007,115,264 / (327,680 · 8193)
    # = 139,007,115,264 / 2,684,682,240 = 51.778 (the rounder 140 GB / 2.6 GB ≈ 53)
    assert est.kv_crossover_batch == 139_007_115_264 / 2_684_682_240
    assert f"{est.kv_crossover_batch:.2f}" == "51.78"
    shown = re.search(r"overtake weight reads at batch (\d+)", text.summary(est))
    assert shown and int(shown[1]) == 52  # 51.78, rounded


def test_decode_attention_intensity_is_2g_over_s(llama70_decode_b64_8k):
    attention = [k for k in llama70_decode_b64_8k.kernels if "attention" in k.name]
    assert len(attention) == 80
    # g = 64 / 8 = 8 query heads per KV head: I = 2g/s = 8 (GQA, Ainslie et al. 2023), less
    # the non-KV bytes. For 64 sequences: W = 64·4·8193·128·64 heads (the static cache holds
    # 8193 tokens); K and V read 64·2·8193·128·8·2 B; q and o 64·64·128·2 B each; the fp32
    # lse 64·64·4 B; the efficient kernel's bool mask, 8193 B, broadcast over the batch
    # and heads so read once
    flops = 64 * 4 * 8193 * 128 * 64
    kv = 64 * 2 * 8193 * 128 * 8 * 2
    q = o = 64 * 64 * 128 * 2
    lse, mask = 64 * 64 * 4, 8193
    for kernel in attention:
        assert kernel.flops == flops == 17_181_966_336
        assert kernel.read_by == {"kv_cache": kv, "activations": q + mask}
        assert kernel.bytes == kv + q + mask + o + lse == 2_149_867_521
        assert kernel.intensity == 17_181_966_336 / 2_149_867_521  # 7.992


def test_llama70b_does_not_fit_one_h100(llama70_decode_b1):
    memory = llama70_decode_b1.memory
    assert not memory.fits
    # weights 2·70,553,706,496 B + KV 129 tokens · 327,680 B + the activation peak (one
    # row of logits, 128,256·2 B, beside one hidden state, 8192·2 B: 272,896 B) against
    # 80 GiB = 85,899,345,920 B: 55,250,610,688 B (51.46 GiB) missing
    assert memory.kv_cache_bytes == 129 * 327_680
    assert memory.activations_peak_bytes == 128_256 * 2 + 8192 * 2 == 272_896
    assert memory.capacity_bytes == 80 * 2**30
    missing = 2 * LLAMA70_PARAMS + 129 * 327_680 + 272_896 - 80 * 2**30
    assert memory.missing_bytes == missing == 55_250_610_688
    shown = re.search(r"does NOT fit: ([\d.]+) GiB missing", text.summary(llama70_decode_b1))
    assert shown and float(shown[1]) == 51.46
    assert memory.max_batch == 0
    # no batch fits: the weights alone, 141,107,412,992 B = 131.42 GiB, are 51.42 GiB too many
    assert (
        "no decode batch fits: the weights alone (131.42 GiB) do not fit in 80.00 GiB: "
        "51.42 GiB short"
    ) in text.summary(llama70_decode_b1)


def test_kv_bytes_follow_num_key_value_heads(meta_lm):
    def kv_read(kv_heads):
        model = meta_lm("llama", num_key_value_heads=kv_heads)
        return torchroof.estimate(model, "decode", batch=4, context=256).kv_bytes_read

    # The step reads each cache once: K and V, 2 layers, 257 tokens (context + the new one)

    # 4 sequences · 257 tokens · 2 layers · 2 (K, V) · h_kv · 32 dims · 2 B
    assert kv_read(2) == 4 * 257 * 2 * 2 * 2 * 32 * 2
    assert kv_read(4) == 2 * kv_read(2)
    assert kv_read(1) * 2 == kv_read(2)


def test_dynamic_cache_copies_the_whole_cache_every_step(meta_lm):
    model = meta_lm("llama")
    static = torchroof.estimate(model, "decode", batch=2, context=1024, cache="static")
    dynamic = torchroof.estimate(
        model, "decode", batch=2, context=1024, cache="dynamic", fusion="eager"
    )
    cats = [
        k for k in dynamic.kernels if k.name == "aten.cat.default" and k.traffic.get("kv_cache")
    ]
    assert len(cats) == 4  # K and V in each of 2 layers
    # each cat reads the 1024-token cache and writes 1025 tokens: (1024 + 1 + 1025) · 2·2·32·2
    per_cat = (1024 + 1 + 1025) * 2 * 2 * 32 * 2
    assert all(k.bytes == per_cat for k in cats)
    # static: attention reads K and V of 1025 tokens in 2 layers, 2·(2·1025·2·2·32·2) =
    # 1,049,600 B, and 4 index_copy_ write the new token, 4·(2·2·32·2) = 1,024 B
    assert static.traffic()["kv_cache"] == 1_049_600 + 1_024
    # dynamic: the same attention reads, and each of the 4 cats reads the 1024-token cache
    # and writes 1025 tokens (the new token it reads is an activation): 4·2049·2·2·32·2,
    # 3.0x the static cache's KV traffic
    assert dynamic.traffic()["kv_cache"] == 1_049_600 + 4 * 2049 * 2 * 2 * 32 * 2 == 3_147_776
    assert dynamic.metadata["cache"] == "dynamic"


def test_prefill_writes_the_kv_cache(meta_lm):
    est = torchroof.estimate(meta_lm("llama"), "prefill", batch=2, seq=64)
    writes = [k for k in est.kernels if k.name == "aten.index_copy_.default"]
    assert len(writes) == 4  # K and V of 2 layers
    # 2 sequences · 64 tokens · 2 KV heads · 32 dims · 2 B written into the cache
    assert all(k.written_by == {"kv_cache": 2 * 64 * 2 * 32 * 2} for k in writes)
    assert est.tokens_per_s == pytest.approx(128 / est.time_s)


@pytest.mark.parametrize(
    ("optimizer", "precision", "bytes_per_param"),
    [
        # fp32 master + bf16 copy (Micikevicius et al. 2018): Adam 16 read + 14 written = 30 B,
        ("adamw", "mixed", 30),
        ("adam", "mixed", 30),
        # plain SGD 4 + 4 read, 4 + 2 written = 14 B; with momentum 12 + 10 = 22 B
        ("sgd", "mixed", 14),
        ("sgd-momentum", "mixed", 22),
        # one dtype throughout: AdamW reads p, g, m, v and writes p, m, v: 7 · s
        ("adamw", "bf16", 14),
        ("adamw", "fp32", 28),
    ],
)
def test_fused_optimizer_bytes_per_parameter(optimizer, precision, bytes_per_param, meta_lm):
    est = torchroof.estimate(
        meta_lm("llama"), "train", batch=1, seq=16, optimizer=optimizer, precision=precision
    )
    step = [k for k in est.kernels if k.phase == "optimizer"]
    assert [k.name for k in step] == ["torchroof.fused_optimizer_step.default"]
    params = est.metadata["parameters"]
    assert step[0].bytes == bytes_per_param * params
    if optimizer.startswith("adam"):
        assert step[0].flops == 12 * params  # ~12 FLOPs per parameter


def test_training_step_phases_and_matmul_ratio(meta_lm):
    est = torchroof.estimate(meta_lm("llama"), "train", batch=2, seq=64)
    assert est.uncounted == {}
    assert all(est.phase_time_s(p) > 0 for p in ("forward", "backward", "optimizer"))

    def matmul_flops(phase):
        return sum(k.flops for k in est.kernels if k.phase == phase and k.name == "aten.mm.default")

    assert matmul_flops("backward") == 2 * matmul_flops("forward")
    table = text.layer_table(est)
    for header in (
        "forward ms",
        "backward ms",
        "optimizer ms",
        "weights MB",
        "grads MB",
        "opt state MB",
        "activations MB",
    ):
        assert header in table
    row = next(r for r in est.rows() if r.name == "optimizer")
    assert set(row.traffic) >= {"weights", "gradients", "optimizer_state"}


def test_activation_checkpointing_recomputes_forward_in_backward(meta_lm):
    plain = torchroof.estimate(meta_lm("llama"), "train", batch=2, seq=64)
    ckpt = torchroof.estimate(meta_lm("llama"), "train", batch=2, seq=64, checkpointing=True)
    recompute = [k for k in ckpt.kernels if k.phase == "recompute"]
    assert recompute and all(k.module.startswith("model.layers.") for k in recompute)
    block_forward = sum(
        k.flops
        for k in plain.kernels
        if k.phase == "forward" and k.module.startswith("model.layers.")
    )
    # the decoder layers' forward runs again inside backward, up to the last tensor the
    # backward needs (non-reentrant checkpointing stops early: the down_proj output is
    # never saved, so that matmul is not redone)
    recomputed = sum(k.flops for k in recompute)
    assert 0.5 * block_forward < recomputed < block_forward

    def block_flops(est, phase, kind):
        return sum(
            k.flops
            for k in est.kernels
            if k.phase == phase and kind in k.name and k.module.startswith("model.layers.")
        )

    # every matmul but down_proj is redone: 2 layers · 2·(2·64 tokens)·256·128 = 16,777,216
    # FLOPs of down_proj fewer than the blocks' forward matmuls
    forward_mm = block_flops(plain, "forward", "aten.mm.default")
    assert block_flops(ckpt, "recompute", "aten.mm.default") == forward_mm - 2 * 8_388_608
    # and the flash attention forward runs again whole
    attention = block_flops(plain, "forward", "flash_attention")
    assert attention > 0 and block_flops(ckpt, "recompute", "flash_attention") == attention
    assert ckpt.memory.activations_peak_bytes < plain.memory.activations_peak_bytes


@pytest.mark.parametrize("optimizer", ["adafactor", "muon"])
def test_traced_optimizers_are_priced(optimizer, meta_lm):
    est = torchroof.estimate(meta_lm("llama"), "train", batch=1, seq=16, optimizer=optimizer)
    assert est.uncounted == {}
    step = [k for k in est.kernels if k.phase == "optimizer"]
    assert step
    if optimizer == "muon":
        # Newton-Schulz: matmuls on the tensor cores dominate the update's work
        tensor = sum(k.flops for k in step if k.unit == "tensor")
        assert tensor > 0.9 * sum(k.flops for k in step)


def test_real_cpu_module_is_traced_on_a_meta_copy(meta_lm):
    from conftest import FAMILY_CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **FAMILY_CONFIGS["llama"])
    )
    before = model.lm_head.weight.detach().clone()
    est = torchroof.estimate(model, "train", batch=1, seq=16)
    assert model.lm_head.weight.device.type == "cpu"
    torch.testing.assert_close(model.lm_head.weight.detach(), before)
    assert model.lm_head.weight.grad is None
    meta_twin = torchroof.estimate(meta_lm("llama", dtype=torch.float32), "train", batch=1, seq=16)
    assert est.flops == meta_twin.flops


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(model="llama-3-8", regime="prefill"), UnknownModelError, "did you mean"),
        (dict(model="gpt2", regime="prefill", batch=-1), WorkloadError, "batch must be"),
        (dict(model="gpt2", regime="decode", context=0), WorkloadError, "context must be"),
        (dict(model="gpt2", regime="serve"), WorkloadError, "unknown regime"),
        (dict(model="gpt2", regime="train", optimizer="lion"), WorkloadError, "unknown optimizer"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        torchroof.estimate(**kwargs)


def test_config_without_the_fields_a_regime_needs():
    from transformers import PretrainedConfig

    with pytest.raises(ModelBuildError, match="cannot build a language model"):
        torchroof.estimate(PretrainedConfig(), "decode", context=8)
    module = torch.nn.Linear(8, 8, device="meta")
    with pytest.raises(WorkloadError, match="Linear is not a transformers model: the decode"):
        torchroof.estimate(module, "decode", context=8)


def test_workload_validation():
    assert Workload("decode", batch=3, context=10).tokens == 3
    assert Workload("train", batch=2, seq=10).tokens == 20
    with pytest.raises(WorkloadError, match="cache"):
        Workload("decode", context=4, cache="paged-ish")


def test_moe_decode_reads_only_the_routed_experts():
    from conftest import SMALL
    from transformers import AutoConfig

    config = AutoConfig.for_model("mixtral", **SMALL, num_local_experts=8, num_experts_per_tok=2)

    def expert_weight_reads(batch):
        est = torchroof.estimate(config, "decode", batch=batch, context=64)
        assert est.uncounted == {}
        grouped = [k for k in est.kernels if k.name == "aten._grouped_mm.default"]
        assert len(grouped) == 4  # gate-up and down projections in each of 2 layers
        assert any("balanced routing" in a for a in est.assumptions)  # stated in the report
        assert "balanced routing" in text.summary(est)
        return sum(k.read_by.get("weights", 0) for k in grouped)

    # per layer: gate_up [8, 128, 512] + down [8, 256, 128] bf16 = 8 · 196,608 · 2 bytes;
    # balanced routing: batch 1 routes 2 token-slots to 2 of the 8 experts, batch 8 to all 8
    all_experts = 2 * 8 * (128 * 512 + 256 * 128) * 2
    assert expert_weight_reads(8) == all_experts
    assert expert_weight_reads(1) == all_experts * 2 // 8

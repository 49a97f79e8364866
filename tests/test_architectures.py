"""Beyond dense decoders: recurrent state as the decode cache (SSM, hybrids), MLA's latent
cache, encoder–decoder and encoder models. Small configs built on meta."""

from __future__ import annotations

import pytest
from conftest import TINY_JAMBA, TINY_MLA
from transformers import AutoConfig

import torchroof
from torchroof.config import Workload, WorkloadError
from torchroof.models.sources import build_model
from torchroof.workloads import kv_bytes_per_token, run_workload


def test_mamba_decode_reads_its_recurrent_state_as_the_cache():
    config = AutoConfig.for_model(
        "mamba",
        hidden_size=64,
        state_size=16,
        expand=2,
        conv_kernel=4,
        num_hidden_layers=2,
        vocab_size=512,
    )
    trace = run_workload(build_model(config), Workload("decode", context=100))
    # d_inner = 2 · 64 = 128. Per layer: conv state [1, 128, 4] bf16 = 1,024 B and SSM
    # state [1, 128, 16] fp32 = 8,192 B; 2 layers -> 18,432 B, whatever the context.
    assert trace.role_bytes["kv_cache"] == 2 * (128 * 4 * 2 + 128 * 16 * 4) == 18_432
    # the recurrent step, not a scan over the context: the same ops at any context length
    assert trace.facts.kv_cache_tokens == 101
    longer = run_workload(build_model(config), Workload("decode", context=1000))
    assert [op.name for op in longer.ops] == [op.name for op in trace.ops]
    assert longer.role_bytes["kv_cache"] == trace.role_bytes["kv_cache"]
    est = torchroof.estimate(config, "decode", context=100)
    assert est.uncounted == {}
    assert est.kv_bytes_read > 0


def test_hybrid_decode_cache_holds_attention_kv_and_ssm_state():
    config = AutoConfig.for_model("jamba", **TINY_JAMBA)
    trace = run_workload(build_model(config), Workload("decode", context=31))
    # layer 1 (attention): K and V of 32 slots, 2 heads of 16 dims, bf16: 2·32·2·16·2 = 4,096.
    # layer 0 (mamba, d_inner 128): conv [1, 128, 4] bf16 = 1,024 + SSM [1, 128, 8] fp32 = 4,096.
    assert trace.role_bytes["kv_cache"] == 4_096 + 1_024 + 4_096


def test_mla_caches_the_latent_not_expanded_kv():
    model = build_model(AutoConfig.for_model("deepseek_v3", **TINY_MLA))
    # latent 32 + rope key 8 per token and layer, bf16: 2 · 40 · 2 layers = 160 B/token;
    # expanded K/V would be 4 heads · (K 24 + V 16) · 2 B · 2 layers = 640 B/token.
    assert kv_bytes_per_token(model) == 2 * (32 + 8) * 2 == 160
    trace = run_workload(model, Workload("decode", context=100))
    assert trace.role_bytes["kv_cache"] == 160 * 101  # 101 slots: context + the new token
    est = torchroof.estimate(AutoConfig.for_model("deepseek_v3", **TINY_MLA), "decode", context=100)
    assert est.uncounted == {}
    assert any("balanced routing" in a for a in est.assumptions)


T5 = dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, vocab_size=512)


def test_encoder_decoder_prefill_writes_self_and_cross_attention_caches():
    config = AutoConfig.for_model("t5", **T5)
    est = torchroof.estimate(config, "prefill", seq=50)
    assert est.uncounted == {}
    # the decoder's first token caches its own K/V (1 token) and the cross-attention K/V
    # of the 50 encoded source tokens: 2 layers · 2 (K, V) · 64 · 2 B · (1 + 50) = 26,112
    assert est.memory.kv_cache_bytes == 2 * 2 * 64 * 2 * (1 + 50) == 26_112
    # matmul and attention FLOPs. Encoder, per layer over 50 tokens: q, k, v, o 2·50·64·64
    # each, wi and wo 2·50·64·128 each, attention (4 heads of 16, unmasked) 2·4·50·50·32
    encoder = 4 * 2 * 50 * 64 * 64 + 2 * 2 * 50 * 64 * 128 + 2 * 4 * 50 * 50 * 32
    # decoder, per layer for its one token: self-attention q, k, v, o 2·64·64 each over one
    # key (2·4·1·32); cross-attention q and o 2·64·64, k and v over the 50 encoded tokens
    # 2·50·64·64 each, attention over 50 keys 2·4·50·32; wi and wo 2·64·128 each
    decoder = 6 * 2 * 64 * 64 + 2 * 4 * 32 + 2 * 2 * 50 * 64 * 64 + 2 * 4 * 50 * 32
    decoder += 2 * 2 * 64 * 128
    head = 2 * 64 * 512  # the first token's logits
    tensor = sum(k.flops for k in est.kernels if k.unit == "tensor")
    assert tensor == 2 * encoder + 2 * decoder + head == 9_727_488


def test_encoder_decoder_decode_and_train():
    config = AutoConfig.for_model("t5", **T5)
    decode = torchroof.estimate(config, "decode", context=40)
    assert decode.uncounted == {}
    # self-attention cache 41 tokens + cross-attention 40 source tokens, 2 layers, bf16
    assert decode.memory.kv_cache_bytes == 2 * 2 * 64 * 2 * (41 + 40)
    train = torchroof.estimate(config, "train", seq=32)
    assert train.uncounted == {}
    assert train.phase_time_s("backward") > train.phase_time_s("forward") > 0


def test_encoder_only_models_prefill_and_train_but_do_not_decode():
    config = AutoConfig.for_model(
        "distilbert", dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=512
    )
    assert torchroof.estimate(config, "prefill", seq=32).uncounted == {}
    assert torchroof.estimate(config, "train", seq=32).uncounted == {}
    with pytest.raises(WorkloadError, match="encoder: it does not generate"):
        torchroof.estimate(config, "decode", context=32)


def test_absorbed_mla_decode_equals_transformers_expanded_attention():
    """Absorption is exact: on CPU with real weights, the absorbed step's logits equal
    transformers' expanded step's."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from torchroof.capture.mode import Capture
    from torchroof.models.mla import absorbed_mla

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", **{**TINY_MLA, "first_k_dense_replace": 2})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        cache = model(ids[:, :11], use_cache=True).past_key_values
        cache_copy = copy.deepcopy(cache)
        expanded = model(ids[:, 11:], cache=cache, use_cache=True).logits
        capture = Capture()
        with capture, absorbed_mla(model, capture) as absorbed:
            latent = model(ids[:, 11:], cache=cache_copy, use_cache=True).logits
    assert absorbed
    torch.testing.assert_close(latent, expanded, rtol=1e-5, atol=1e-5)
    kernels = [
        op for op in capture.trace.ops if op.name == "torchroof.mla_decode_attention.default"
    ]
    assert len(kernels) == 2  # one per layer


def test_absorbed_mla_decode_reads_the_latent_once_per_layer():
    config = AutoConfig.for_model("deepseek_v3", **TINY_MLA)
    absorbed = torchroof.estimate(config, "decode", batch=2, context=99)
    expanded = torchroof.estimate(config, "decode", batch=2, context=99, mla="expanded")
    kernels = [k for k in absorbed.kernels if k.name == "torchroof.mla_decode_attention.default"]
    assert len(kernels) == 2
    # per layer, batch 2, 4 heads, 100 cached tokens, r = 32, d_r = 8:
    # W = 2·2·4·100·(32 + 8) + 2·2·4·100·32 = 64,000 + 51,200 = 115,200
    assert all(k.flops == 115_200 for k in kernels)
    # reads: latent [2, 1, 100, 32] + rope key [2, 1, 100, 8] + queries [2, 4, 1, 40], bf16
    # = (6,400 + 1,600 + 320) · 2 = 16,640 B; writes the latent output [2, 4, 1, 32]: 512 B
    assert all(k.bytes == 16_640 + 512 for k in kernels)
    assert absorbed.metadata["mla"] == "absorbed" and "mla" not in expanded.metadata
    # expanded re-projects the whole cache through kv_b_proj every step: more work
    assert expanded.flops > absorbed.flops
    assert expanded.memory.kv_cache_bytes == absorbed.memory.kv_cache_bytes == 2 * 160 * 100


def test_a_model_without_a_cache_recomputes_the_context_every_token():
    config = AutoConfig.for_model(
        "openai-gpt", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128
    )
    decode = torchroof.estimate(config, "decode", context=32)
    prefill = torchroof.estimate(config, "prefill", seq=33)
    # GPT-1 has no KV cache in transformers: generating token 33 runs all 33 tokens again
    assert decode.flops == prefill.flops
    assert decode.memory.kv_cache_bytes == 0
    assert any("recomputes all 33 tokens" in a for a in decode.assumptions)


def test_absorbed_mla_reads_each_up_projection_once_whatever_the_batch():
    model = build_model(AutoConfig.for_model("deepseek_v3", **TINY_MLA))
    trace = run_workload(model, Workload("decode", batch=8, context=99))
    layer0 = [op for op in trace.ops if op.module.startswith("model.layers.0.self_attn")]
    bmms = [op for op in layer0 if op.name == "aten.bmm.default"]
    # q·W_UK over [h=4, d_nope=16, r=32] and o·W_UV over [4, 32, d_v=16]: the weights as
    # they are, the 8 sequences folded into the rows (not a weight copy per sequence)
    assert [op.inputs[1].shape for op in bmms] == [(4, 16, 32), (4, 32, 16)]
    assert [op.inputs[0].shape for op in bmms] == [(4, 8, 16), (4, 8, 32)]
    copies = [op for op in layer0 if op.name in ("aten.clone.default", "aten.expand.default")]
    assert not any(op.outputs[0].shape[-2:] in ((16, 32), (32, 16)) for op in copies)


def test_sparse_attention_indexers_keep_the_expanded_path():
    from torchroof.models.completions import default_config

    est = torchroof.estimate(default_config("deepseek_v32"), "decode", context=64)
    assert "mla" not in est.metadata  # DSA's top-k indexer is not absorbed (not modelled)
    assert est.uncounted == {}

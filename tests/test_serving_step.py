"""The engine-step function (torchroof.serving.StepTimer): a step mixing prefill chunks and
decodes priced from a model prepared for decode, checked against the estimates it must
agree with and against W and Q derived by hand.

The model is tests/conftest.py's small Llama with 2 layers: d = 128, 4 query heads of 32,
2 K/V heads, vocab 1000, bf16; the decode is prepared at context 64. Priced on the H100
SXM's pure roofline, where each kernel takes max(W/pi, Q/beta) and these small kernels are
all memory-bound.
"""

import pytest
from conftest import TINY_MLA, meta_causal_lm, small_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from torchroof.hardware import UnknownHardwareError
from torchroof.hardware import get as load_hardware
from transformers import AutoConfig, GraniteConfig

import torchroof
from torchroof.config.errors import OptionError
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, TensorRef
from torchroof.serving import SequenceWork, StepTimer, decodes, prompt
from torchroof.serving.attention import (
    AttentionGeometry,
    chunk_kernel,
    decode_geometry,
    decode_kernel,
    expand_kernels,
)
from torchroof.serving.composition import StepMix, items_of

H100_BETA = load_hardware("h100-sxm").hbm_bytes_per_s.value  # bytes/s, pure roofline
SMALL_LLAMA = small_llama(2).to_dict()
SMALL_LLAMA = {
    k: SMALL_LLAMA[k]
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    )
}
LAYER = AttentionGeometry("model.layers.0.self_attn", 4, 2, 32, 32, "bfloat16", "bfloat16", True)


@pytest.fixture(scope="module")
def prepared():
    return torchroof.prepare(small_llama(2), "decode", context=64, batch=4)


@pytest.fixture(scope="module")
def timer(prepared):
    return StepTimer(prepared, "h100-sxm")


def test_a_batch_of_equal_decodes_is_the_decode_estimate(prepared, timer):
    step = timer.time(decodes(4, 64))
    estimate = prepared.price("h100-sxm", batch=4)
    # the one difference: transformers' static-cache decode reads a bool mask over the
    # 64 + 1 keys (one row, broadcast over the batch) that a paged engine's kernel does not:
    # 65 B per layer, 2 layers, at beta
    assert estimate.time_s - step.time_s == pytest.approx(2 * 65 / H100_BETA, rel=1e-6)
    assert (step.tokens, step.sequences, step.logit_rows) == (4, 4, 4)
    assert step.time_s == pytest.approx(step.body_s + step.head_s + step.attention_s)
    # the attention part is the traced step's two attention kernels less their mask bytes
    traced = sum(k.time_s for k in estimate.kernels if "attention" in k.name)
    assert step.attention_s == pytest.approx(traced - 2 * 65 / H100_BETA, rel=1e-9)


def test_a_longer_context_adds_only_its_key_and_value_reads(timer):
    short, long = timer.time(decodes(4, 64)), timer.time(decodes(4, 192))
    # 128 more keys per sequence: K and V of 2 heads x 32 dims x 2 B each, 4 sequences,
    # 2 layers: 128 * 2 * 64 * 2 * 4 * 2 = 262,144 B more read by attention, nothing else
    assert long.body_s == short.body_s and long.head_s == short.head_s
    assert long.attention_s - short.attention_s == pytest.approx(262_144 / H100_BETA, rel=1e-9)


def test_a_lone_prompt_is_close_to_the_prefill_estimate(timer):
    step = timer.time([prompt(16)])
    prefill = torchroof.estimate(small_llama(2), "prefill", seq=16, batch=1)
    # the same GEMMs, norms and causal attention on 16 tokens and logits for the last one;
    # the step adds the copy transformers makes undoing the decode's grouped-query packing
    # of attention's output (16 x 4 x 32 x 2 B = 4 KiB read and written per layer)
    assert step.time_s > prefill.time_s
    assert step.time_s - prefill.time_s < 2 * 2 * 4096 / H100_BETA


def test_only_sampled_rows_reach_the_output_projection(timer):
    chunk = SequenceWork(16, 48, samples=False)  # a prompt's chunk that is not its last
    one = timer.time([SequenceWork(1, 10), chunk])
    two = timer.time([SequenceWork(1, 10), SequenceWork(16, 48, samples=True)])
    assert (one.logit_rows, two.logit_rows, one.tokens) == (1, 2, 17)
    assert one.body_s == two.body_s and one.attention_s == two.attention_s
    # one more row of logits: its 128 bf16 inputs (256 B) read, 1000 bf16 logits written
    assert two.head_s - one.head_s == pytest.approx((256 + 2000) / H100_BETA, rel=1e-9)


def test_ragged_attention_by_hand():
    # two decodes over 10 and 30 cached tokens: 11 + 31 = 42 keys in all
    cost, shape = decode_kernel(LAYER, [SequenceWork(1, 10), SequenceWork(1, 30)])
    assert cost.flops == 2 * 4 * (32 + 32) * 42  # = 21,504: QK and PV for every key
    assert cost.bytes_read == 2 * 4 * 32 * 2 + 42 * 2 * 64 * 2  # q + K and V = 11,264
    assert cost.bytes_written == 2 * 4 * 32 * 2 + 2 * 4 * 4  # o + fp32 lse = 544
    # packed: each K/V head's 2 query heads are a kernel's rows, 2 seqs x 2 K/V heads
    assert (shape.batch, shape.m, shape.n, shape.kept) == (4, 2, 21, 1.0)
    # a 16-token chunk on 48 cached tokens: row i (1..16) sees 48 + i keys, 904 pairs
    cost, shape = chunk_kernel(LAYER, [SequenceWork(16, 48)])
    assert cost.flops == 2 * 4 * 64 * (16 * 48 + 16 * 17 // 2) == 462_848
    assert cost.bytes_read == 16 * 4 * 32 * 2 + 64 * 2 * 64 * 2  # q + K and V = 20,480
    assert cost.bytes_written == 16 * 4 * 32 * 2 + 16 * 4 * 4  # o + lse = 4,352
    assert (shape.batch, shape.m, shape.n) == (4, 16, 64)
    assert shape.kept == pytest.approx(904 / (16 * 64))


def test_a_step_mix_sums_its_sequences_by_hand(timer):
    step = [
        prompt(16, 48, last=False),  # 16 rows over 64 keys, 904 pairs, no logits
        SequenceWork(4, 100, verifies=True),  # 3 drafts checked: 4 logit rows, 104 keys
        *decodes(3, 100),  # 101 keys each
    ]
    mix = StepMix.of(items_of(step))
    # 4 + 16 = 20 pairs of the verification: row i (1..4) sees 100 + i keys = 410
    assert (mix.sequences, mix.tokens, mix.rows, mix.longest) == (5, 16 + 4 + 3, 4 + 3, 104)
    assert (mix.decodes, mix.decode_keys) == (3, 3 * 101)
    assert (mix.chunks, mix.chunk_rows, mix.chunk_keys) == (2, 20, 64 + 104)
    assert mix.chunk_pairs == 904 + 410
    assert (mix.verifications, mix.drafted, mix.width, mix.plain_chunks) == (1, 3, 0, True)
    # the scheduler's sums price exactly as the sequences they sum
    assert timer.time(mix) == timer.time(step)


def test_a_step_mix_is_the_sum_of_its_parts_and_decodes_sum_on_their_own():
    """What the scheduler sums as it schedules (its one-token decodes' count, keys and
    longest, then the rest's mix added) is the mix of the whole step."""
    decoding = [(1, 100, True, False), (1, 40, True, False), (1, 250, True, False)]
    rest = [(16, 48, False, False), (4, 100, True, True)]
    # 3 decodes over 101 + 41 + 251 = 393 keys, the longest 251
    assert StepMix.decoding(3, 393, 251) == StepMix.of(decoding)
    assert StepMix.decoding(3, 393, 251) + StepMix.of(rest) == StepMix.of(decoding + rest)
    assert StepMix.of(rest) + StepMix.decoding(0, 0, 0) == StepMix.of(rest)
    assert StepMix.decoding(0, 0, 0) == StepMix.of([])
    # the widths: 1 where every sequence decodes, 4 for verifications alone, else 0
    verify = [(4, 10, True, True), (4, 20, True, True)]
    assert (StepMix.of(verify[:1]) + StepMix.of(verify[1:])).width == 4
    assert (StepMix.of(decoding) + StepMix.of(verify)).width == 0
    assert (StepMix.of(decoding[:1]) + StepMix.of(decoding[1:])).width == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(0, 3000), st.booleans(), st.booleans()),
        max_size=12,
    ),
    st.integers(0, 12),
)
def test_a_step_mix_split_anywhere_adds_back_to_the_whole(items, cut):
    items = [
        (new, context, samples or verifies, verifies) for new, context, samples, verifies in items
    ]
    assert StepMix.of(items[:cut]) + StepMix.of(items[cut:]) == StepMix.of(items)


def test_a_mixed_step_adds_its_parts(timer):
    step = [prompt(16, 48, last=False), *decodes(3, 100)]
    mixed = timer.time(step)
    alone = timer.time([prompt(16, 48, last=False)])
    # adding 3 decodes costs more GEMM rows and more attention, never less
    assert mixed.tokens == 19 and mixed.logit_rows == 3
    assert mixed.time_s > alone.time_s and mixed.attention_s > alone.attention_s
    decodes_alone = timer.time(decodes(3, 100))
    # the prompt's chunk runs in a kernel of its own beside the decodes' (two launches)
    assert mixed.attention_s == pytest.approx(alone.attention_s + decodes_alone.attention_s)


def test_tensor_parallel_decode_is_the_decode_estimate():
    prepared = torchroof.prepare(small_llama(2), "decode", context=64, batch=4, tp=2)
    step = StepTimer(prepared, "dgx-h100").time(decodes(4, 64))
    # each rank's mask, as on one GPU: 65 B per layer
    estimate = prepared.price("dgx-h100", batch=4).time_s
    assert estimate - step.time_s == pytest.approx(2 * 65 / H100_BETA, rel=1e-3)


def test_attention_it_cannot_price_per_sequence_is_refused():
    # Gemma 2 keeps a sliding window on its local layers
    gemma = torchroof.prepare(meta_causal_lm("gemma2"), "decode", context=64, batch=2)
    with pytest.raises(OptionError, match="sliding window of 4,096 tokens"):
        StepTimer(gemma)
    # attention run as matmuls and a softmax: no fused kernel to price per sequence
    eager = small_llama(2)
    eager._attn_implementation = "eager"
    with pytest.raises(OptionError, match="no fused attention kernel"):
        StepTimer(torchroof.prepare(eager, "decode", context=16))
    t = TensorMeta((2, 2, 2, 32), (256, 128, 32, 1), "bfloat16", 0)
    kv = TensorMeta((2, 2, 65, 32), (4160, 2080, 32, 1), "bfloat16", 1)
    refs = {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2)}
    other = OpRecord(0, "torchroof.other_attention", (t, kv, kv), (), refs, "m", "forward")
    with pytest.raises(OptionError, match="is not priced per sequence yet"):
        decode_geometry(other, 64)
    sdpa = "aten._scaled_dot_product_flash_attention.default"
    window = OpRecord(0, sdpa, (t, kv, kv), (), refs, "m", "forward")
    with pytest.raises(OptionError, match="sliding window"):
        decode_geometry(window, 128)  # 65 keys at context 128: a window of its own
    assert decode_geometry(window, 64) == LAYER  # 2 rows of 2 K/V heads: packed, 4 heads


def test_logits_scaled_after_the_projection_are_part_of_it():
    # Granite divides its logits by logits_scaling at the model's root, after lm_head
    config = GraniteConfig(**{**SMALL_LLAMA, "logits_scaling": 8.0})
    prepared = torchroof.prepare(config, "decode", context=16, batch=4)
    timer = StepTimer(prepared)
    assert timer.time(decodes(4, 16)).time_s == pytest.approx(
        prepared.price(batch=4).time_s - 2 * 17 / H100_BETA, rel=1e-9
    )
    one = timer.time([SequenceWork(16, 48, samples=False), SequenceWork(1, 10)])
    two = timer.time([SequenceWork(16, 48), SequenceWork(1, 10)])
    # one more row: lm_head reads its 256 B input and writes 1000 bf16 logits (2000 B),
    # and the division reads and writes them again
    assert two.head_s - one.head_s == pytest.approx((256 + 3 * 2000) / H100_BETA, rel=1e-9)


def test_a_verification_computes_logits_at_every_new_token(timer):
    # two sequences verifying 4 drafted tokens each: 5 new tokens, 5 rows of logits each
    step = [SequenceWork(5, 100, verifies=True), SequenceWork(5, 300, verifies=True)]
    verified = timer.time(step)
    assert (verified.tokens, verified.logit_rows) == (10, 10)
    assert verified.head_s == timer.time(decodes(10, 64)).head_s
    with pytest.raises(OptionError, match="verifies needs samples=True"):
        SequenceWork(5, 100, samples=False, verifies=True)


def test_a_step_with_a_prompt_launches_eagerly_under_a_runtime():
    # vLLM replays a full CUDA graph for decode-only steps (1.37 us a kernel) and launches
    # a step with a prompt chunk eagerly here (2.52 us): the same 12 tokens cost the
    # difference on every kernel but attention and the output projection
    prepared = torchroof.prepare(small_llama(2), "decode", context=16)
    timer = StepTimer(prepared, mode="realistic", runtime="vllm")
    graphed = timer.time(decodes(12, 16))
    mixed = timer.time([prompt(8), *decodes(4, 16)])
    kernels = prepared.price(batch=12, mode="realistic", runtime="vllm").kernels
    body = [k for k in kernels if "attention" not in k.name and k.module != "lm_head"]
    assert mixed.body_s - graphed.body_s == pytest.approx(len(body) * (2.52 - 1.37) * 1e-6)


def test_large_token_counts_interpolate_between_grid_sizes():
    # exact_up_to=16: a 17..3000-token prompt's body and head come from the two grid
    # batches around it (each 1/16 above the last). On the pure roofline each kernel's
    # time is linear in the tokens but where it turns compute-bound: off by 1e-4 at most
    # here; realistic mode's waves make steps between grid sizes: off by 2.7% at most here
    prepared = torchroof.prepare(small_llama(2), "decode", context=16)
    sizes = [*range(17, 400, 7), 500, 777, 1000, 2000, 3000]
    for mode, bound in (("roofline", 1e-3), ("realistic", 0.05)):
        exact = StepTimer(prepared, mode=mode)
        grid = StepTimer(prepared, mode=mode, exact_up_to=16)
        worst = max(
            abs(grid.time([prompt(n)]).time_s / exact.time([prompt(n)]).time_s - 1) for n in sizes
        )
        assert 0 < worst < bound, (mode, worst)
    assert grid.time([prompt(16)]).time_s == exact.time([prompt(16)]).time_s


def test_bad_steps_are_refused_in_one_line(prepared, timer):
    cases = [
        (lambda: timer.time([]), "needs at least one sequence"),
        (lambda: timer.time([(1, 64)]), "is a tuple, not a SequenceWork"),
        (lambda: timer.time(prompt(5)), "wrap the one sequence"),
        (lambda: timer.time(StepMix.of([])), "needs at least one sequence"),
        (lambda: timer.time(decodes(2, 8), graphed=0), "graphed must be a whole number"),
        (lambda: SequenceWork(0, 64), "new_tokens must be at least 1"),
        (lambda: SequenceWork(1, -1), "context must be 0 or more"),
        (lambda: SequenceWork(1.5, 3), "whole number of tokens"),
        (lambda: decodes(0, 64), "batch must be a whole number"),
        (lambda: timer.time([SequenceWork(1, 4096)]), "longer than the model's maximum"),
        (lambda: StepTimer(prepared, "no-such-gpu"), "no-such-gpu"),
        (lambda: StepTimer(prepared, batch=3), "give them to torchroof.prepare()"),
        (
            lambda: StepTimer(torchroof.prepare(small_llama(2), "decode", context=8, tp=2)),
            "cluster",
        ),
        (
            lambda: StepTimer(torchroof.prepare(small_llama(2), "prefill", seq=64)),
            "prepare the model with regime 'decode'",
        ),
        (
            lambda: StepTimer(torchroof.prepare(small_llama(2), "decode", cache="dynamic")),
            "needs cache='static'",
        ),
    ]
    for call, message in cases:
        with pytest.raises((OptionError, ValueError, UnknownHardwareError)) as caught:
            call()
        assert message in str(caught.value)
        assert "\n" not in str(caught.value)
    # a step given as any iterable is read once
    assert timer.time(w for w in decodes(2, 64)).tokens == 2


# -- multi-head latent attention ----------------------------------------------------------


@pytest.fixture(scope="module")
def latent():
    """conftest's tiny DeepSeek-V3 (2 layers, 4 heads, latent r = 32, rope d_r = 8,
    d_nope = 16, d_v = 16), prepared for decode at context 64, batch 4."""
    config = AutoConfig.for_model("deepseek_v3", **TINY_MLA)
    prepared = torchroof.prepare(config, "decode", context=64, batch=4)
    return prepared, StepTimer(prepared, "h100-sxm")


def test_latent_attention_by_hand(latent):
    _, timer = latent
    (layer,) = timer.layers()
    # decodes: 4 heads on the one latent of r + d_r = 40 dims, averaging its first 32
    assert (layer.query_heads, layer.kv_heads, layer.head_dim, layer.value_dim) == (4, 1, 40, 32)
    assert timer.kv_bytes_per_token() == 2 * 40 * 2  # = 160: the latent once a layer, bf16
    cost, shape = decode_kernel(layer, [SequenceWork(1, 10), SequenceWork(1, 30)])
    assert cost.flops == 2 * 4 * (40 + 32) * 42  # = 24,192 over 42 keys
    assert cost.bytes_read == 2 * 4 * 40 * 2 + 42 * 40 * 2  # q + the latents once = 4,000
    assert cost.bytes_written == 2 * 4 * 32 * 2 + 2 * 4 * 4  # o + lse = 544
    assert (shape.batch, shape.m) == (2, 4)  # every head of a sequence on its one latent
    # a 16-token chunk on 48 cached runs expanded: 4 K/V heads of d_nope + d_r = 24, d_v 16
    cost, _ = chunk_kernel(layer.prefill, [SequenceWork(16, 48)])
    assert cost.flops == 2 * 4 * (24 + 16) * 904  # = 289,280
    assert cost.bytes_read == 16 * 4 * 24 * 2 + 64 * 4 * 40 * 2  # q + K and V = 23,552
    # after the 48 cached latents are gathered (48 x 40 read and written, bf16), expanded
    # to 4 x (16 + 16) = 128 dims each, and K assembled with the rope key per head
    (gather, _), (gemm, shape), (assemble, _) = expand_kernels(layer, 48)
    assert (gather.bytes_read, gather.bytes_written) == (3_840, 3_840)
    assert gemm.flops == 2 * 48 * 32 * 128  # = 393,216
    assert gemm.bytes_read == 48 * 32 * 2 + 32 * 128 * 2  # workspace + kv_b_proj = 11,264
    assert gemm.bytes_written == 48 * 128 * 2  # = 12,288
    assert (shape.kind, shape.m, shape.n, shape.k) == ("gemm", 48, 128, 32)
    assert assemble.bytes_read == 48 * 4 * 16 * 2 + 48 * 8 * 2  # K_nope + rope key = 6,912
    assert assemble.bytes_written == 48 * 4 * 24 * 2  # = 9,216


def test_a_batch_of_equal_latent_decodes_is_the_decode_estimate(latent):
    prepared, timer = latent
    step = timer.time(decodes(4, 64))
    estimate = prepared.price("h100-sxm", batch=4)
    # the one difference: the ragged kernel writes its fp32 log-sum-exp (4 rows x 4 heads x
    # 4 B = 64 B a layer) that the traced absorbed kernel does not count: 2 x 64 B at beta
    assert step.time_s - estimate.time_s == pytest.approx(2 * 64 / H100_BETA, rel=1e-6)


def test_a_chunk_over_cached_latents_pays_their_expansion(latent):
    """The same 32-token chunk with 48 tokens cached before it or none, each kernel
    memory-bound on the pure roofline: the cached ones add, per layer, 48 more keys of K
    and V to the expanded attention (48 x 4 x 40 x 2 B = 15,360 B) and the expansion's three
    kernels (7,680 + 23,552 + 16,128 = 47,360 B), each at beta."""
    _, timer = latent
    fresh = timer.attention_s([SequenceWork(32, 0)], tokens=32)
    cached = timer.attention_s([SequenceWork(32, 48)], tokens=32)
    assert cached - fresh == pytest.approx(2 * (15_360 + 47_360) / H100_BETA, rel=1e-9)


def test_a_verification_over_latents_runs_in_the_decode_kernel(latent):
    """A verification of 3 drafts (4 tokens) over 4,000 cached runs in the absorbed kernel,
    as vLLM's MLA backends run queries of up to 1 + k tokens: reading the 4,004 latents once
    (4,004 x 40 x 2 B a layer) and nothing expanded, as a decode over them does (4 query
    rows of 4 heads instead of 1: 3 x 4 x (40 x 2 + 32 x 2 + 4) B of q, o and the fp32
    log-sum-exp more a layer)."""
    _, timer = latent
    verify = timer.attention_s([SequenceWork(4, 4000, verifies=True)], tokens=4)
    decode = timer.attention_s([SequenceWork(1, 4003)], tokens=1)
    assert verify - decode == pytest.approx(2 * 3 * 4 * (80 + 64 + 4) / H100_BETA, rel=1e-9)


def test_latent_attention_is_refused_where_it_would_be_priced_wrong():
    config = AutoConfig.for_model("deepseek_v3", **TINY_MLA)
    tp = torchroof.prepare(config, "decode", context=16, tp=2)
    with pytest.raises(OptionError, match="latent attention at tensor parallel 2"):
        StepTimer(tp, "dgx-h100")
    # every head's K and V cached instead of the latent (as a sparse indexer's model does)
    expanded = torchroof.prepare(config, "decode", context=16, mla="expanded")
    with pytest.raises(OptionError, match="its traced decode attends over expanded keys"):
        StepTimer(expanded, "h100-sxm")
    # the knob means nothing to a model without latent attention: not refused
    plain = torchroof.prepare(small_llama(2), "decode", context=16, mla="expanded")
    assert StepTimer(plain, "h100-sxm").kv_bytes_per_token() == 2 * 2 * 64 * 2


def test_a_latent_model_serves():
    """The tiny DeepSeek-V3 served: its cache holds 160 B a token."""
    config = AutoConfig.for_model("deepseek_v3", **TINY_MLA)
    run = torchroof.serve(config, "h100-sxm", concurrency=2, requests=6, input_len=64,
                          output_len=8)  # fmt: skip
    assert run.engine["kv_bytes_per_token"] == 160
    assert run.summary()["tpot_s"]["p50"] > 0

"""Workloads across GPUs: ``tp``, ``fsdp``, ``dp`` and
``microbatches`` given to ``trace_model`` trace rank 0 of the real parallel program through
the prefill, decode and train regimes; roles and the footprint are per rank.

The model is test_parallel.py's tiny Llama: 2 layers, d = 256, 4 heads of 64 (2 KV heads),
MLP 512, vocab 1024, bf16; B = 2 sequences of T = 16 tokens. Every expected number is
derived beside its assertion.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import PARALLEL_LLAMA
from torchroof.counters import cost_of, kind_of
from torchroof.counters.collectives import collective_kind, message_bytes, wire_bytes
from torchroof.hardware.cluster import get_cluster
from transformers import GPT2Config, LlamaConfig

import torchroof
from torchroof.config import Workload, WorkloadError
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace
from torchroof.render import text
from torchroof.report.memory import MemoryFootprint, footprint

CONFIG = PARALLEL_LLAMA
B, T, D, V = 2, 16, 256, 1024
BF16 = 2  # bytes
# One decoder layer: q, o 256x256 + k, v 256x128 + gate, up, down 3 x 256x512 + 2 norms of 256
LAYER_PARAMS = 2 * 65_536 + 2 * 32_768 + 3 * 131_072 + 2 * 256  # 590,336
NORM_PARAMS = 2 * 2 * 256 + 256  # two per layer and the final one: 1,280, never TP-sharded
PARAMS = 2 * LAYER_PARAMS + 2 * V * D + 256  # + embedding + LM head + final norm: 1,705,216


def _config(**overrides: int) -> LlamaConfig:
    return LlamaConfig(**{**CONFIG, **overrides})


def _trace(regime: str, config: LlamaConfig | None = None, **knobs) -> Trace:
    # the counts below are derived for bf16 throughout (precision="mixed" is the default)
    knobs = {"batch": B, "seq": T, "precision": "bf16", **knobs}
    return torchroof.trace_model(config or _config(), regime, **knobs)


def _collectives(trace: Trace, kind: str) -> list[OpRecord]:
    return [
        op for op in trace.ops if kind_of(op.packet) == "collective" and collective_kind(op) == kind
    ]


def _gemm_flops(trace: Trace, phase: str | None = None) -> int:
    return sum(
        cost_of(op).flops
        for op in trace.ops
        if kind_of(op.packet) == "matmul" and (phase is None or op.phase == phase)
    )


@pytest.fixture(scope="module")
def train_fsdp4() -> Trace:
    return _trace("train", fsdp=4)


# -- tensor parallel: FLOPs and memory per rank ----------------------------------------------


def test_tp8_gemm_flops_per_rank_are_an_eighth_of_one_gpu():
    # 8 heads and 8 KV heads of 32, so each of 8 ranks holds whole heads
    config = _config(num_attention_heads=8, num_key_value_heads=8)
    # prefill, N = B*T = 32 tokens: q, k, v, o 4 x 2*32*256*256 = 16,777,216; the MLP
    # 3 x 2*32*256*512 = 25,165,824; x 2 layers = 83,886,080; the LM head over the last
    # token of each sequence 2*2*256*1024 = 1,048,576: 84,934,656
    one = _trace("prefill", config)
    eight = _trace("prefill", config, tp=8)
    assert _gemm_flops(one) == 84_934_656
    assert _gemm_flops(eight) * 8 == _gemm_flops(one)  # 10,616,832
    # train: forward 2*32*(4*256^2 + 3*256*512)*2 layers + 2*32*256*1024 LM head
    # = 100,663,296; backward twice that; per rank an eighth of each
    one, eight = _trace("train", config), _trace("train", config, tp=8)
    assert _gemm_flops(one, "forward") == 100_663_296
    assert _gemm_flops(one, "backward") == 201_326_592
    assert _gemm_flops(eight, "forward") == 100_663_296 // 8
    assert _gemm_flops(eight, "backward") == 201_326_592 // 8


def test_tp_decode_cache_holds_the_local_kv_heads():
    # 2 KV heads at tp=2: one per rank. K and V, 2 layers, B = 2, 17 slots (16 cached + the
    # new token), 64 wide, 2 B: 2*2*2*17*64*2 = 34,816 on one GPU, 17,408 per rank
    for cache in ("static", "dynamic"):
        one = _trace("decode", context=16, cache=cache)
        two = _trace("decode", context=16, cache=cache, tp=2)
        assert one.role_bytes["kv_cache"] == 34_816
        assert two.role_bytes["kv_cache"] == 34_816 // 2
    # the attention kernel reads the rank's KV head: (B, 1, 17, 64)
    (attention, *_) = [op for op in two.ops if kind_of(op.packet) == "attention"]
    assert attention.inputs[1].shape[:2] == (B, 1)


def test_tp_train_memory_per_rank():
    trace = _trace("train", tp=2)
    # every matrix is halved, the norms are replicated: (1,705,216 - 1,280) / 2 + 1,280
    # = 853,248 parameters, x 2 B = 1,706,496
    local = (PARAMS - NORM_PARAMS) // 2 + NORM_PARAMS
    assert trace.role_bytes["weights"] == local * BF16 == 1_706_496
    # AdamW bf16: two moments at the local shapes
    assert trace.role_bytes["optimizer_state"] == 2 * local * BF16
    # transformers' vocabulary-parallel embedding leaves its gradient replicated: the whole
    # 1024 x 256 table's (524,288 B) instead of half of it
    assert trace.role_bytes["gradients"] == local * BF16 + V * D * BF16 // 2 == 1_968_640
    # the fused optimizer reads the local shards (the embedding's gradient sliced to them)
    (step,) = [op for op in trace.ops if op.phase == "optimizer"]
    assert sum(t.numel for t in step.tensors("params")) == local
    assert sum(t.numel for t in step.tensors("grads")) == local


# -- FSDP through the train regime ------------------------------------------------------------


def test_fsdp_collectives_per_layer_through_the_train_regime(train_fsdp4):
    gathers = _collectives(train_fsdp4, "all_gather")
    scatters = _collectives(train_fsdp4, "reduce_scatter")
    # each layer is all-gathered in forward and again in backward (resharded after
    # forward): 590,336 elements x 2 B = 1,180,672 bytes gathered from 147,584-element
    # shards; wire bytes (n-1)/n x S at n = 4: 885,504
    layer = [op for op in gathers if op.inputs[0].numel == LAYER_PARAMS]
    assert Counter(op.phase for op in layer) == {"forward": 2, "backward": 2}
    for op in layer:
        assert op.inputs[1].shape == (LAYER_PARAMS // 4,)
        assert (message_bytes(op), wire_bytes(op)) == (1_180_672, 885_504)
        assert op.arg("group_ranks") == [0, 1, 2, 3]
    # one reduce-scatter of each layer's gradients: S = 1,180,672 in, a 295,168-byte shard out
    layer = [op for op in scatters if op.inputs[1].numel == LAYER_PARAMS]
    assert len(layer) == 2
    assert {(message_bytes(op), wire_bytes(op)) for op in layer} == {(1_180_672, 885_504)}
    assert {cost_of(op).bytes_written for op in layer} == {295_168}


def test_fsdp_copies_around_each_layer_move_its_bytes_once(train_fsdp4):
    """FSDP2's own copies are priced (no op of the step is left without a rule): per layer,
    copy-in reads the 147,584-element bf16 shard and writes as much into the all-gather
    buffer (295,168 B each way); copy-out reads the gathered 1,180,672 B and writes the
    same into the unsharded parameters; chunk_cat packs the 1,180,672 B of unsharded
    gradients into the reduce-scatter input."""
    copies = [op for op in train_fsdp4.ops if op.packet.startswith("fsdp.")]
    assert copies and all(cost_of(op).counted for op in copies)
    shard, whole = LAYER_PARAMS // 4 * BF16, LAYER_PARAMS * BF16

    def layer_costs(packet: str) -> set[tuple[int, int]]:
        costs = {
            (c.bytes_read, c.bytes_written)
            for op in copies
            if op.packet == packet
            for c in [cost_of(op)]
        }
        return {pair for pair in costs if whole in pair or shard in pair}

    assert (shard, shard) in layer_costs("fsdp.all_gather_copy_in")
    assert (whole, whole) in layer_costs("fsdp.split_with_sizes_copy")
    assert (whole, whole) in layer_costs("fsdp.chunk_cat")
    est = torchroof.Trace.of(train_fsdp4).estimate("dgx-h100")
    assert est.uncounted == {}


def test_fsdp_memory_per_rank(train_fsdp4):
    memory = footprint(train_fsdp4, 80e9, B)
    # parameters, gradients and the two AdamW moments, each 1,705,216 / 4 = 426,304 x 2 B
    assert memory.weights_bytes == PARAMS // 4 * BF16 == 852_608
    assert memory.gradients_bytes == 852_608
    assert memory.optimizer_state_bytes == 2 * 852_608
    # unsharded layers in flight at the peak, in layer 1's backward: layer 0's all-gather
    # buffer (prefetched), layer 1's unsharded gradients and its reduce-scatter input, each
    # a layer's 1,180,672 B; FSDP frees unsharded parameters after use and gathers them
    # again into the same storage, which the footprint follows
    assert memory.layer_buffers_bytes == 3 * LAYER_PARAMS * BF16 == 3_542_016
    # the largest micro-batch: buffers and shards fixed, activations per sequence
    fixed = 4 * 852_608 + 3_542_016
    per_sequence = memory.activations_peak_bytes / B
    assert memory.max_batch == int((80e9 - fixed) // per_sequence)


def test_reshard_after_forward_off_keeps_layers_gathered():
    trace = _trace("train", fsdp=4, reshard_after_forward=False)
    assert {op.phase for op in _collectives(trace, "all_gather")} == {"forward"}
    memory = footprint(trace, 80e9, B)
    # ZeRO-2-like: at the peak (the LM head's backward) both layers' unsharded parameters
    # (2 x 1,180,672), the LM head's and the final norm's (262,400 x 2 B) and the LM head's
    # unsharded gradient (262,144 x 2 B) are alive: 3,410,432 B (the embedding's was freed
    # after its forward: its backward reads no weight)
    assert memory.layer_buffers_bytes == (2 * LAYER_PARAMS + 262_400 + 262_144) * BF16


def test_hsdp_reduce_scatters_then_all_reduces_across_replicas():
    trace = _trace("train", dp=2, fsdp=2)
    # mesh (dp, fsdp) = (2, 2): parameters sharded over ranks [0, 1], replicated over [0, 2]
    assert {tuple(op.arg("group_ranks")) for op in _collectives(trace, "all_gather")} == {(0, 1)}
    reduces = _collectives(trace, "all_reduce")
    assert {tuple(op.arg("group_ranks")) for op in reduces} == {(0, 2)}
    # a layer's gradient shard, 590,336 / 2 x 2 B = 590,336 B, all-reduced: 2(n-1)/n = 1
    layer = [op for op in reduces if op.inputs[0].numel == LAYER_PARAMS // 2]
    assert [(message_bytes(op), wire_bytes(op)) for op in layer] == [(590_336, 590_336)] * 2
    assert trace.role_bytes["weights"] == PARAMS // 2 * BF16


# -- gradient accumulation -----------------------------------------------------------------


def test_microbatches_run_forward_and_backward_each_then_one_optimizer_step():
    one, four = _trace("train"), _trace("train", microbatches=4)
    # forward GEMMs 2*32*(2*256^2 + 2*256*128 + 3*256*512)*2 layers + 2*32*256*1024
    # = 92,274,688 per micro-batch
    assert _gemm_flops(one, "forward") == 92_274_688
    assert _gemm_flops(four, "forward") == 4 * 92_274_688
    assert _gemm_flops(four, "backward") == 4 * _gemm_flops(one, "backward")
    assert [op.name for op in four.ops if op.phase == "optimizer"] == [
        "torchroof.fused_optimizer_step.default"
    ]
    # gradients accumulate in place: held once, as with one micro-batch
    assert four.role_bytes == one.role_bytes
    assert four.facts.tokens == 4 * B * T
    assert Workload("train", batch=B, seq=T, microbatches=4).tokens == 128


def test_fsdp_microbatches_gather_and_scatter_each_time():
    # torchtitan's trainer keeps gradient sync on: every micro-batch gathers the layers
    # twice and reduce-scatters their gradients (2 layers: 4 gathers, 2 scatters each)
    trace = _trace("train", fsdp=4, microbatches=2)
    gathers = [op for op in _collectives(trace, "all_gather") if op.inputs[0].numel == LAYER_PARAMS]
    scatters = [
        op for op in _collectives(trace, "reduce_scatter") if op.inputs[1].numel == LAYER_PARAMS
    ]
    assert (len(gathers), len(scatters)) == (2 * 4, 2 * 2)
    assert trace.role_bytes["gradients"] == PARAMS // 4 * BF16


def test_deferred_gradient_sync_reduces_once_and_holds_unsharded_gradients():
    trace = _trace("train", fsdp=4, microbatches=3, defer_gradient_sync=True)
    # set_requires_gradient_sync(False) before micro-batches 1 and 2: one reduce-scatter per
    # unit (embedding, 2 layers, norm + LM head) for the step; the gathers stay 3 x 7
    assert len(_collectives(trace, "reduce_scatter")) == 4
    assert len(_collectives(trace, "all_gather")) == 3 * 7
    memory = footprint(trace, 80e9, B)
    # at the peak (the last micro-batch's backward of layer 1): every parameter's unsharded
    # gradient, held since the first micro-batch (1,705,216 x 2 B), beside layer 1's
    # unsharded parameters and layer 0's prefetched all-gather buffer (1,180,672 B each)
    assert memory.layer_buffers_bytes == (PARAMS + 2 * LAYER_PARAMS) * BF16 == 5_771_776
    assert memory.gradients_bytes == PARAMS // 4 * BF16  # the shards, after the one reduction


# -- Llama-3-70B decode on a DGX H100 ----------------------------------------------------------


def test_llama70b_decode_tp8_fits_a_dgx_h100():
    trace = torchroof.trace_model("llama-3-70b", "decode", batch=64, context=8192, tp=8)
    capacity = get_cluster("dgx-h100").accelerator.hbm_capacity_bytes.value
    memory = footprint(trace, capacity, 64)
    # 70,553,706,496 parameters; the 161 RMSNorm weights of 8192 (2 per layer and the final
    # one) are replicated, every matrix (the vocabulary-sharded embedding and LM head too)
    # is split 8 ways: (70,553,706,496 - 1,318,912) / 8 + 1,318,912 = 8,820,367,360
    # parameters per rank, x 2 B = 17,640,734,720 (70.6e9 x 2 / 8 = 17.6 GB)
    params = 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)
    params += 2 * 128_256 * 8192 + 8192
    norms = 161 * 8192
    assert memory.weights_bytes == 2 * ((params - norms) // 8 + norms) == 17_640_734_720
    # KV: one of the 8 KV heads per rank: 64 sequences x 8193 slots x 327,680 B / 8
    assert memory.kv_cache_bytes == 64 * 8193 * 327_680 // 8 == 21_477_457_920
    # the activation peak is the LM head's: the rank's logits (64 x 16,032 x 2 B), the 8
    # ranks' gathered (64 x 128,256 x 2 B) and their concatenation along the vocabulary
    assert memory.activations_peak_bytes == 64 * 16_032 * 2 + 2 * 64 * 128_256 * 2
    assert memory.capacity_bytes == 80 * 2**30
    assert memory.fits  # at tp=1 the step lacks 227 GB
    # largest batch: (85,899,345,920 - 17,640,734,720) / ((21,477,457,920 + 34,885,632) / 64)
    # = 68,258,611,200 / 336,130,368 = 203.07
    assert memory.max_batch == 203


# -- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("regime", "knobs", "message"),
    [
        ("decode", {"fsdp": 8}, "fsdp=8 applies to a step that trains (train); a decode step"),
        ("prefill", {"fsdp": 2}, "fsdp=2 applies to a step that trains"),
        ("prefill", {"microbatches": 4}, "microbatches=4 applies to a step that trains"),
        ("train", {"tp": 0}, "tp must be a positive integer, got 0"),
        ("train", {"microbatches": 1.5}, "microbatches must be a positive integer, got 1.5"),
    ],
)
def test_bad_plans_are_one_clear_error(regime, knobs, message):
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Workload(regime, **knobs)


def test_tp_that_does_not_divide_the_heads_is_refused_before_building():
    with pytest.raises(WorkloadError, match="num_key_value_heads=2 does not divide by tp=4"):
        _trace("prefill", tp=4)
    with pytest.raises(WorkloadError, match="num_attention_heads=4 does not divide by tp=3"):
        _trace("decode", tp=3)


def test_a_model_without_a_tensor_parallel_plan_is_refused():
    config = GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=128)
    with pytest.raises(WorkloadError, match="GPT2Config has no base_model_tp_plan"):
        _trace("prefill", config, tp=2)


def test_a_traced_optimizer_on_shards_is_refused():
    with pytest.raises(WorkloadError, match="muon optimizer is not yet traced on sharded"):
        _trace("train", tp=2, optimizer="muon")


def test_the_footprint_line_names_the_unsharded_layers():
    memory = MemoryFootprint(
        weights_bytes=10**9,
        gradients_bytes=10**9,
        optimizer_state_bytes=2 * 10**9,
        kv_cache_bytes=0,
        activations_peak_bytes=3 * 10**9,
        capacity_bytes=10 * 10**9,
        batch=3,
        layer_buffers_bytes=2 * 10**9,
    )
    # 1 + 1 + 2 + 2 + 3 = 9 GB of 10: fits; 10 - 6 fixed = 4 GB free at 1 GB per sequence
    assert memory.total_bytes == 9 * 10**9 and memory.fits
    assert memory.max_batch == 4
    assert "unsharded layer buffers 1.86 GiB" in memory.line()  # 2e9 B / 2^30 = 1.86 GiB


def test_compare_over_tp_reports_gpus_and_throughput_per_gpu():
    from torchroof.studies import compare

    result = compare(
        _config(), {"tp": [1, 2]}, regime="decode", batch=B, context=T, hardware="dgx-h100"
    )
    one, two = (v.estimate for v in result.variants)
    # a TP group of 2 shares its replica's B tokens: each GPU is credited B / 2 per step
    assert two.tokens_per_s == pytest.approx(B / two.time_s)
    table = text.variants_table(result)
    rows = {line.split("  ")[0].strip(): line.split() for line in table.splitlines()}
    assert rows["GPUs"][-2:] == ["1", "2"]
    per_gpu = [float(v.replace(",", "")) for v in rows["tokens/s per GPU"][-2:]]
    assert per_gpu == [round(B / one.time_s, 1), round(B / 2 / two.time_s, 1)]
    # one GPU exposes no communication; two wait on their all-reduces (no compute to hide
    # them behind: each row-wise layer's output is read at once)
    exposed = [float(v) for v in rows["exposed comm ms"][-2:]]
    assert exposed[0] == 0.0 and exposed[1] > 0.0


def test_a_sweep_over_fsdp_is_a_sweep_over_gpu_counts():
    from torchroof.studies import SWEEP_KEYS, sweep

    assert {"batch", "seq", "context", "tp", "fsdp", "dp", "microbatches"} <= set(SWEEP_KEYS)
    result = sweep(_config(), "fsdp", [2, 4], regime="train", batch=B, seq=T, hardware="dgx-h100")
    rows = result.rows()
    assert [r["gpus"] for r in rows] == [2, 4]
    # FSDP ranks each train their own B x T tokens: per GPU = B·T / step time
    for r in rows:
        assert r["tokens_per_s_per_gpu"] == pytest.approx(B * T / r["step_time_s"])
    # the shards halve from 2 to 4 ranks: rank 0 holds half the weights (of the sharded
    # parameters; every FSDP unit here is sharded, so all of them)
    weights = [p.estimate.memory.weights_bytes for p in result.points]
    assert weights[1] * 2 == pytest.approx(weights[0], rel=0.01)
    assert "tokens/s per GPU" in text.sweep_table(result).splitlines()[0]


def test_tp_all_reduces_block_the_layer_after_them_when_fused():
    """``_wrap_tensor_autograd`` hands an all-reduce's result to autograd as a new tensor;
    capture records it under the collective's storage, so fusion never merges kernels of
    two layers across it and each forward all-reduce of o_proj is read at once: fully
    exposed, fused or not."""
    est = torchroof.Trace.of(_trace("train", tp=2)).estimate("dgx-h100")
    blocking = [
        k for k in est.kernels
        if k.unit == "network" and k.phase == "forward" and k.module.endswith("o_proj")
    ]  # fmt: skip
    assert len(blocking) == 2 and all(k.exposed_s == k.time_s for k in blocking)


def test_fsdp_shards_each_block_when_the_models_plan_names_none_of_its_modules():
    """transformers' FSDP plan names ``layers.*``, which GPT-2 lacks (``transformer.h``):
    each block is then a unit of its own, as torchtitan shards them, and the tied
    embedding goes with the root: one reduce-scatter per block plus the root's."""
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512)
    trace = _trace("train", config, fsdp=4)
    scatters = Counter(op.module for op in _collectives(trace, "reduce_scatter"))
    assert scatters == {"transformer.h.0": 1, "transformer.h.1": 1, "": 1}


def test_tp_all_reduces_block_under_fsdp_too():
    """With FSDP the step runs under a FakeTensorMode, where ``wait_tensor`` returns a new
    fake tensor: capture keeps it under the collective's storage, so each forward o_proj
    all-reduce still blocks the layer after it (fully exposed)."""
    est = torchroof.Trace.of(_trace("train", tp=2, fsdp=2)).estimate("dgx-h100")
    blocking = [
        k for k in est.kernels
        if k.unit == "network" and k.phase == "forward" and k.module.endswith("o_proj")
    ]  # fmt: skip
    assert len(blocking) == 2 and all(k.exposed_s == k.time_s for k in blocking)


REWRAPS = ("_c10d_functional._wrap_tensor_autograd", "_c10d_functional.wait_tensor")


def test_a_rewrapped_collective_result_keeps_the_collectives_storage():
    """``_wrap_tensor_autograd`` (and, under FSDP's FakeTensorMode, ``wait_tensor``) hand a
    collective's result on as a new tensor; capture records it under the same storage, so
    fusion and the schedule see who reads the collective's result."""
    for trace in (_trace("train", tp=2), _trace("train", tp=2, fsdp=2)):
        rewraps = [op for op in trace.ops if op.name.startswith(REWRAPS)]
        assert rewraps
        assert all(op.outputs[0].storage == op.inputs[0].storage for op in rewraps)


def _tied_gemma2(layers: int = 2):
    from transformers import Gemma2Config

    # Gemma 2 ties its LM head to its input embedding
    return Gemma2Config(
        hidden_size=D,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=V,
        tie_word_embeddings=True,
    )


def test_a_tied_lm_head_stays_the_embedding_under_tensor_parallel():
    from transformers import Gemma2Config

    # transformers' plan shards the embedding vocabulary-wise and the head column-wise:
    # both Shard(0) of one V x d table
    config = _tied_gemma2()
    trace = torchroof.trace_model(config, "train", batch=1, seq=16, tp=2)
    # the head's forward GEMM runs on the rank's half of the vocabulary:
    # 2 x 16 tokens x 256 x 512 columns = 4,194,304 FLOPs
    (head,) = [
        op
        for op in trace.ops
        if op.module == "lm_head" and op.phase == "forward" and kind_of(op.packet) == "matmul"
    ]
    assert cost_of(head).flops == 2 * 16 * D * (V // 2) == 4_194_304
    # one table, held once: its half is 512 x 256 x 2 B = 262,144 B of the weights, and
    # the head reads the embedding's own shard
    (table,) = [t for t in head.inputs if t.shape in ((V // 2, D), (D, V // 2))]
    assert trace.roles[table.storage] == "weights"
    untied = torchroof.trace_model(
        Gemma2Config(**{**config.to_dict(), "tie_word_embeddings": False}),
        "train",
        batch=1,
        seq=16,
        tp=2,
    )
    assert untied.role_bytes["weights"] - trace.role_bytes["weights"] == V // 2 * D * BF16


@pytest.mark.parametrize(
    "plan, message",
    [
        # the embedding split by vocabulary (Shard(0)), its tied head by hidden size
        (
            {"model.embed_tokens": "embedding_rowwise", "lm_head": "rowwise"},
            "lm_head.weight is tied to model.embed_tokens",
        ),
        # the embedding split by vocabulary, its tied head left out: a whole second table
        ({"model.embed_tokens": "embedding_rowwise"}, "lm_head.weight: not sharded"),
    ],
)
def test_a_tied_copy_the_plan_shards_otherwise_is_refused(plan, message):
    import torch
    from transformers import Gemma2ForCausalLM

    from torchroof.config.parallel_plan import ParallelPlan
    from torchroof.parallel.mesh import build_mesh
    from torchroof.parallel.program import fake_process_group
    from torchroof.parallel.tensor import apply_tensor_parallel

    with torch.device("meta"):
        model = Gemma2ForCausalLM(_tied_gemma2(layers=1))
    with fake_process_group(2):
        mesh = build_mesh(ParallelPlan(tp=2))
        with pytest.raises(ValueError, match=message):
            apply_tensor_parallel(model, mesh["tp"], plan=plan)

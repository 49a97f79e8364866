"""Context parallel: ``cp`` ranks split each sequence, and attention runs
as torch's own load-balanced ring attention (``torch.distributed.tensor.experimental``'s
context-parallel dispatcher, torchroof.parallel.context.apply_context_parallel); one rank's local
ops and its K/V exchange are recorded, the exchange as collectives on the cp group.

The model is conftest.PARALLEL_LLAMA: 2 layers, d = 256, 4 heads of 64 (2 KV heads), MLP
512, vocab 1024, bf16; B = 2 sequences of T = 64 tokens. Every expected number is derived
beside its assertion.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import PARALLEL_LLAMA
from torch.distributed.tensor import DTensor
from torchroof.counters import cost_of, kind_of
from torchroof.counters.collectives import collective_kind, message_bytes, wire_bytes
from torchroof.hardware.cluster import get_cluster
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

import torchroof
from torchroof.config import Workload, WorkloadError
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.parallel.context import (
    CONTEXT_PARALLEL_ATTENTION,
    ContextParallelError,
    apply_context_parallel,
)
from torchroof.parallel.mesh import build_mesh
from torchroof.parallel.program import fake_process_group
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace
from torchroof.report import analysis
from torchroof.timing.network import collective_time

B, T = 2, 64
H, H_KV, HEAD = 4, 2, 64
BF16, FP32 = 2, 4  # bytes
FLASH = "aten._scaled_dot_product_flash_attention.default"
FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_backward.default"
# Linear parameters: per layer q, o 256x256 + k, v 256x128 + gate, up, down 3 x 256x512
# = 589,824; two layers and the LM head 256x1024: 1,179,648 + 262,144 = 1,441,792.
LINEAR_PARAMS = 1_441_792


def _trace(regime: str = "train", **knobs) -> Trace:
    return torchroof.trace_model(LlamaConfig(**PARALLEL_LLAMA), regime, batch=B, seq=T, **knobs)


@pytest.fixture(scope="module")
def train_cp1() -> Trace:
    return _trace()


@pytest.fixture(scope="module")
def train_cp2() -> Trace:
    return _trace(cp=2)


def _collectives(trace: Trace, kind: str) -> list[OpRecord]:
    return [
        op for op in trace.ops if kind_of(op.packet) == "collective" and collective_kind(op) == kind
    ]


def _flops(trace: Trace, kind: str) -> int:
    return sum(cost_of(op).flops for op in trace.ops if kind_of(op.packet) == kind)


def _attention_blocks(trace: Trace, name: str, module: str) -> list[tuple[int, int, bool]]:
    """(queries, keys, causal) of each flash call of one layer (a backward's inputs start
    with the output's gradient)."""
    q = 1 if name == FLASH_BACKWARD else 0
    return [
        (op.inputs[q].shape[2], op.inputs[q + 1].shape[2], bool(op.arg("is_causal", False)))
        for op in trace.ops
        if op.name == name and op.module == module
    ]


def test_linear_flops_per_rank_halve_at_cp2(train_cp1, train_cp2):
    # forward 2 x tokens x params, backward twice that: 6 x 128 x 1,441,792 on one GPU,
    # 6 x 64 x 1,441,792 on each of two context-parallel ranks (B x T / cp tokens each)
    assert _flops(train_cp1, "matmul") == 6 * B * T * LINEAR_PARAMS == 1_107_296_256
    assert _flops(train_cp2, "matmul") == 6 * B * T // 2 * LINEAR_PARAMS == 553_648_128


def test_ring_attention_blocks_and_flops(train_cp1, train_cp2):
    layer = "model.layers.0.self_attn"
    # rank 0 holds chunks 0 and 3 of 4 (16 tokens each, head-tail load balancing): its own
    # K/V causally (32 x 32), then rank 1's K/V (chunks 1, 2) for its later chunk only
    # (16 queries x 32 keys, nothing masked); the backward visits the same blocks
    assert _attention_blocks(train_cp2, FLASH, layer) == [(32, 32, True), (16, 32, False)]
    assert _attention_blocks(train_cp2, FLASH_BACKWARD, layer) == [(32, 32, True), (16, 32, False)]
    # pairs kept: one GPU 64 x 65 / 2 = 2,080; rank 0 32 x 33 / 2 + 16 x 32 = 528 + 512
    # = 1,040, exactly half. Forward 2 B H pairs (d + d), backward 2 B H pairs (3d + 2d),
    # two layers: one GPU 2 x (2·2·4·2080·128 + 2·2·4·2080·320) = 59,637,760
    assert _flops(train_cp1, "attention") == 2 * 16 * 2080 * (128 + 320) == 29_818_880
    assert _flops(train_cp2, "attention") == 2 * 16 * 1040 * (128 + 320) == 14_909_440


def test_ring_attention_at_cp4_is_a_quarter():
    trace = _trace("prefill", cp=4, cache="dynamic")
    layer = "model.layers.0.self_attn"
    # rank 0 holds chunks 0 and 7 of 8 (8 tokens each): 16 x 16 causal, then for each of
    # the 3 other ranks its later chunk (8 queries) against their 16 keys
    assert _attention_blocks(trace, FLASH, layer) == [(16, 16, True)] + [(8, 16, False)] * 3
    # pairs 16 x 17 / 2 + 3 x 8 x 16 = 136 + 384 = 520 = 2,080 / 4; forward 2 B H pairs 2d
    assert sum(cost_of(op).flops for op in trace.ops if op.name == FLASH) == 2 * 16 * 520 * 128


def test_kv_exchange_per_layer(train_cp2):
    # attention's gathers (FSDP's parameter gathers over the same ranks are the others)
    gathers = [
        op for op in _collectives(train_cp2, "all_gather") if op.module.endswith("self_attn")
    ]
    exchanges = _collectives(train_cp2, "send_recv")  # all_to_all_single permutations
    # per layer: forward one all-gather of K and V (torch's default rotater gathers once),
    # backward one again, and dK, dV passed round the ring once per step of it (cp = 2)
    assert Counter((op.module, op.phase) for op in gathers) == {
        (f"model.layers.{i}.self_attn", phase): 1
        for i in (0, 1)
        for phase in ("forward", "backward")
    }
    assert Counter(op.module for op in exchanges) == {
        "model.layers.0.self_attn": 2,
        "model.layers.1.self_attn": 2,
    }
    assert {tuple(op.arg("group_ranks")) for op in gathers + exchanges} == {(0, 1)}
    # K and V of the rank's 32 tokens: 2 x B x h_kv x 32 x d = 2 x 2·2·32·64 = 16,384 bf16
    # values sent (32,768 B); gathered from both ranks S = 65,536 B, of which a rank sends
    # (n - 1) / n = 32,768 B on the wire
    kv = 2 * B * H_KV * (T // 2) * HEAD
    assert {(op.inputs[0].numel, op.inputs[0].dtype) for op in gathers} == {(kv, "bfloat16")}
    assert {(message_bytes(op), wire_bytes(op)) for op in gathers} == {(65_536, 32_768)}
    # dK and dV accumulate in fp32 (torch's convert_to_f32): 16,384 x 4 B = 65,536 B, all of
    # it sent to the next rank: a permutation (split sizes [0, 16,384]), priced as a send
    # and a receive (bus factor 1), not as an all-to-all ((n - 1) / n of it)
    assert {op.name for op in exchanges} == {"_c10d_functional.all_to_all_single.default"}
    assert {tuple(op.arg("input_split_sizes")) for op in exchanges} == {(0, kv)}
    assert {(message_bytes(op), wire_bytes(op)) for op in exchanges} == {(kv * FP32, 65_536)}


def test_cp_group_ranks_with_tensor_parallel():
    trace = _trace(cp=2, tp=2)
    gathers = [op for op in _collectives(trace, "all_gather") if op.module.endswith("self_attn")]
    assert len(gathers) == 4  # two layers, forward and backward
    # mesh (dp, fsdp, cp, tp) = (1, 1, 2, 2): rank 0's TP group is [0, 1], its CP group [0, 2]
    assert {tuple(op.arg("group_ranks")) for op in gathers} == {(0, 2)}
    # one KV head per TP rank: 2 x 2·1·32·64 = 8,192 bf16 values sent per gather
    assert {op.inputs[0].numel for op in gathers} == {8_192}
    reduces = _collectives(trace, "all_reduce")
    assert reduces and {tuple(op.arg("group_ranks")) for op in reduces} == {(0, 1)}


def test_cp_composes_with_sequence_parallel():
    trace = _trace(cp=2, tp=2, sequence_parallel=True)
    ring = Counter(
        op.name
        for op in trace.ops
        if kind_of(op.packet) == "collective"
        and op.arg("group_ranks") == [0, 2]
        and op.module.endswith("self_attn")  # not FSDP's, over the same ranks
    )
    # the ring on the cp group [0, 2] as without sequence parallel: per layer two K/V
    # gathers (forward, backward) and two dK, dV permutations
    assert ring == {
        "_c10d_functional.all_gather_into_tensor.default": 4,
        "_c10d_functional.all_to_all_single.default": 4,
    }
    # sequence parallel's reduce-scatters stay on the tp group [0, 1]
    scatters = [  # not FSDP's in-place ones, over the cp ranks
        op for op in _collectives(trace, "reduce_scatter") if op.name.startswith("_c10d_functional")
    ]
    assert scatters and {tuple(op.arg("group_ranks")) for op in scatters} == {(0, 1)}


def test_exchange_priced_on_dgx_h100(train_cp2):
    est = torchroof.Trace.of(train_cp2).estimate("dgx-h100")
    assert est.uncounted == {}
    cluster = get_cluster("dgx-h100")
    expected = collective_time("all_gather", 65_536, [0, 1], cluster)
    gathers = [
        k for k in est.kernels if k.name == "_c10d_functional.all_gather_into_tensor.default"
    ]
    assert len(gathers) == 4
    assert {k.link for k in gathers} == {expected.link} == {"nvlink"}
    assert all(k.network_s == pytest.approx(expected.time_s) for k in gathers)
    # the backward's dK, dV permutations: 65,536 B each to the next rank, over NVLink
    passed = collective_time("send_recv", 65_536, [0, 1], cluster)
    permutes = [k for k in est.kernels if k.name == "_c10d_functional.all_to_all_single.default"]
    assert len(permutes) == 4
    assert all(k.network_s == pytest.approx(passed.time_s) for k in permutes)
    assert passed.time_s > expected.time_s  # twice the bytes of a gather's wire share
    # the two ranks of a context-parallel group share one replica's B x T = 128 tokens
    assert analysis.ranks(est) == (2, 2)
    assert analysis.tokens_per_s_per_gpu(est) == pytest.approx(128 / est.time_s / 2)


def test_prefill_caches_the_ranks_own_tokens():
    trace = _trace("prefill", cp=2, cache="dynamic")
    # K and V of 32 tokens per layer: 2 layers x 2 x B x h_kv x 32 x d x 2 B = 65,536 B
    assert trace.role_bytes["kv_cache"] == 2 * 2 * B * H_KV * 32 * HEAD * BF16 == 65_536
    assert len(_collectives(trace, "all_gather")) == 2  # one per layer, no backward


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"cp": 2, "seq": 66}, "2 x cp = 4 equal chunks"),
        ({"cp": 2, "regime": "prefill"}, "cache='dynamic'"),
        ({"cp": 2, "regime": "decode", "cache": "dynamic"}, "fewer"),
    ],
)
def test_refused_plans(knobs, message):
    with pytest.raises(WorkloadError, match=message):
        Workload(**{"regime": "train", "seq": T, **knobs})


def test_model_restored_and_mask_refused():
    plan = ParallelPlan(cp=2)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**PARALLEL_LLAMA))
        handlers = dict(DTensor._op_dispatcher._custom_op_handlers)
        ids = torch.zeros(B, T, dtype=torch.long, device="meta")
        with apply_context_parallel(model, mesh["cp"]):
            assert model.config._attn_implementation == CONTEXT_PARALLEL_ATTENTION
            with pytest.raises(ContextParallelError, match="no attention mask"):
                model(ids, attention_mask=torch.ones_like(ids))
        assert model.config._attn_implementation == "sdpa"
        assert DTensor._op_dispatcher._custom_op_handlers == handlers


def test_sliding_window_shorter_than_the_sequence_is_refused():
    config = MistralConfig(**PARALLEL_LLAMA, sliding_window=16)
    with pytest.raises(WorkloadError, match="sliding window of 16 tokens, shorter than the 64"):
        torchroof.trace_model(config, "train", batch=B, seq=T, cp=2)
    # a window as long as the sequence changes nothing: the ring runs
    trace = torchroof.trace_model(
        MistralConfig(**PARALLEL_LLAMA, sliding_window=T), "train", batch=B, seq=T, cp=2
    )
    ring = [op for op in _collectives(trace, "all_gather") if op.module.endswith("self_attn")]
    assert len(ring) == 4  # not FSDP's parameter gathers over the same ranks


@pytest.mark.parametrize(
    ("knobs", "sharded", "replicated"),
    [
        # context-parallel ranks hold the same parameters and sum their gradients: FSDP
        # shards over them, with the fsdp ranks (torchtitan's dp_shard_cp), and dp replicas
        # all-reduce (HSDP). Mesh (dp, fsdp, cp, tp), rank 0's groups:
        ({"cp": 2}, (0, 1), None),  # (1, 1, 2, 1): cp ranks 0, 1
        ({"cp": 2, "fsdp": 2}, (0, 1, 2, 3), None),  # fsdp x cp = ranks 0-3
        ({"cp": 2, "dp": 2}, (0, 1), (0, 2)),  # shard over cp, replicate over dp
    ],
    ids=["cp", "cp-fsdp", "cp-dp"],
)
def test_training_shards_parameters_over_the_context_parallel_ranks(knobs, sharded, replicated):
    trace = _trace(**knobs)
    gathers = {
        tuple(op.arg("group_ranks"))
        for op in _collectives(trace, "all_gather")
        if not op.module.endswith("self_attn")
    }
    scatters = {tuple(op.arg("group_ranks")) for op in _collectives(trace, "reduce_scatter")}
    reduces = {tuple(op.arg("group_ranks")) for op in _collectives(trace, "all_reduce")}
    assert gathers == scatters == {sharded}
    assert reduces == ({replicated} if replicated else set())


def test_ring_passes_at_cp4_are_priced_between_the_rank_and_its_peer():
    # cp 4: the backward passes dK, dV to one peer of the 4 with all_to_all_single (one
    # non-zero split size); it is priced as a send between rank 0 and that peer, not
    # refused as a "pair" of 4 ranks
    trace = _trace(cp=4)
    permutes = [op for op in trace.ops if op.name == "_c10d_functional.all_to_all_single.default"]
    assert permutes and {tuple(op.arg("group_ranks")) for op in permutes} == {(0, 1, 2, 3)}
    peers = {tuple(op.arg("input_split_sizes")).index(max(op.arg("input_split_sizes")))
             for op in permutes}  # fmt: skip
    assert len(peers) == 1
    peer = peers.pop()
    est = torchroof.Trace.of(trace).estimate("dgx-h100")
    cluster = get_cluster("dgx-h100")
    # dK and dV of the rank's T / cp = 16 tokens in fp32: 2 x 2·2·16·64 x 4 B = 32,768 B
    kv = 2 * B * H_KV * (T // 4) * HEAD
    expected = collective_time("send_recv", kv * FP32, [0, peer], cluster)
    priced = [k for k in est.kernels if k.name == "_c10d_functional.all_to_all_single.default"]
    assert kv * FP32 == 32_768
    # two layers, cp = 4 passes each (the last hands dK, dV back to the rank that owns them)
    assert len(priced) == len(permutes) == 2 * 4
    assert all(k.network_s == pytest.approx(expected.time_s) for k in priced)
    assert {k.link for k in priced} == {"nvlink"}


def test_a_ring_across_nodes_is_paced_by_its_slower_hop():
    # cp 8 x tp 2 on dgx-h100 (8 GPUs a node): rank 0's cp group is [0, 2, ..., 14]. The
    # ring sends dK, dV from rank 0 to rank 2 (its node, NVLink) while rank 0 receives from
    # rank 14 (the next node): the pass ends when both have, so it is priced on the network
    trace = _trace(cp=8, tp=2)
    permutes = [op for op in trace.ops if op.name == "_c10d_functional.all_to_all_single.default"]
    group = [0, 2, 4, 6, 8, 10, 12, 14]
    assert {tuple(op.arg("group_ranks")) for op in permutes} == {tuple(group)}
    # one KV head per TP rank, T / cp = 8 tokens: 2 x 2·1·8·64 = 2,048 fp32 values, 8,192 B
    assert {tuple(op.arg("input_split_sizes")) for op in permutes} == {(0, 2048, 0, 0, 0, 0, 0, 0)}
    assert {tuple(op.arg("output_split_sizes")) for op in permutes} == {(0,) * 7 + (2048,)}
    cluster = get_cluster("dgx-h100")
    sent = collective_time("send_recv", 2048 * FP32, [0, 2], cluster)
    received = collective_time("send_recv", 2048 * FP32, [14, 0], cluster)
    assert (sent.link, received.link) == ("nvlink", "network")
    est = torchroof.Trace.of(trace).estimate("dgx-h100")
    priced = [k for k in est.kernels if k.name == "_c10d_functional.all_to_all_single.default"]
    assert len(priced) == len(permutes) == 2 * 8  # two layers, cp passes each
    assert {k.link for k in priced} == {"network"}
    assert all(k.network_s == pytest.approx(received.time_s) for k in priced)
    assert received.time_s > sent.time_s


def test_the_pairs_a_permutation_crosses():
    # pair_ranks on the cp 8 x tp 2 ring's dK, dV pass (rank 0 sends to group index 1,
    # rank 2, and receives from index 7, rank 14), and on variants of it
    from dataclasses import replace

    from torchroof.counters.collectives import pair_ranks

    (op, *_) = [
        op
        for op in _trace(cp=8, tp=2).ops
        if op.name == "_c10d_functional.all_to_all_single.default"
    ]
    group = [0, 2, 4, 6, 8, 10, 12, 14]

    def splits(sends, receives=None):
        args = {**op.args, "input_split_sizes": sends, "output_split_sizes": receives}
        return pair_ranks(replace(op, args=args), group)

    one = [0, 2048, 0, 0, 0, 0, 0, 0]
    assert pair_ranks(op, group) == [[0, 2], [14, 0]]
    assert splits(one) == [[0, 2]]  # no receive sizes recorded: the send hop alone
    assert splits([2048, 0, 0, 0, 0, 0, 0, 0], [2048] + [0] * 7) == [[0], [0]]  # to itself
    assert splits([256] * 8, [256] * 8) == [group]  # an all-to-all, not a permutation
    assert pair_ranks(op, [0, 8]) == [[0, 8]]  # a pair stays the pair

"""The real parallel program on a fake process group, on one CPU: transformers'
tensor-parallel plan and FSDP2 applied to a tiny Llama, one
rank's local ops and collectives recorded, each collective priced (HBM bytes, wire bytes).

The model: 2 layers, d = 256, 4 heads of 64 (2 KV heads), MLP 512, vocab 1024, bf16; the
batch B = 2, T = 16. Every expected number is derived beside its assertion.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from conftest import PARALLEL_LLAMA
from torchroof.counters import cost_of, kind_of
from torchroof.counters.collectives import collective_kind, message_bytes, wire_bytes
from transformers import LlamaConfig, LlamaForCausalLM

import torchroof
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.parallel.fsdp import apply_fsdp, fake_parameters
from torchroof.parallel.mesh import build_mesh
from torchroof.parallel.program import fake_process_group
from torchroof.parallel.tensor import apply_tensor_parallel
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, TensorRef
from torchroof.records.trace import Trace

CONFIG = PARALLEL_LLAMA
B, T, D, V = 2, 16, 256, 1024
BF16 = 2  # bytes
# Parameters of one decoder layer: q 256x256 + k 256x128 + v 256x128 + o 256x256 + gate, up,
# down 3 x 256x512 + two RMSNorm weights 2 x 256
# = 65,536 + 32,768 + 32,768 + 65,536 + 393,216 + 512 = 590,336.
LAYER_PARAMS = 590_336
EMBED_PARAMS = V * D  # 262,144
NORM_AND_HEAD_PARAMS = D + V * D  # the final norm and the LM head, one FSDP unit: 262,400


def _llama(**overrides: int) -> LlamaForCausalLM:
    config = LlamaConfig(**{**CONFIG, **overrides})
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def _trace_tp(tp: int, *, train: bool, **overrides: int) -> Trace:
    """Rank 0 of a TP group of ``tp`` on meta: prefill under no_grad, or forward+backward."""
    plan = ParallelPlan(tp=tp)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        model = apply_tensor_parallel(_llama(**overrides), mesh["tp"])
        ids = torch.zeros(B, T, dtype=torch.long, device="meta")
        with torchroof.trace() as trace:
            if train:
                model(ids, labels=ids).loss.backward()
            else:
                with torch.no_grad():
                    model(ids)
    return trace


def _trace_fsdp(plan: ParallelPlan, *, reshard_after_forward: bool = True) -> Trace:
    """Rank 0 of ``plan`` (FSDP, optionally with TP) for one forward+backward, on fake
    parameters (FSDP2 refuses meta ones)."""
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        model = apply_tensor_parallel(_llama(), mesh["tp"])
        apply_fsdp(model, mesh, reshard_after_forward=reshard_after_forward)
        with fake_parameters(model):
            ids = torch.zeros(B, T, dtype=torch.long)
            with torchroof.trace() as trace:
                model(ids, labels=ids).loss.backward()
    return trace


def _collectives(trace: Trace, kind: str | None = None) -> list[OpRecord]:
    return [
        op
        for op in trace.ops
        if kind_of(op.packet) == "collective" and (kind is None or collective_kind(op) == kind)
    ]


def _matmul_flops(trace: Trace, module: str, phase: str) -> list[int]:
    return [
        cost_of(op).flops
        for op in trace.ops
        if op.module == module and op.phase == phase and op.packet == "aten.mm"
    ]


@pytest.fixture(scope="module")
def prefill_tp1() -> Trace:
    return _trace_tp(1, train=False)


@pytest.fixture(scope="module")
def prefill_tp2() -> Trace:
    return _trace_tp(2, train=False)


@pytest.fixture(scope="module")
def train_tp2() -> Trace:
    return _trace_tp(2, train=True)


@pytest.fixture(scope="module")
def train_fsdp4() -> Trace:
    return _trace_fsdp(ParallelPlan(fsdp=4))


@pytest.fixture(scope="module")
def train_fsdp4_tp2() -> Trace:
    return _trace_fsdp(ParallelPlan(fsdp=4, tp=2))


# -- tensor parallel ------------------------------------------------------------------------


def test_q_proj_flops_per_rank_are_one_tp_th_of_one_gpu(prefill_tp1, prefill_tp2):
    # q_proj: (B*T, d) x (d, d/tp): 2*B*T*d*d/tp = 2*2*16*256*256/tp = 4,194,304/tp
    assert _matmul_flops(prefill_tp1, "model.layers.0.self_attn.q_proj", "forward") == [4_194_304]
    assert _matmul_flops(prefill_tp2, "model.layers.0.self_attn.q_proj", "forward") == [2_097_152]
    # the local shard, not the global weight: (32, 256) x (256, 128)
    (mm,) = [
        op
        for op in prefill_tp2.ops
        if op.module == "model.layers.0.self_attn.q_proj" and op.packet == "aten.mm"
    ]
    assert [t.shape for t in mm.inputs] == [(B * T, D), (D, D // 2)]


def test_one_all_reduce_after_each_row_wise_layer(prefill_tp2):
    # o_proj and down_proj are row-wise: 2 per layer x 2 layers = 4 all-reduces of (B, T, d)
    in_layers = [op for op in _collectives(prefill_tp2, "all_reduce") if ".layers." in op.module]
    assert [op.module for op in in_layers] == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.down_proj",
    ]
    for op in in_layers:
        assert op.inputs[0].shape == (B, T, D) and op.inputs[0].dtype == "bfloat16"
        assert op.arg("group_size") == 2 and op.arg("group_ranks") == [0, 1]
        # ring all-reduce: S = B*T*d*2 = 16,384 bytes; x 2(n-1)/n = 1 at n = 2
        assert message_bytes(op) == 16_384
        assert wire_bytes(op) == 16_384
        cost = cost_of(op)
        assert (cost.flops, cost.unit) == (0, "network")
        assert cost.bytes == 2 * 16_384  # the buffer read once and written once


def test_vocab_parallel_embedding_and_gathered_lm_head(prefill_tp2):
    # embedding_rowwise: each rank looks up its half of the vocabulary, partial sums
    # all-reduced: (B, T, d). colwise_gather_output: the LM head's (B, T, V/2) halves are
    # all-gathered: S = B*T*V*2 = 65,536 bytes, wire (n-1)/n * S = 32,768.
    kinds = Counter((op.module, collective_kind(op)) for op in _collectives(prefill_tp2))
    assert kinds[("model.embed_tokens", "all_reduce")] == 1
    (gather,) = _collectives(prefill_tp2, "all_gather")
    assert gather.module == "lm_head"
    assert (message_bytes(gather), wire_bytes(gather)) == (65_536, 32_768)
    assert sum(kinds.values()) == 6  # 1 embedding + 4 row-wise + 1 LM head


def test_tp4_all_reduce_wire_bytes_and_flops():
    # 4 KV heads so that each of 4 ranks holds whole heads
    trace = _trace_tp(4, train=False, num_key_value_heads=4)
    # 2*2*16*256*256/4 = 1,048,576
    assert _matmul_flops(trace, "model.layers.1.self_attn.q_proj", "forward") == [1_048_576]
    in_layers = [op for op in _collectives(trace, "all_reduce") if ".layers." in op.module]
    assert len(in_layers) == 4
    # 2(n-1)/n at n = 4 is 1.5: 16,384 * 1.5 = 24,576 bytes per rank
    assert {wire_bytes(op) for op in in_layers} == {24_576}
    assert {tuple(op.arg("group_ranks")) for op in in_layers} == {(0, 1, 2, 3)}


def test_kv_heads_that_do_not_divide_are_refused():
    with fake_process_group(4):
        mesh = build_mesh(ParallelPlan(tp=4))
        with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by tp=4"):
            apply_tensor_parallel(_llama(), mesh["tp"])


def test_tp2_train_step_all_reduces_and_backward_flops(train_tp2):
    forward = [op for op in _collectives(train_tp2, "all_reduce") if op.phase == "forward"]
    backward = [op for op in _collectives(train_tp2, "all_reduce") if op.phase == "backward"]
    # forward: the embedding + o_proj and down_proj per layer = 1 + 2*2 = 5
    assert len(forward) == 5
    # backward: a column-wise layer's input is replicated, so its input gradient is a partial
    # sum: q, k, v, gate, up per layer (5 * 2 = 10) + the LM head = 11
    assert len(backward) == 11
    assert Counter(op.module.rsplit(".", 1)[-1] for op in backward) == Counter(
        {"q_proj": 2, "k_proj": 2, "v_proj": 2, "gate_proj": 2, "up_proj": 2, "lm_head": 1}
    )
    assert {wire_bytes(op) for op in forward + backward} == {16_384}
    # q_proj backward: grad input (B*T, d/2) x (d/2, d) and grad weight (d/2, B*T) x (B*T, d),
    # each 2*32*128*256 = 2,097,152 FLOPs: half of one GPU's
    assert _matmul_flops(train_tp2, "model.layers.0.self_attn.q_proj", "backward") == [
        2_097_152,
        2_097_152,
    ]


def test_dtensor_shape_inference_is_not_recorded(prefill_tp2):
    # DTensor learns output shapes by running each op on fake global-shape tensors, once per
    # process (cached): were it recorded, the first trace would hold more ops than a second.
    again = _trace_tp(2, train=False)
    assert [op.name for op in again.ops] == [op.name for op in prefill_tp2.ops]
    assert not any(op.name == "aten.empty_strided.default" for op in prefill_tp2.ops)


# -- FSDP -----------------------------------------------------------------------------------


def test_fsdp_all_gather_and_reduce_scatter_bytes_per_layer(train_fsdp4):
    gathers = _collectives(train_fsdp4, "all_gather")
    scatters = _collectives(train_fsdp4, "reduce_scatter")
    # units: the embedding, each layer, the final norm with the LM head. Each layer is
    # gathered in forward and again in backward (resharded after forward); the norm+head
    # unit is kept gathered, so 4 forward + 3 backward all-gathers; one reduce-scatter per unit
    assert Counter(op.inputs[0].numel for op in gathers) == Counter(
        {LAYER_PARAMS: 4, EMBED_PARAMS: 2, NORM_AND_HEAD_PARAMS: 1}
    )
    assert Counter(op.inputs[1].numel for op in scatters) == Counter(
        {LAYER_PARAMS: 2, EMBED_PARAMS: 1, NORM_AND_HEAD_PARAMS: 1}
    )
    layer_gather = next(op for op in gathers if op.module == "model.layers.0")
    # flat shard: 590,336 / 4 = 147,584 elements; S = the gathered 590,336 x 2 = 1,180,672
    # bytes; wire (n-1)/n * S = 885,504; HBM: the shard read (295,168) + S written
    assert layer_gather.inputs[1].shape == (147_584,)
    assert (message_bytes(layer_gather), wire_bytes(layer_gather)) == (1_180_672, 885_504)
    cost = cost_of(layer_gather)
    assert (cost.bytes_read, cost.bytes_written) == (295_168, 1_180_672)
    layer_scatter = next(op for op in scatters if op.module == "model.layers.0")
    # reduce-scatter of the layer's bf16 gradients: S = the full input, the same 1,180,672
    assert (message_bytes(layer_scatter), wire_bytes(layer_scatter)) == (1_180_672, 885_504)
    assert cost_of(layer_scatter).bytes_written == 295_168
    assert layer_scatter.arg("reduce_op") == "avg"
    assert {tuple(op.arg("group_ranks")) for op in gathers + scatters} == {(0, 1, 2, 3)}


def test_fsdp_without_reshard_gathers_once():
    # reshard_after_forward=False (ZeRO-2-like): no all-gather in backward
    trace = _trace_fsdp(ParallelPlan(fsdp=4), reshard_after_forward=False)
    gathers = _collectives(trace, "all_gather")
    assert [op.phase for op in gathers] == ["forward"] * 4
    assert len(_collectives(trace, "reduce_scatter")) == 4


def test_hsdp_reduce_scatters_in_the_replica_then_all_reduces_across():
    # dp=2 x fsdp=2: each unit is sharded over ranks [0, 1] and replicated over [0, 2]
    trace = _trace_fsdp(ParallelPlan(dp=2, fsdp=2))
    scatters = _collectives(trace, "reduce_scatter")
    reduces = _collectives(trace, "all_reduce")
    assert {tuple(op.arg("group_ranks")) for op in scatters} == {(0, 1)}
    assert {tuple(op.arg("group_ranks")) for op in reduces} == {(0, 2)}
    assert len(reduces) == len(scatters) == 4  # one per unit
    layer = next(op for op in reduces if op.module == "model.layers.0")
    # the layer's gradient shard: 590,336 / 2 x 2 bytes = 590,336 bytes; 2(n-1)/n = 1 at n = 2
    assert (message_bytes(layer), wire_bytes(layer)) == (590_336, 590_336)


def test_fsdp_with_tp_on_eight_ranks(train_fsdp4_tp2):
    gathers = [
        op for op in _collectives(train_fsdp4_tp2, "all_gather") if op.packet.startswith("c10d")
    ]
    # TP halves the sharded matrices, not the norms: (590,336 - 512) / 2 + 512 = 295,424
    # per TP rank, over 4 FSDP ranks: 73,856 each
    layer = next(op for op in gathers if op.module == "model.layers.0")
    assert [t.shape for t in layer.inputs] == [(295_424,), (73_856,)]
    # FSDP groups are strided across the TP dimension; the TP group is consecutive ranks
    assert layer.arg("group_ranks") == [0, 2, 4, 6]
    tp_reduces = [op for op in _collectives(train_fsdp4_tp2, "all_reduce")]
    assert {tuple(op.arg("group_ranks")) for op in tp_reduces} == {(0, 1)}
    assert len(tp_reduces) == 16  # as at TP=2 alone: 5 forward + 11 backward


def test_collective_args_survive_a_saved_trace(train_fsdp4_tp2, tmp_path):
    path = tmp_path / "fsdp_tp.json"
    train_fsdp4_tp2.save(path)
    loaded = Trace.load(path)
    before, after = _collectives(train_fsdp4_tp2), _collectives(loaded)
    assert len(after) == len(before) > 0
    for old, new in zip(before, after, strict=True):
        assert new.args == old.args
        assert wire_bytes(new) == wire_bytes(old)
        assert cost_of(new) == cost_of(old)
    saved = json.loads(path.read_text())
    first = next(op for op in saved["ops"] if op["op"] == "c10d._allgather_base_.default")
    assert first["args"]["group_ranks"] == [0, 2, 4, 6]
    assert first["args"]["process_group"] == first["args"]["group_name"]  # a name, not an object


# -- the rule on a hand-built record ----------------------------------------------------------


def _meta(shape: tuple[int, ...], storage: int) -> TensorMeta:
    return TensorMeta(shape, (1,), "bfloat16", storage)


def test_all_gather_rule_on_a_hand_built_record():
    out, shard = _meta((8,), 1), _meta((2,), 2)
    op = OpRecord(
        0,
        "c10d._allgather_base_.default",
        (out, shard),
        (out,),
        {"output_tensor": TensorRef(0), "input_tensor": TensorRef(1), "group_size": 4},
        "",
        "forward",
    )
    # read the 2-element shard (4 bytes), write the 8-element buffer (16 bytes);
    # wire (4-1)/4 * 16 = 12 bytes
    cost = cost_of(op)
    assert (cost.bytes_read, cost.bytes_written, cost.unit) == (4, 16, "network")
    assert wire_bytes(op) == 12
    del op.args["group_size"]
    with pytest.raises(ValueError, match="no recorded group size"):
        wire_bytes(op)


def test_wait_tensor_costs_nothing(train_fsdp4_tp2):
    waits = [op for op in train_fsdp4_tp2.ops if op.packet == "_c10d_functional.wait_tensor"]
    assert waits  # functional collectives are waited on under a fake tensor mode
    assert all(cost_of(op).bytes == 0 and kind_of(op.packet) == "view" for op in waits)


# -- the process group and the plan ---------------------------------------------------------


def test_fake_process_group_is_reentrant_and_destroyed_on_exit():
    with fake_process_group(2):
        with fake_process_group(2):
            assert dist.get_world_size() == 2
        assert dist.is_initialized()  # the inner block left the outer group alone
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_process_group(4):
                pass
    assert not dist.is_initialized()


def test_parallel_plan_and_mesh():
    plan = ParallelPlan(dp=2, fsdp=2, tp=2)
    assert plan.world == 8 and plan.mesh_shape == (1, 2, 2, 1, 2)  # pp, dp, fsdp, cp, tp
    with pytest.raises(ValueError, match="ParallelPlan.tp must be a positive integer"):
        ParallelPlan(tp=0)
    with pytest.raises(RuntimeError, match="fake_process_group"):
        build_mesh(plan)
    with fake_process_group(4):
        with pytest.raises(ValueError, match="spans 8 ranks"):
            build_mesh(plan)

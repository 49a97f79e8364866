"""Expert parallelism: rank 0 of transformers' all-to-all dispatch (AllToAllEP) on a fake
process group, traced on meta under balanced routing (torchroof.parallel.expert,
torchroof.capture.routing)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from conftest import TINY_MIXTRAL
from torchroof.counters import kind_of
from torchroof.counters.collectives import collective_kind, message_bytes, wire_bytes
from transformers import LlamaConfig, MixtralConfig

import torchroof
from torchroof.config import PricingOptions, Workload
from torchroof.config.errors import OptionError, WorkloadError
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.models.sources import build_model
from torchroof.parallel.expert import apply_expert_parallel, expert_mesh, without_expert_rules
from torchroof.parallel.mesh import build_mesh
from torchroof.parallel.program import fake_process_group
from torchroof.parallel.tensor import apply_tensor_parallel
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace

MIXTRAL = TINY_MIXTRAL  # conftest: d 64, 8 experts of FFN 128, top-2, 2 layers
B, T, D, FFN, E, TOP_K, LAYERS = 2, 16, 64, 128, 8, 2, 2
TOKENS = B * T  # 32 on each rank
EP = 4
BF16 = 2  # bytes
CLUSTER = "dgx-h100"


def _mixtral() -> torch.nn.Module:
    return build_model(MixtralConfig(**MIXTRAL), torch.bfloat16)


def _train_step(model: torch.nn.Module, batch: int = B) -> Trace:
    ids = torch.zeros(batch, T, dtype=torch.long, device="meta")
    with torchroof.trace() as trace:
        model(ids, labels=ids).loss.backward()
    return trace


@pytest.fixture(scope="module")
def ep4() -> Trace:
    """Rank 0 of EP = 4 (2 of the 8 experts per rank), one forward + backward of 32 tokens."""
    with fake_process_group(EP):
        mesh = expert_mesh(EP, EP)
        model = apply_expert_parallel(_mixtral(), mesh["ep"], mesh["tp"])
        return _train_step(model)


def _all_to_alls(trace: Trace, layer: int, phase: str) -> list[OpRecord]:
    module = f"model.layers.{layer}.mlp.experts"
    return [
        op
        for op in trace.ops
        if op.module == module
        and op.phase == phase
        and kind_of(op.packet) == "collective"
        and collective_kind(op) == "all_to_all"
    ]


def _expert_flops(trace: Trace) -> int:
    estimate = trace.estimate(CLUSTER)
    assert estimate.uncounted == {}
    return sum(k.flops for k in estimate.kernels if "experts" in k.module and k.unit == "tensor")


def test_each_moe_layer_dispatches_and_combines_with_two_token_all_to_alls(ep4):
    for layer in range(LAYERS):
        forward = _all_to_alls(ep4, layer, "forward")
        # the per-expert counts (c10d, in place), then the tokens out and the outputs back
        assert [op.name for op in forward] == [
            "c10d.alltoall_base_.default",
            "_c10d_functional.all_to_all_single.default",
            "_c10d_functional.all_to_all_single.default",
        ]
        assert all(op.arg("group_ranks") == [0, 1, 2, 3] for op in forward)
        counts, dispatch, combine = forward
        # counts: ep x E/ep int64 = 4 x 2 x 8 B = 64 B, of which 3/4 leave the rank: 48 B
        assert (message_bytes(counts), wire_bytes(counts)) == (64, 48)
        # tokens: 32 tokens x top-2 = 64 rows of d = 64 in bf16 = 32 x 2 x 64 x 2 = 8192 B,
        # 1/4 stays on rank 0 (its own experts' rows), 3/4 = 6144 B go on the wire
        for op in (dispatch, combine):
            assert op.outputs[0].shape == (TOKENS * TOP_K, D)
            assert message_bytes(op) == TOKENS * TOP_K * D * BF16 == 8192
            assert wire_bytes(op) == 8192 * 3 // 4 == 6144
        # the split sizes: 64 rows sent, 64 / 4 = 16 to each peer, and 16 received from each
        assert dispatch.arg("input_split_sizes") == [16, 16, 16, 16]
        assert dispatch.arg("output_split_sizes") == [16, 16, 16, 16]
        # backward: the gradients go through the two exchanges in reverse, no counts
        backward = _all_to_alls(ep4, layer, "backward")
        assert [message_bytes(op) for op in backward] == [8192, 8192]


def test_split_sizes_are_read_back_under_balanced_routing(ep4):
    routing = [a.what for a in ep4.assumptions if a.kind == "routing"]
    # one tolist per layer of stack([sent per rank, received per rank]): 2 x 4 sizes
    # summing to 64 + 64 = 128 rows
    assert routing == ["Tensor.tolist() on torch.int64 balanced: 128 split over 8"] * LAYERS


def test_rows_that_do_not_divide_split_with_the_larger_shares_first():
    with fake_process_group(EP):
        mesh = expert_mesh(EP, EP)
        model = apply_expert_parallel(_mixtral(), mesh["ep"], mesh["tp"])
        ids = torch.zeros(1, 15, dtype=torch.long, device="meta")
        with torchroof.trace() as trace:
            model(ids, labels=ids).loss.backward()
    tokens = [op for op in trace.ops if op.name == "_c10d_functional.all_to_all_single.default"]
    # 15 tokens x top-2 = 30 rows over 4 ranks: 8, 8, 7, 7 sent, and as many received;
    # 4 token all-to-alls per layer (2 forward, 2 backward), all of the 30 rows
    assert len(tokens) == 4 * LAYERS
    for op in tokens:
        assert op.arg("input_split_sizes") == op.arg("output_split_sizes") == [8, 8, 7, 7]
        assert op.inputs[0].shape == (30, D)


def test_local_grouped_gemm_runs_e_over_ep_experts(ep4):
    gemms = [
        op for op in ep4.ops if op.name == "aten._grouped_mm.default" and op.phase == "forward"
    ]
    # per layer: gate-up on 2 of 8 experts' (64 x 256) weights, then down on (128 x 64);
    # each over the 64 rows rank 0 received (16 from each of the 4 ranks)
    shapes = [(op.inputs[0].shape, op.inputs[1].shape) for op in gemms]
    assert shapes == [((64, D), (E // EP, D, 2 * FFN)), ((64, FFN), (E // EP, FFN, D))] * LAYERS


def test_expert_flops_per_rank_are_one_ep_th_of_the_group_batch_on_one_gpu(ep4):
    # The EP group runs 4 x 32 = 128 tokens. On one GPU they make 128 x 2 = 256 routed rows
    # through all 8 experts; at EP = 4 rank 0 runs its 2 experts on 256 x 2/8 = 64 rows.
    # Per row: 2 x (64 x 256 + 128 x 64) = 49,152 FLOPs forward, x 3 with backward
    # (dX and dW): 147,456. Rank 0: 64 rows x 147,456 x 2 layers = 18,874,368 = 1/4 of the
    # one-GPU 256 x 147,456 x 2 = 75,497,472.
    one_gpu = _expert_flops(_train_step(_mixtral(), batch=EP * B))
    assert one_gpu == 256 * 147_456 * LAYERS == 75_497_472
    assert _expert_flops(ep4) == one_gpu // EP == 18_874_368


def test_with_tensor_parallel_each_rank_sends_its_slice_of_the_shared_batch():
    """TP 2 x EP 4 on 4 ranks: ranks 0 and 1 share a batch; each sends half its tokens."""
    with fake_process_group(4):
        mesh = build_mesh(ParallelPlan(fsdp=2, tp=2))
        model = _mixtral()
        tp_plan = without_expert_rules(model.tp_plan, model.ep_plan)
        # Mixtral's TP plan shards the experts too (moe_tp_experts): EP takes them
        assert not any(".mlp.experts" in name for name in tp_plan)
        apply_tensor_parallel(model, mesh["tp"], plan=tp_plan)
        apply_expert_parallel(model, expert_mesh(4, 4)["ep"], mesh["tp"])
        trace = _train_step(model)
    dispatch = _all_to_alls(trace, 0, "forward")[1]
    # rank 0's slice: 32 / 2 = 16 tokens x top-2 x 64 x 2 B = 4096 B, 8 rows to each peer
    assert message_bytes(dispatch) == 16 * TOP_K * D * BF16 == 4096
    assert dispatch.arg("input_split_sizes") == [8, 8, 8, 8]
    gathers = [
        op
        for op in trace.ops
        if op.module == "model.layers.0.mlp.experts"
        and op.phase == "forward"
        and kind_of(op.packet) == "collective"
        and collective_kind(op) == "all_gather"
    ]
    # the two slices' outputs gathered over the TP pair: 32 x 64 in fp32 (the routing
    # weights are fp32, so is their weighted sum) = 8192 B
    assert [(op.arg("group_ranks"), message_bytes(op)) for op in gathers] == [([0, 1], 8192)]


def test_expert_weights_are_sharded_on_the_expert_dimension():
    with fake_process_group(EP):
        mesh = expert_mesh(EP, EP)
        model = apply_expert_parallel(_mixtral(), mesh["ep"], mesh["tp"])
        experts = model.get_submodule("model.layers.0.mlp.experts")
        local = experts.gate_up_proj.to_local()
        # 8 experts of (2 x 128, 64) -> 2 per rank; num_experts is the local count
        assert tuple(local.shape) == (E // EP, 2 * FFN, D)
        assert experts.num_experts == E // EP
        # attention and the router stay whole on every rank
        gate = model.get_submodule("model.layers.0.mlp.gate")
        assert tuple(gate.weight.shape) == (E, D)


def test_a_group_of_one_leaves_the_model_alone():
    with fake_process_group(1):
        mesh = expert_mesh(1, 1)
        model = _mixtral()
        before = {name: tuple(p.shape) for name, p in model.named_parameters()}
        assert apply_expert_parallel(model, mesh["ep"], mesh["tp"]) is model
        assert {name: tuple(p.shape) for name, p in model.named_parameters()} == before


def test_experts_that_do_not_divide_are_refused_before_any_change():
    with fake_process_group(3):
        mesh = expert_mesh(3, 3)
        model = _mixtral()
        with pytest.raises(ValueError, match=r"8 experts.*ep=3"):
            apply_expert_parallel(model, mesh["ep"], mesh["tp"])
        # nothing was sharded
        assert model.get_submodule("model.layers.0.mlp.experts").num_experts == E


def test_a_dense_model_has_no_ep_plan():
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with fake_process_group(2):
        mesh = expert_mesh(2, 2)
        with pytest.raises(ValueError, match="LlamaForCausalLM has no ep plan"):
            apply_expert_parallel(build_model(config, torch.bfloat16), mesh["ep"], mesh["tp"])


def test_a_plan_without_dispatch_is_refused():
    with fake_process_group(2):
        mesh = expert_mesh(2, 2)
        plan = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}
        with pytest.raises(ValueError, match="ep_dispatch_experts"):
            apply_expert_parallel(_mixtral(), mesh["ep"], mesh["tp"], plan=plan)


def test_expert_mesh_needs_its_process_group():
    with pytest.raises(RuntimeError, match="fake_process_group"):
        expert_mesh(4, 2)
    with fake_process_group(4):
        with pytest.raises(ValueError, match="ep=3"):
            expert_mesh(4, 3)
        mesh = expert_mesh(4, 2)
        # EP groups of consecutive ranks: rank 0 is with rank 1
        assert dist.get_process_group_ranks(mesh["ep"].get_group()) == [0, 1]


# -- balanced routing of the dispatch's counts ---------------------------------------------
def test_scatter_add_of_ones_counts_rows_per_expert():
    expert_ids = torch.empty(64, dtype=torch.long, device="meta")
    with torchroof.trace():
        counts = torch.zeros(8, dtype=torch.long, device="meta")  # made inside: mean 0
        counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
        # 64 (token, expert) rows into 8 experts: 8 each
        assert counts.tolist() == [8] * 8
        # the out-of-place form, and its per-rank sums (2 experts a rank: 16)
        again = torch.zeros_like(counts).scatter_add(0, expert_ids, torch.ones_like(expert_ids))
        assert again.view(4, 2).sum(dim=1).tolist() == [16] * 4


def test_fake_tensor_counts_read_one_by_one_sum_to_the_same_total():
    """A FakeTensor's tolist (under fake_parameters, for FSDP2) reads each element with
    .item(): the elements answer the balanced split, so the sizes still sum exactly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        expert_ids = torch.empty(30, dtype=torch.long)
        with torchroof.trace():
            counts = torch.zeros(4, dtype=torch.long)
            counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
            # 30 rows over 4 experts: 8, 8, 7, 7 (the larger shares first), as on meta
            assert counts.tolist() == [8, 8, 7, 7]
            assert torch.stack([counts, counts]).tolist() == [[8, 8, 7, 7]] * 2


def test_functional_all_to_all_keeps_the_counts_mean():
    from torch.distributed._functional_collectives import all_to_all_single

    with fake_process_group(4):
        group = dist.group.WORLD
        with torch.device("meta"):
            expert_ids = torch.empty(64, dtype=torch.long)
        with torchroof.trace() as trace:
            sent = torch.zeros(8, dtype=torch.long, device="meta")
            sent = sent.scatter_add_(0, expert_ids, torch.ones_like(expert_ids)).view(4, 2)
            received = all_to_all_single(sent, None, None, group)
            # balanced routing is symmetric: 16 rows from each of the 4 ranks, 64 in all
            assert torch.stack([sent.sum(dim=1), received.sum(dim=1)]).tolist() == [[16] * 4] * 2
        assert Counter(op.name for op in trace.ops)["_c10d_functional.all_to_all_single.default"]


# -- the ep knob: serving and training steps across GPUs ----------------------------------


def test_serving_with_ep_runs_data_parallel_attention_and_sharded_experts():
    # ep = dp = 4: each rank its own batch of 2 x 16 tokens, 2 of the 8 experts; per layer
    # forward two token all-to-alls of 32 tokens x top-2 x 64 x 2 B = 8,192 B each.
    est = torchroof.estimate(
        MixtralConfig(**MIXTRAL), "prefill", hardware=CLUSTER, batch=B, seq=T, dp=EP, ep=EP
    )
    token_a2a = [
        k for k in est.kernels if k.unit == "network" and any("all_to_all" in o for o in k.ops)
    ]
    assert len(token_a2a) == 2 * LAYERS
    # (n - 1)/n of each message leaves the rank: 3/4 x 8,192 = 6,144 B over NVLink
    assert {k.wire_by_link.get("nvlink") for k in token_a2a} == {6_144}
    # no FSDP in a serving step: the dense weights are whole on every rank
    assert not any("all_gather" in o for k in est.kernels for o in k.ops)


def test_routing_imbalance_scales_the_busiest_ranks_expert_work():
    # the busiest rank's experts get 1.5x the balanced rows: its grouped GEMMs' compute
    # time and its expert all-to-alls' bytes take 1.5x as long (alpha, the per-message
    # latency, does not grow); FLOPs stay the balanced ones.
    base = dict(hardware=CLUSTER, batch=B, seq=T, dp=EP, ep=EP)
    config = MixtralConfig(**MIXTRAL)
    balanced = torchroof.estimate(config, "prefill", **base)
    busy = torchroof.estimate(config, "prefill", routing_imbalance=1.5, **base)
    assert busy.flops == balanced.flops
    pairs = list(zip(balanced.kernels, busy.kernels, strict=True))
    for before, after in pairs:
        if before.unit == "network" and any("all_to_all" in o for o in before.ops):
            carried = before.network_s - before.latency_s
            assert before.latency_s > 0
            assert after.network_s == pytest.approx(before.latency_s + 1.5 * carried)
        elif any("grouped_mm" in o for o in before.ops):
            assert after.compute_s == pytest.approx(1.5 * before.compute_s)
        else:
            assert after.time_s == before.time_s
    assert any("1.5x the balanced share" in a for a in busy.assumptions)


def test_training_with_ep_shards_experts_over_the_ranks_that_hold_them():
    # fsdp 8, ep 4: each expert lives on 2 ranks (efsdp = 8 / 4 = 2: ranks 0 and 4, the
    # same place in the two EP groups), whose FSDP all-gathers (forward) and
    # reduce-scatters (backward) run over those 2, once per MoE layer; the dense units
    # shard over all 8; the token all-to-alls run over the EP group, ranks 0-3.
    trace = torchroof.trace_model(MixtralConfig(**MIXTRAL), "train", batch=B, seq=T, fsdp=8, ep=EP)
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    for op in trace.ops:
        if kind_of(op.packet) == "collective":
            key = (collective_kind(op), tuple(op.arg("group_ranks")))
            groups[key] = groups.get(key, 0) + 1
    assert groups[("all_gather", (0, 4))] == 2 * LAYERS  # forward, then again in backward
    assert groups[("reduce_scatter", (0, 4))] == LAYERS
    assert groups[("all_to_all", (0, 1, 2, 3))] == 3 * LAYERS + 2 * LAYERS  # counts + tokens
    assert ("reduce_scatter", tuple(range(8))) in groups


def test_ep_must_fit_the_ranks_that_hold_batches():
    with pytest.raises(WorkloadError, match="multiple of tp=2"):
        Workload(regime="prefill", tp=2, dp=4, ep=3)
    with pytest.raises(WorkloadError, match="divide dp x fsdp x cp x tp = 2"):
        Workload(regime="prefill", dp=2, ep=4)
    with pytest.raises(OptionError, match="routing_imbalance"):
        PricingOptions(routing_imbalance=0.5)


def test_fewer_local_experts_than_their_ranks_shard_along_dim_one():
    # 8 experts over ep 8 (one per rank), fsdp 16: each expert lives on 2 ranks (ranks 0
    # and 8). Sharding dim 0 (one expert) over 2 would pad to a whole expert per rank and
    # gather two; torchtitan shards such experts along dim 1: each rank holds half of its
    # expert (gate-up 128 x 64 + down 32 x 128 = 12,288 bf16) and gathers the whole one,
    # 24,576 elements = 49,152 B
    trace = torchroof.trace_model(MixtralConfig(**MIXTRAL), "train", batch=B, seq=T, fsdp=16, ep=8)
    gathers = [  # the experts' unit, over the 2 ranks that hold them
        op
        for op in trace.ops
        if kind_of(op.packet) == "collective"
        and collective_kind(op) == "all_gather"
        and op.arg("group_ranks") == [0, 8]
    ]
    assert len(gathers) == 2 * LAYERS  # forward, then again in backward
    assert {message_bytes(op) for op in gathers} == {49_152}


def test_experts_whose_rows_do_not_split_evenly_shard_whole():
    # fsdp 24, ep 8: each expert lives on 3 ranks, and neither gate-up's 256 rows nor
    # down's 64 split into 3; FSDP2 splits dim 1 evenly only, so these shard along dim 0
    # (padded to one expert per rank: the gather carries 3 experts, 3 x 24,576 bf16)
    trace = torchroof.trace_model(MixtralConfig(**MIXTRAL), "train", batch=B, seq=T, fsdp=24, ep=8)
    gathers = [
        op
        for op in trace.ops
        if kind_of(op.packet) == "collective"
        and collective_kind(op) == "all_gather"
        and op.arg("group_ranks") == [0, 8, 16]
    ]
    assert len(gathers) == 2 * LAYERS
    assert {message_bytes(op) for op in gathers} == {3 * 24_576 * BF16}


def test_context_parallel_ranks_send_their_own_tokens_to_the_experts():
    # cp 2 x ep 2 (2 ranks): each cp rank holds B x T / cp = 2 x 16 / 2 = 16 of the tokens,
    # and the EP group is the cp pair (0, 1). Each token all-to-all sends the rank's
    # 16 tokens x top-2 rows of d = 64 in bf16: 16 x 2 x 64 x 2 B = 4,096 B (half of the
    # 8,192 B one rank of ep 2 without cp sends for its 32 tokens)
    def tokens_sent(trace: Trace) -> set[tuple[tuple[int, ...], int]]:
        return {
            (tuple(op.arg("group_ranks")), message_bytes(op))
            for op in _all_to_alls(trace, 0, "forward")
            if message_bytes(op) > 64  # not the counts' exchange (8 experts x 8 B)
        }

    config = MixtralConfig(**MIXTRAL)
    cp = torchroof.trace_model(config, "train", batch=B, seq=T, cp=2, ep=2)
    alone = torchroof.trace_model(config, "train", batch=B, seq=T, fsdp=2, ep=2)
    assert tokens_sent(cp) == {((0, 1), TOKENS // 2 * TOP_K * D * BF16)} == {((0, 1), 4096)}
    assert tokens_sent(alone) == {((0, 1), TOKENS * TOP_K * D * BF16)}
    # the ring attention runs on the same pair; each expert lives on one rank (world / ep
    # = 1 copy): no expert collective but the all-to-alls
    ring = [
        op
        for op in cp.ops
        if op.module.endswith("self_attn") and kind_of(op.packet) == "collective"
    ]
    assert ring and {tuple(op.arg("group_ranks")) for op in ring} == {(0, 1)}
    experts = {
        collective_kind(op)
        for op in cp.ops
        if kind_of(op.packet) == "collective" and op.module.endswith("experts")
    }
    assert experts == {"all_to_all"}
    # cp 2 x tp 2 x ep 2 (4 ranks, cp outside tp): the EP group is the TP pair (0, 1) and
    # each expert's two copies sit on the cp ranks (0, 2), which shard it as FSDP shards
    # the dense weights over them: gradients reduce-scattered over (0, 2), not all-reduced
    both = torchroof.trace_model(config, "train", batch=B, seq=T, cp=2, tp=2, ep=2)
    reductions = Counter(
        (collective_kind(op), tuple(op.arg("group_ranks")))
        for op in both.ops
        if kind_of(op.packet) == "collective" and op.module.endswith("experts")
        and collective_kind(op) in ("reduce_scatter", "all_reduce")
    )  # fmt: skip
    assert reductions == {("reduce_scatter", (0, 2)): LAYERS}


def test_a_routing_imbalance_leaves_the_ring_attentions_passes_alone():
    # cp 2 x ep 2: the busiest rank's experts get 2x the balanced rows, so its token
    # all-to-alls carry twice the bytes (alpha unscaled); the ring's dK, dV passes (an
    # all_to_all_single to one peer) carry no routed tokens and keep their time
    config = MixtralConfig(**MIXTRAL)
    knobs = dict(hardware=CLUSTER, batch=B, seq=T, cp=2, ep=2)
    balanced = torchroof.estimate(config, "train", **knobs).kernels
    busiest = torchroof.estimate(config, "train", routing_imbalance=2.0, **knobs).kernels

    def network(kernels, module_end: str) -> list:
        return [k for k in kernels if k.unit == "network" and k.module.endswith(module_end)]

    ring = network(balanced, "self_attn"), network(busiest, "self_attn")
    assert [k.name for k in ring[0] if "all_to_all" in k.name]  # the passes are there
    assert [k.network_s for k in ring[0]] == [k.network_s for k in ring[1]]
    pairs = zip(network(balanced, "experts"), network(busiest, "experts"), strict=True)
    tokens = [(before, after) for before, after in pairs if "all_to_all" in before.name]
    assert tokens
    for before, after in tokens:
        carried = before.network_s - before.latency_s
        assert after.network_s == pytest.approx(before.latency_s + 2.0 * carried)

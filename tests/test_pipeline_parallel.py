"""Pipeline parallel: torch's schedules laid on a timeline, stages traced
once each, bubbles, per-stage memory and the activations sent between stages."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import torchroof
from torchroof.config import Workload
from torchroof.config.errors import WorkloadError
from torchroof.models.sources import build_model
from torchroof.parallel.pipeline.schedule import Action, action_order, simulate
from torchroof.parallel.stages import make_stage, split_layers
from torchroof.render import files, text
from torchroof.report import analysis
from torchroof.workloads import run_workload


def times(forward: float, backward: float, per_stage: dict[int, float] | None = None):
    scale = per_stage or {}

    def duration(action: Action) -> float:
        base = forward if action.kind == "F" else backward
        return base * scale.get(action.stage, 1.0)

    return duration


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_of_equal_stages_is_the_textbook_one(schedule: str) -> None:
    # p = 4 ranks, m = 8 micro-batches, t_F = 1, t_B = 2: the step is
    # (m + p - 1)(t_F + t_B) = 11 * 3 = 33 and every rank idles (p - 1)/(m + p - 1) = 3/11.
    timeline = simulate(action_order(schedule, 4, 8), times(1.0, 2.0))
    assert timeline.step_time_s == pytest.approx(33.0)
    assert timeline.bubble_share == pytest.approx(3 / 11)
    for rank in range(4):
        assert timeline.idle_share(rank) == pytest.approx(3 / 11)


def test_interleaving_shrinks_the_bubble_by_the_virtual_stages() -> None:
    # v = 2 stages per rank, each half a rank's work (t_F = 0.5, t_B = 1): the bubble is
    # (p - 1)/(v·m + p - 1) = 3/(16 + 3) = 3/19 (Narayanan et al. 2021, interleaved 1F1B).
    timeline = simulate(action_order("interleaved-1f1b", 4, 8, 2), times(0.5, 1.0))
    assert timeline.bubble_share == pytest.approx(3 / 19)


def test_micro_batches_in_flight_per_stage() -> None:
    # 1F1B: stage s runs p - s forwards before its first backward, so it holds
    # min(p - s, m) = 4, 3, 2, 1 micro-batches; GPipe runs all m = 8 forwards first.
    one_f_one_b = simulate(action_order("1f1b", 4, 8), times(1.0, 2.0))
    gpipe = simulate(action_order("gpipe", 4, 8), times(1.0, 2.0))
    assert [one_f_one_b.in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    assert [gpipe.in_flight(s) for s in range(4)] == [8, 8, 8, 8]


def test_a_heavier_last_stage_makes_the_bubble_worse() -> None:
    # The LM head makes the last stage 1.5x the others: every other rank waits on it, so
    # the idle share rises above the equal-stage 3/11; the step is at least the last
    # stage's own work, m (1.5 + 3) = 36, plus the fill of the three before it (3 x 1).
    timeline = simulate(action_order("1f1b", 4, 8), times(1.0, 2.0, {3: 1.5}))
    assert timeline.bubble_share > 3 / 11 + 0.02
    assert timeline.step_time_s >= 8 * 4.5 + 3 - 1e-9


def test_transfers_lie_on_the_critical_path() -> None:
    # p = 2, m = 1, transfer x = 0.25: F0 (1) + x + F1 (1) + B1 (2) + x + B0 (2) = 6.5.
    timeline = simulate(action_order("gpipe", 2, 1), times(1.0, 2.0), lambda a, b: 0.25)
    assert timeline.step_time_s == pytest.approx(6.5)


def test_zero_bubble_schedules_run_split_backwards() -> None:
    order = action_order("zbv", 4, 8)
    kinds = {a.kind for actions in order.values() for a in actions}
    assert {"I", "W"} <= kinds
    # V shape: rank 0 holds the first stage and the last (2p - 1 = 7)
    assert {a.stage for a in order[0]} == {0, 7}


def test_layer_split_as_transformers_splits() -> None:
    # 126 layers over 8 stages: 15 each and 6 left, one each to the first six stages.
    counts = [len(s.layers) for s in split_layers(126, 8)]
    assert counts == [16, 16, 16, 16, 16, 16, 15, 15]
    assert [len(s.layers) for s in split_layers(8, 2, (3, 5))] == [3, 5]
    with pytest.raises(WorkloadError, match="3\\+4 = 7 layers"):
        split_layers(8, 2, (3, 4))
    with pytest.raises(WorkloadError, match="cannot fill"):
        split_layers(2, 4)


TINY = LlamaConfig(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)


@pytest.fixture(scope="module")
def pipelined() -> torchroof.Estimate:
    return torchroof.estimate(TINY, "train", hardware="dgx-h100", seq=128, pp=4, microbatches=8)


def test_each_distinct_stage_is_traced_once(pipelined: torchroof.Estimate) -> None:
    # 8 layers over 4 stages: the first (embedding) and last (norm, head) differ, the two
    # middle ones hold equal layers and share one trace.
    step = pipelined.pipeline
    assert [r.traced_as for r in step.stages] == [0, 1, 1, 3]
    assert [r.layers for r in step.stages][::3] == [
        "layers 0-1 + embedding",
        "layers 6-7 + norm + head",
    ]


def test_activation_sent_between_stages(pipelined: torchroof.Estimate) -> None:
    # one micro-batch's hidden states: batch 1 x 128 tokens x 256 x 2 B (bf16) = 65,536 B
    step = pipelined.pipeline
    assert {r.activation_bytes for r in step.stages} == {65_536}
    assert step.transfer_link == "nvlink"  # ranks 0 and 1 of a DGX share a node


def test_per_stage_memory_counts_the_micro_batches_in_flight(
    pipelined: torchroof.Estimate,
) -> None:
    step = pipelined.pipeline
    assert [r.in_flight for r in step.stages] == [4, 3, 2, 1]
    middle = step.stages[1], step.stages[2]  # one trace: same fixed bytes and peak
    # stage 1 holds one micro-batch more than stage 2: exactly one more saved forward
    assert middle[0].memory_bytes - middle[1].memory_bytes == middle[0].saved_bytes
    assert middle[0].saved_bytes > 0


def test_step_time_and_throughput_come_from_the_schedule(pipelined: torchroof.Estimate) -> None:
    step = pipelined.pipeline
    assert pipelined.time_s == pytest.approx(step.step_time_s)
    assert step.step_time_s > step.pipeline_s  # the optimizer runs after the drain
    # one replica spans the 4 stages: tokens/s per GPU = 8 x 128 tokens / step / 4 GPUs
    from torchroof.report import analysis

    expected = 8 * 128 / pipelined.time_s / 4
    assert analysis.tokens_per_s_per_gpu(pipelined) == pytest.approx(expected)
    assert "pipeline: 1f1b over 4 ranks, 8 micro-batches" in text.summary(pipelined)


def test_decode_stage_holds_its_own_layers_cache() -> None:
    # stage 1 of 4 owns 2 of the 8 layers and caches only theirs: a static cache of
    # context + 1 = 257 positions, 2 layers x (K, V) x batch 2 x 257 x 2 KV heads x 64 dims
    # x 2 B = 263,168 B, a quarter of the whole model's.
    model = build_model(TINY, torch.bfloat16)
    make_stage(model, split_layers(8, 4)[1])
    trace = run_workload(model, Workload(regime="decode", batch=2, context=256))
    assert trace.role_bytes["kv_cache"] == 2 * 2 * 2 * 257 * 2 * 64 * 2
    assert trace.facts.pipeline is not None
    assert trace.facts.pipeline.activation_bytes == 2 * 1 * 256 * 2  # one token each


def test_zbv_splits_input_and_weight_gradients() -> None:
    est = torchroof.estimate(
        TINY, "train", hardware="dgx-h100", seq=128, pp=2, microbatches=4, pp_schedule="zbv"
    )
    middle = est.pipeline.stages[1]
    assert middle.input_s > 0 and middle.weight_s > 0
    assert middle.backward_s == pytest.approx(middle.input_s + middle.weight_s)
    first = est.pipeline.stages[0]
    assert first.input_s == 0.0  # the first stage has no input gradient: W is its backward


def test_pipelines_refuse_what_they_do_not_compose_with() -> None:
    with pytest.raises(WorkloadError, match=r"over the data ranks \(fsdp, dp, cp\)"):
        Workload(regime="train", pp=2, cp=2, seq=128, pp_schedule="zbv")
    with pytest.raises(WorkloadError, match="splits each backward"):
        Workload(regime="train", pp=2, fsdp=2, pp_schedule="zbv")
    with pytest.raises(WorkloadError, match="pp_split"):
        Workload(regime="train", pp=2, pp_split="4,x")
    with pytest.raises(WorkloadError, match="W would be empty"):
        Workload(regime="train", pp=2, tp=2, pp_schedule="zbv")


def test_a_pipelined_estimate_round_trips_through_json(pipelined: torchroof.Estimate) -> None:
    again = torchroof.Estimate.from_json(files.estimate_json(pipelined))
    assert again.pipeline == pipelined.pipeline
    assert again.time_s == pytest.approx(pipelined.time_s)


def test_the_chrome_trace_lays_out_every_rank(pipelined: torchroof.Estimate) -> None:
    from torchroof.render.chrome_trace import chrome_trace

    events = chrome_trace(pipelined)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] >= 100]
    for rank in range(4):
        mine = [e for e in spans if e["pid"] == 100 + rank]
        # 8 forwards and 8 backwards per rank; sends: ranks 0-2 pass 8 activations on,
        # ranks 1-3 pass 8 gradients back; then one gradient sync + optimizer span
        assert sum(e["cat"] == "F" for e in mine) == 8
        assert sum(e["cat"] == "B" for e in mine) == 8
        assert sum(e["cat"] == "send" for e in mine) == 8 * ((rank < 3) + (rank > 0))
        assert sum(e["cat"] == "after" for e in mine) == 1
    last_end = max(e["ts"] + e["dur"] for e in spans)
    assert last_end == pytest.approx(pipelined.time_s * 1e6)


def test_a_serving_pipeline_caches_every_micro_batch() -> None:
    # decode, pp 2, 4 micro-batches of 2 sequences: each stage holds the K/V of all 8
    # sequences: 4 x its one-micro-batch cache (4 of the 8 layers: 4 x 2 x 2 x 257 x 2 x 64
    # x 2 B = 526,336 B per micro-batch).
    est = torchroof.estimate(
        TINY, "decode", hardware="dgx-h100", batch=2, context=256, pp=2, microbatches=4
    )
    one = 4 * 2 * 2 * 257 * 2 * 64 * 2
    assert est.memory.kv_cache_bytes == 4 * one
    assert est.memory.batch == 8
    assert [r.in_flight for r in est.pipeline.stages] == [4, 4]
    # forward only: GPipe's forwards, m + p - 1 = 5 slots of the slower stage at most
    assert est.pipeline.trains is False
    assert est.facts.tokens == 8  # one new token for each of the 8 sequences


def test_saving_a_pipelined_trace_is_refused_before_tracing(tmp_path) -> None:
    from torchroof.cli.main import main

    code = main(["estimate", "llama-3-8b", "--pp", "2", "--save-trace", str(tmp_path / "t.json")])
    assert code == 2
    assert not (tmp_path / "t.json").exists()


def test_serving_composes_tensor_pipeline_and_expert_parallel() -> None:
    # A tiny Mixtral decoding at tp 2 x dp 2 (4 ranks per stage) x pp 2, experts over
    # ep 4: each stage's MoE layers send tokens to the 4 ranks of its EP group and its
    # attention all-reduces over the 2 ranks of its TP group; stage 1 runs on ranks 4-7.
    from torchroof.counters import kind_of
    from torchroof.counters.collectives import collective_kind
    from transformers import MixtralConfig

    config = MixtralConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=1000,
    )
    knobs = dict(batch=4, context=256, tp=2, dp=2, ep=4, pp=2, microbatches=2)
    trace = torchroof.trace_model(config, "decode", **knobs)
    groups = {
        (collective_kind(op), tuple(op.arg("group_ranks")))
        for stage in trace.traces.values()
        for op in stage.ops
        if kind_of(op.packet) == "collective"
    }
    assert ("all_to_all", (0, 1, 2, 3)) in groups
    assert ("all_reduce", (0, 1)) in groups
    assert trace.ranks_per_stage == 4
    est = torchroof.estimate_trace(trace, "dgx-h100")
    assert est.pipeline.transfer_link == "nvlink"  # ranks 0 and 4: one node
    # batch 4 per micro-batch: the collectives' alpha is most of their time
    comm = est.communication()
    assert comm.latency_s > 0.5 * comm.time_s
    assert "alpha (per-collective latency" in text.summary(est)


def test_dualpipev_times_its_whole_backwards_as_input_plus_weight_halves() -> None:
    # DualPipeV mixes whole backwards (B) with split ones (I, W) on one stage trace split
    # at I / W: a B lasts I + W, so every rank is busy 2m·(F + I + W) over its two stages
    # and the utilisation stays below 1.
    est = torchroof.estimate(
        TINY, "train", hardware="dgx-h100", seq=128, pp=2, microbatches=4,
        pp_schedule="dualpipev",
    )  # fmt: skip
    spans = est.pipeline.timeline
    for span in spans:
        if span.what == "B":
            row = est.pipeline.stages[span.stage]
            assert span.end_s - span.start_s == pytest.approx(row.input_s + row.weight_s)
    assert 0 < est.mfu < 1
    # a micro-batch is released by its B or its W: no stage holds more than all of them
    assert all(r.in_flight <= 4 for r in est.pipeline.stages)


def test_gradient_sync_runs_once_per_step_not_per_micro_batch() -> None:
    # tp 2 x dp 2: the replicas' all-reduce carries gradients, so a pipeline runs it once,
    # after a stage's last backward; the tensor-parallel all-reduces carry activations and
    # run in every micro-batch's forward and backward.
    from torchroof.parallel.pipeline.price import once_per_step, stage_actions

    trace = torchroof.trace_model(TINY, "train", seq=128, pp=2, microbatches=4, tp=2, dp=2)
    stage = trace.traces[1]
    est = torchroof.estimate_trace(stage, "dgx-h100")
    sync = [k for k in est.kernels if k.ops == ("c10d.allreduce_.default",)]
    tensor_parallel = [k for k in est.kernels if k.ops == ("_c10d_functional.all_reduce.default",)]
    assert sync and tensor_parallel
    assert all(once_per_step(k, reshard_after_forward=True) for k in sync)
    assert not any(once_per_step(k, reshard_after_forward=True) for k in tensor_parallel)
    # mixed precision reduces in fp32: each all-reduced fp32 buffer is cast back to the
    # bf16 gradients once per step too, one cast per all-reduce
    casts = [
        k for k in est.kernels
        if k.ops == ("aten._to_copy.default",) and set(k.written_by) == {"gradients"}
    ]  # fmt: skip
    assert len(casts) == len(sync) and all(k.dtype == "float32" for k in casts)
    assert all(once_per_step(k, reshard_after_forward=True) for k in casts)
    assert stage.facts.pipeline is not None
    times = stage_actions(est, stage.facts.pipeline.marks, trains=True)
    assert times.after_s >= sum(k.exposed_s for k in sync)
    # with FSDP, its reduce-scatter (whose input, the unsharded gradients, is transient)
    # and the copy that fills it run once too; its all-gathers too when parameters stay
    # gathered, else in every micro-batch
    sharded = torchroof.trace_model(TINY, "train", seq=128, pp=2, microbatches=4, fsdp=2)
    kernels = torchroof.estimate_trace(sharded.traces[1], "dgx-h100").kernels
    scatters = [k for k in kernels if k.ops[0].startswith(("c10d._reduce_scatter", "fsdp.chunk"))]
    gathers = [k for k in kernels if k.ops[0].startswith("c10d._allgather_base_")]
    assert scatters and gathers
    assert all(once_per_step(k, reshard_after_forward=True) for k in scatters)
    assert not any(once_per_step(k, reshard_after_forward=True) for k in gathers)
    assert all(once_per_step(k, reshard_after_forward=False) for k in gathers)


def test_mixed_precision_accumulates_every_micro_batch() -> None:
    # the bf16 -> fp32 gradient accumulation follows every micro-batch's backward: the
    # stage's backward mark lies past it, so it is charged m times, not once.
    trace = torchroof.trace_model(TINY, "train", seq=128, pp=2, microbatches=4, precision="mixed")
    for stage in trace.traces.values():
        assert stage.facts.pipeline is not None
        end = stage.facts.pipeline.marks.backward_end
        assert end is not None
        accumulation = [op.index for op in stage.ops if op.module == "gradient accumulation"]
        assert accumulation and max(accumulation) < end


def test_routing_imbalance_needs_experts_sharded_over_ranks() -> None:
    from torchroof.config.errors import OptionError

    with pytest.raises(OptionError, match="ep=1"):
        torchroof.estimate(TINY, "prefill", hardware="dgx-h100", seq=128, routing_imbalance=1.5)


def test_pipeline_knobs_without_a_pipeline_are_refused() -> None:
    with pytest.raises(WorkloadError, match="give pp > 1"):
        Workload(regime="train", pp_schedule="zbv")
    with pytest.raises(WorkloadError, match="at least 2 stages per rank"):
        Workload(regime="train", pp=2, pp_schedule="interleaved-1f1b", virtual_stages=1)
    with pytest.raises(WorkloadError, match="GPipe's order"):
        Workload(regime="decode", pp=2, pp_schedule="zbv")


def test_sequence_parallel_stages_send_their_shard_of_the_sequence() -> None:
    # tp 2 with sequence parallel: between layers each rank holds T/tp of the residual
    # stream, so a stage sends 1 x 64 tokens x 256 x 2 B = 32,768 B, half of what a plain
    # tensor-parallel stage sends (the whole replicated 65,536 B)
    base = dict(hardware="dgx-h100", seq=128, pp=2, tp=2, microbatches=4)
    plain = torchroof.estimate(TINY, "train", **base).pipeline
    sequence = torchroof.estimate(TINY, "train", sequence_parallel=True, **base).pipeline
    assert {r.activation_bytes for r in plain.stages} == {65_536}
    assert {r.activation_bytes for r in sequence.stages} == {32_768}


def test_each_stage_boundary_is_priced_on_the_link_it_crosses() -> None:
    # pp 4 x (tp 2 x dp 2) on 8-GPU nodes: stage s runs on GPUs 4s..4s+3, so the boundaries 0-1 and
    # 2-3 stay inside a node (NVLink) and 1-2 crosses to the next (the network); a serving
    # step's one micro-batch crosses all three
    est = torchroof.estimate(TINY, "prefill", hardware="dgx-h100", seq=128, pp=4, tp=2, dp=2)
    step = est.pipeline
    assert step.transfer_link == "network"  # the slowest boundary
    sends = {span.stage: span.end_s - span.start_s for span in step.timeline if span.what == "send"}
    assert sends[0] == pytest.approx(sends[2]) and sends[1] > sends[0]
    forward = sum(r.forward_s for r in step.stages)
    assert step.latency_s == pytest.approx(forward + sends[0] + sends[1] + sends[2])


def test_a_model_without_a_pp_plan_is_split_as_its_forward_runs_it() -> None:
    # GPT-2 ships no base_model_pp_plan: its 12 blocks (transformer.h) split 6 + 6, wte, wpe
    # and the dropout with the first stage, ln_f and the tied head with the last
    from torchroof.api import Trace

    staged = torchroof.trace_model("gpt2", "prefill", seq=64, batch=1, pp=2, microbatches=2)
    whole = torchroof.trace_model("gpt2", "prefill", seq=64, batch=1)
    assert staged.layers == ["layers 0-5 + embedding", "layers 6-11 + norm + head"]
    assert "wte, wpe, drop on the first stage, ln_f, the head on the last" in staged.split_note
    flops = [Trace.of(t).estimate("h100-sxm").flops for t in staged.traces.values()]
    # the two stages do the whole model's work, and one more add: the second stage adds its
    # position embedding's stand-in (zeros) to what it receives, 64 tokens x 768 = 49,152
    assert sum(flops) - whole.estimate("h100-sxm").flops == 64 * 768
    est = staged.estimate("dgx-h100")
    assert any("split: GPT2Model.h split as its forward runs it" in a for a in est.assumptions)


@pytest.mark.parametrize("family", ["bloom", "falcon", "opt"])
def test_derived_splits_train_layers_that_return_tuples_and_nested_lists(family) -> None:
    # Bloom's and Falcon's blocks return tuples (hidden states first): another stage's
    # block returns the same shape; OPT's layers sit in model.decoder.layers and its final
    # norm is registered before them (the forward's order decides); Falcon's rotary
    # embedding holds no parameter and runs on every stage
    from transformers import BloomConfig, FalconConfig, OPTConfig

    small = dict(vocab_size=128)
    config = {
        "bloom": BloomConfig(hidden_size=64, n_layer=4, n_head=4, **small),
        "falcon": FalconConfig(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, **small
        ),
        "opt": OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
            word_embed_proj_dim=64, **small,
        ),
    }[family]  # fmt: skip
    staged = torchroof.trace_model(config, "train", seq=32, batch=1, pp=2, microbatches=2)
    assert staged.layers == ["layers 0-1 + embedding", "layers 2-3 + norm + head"]
    last = {"bloom": "ln_f", "falcon": "ln_f", "opt": "final_layer_norm"}[family]
    assert f"{last}, the head on the last" in staged.split_note
    if family == "falcon":
        assert staged.split_note.endswith("rotary_emb on every stage")
    step = staged.estimate("dgx-h100").pipeline
    assert step is not None and [s.in_flight for s in step.stages] == [2, 1]


def test_a_model_with_two_stacks_of_layers_is_refused() -> None:
    from transformers import BartConfig

    config = BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
    )  # fmt: skip
    with pytest.raises(WorkloadError, match=r"it has 2 \(encoder.layers, decoder.layers\)"):
        torchroof.trace_model(config, "prefill", seq=16, batch=1, pp=2, microbatches=2)


def test_context_parallel_stages_run_the_ring_on_their_shard_and_send_it() -> None:
    # pp 2 x cp 2, TINY (8 layers: 4 a stage, d = 256, 4 heads of 64, 2 KV heads), batch 1
    # of seq 128, 4 micro-batches. cp 2 cuts each sequence into 2 x cp = 4 chunks of 32;
    # rank 0 holds chunks 0 and 3, 64 tokens.
    trace = torchroof.trace_model(TINY, "train", seq=128, pp=2, cp=2, microbatches=4)
    assert set(trace.traces) == {0, 1}  # first and last stage differ
    flash = "aten._scaled_dot_product_flash_attention.default"
    for index, stage in trace.traces.items():
        layers = range(4 * index, 4 * index + 4)
        # every layer of the stage attends as one ring rank: its own 64 tokens causally,
        # then for its later chunk (32 queries) the other rank's 64 keys
        blocks = [
            (op.inputs[0].shape[2], op.inputs[1].shape[2], bool(op.arg("is_causal", False)))
            for op in stage.ops
            if op.name == flash
        ]
        assert blocks == [(64, 64, True), (32, 64, False)] * 4
        # per layer one K/V all-gather in forward and one in backward, on the stage's cp
        # group: ranks 0 and 1 of the stage's own program of 2 ranks
        gathers = [
            op
            for op in stage.ops
            if op.name == "_c10d_functional.all_gather_into_tensor.default"
            and op.module.endswith("self_attn")
        ]
        assert sorted({op.module for op in gathers}) == [
            f"model.layers.{i}.self_attn" for i in layers
        ]
        assert len(gathers) == 2 * 4
        assert {tuple(op.arg("group_ranks")) for op in gathers} == {(0, 1)}
    est = torchroof.estimate(TINY, "train", hardware="dgx-h100", seq=128, pp=2, cp=2,
                             microbatches=4)  # fmt: skip
    # a stage sends its shard: 1 x 64 tokens x 256 x 2 B = 32,768 B, half of the 65,536 B
    # a pipeline without cp sends
    assert {r.activation_bytes for r in est.pipeline.stages} == {32_768}
    # the pp x cp = 4 ranks share the step's 4 micro-batches x 128 tokens
    assert analysis.ranks(est) == (4, 4)
    assert analysis.tokens_per_s_per_gpu(est) == pytest.approx(4 * 128 / est.time_s / 4)
    # a serving pipeline (prefill, each rank caching its own K/V) sends the same shard
    served = torchroof.estimate(TINY, "prefill", hardware="dgx-h100", seq=128, pp=2, cp=2,
                                cache="dynamic")  # fmt: skip
    assert {r.activation_bytes for r in served.pipeline.stages} == {32_768}

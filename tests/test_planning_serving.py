"""The serving plan search: its enumeration counted by hand, its answer against an
exhaustive loop over ``torchroof.serve``, and its one-line answers where nothing meets the
targets or a KV cache cannot hold a request.

Every search serves 40 requests of 64 to 512 prompt tokens and 64 output tokens, arriving
at 10,000 per second (within about 4 ms), on the 2-layer Llama of conftest (4 heads, 2 K/V
heads) in realistic mode on a DGX H100. At ``max_num_seqs=8`` a replica admits 8 requests
at once; each then runs 64 steps of about 0.1 ms (6.4 ms), so every later request it holds
waits past a 2 ms TTFT target: exactly 8 requests per replica meet it.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter

import pytest
from conftest import TINY_MIXTRAL, small_llama
from transformers import MixtralConfig

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.planning import plan_serving, serving_search
from torchroof.planning.serving_space import ServingSpace, enumerate_serving, serving_space
from torchroof.serving import EngineConfig

LOAD = dict(rate=10_000.0, requests=40, input_len="uniform:64,512", output_len=64)
TARGETS = dict(ttft_s=0.002, tpot_s=0.0003)
EIGHT = {"max_num_seqs": (8,), "max_num_batched_tokens": (2048,)}
KV_HEADS_REASON = "tp=4: num_key_value_heads=2 does not divide by tp=4"


@pytest.fixture(scope="module")
def searched():
    """The search on up to 4 GPUs at attainment 50%, and the timers it built."""
    built = []
    original = serving_search.deployment_timer

    def counting(model, hardware, knobs, *rest):
        built.append((knobs["tp"], knobs["kv_dtype"]))
        return original(model, hardware, knobs, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serving_search, "deployment_timer", counting)
        plans = plan_serving(
            small_llama(2), "dgx-h100", attainment=0.5, gpus_max=4, space=EIGHT,
            mode="realistic", **TARGETS, **LOAD,
        )  # fmt: skip
    return plans, built


def test_the_fewest_gpus_match_an_exhaustive_loop_over_serve(searched):
    plans, built = searched
    # tp 1 x 1..4 replicas and tp 2 x 1..2 (tp 4 splits 2 K/V heads, tp 8 exceeds 4 GPUs)
    shapes = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2)]
    assert sorted((p.layout.tp, p.layout.replicas) for p in plans.ranked) == shapes
    # one timer per (tp, KV dtype), shared by every replica count
    assert sorted(built) == [(1, "model"), (2, "model")]
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048)
    by_shape = {(p.layout.tp, p.layout.replicas): p for p in plans.ranked}
    meeting = []
    for tp, replicas in shapes:
        result = torchroof.serve(
            small_llama(2), "dgx-h100", tp=tp, replicas=replicas, engine=engine,
            mode="realistic", **LOAD,
        )  # fmt: skip
        summary = result.summary(TARGETS["ttft_s"], TARGETS["tpot_s"])
        share = summary["requests_meeting_slo"] / 40
        plan = by_shape[(tp, replicas)]
        assert plan.attainment == share == 8 * replicas / 40  # 8 requests a replica meet
        assert plan.p99("ttft") == summary["ttft_s"]["p99"]
        assert plan.p99("tpot") == summary["tpot_s"]["p99"]
        if share >= 0.5:
            meeting.append((tp * replicas, -summary["goodput_per_s"] / (tp * replicas), tp))
    gpus, _, tp = min(meeting)
    # 50% of 40 = 20 requests need 3 replicas (24); tp 2 x 2 replicas holds 16
    assert (gpus, tp) == (3, 1)
    assert (plans.best.gpus, plans.best.layout.tp, plans.best.layout.replicas) == (3, 1, 3)
    assert plans.answer().startswith("fewest GPUs meeting TTFT <= 2 ms and TPOT <= 0.3 ms")


def test_the_ranking_puts_those_meeting_first_and_the_frontier_is_undominated(searched):
    plans, _ = searched
    meets = [p.meets for p in plans.ranked]
    assert meets == sorted(meets, reverse=True) and sum(meets) == 2  # 3 and 4 replicas of tp 1
    assert [p.gpus for p in plans.meeting] == [3, 4]
    rest = [p.attainment for p in plans.ranked if not p.meets]
    assert rest == sorted(rest, reverse=True)
    for latency in ("ttft", "tpot"):
        front = plans.frontier(latency)
        for plan in plans.ranked:
            if plan in front:  # nothing on the front is beaten on both by another plan
                assert not any(
                    other.output_tokens_per_s_per_gpu > plan.output_tokens_per_s_per_gpu
                    and other.p99(latency) < plan.p99(latency)
                    for other in plans.ranked
                )
            else:  # every plan off it is matched or beaten on both by one on it
                assert any(
                    kept.output_tokens_per_s_per_gpu >= plan.output_tokens_per_s_per_gpu
                    and kept.p99(latency) <= plan.p99(latency)
                    for kept in front
                )


def test_the_enumeration_counted_by_hand():
    config = small_llama(2)
    space = ServingSpace(gpus_max=4, gpus_per_node=8)
    found = enumerate_serving(config, space)
    # tp 1, 2, 4, 8 divide a node of 8; tp 4 splits 2 K/V heads, tp 8 exceeds 4 GPUs:
    # (tp 1 x 1..4 replicas + tp 2 x 1..2) x (3 max_num_seqs x 2 max_num_batched_tokens)
    assert len(found.layouts) == (4 + 2) * 3 * 2 == 36
    assert len(found.rejected) == 2 and set(found.rejected.values()) == {1}
    assert any(reason.startswith(KV_HEADS_REASON) for reason in found.rejected)
    assert "tp=8 exceeds gpus_max=4" in found.rejected
    assert all(layout.gpus <= 4 and layout.ep == 1 for layout in found.layouts)
    wider = ServingSpace(
        gpus_max=4, gpus_per_node=8, kv_dtype=("model", "fp8"), disaggregate=("1P1D", "2P1D")
    )
    found = enumerate_serving(config, wider)
    # 36 x 2 KV dtypes; 1P1D: prefill tp + decode tp <= 4 for all 4 pairs of {1, 2};
    # 2P1D: 2 x prefill tp + decode tp: 3 and 4 fit, 5 and 6 do not; each x 6 engines x 2
    assert len(found.layouts) == 36 * 2 + (4 + 2) * 6 * 2 == 144
    assert sum("2P1D with prefill tp=2" in reason for reason in found.rejected) == 2
    moe = enumerate_serving(MixtralConfig(**TINY_MIXTRAL), ServingSpace(4, 8, max_num_seqs=(8,)))
    # a MoE engine splits its 8 experts over its own GPUs: ep = tp; and with each tp one
    # data-parallel attention group, the largest within min(8, 4) = 4 GPUs whose GPUs split
    # the 8 experts: tp 1 x dp 4 and tp 2 x dp 2, both ep 4 (x 2 max_num_batched_tokens)
    assert Counter((x.tp, x.ep, x.attention_dp) for x in moe.layouts) == {
        (1, 1, 1): 4 * 2, (2, 2, 1): 2 * 2, (1, 4, 4): 2, (2, 4, 2): 2,
    }  # fmt: skip
    assert {x.gpus for x in moe.layouts if x.attention_dp > 1} == {4}


def test_data_parallel_attention_groups_counted_by_hand():
    given = ServingSpace(4, 8, max_num_seqs=(8,), max_num_batched_tokens=(2048,), dp=(1, 2, 8))
    moe = enumerate_serving(MixtralConfig(**TINY_MIXTRAL), given)
    # tp 1 and 2 (tp 4 splits 2 K/V heads): dp 1 adds nothing, dp 2 fits both (2 and 4
    # GPUs, ep 2 and 4 divide 8 experts); dp 8 needs 8 GPUs at tp 1 (above gpus_max 4) and
    # 16 at tp 2 (past the node)
    groups = sorted((x.tp, x.attention_dp, x.ep, x.gpus) for x in moe.layouts if x.ep > x.tp)
    assert groups == [(1, 2, 2, 2), (2, 2, 4, 4)]
    assert "tp=1 x dp=8 (data-parallel attention) needs 8 GPUs, above gpus_max=4" in moe.rejected
    assert "tp=2 x dp=8 (data-parallel attention) spans 16 GPUs, past one node's 8" in moe.rejected
    dense = enumerate_serving(small_llama(2), given)
    assert all(x.attention_dp == 1 for x in dense.layouts)
    assert any("a dense model's engines are replicas" in reason for reason in dense.rejected)
    assert serving_space(4, 8, {"dp": 2}).dp == (2,)


def test_a_data_parallel_attention_layout_is_served_as_its_ranks():
    """tp 1 x dp 2 of the tiny Mixtral: two engines behind the router, each rank 0 of
    dp 2 x ep 2 (its 4 of the 8 experts), exactly what torchroof.serve simulates with
    tp=1, dp=2, ep=2, replicas=2."""
    config = MixtralConfig(**TINY_MIXTRAL)
    plans = plan_serving(
        config, "dgx-h100", gpus_max=2, space={**EIGHT, "tp": (1,), "replicas": (1,), "dp": (2,)},
        mode="realistic", **TARGETS, **LOAD,
    )  # fmt: skip
    grouped = next(p for p in plans.ranked if p.layout.attention_dp == 2)
    assert (grouped.gpus, grouped.layout.ep, grouped.layout.replicas) == (2, 2, 2)
    assert grouped.label().startswith("tp 1 x dp 2 (data-parallel attention), ep 2, 8 seqs")
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048)
    served = torchroof.serve(
        config, "dgx-h100", tp=1, dp=2, ep=2, replicas=2, engine=engine, mode="realistic", **LOAD
    )
    summary = served.summary(TARGETS["ttft_s"], TARGETS["tpot_s"])
    assert grouped.p99("ttft") == summary["ttft_s"]["p99"]
    assert grouped.p99("tpot") == summary["tpot_s"]["p99"]
    alone = next(p for p in plans.ranked if p.layout.attention_dp == 1)
    assert (alone.gpus, alone.layout.ep) == (1, 1)


def test_no_layout_meeting_the_targets_is_one_line_naming_the_closest():
    plans = plan_serving(
        small_llama(2), "dgx-h100", gpus_max=4, space={**EIGHT, "tp": (1,)},
        mode="realistic", **TARGETS, **LOAD,
    )  # fmt: skip
    # 90% of 40 = 36 requests; 4 replicas of 8 running hold 32 (80%)
    assert not plans.meeting and len(plans.ranked) == 4
    closest = plans.ranked[0]
    assert (closest.layout.replicas, closest.attainment) == (4, 0.8)
    with pytest.raises(OptionError) as caught:
        _ = plans.best
    line = str(caught.value)
    assert "\n" not in line and line == plans.answer()
    assert line.startswith("no layout meets TTFT <= 2 ms and TPOT <= 0.3 ms for 90% of requests")
    assert (
        "the closest is tp 1 x 4 replicas, 8 seqs, 2,048 tokens/step on 4 GPUs (80% within" in line
    )
    assert f"P99 TTFT {closest.p99('ttft') * 1e3:.4g} ms" in line


def test_a_kv_cache_too_small_for_a_request_rejects_its_layouts_with_the_reason():
    plans = plan_serving(
        small_llama(2), "dgx-h100", gpus_max=2, space={**EIGHT, "tp": (1,)},
        engine=EngineConfig(num_gpu_blocks_override=4), **TARGETS, **LOAD,
    )  # fmt: skip
    # 4 blocks of 16 tokens hold 64 tokens, below any request (64+ prompt tokens + 63
    # kept outputs): both replica counts of the one engine shape refused, counted once
    assert not plans.ranked and plans.enumerated == 2
    ((reason, count),) = plans.rejected.items()
    assert count == 1 and reason.startswith("tp=1, max_num_seqs=8, max_num_batched_tokens=2048:")
    assert "the KV cache holds 4 blocks of 16 tokens (64 tokens" in reason
    with pytest.raises(OptionError, match="no serving layout to simulate: every one was refused"):
        _ = plans.best


def test_the_cli_writes_json_and_the_best_plan_as_a_vllm_command(tmp_path, capsys):
    small_llama(2).to_json_file(tmp_path / "config.json")
    out, command = tmp_path / "plans.json", tmp_path / "serve.sh"
    argv = ["plan", str(tmp_path / "config.json"), "--serve", "--rate", "10000"]
    argv += ["--requests", "40", "--input-len", "uniform:64,512", "--output-len", "64"]
    argv += ["--ttft-ms", "2", "--tpot-ms", "0.3", "--attainment", "0.3", "--gpus-max", "2"]
    argv += ["--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--mode", "realistic"]
    argv += ["--json", str(out), "--emit", "vllm", "--hf-model", "org/small"]
    argv += ["-o", str(command), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "fewest GPUs meeting" in capsys.readouterr().out
    data = json.loads(out.read_text())
    best = data["best"]
    # 30% of 40 = 12 requests: 2 replicas of 8 (16) do it, 1 replica (8) or tp 2 do not
    assert (best["tp"], best["replicas"], data["meeting"], data["simulated"]) == (1, 2, 1, 3)
    args = shlex.split(command.read_text())
    assert args[:3] == ["vllm", "serve", "org/small"]
    assert int(args[args.index("--tensor-parallel-size") + 1]) == best["tp"]
    assert int(args[args.index("--data-parallel-size") + 1]) == best["replicas"]
    assert int(args[args.index("--max-num-seqs") + 1]) == 8
    assert int(args[args.index("--max-model-len") + 1]) <= 512 + 64


def test_a_load_without_a_tpot_says_so_rather_than_zero():
    # one output token a request: no request has a gap between tokens, so no TPOT
    plans = plan_serving(
        small_llama(2), "dgx-h100", rate=100.0, requests=4, input_len=16, output_len=1,
        ttft_s=1e-9, space={"tp": (1,), "replicas": (1,), "max_num_seqs": (64,),
                            "max_num_batched_tokens": (2048,)},
    )  # fmt: skip
    with pytest.raises(OptionError, match="P99 TPOT none") as caught:
        _ = plans.best
    assert "0 ms" not in str(caught.value).split("P99 TPOT")[1]


def test_each_choice_is_simulated_once():
    space = serving_space(4, 8, {"max_num_seqs": [64, 64], "replicas": (1, 1)})
    assert space.max_num_seqs == (64,) and space.replicas == (1,)


def test_bad_input_is_one_line(capsys):
    model = small_llama(2)
    cases = [
        (lambda: plan_serving(model, rate=1.0), "needs a TTFT or a TPOT target"),
        (lambda: plan_serving(model, rate=1.0, ttft_s=1.0, tp=2), "tp is what the search"),
        (lambda: plan_serving(model, rate=1.0, ttft_s=1.0, space={"pp": (2,)}), "has no 'pp'"),
        (
            lambda: plan_serving(model, rate=1.0, ttft_s=1.0, space={"kv_dtype": ("fp4",)}),
            "kv_dtype must list some of model, fp8, int8",
        ),
        (lambda: plan_serving(model, ttft_s=1.0), "give a request rate"),
        (
            lambda: plan_serving(
                model, "h100-sxm", rate=1.0, ttft_s=1.0, space={"disaggregate": ("1P1D",)}
            ),
            "price it on a cluster",
        ),
        (lambda: torchroof.plan(model, "decode"), "not regime 'decode'"),
        # pricing options and the router are checked before anything is traced
        (lambda: plan_serving(model, rate=1.0, ttft_s=1.0, mode="bogus"), "bogus"),
        (lambda: plan_serving(model, rate=1.0, ttft_s=1.0, router="random"), "unknown router"),
        (
            lambda: plan_serving(model, rate=1.0, ttft_s=1.0, space={"chunked_prefill": True}),
            "chunked_prefill takes a list of choices",
        ),
    ]
    for call, message in cases:
        with pytest.raises(OptionError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    for argv, message in [
        (["plan", "--serve", "--gpus", "4", "--rate", "1"], "--gpus is for the training search"),
        (["plan", "--gpus", "4", "--global-batch", "4", "--rate", "1"], "add --serve"),
        (["plan", "--serve", "--rate", "1", "--emit", "torchrun"], "--emit takes vllm or sglang"),
        (["plan", "--global-batch", "4"], "needs --gpus N (training), or --serve"),
        (["plan", "--serve", "--rate", "1", "--ttft-ms", "9", "--jobs", "2"], "simulates here"),
        # every layout refused (tp 8 is above gpus_max 2): said, exit 2
        (
            ["plan", "--serve", "--rate", "1", "--ttft-ms", "9", "--tp", "8", "--gpus-max", "2"],
            "every one was refused",
        ),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1

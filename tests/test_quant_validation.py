"""examples/quant_validation.py: each family of published quantised runs mapped
to the steps torchroof prices, with the arithmetic beside it; every run either predicted or
refused with a reason; one run predicted live equals the checked-in prediction."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import load_example

from torchroof import hardware
from torchroof.models.sources import load_config

qv = load_example("quant_validation")
RUNS = {run["id"]: run for run in qv.load_runs()}
STORED = json.loads(qv.PREDICTIONS_JSON.read_text())


def _request(run_id: str, kv_dtype: str | None = None):
    return qv.request(RUNS[run_id], qv.choose(RUNS[run_id]), kv_dtype)


def _times(step_s: float):
    return qv.StepTimes(step_s, step_s, 0.0, 0.0, None, None, None, 0.0)


def test_llama2_7b_is_built_with_its_published_parameter_count():
    config = load_config("llama-3-8b")
    for name, value in qv.LLAMA2_7B.items():
        setattr(config, name, value)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    # embeddings and LM head 2 x 32000 x 4096 = 262,144,000; per layer: attention
    # 4 x 4096^2 = 67,108,864, MLP 3 x 4096 x 11008 = 135,266,304, norms 2 x 4096 -> x 32
    # layers = 6,476,267,520; final norm 4096: 6,738,415,616 (Llama-2-7B's count)
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616


def test_generate_call_reads_the_whole_static_cache_every_step():
    run_id = "gptfast-a100-llama2-7b-decode-bs1-int4-g32"
    req = _request(run_id)
    prefill, decode = req.phases
    # prompt 5 tokens + BOS = 6; 200 new tokens: the cache holds 206 slots, so a step
    # holding 205 tokens writes and reads the last; 199 decode steps after the prefill's token
    assert (prefill.regime, prefill.workload["seq"], prefill.weight) == ("prefill", 6, 1.0)
    assert (decode.workload["context"], decode.weight) == (205, 199)
    assert decode.workload["quant"] == "int4-weight" and decode.workload["kv_dtype"] == "model"
    assert decode.overrides == qv.LLAMA2_7B and decode.model == "llama-3-8b"
    assert "int4 group 32" in req.note
    prediction = qv.Prediction(req, 196.80, (_times(0.02), _times(0.005)))
    # 0.02 + 199 x 0.005 = 1.015 s for 200 tokens; measured 200 / 196.80 = 1.01626 s
    assert prediction.predicted == pytest.approx(200 / 1.015)
    assert prediction.ratio == pytest.approx(1.015 / (200 / 196.80))


def test_static_batch_prices_the_first_and_last_decode_step():
    req = _request("trtllm061-h100-llama2-7b-bs768-in128-out128-fp8")
    prefill, first, last = req.phases
    assert (prefill.workload["batch"], prefill.workload["seq"]) == (768, 128)
    # 127 decode steps; the k-th holds 128 + k - 1 tokens: 128 then 254, each weighted 63.5
    assert [(p.workload["context"], p.weight) for p in (first, last)] == [(128, 63.5), (254, 63.5)]
    assert {p.workload["kv_dtype"] for p in req.phases} == {"fp8"}  # --fp8_kv_cache
    assert {(p.workload["quant"], p.workload["dtype"]) for p in req.phases} == {("fp8", "fp16")}
    assert req.figure.work == 768 * 128  # 98,304 output tokens
    prediction = qv.Prediction(req, 19694, (_times(1.0), _times(0.01), _times(0.03)))
    # 1.0 + 63.5 x 0.01 + 63.5 x 0.03 = 3.54 s; 98,304 / 3.54 = 27,769 tokens/s
    assert prediction.predicted_s == pytest.approx(3.54)
    assert prediction.predicted == pytest.approx(98304 / 3.54)


def test_unpublished_kv_dtype_is_priced_both_ways_and_long_runs_pass_max_positions():
    run_id = "trtllm07a-h200-llama2-70b-bs96-in128-out4096-fp8"
    choice = qv.choose(RUNS[run_id])
    assert (choice.kv_dtype, choice.alternative_kv) == ("model", "fp8")
    assert {p.workload["kv_dtype"] for p in _request(run_id, "fp8").phases} == {"fp8"}
    # 128 + 4096 = 4224 tokens > Llama-2's 4096 positions: the run did it, so priced beyond
    last = _request(run_id).phases[-1]
    assert last.workload["context"] == 128 + 4094 and last.workload["allow_beyond_max_positions"]
    assert last.overrides == qv.LLAMA2_70B


def test_time_to_first_token_is_one_prefill():
    req = _request("trtllm05-a100-llama2-7b-ttft-bs1-in2048-fp16")
    (phase,) = req.phases
    assert (phase.regime, phase.workload["batch"], phase.workload["seq"]) == ("prefill", 1, 2048)
    assert (phase.workload["quant"], phase.workload["dtype"]) == ("none", "fp16")
    assert req.figure.seconds(133) == pytest.approx(0.133)


def test_training_rows_are_fsdp8_with_selective_checkpointing_on_their_cluster():
    req = _request("torchao-float8-mi300xx8-llama3-8b-fsdp8-train-fp8-rowwise")
    (phase,) = req.phases
    assert phase.hardware == "nd-mi300x-v5"
    assert {k: phase.workload[k] for k in ("fsdp", "batch", "seq", "quant")} == {
        "fsdp": 8,
        "batch": 1,
        "seq": 8192,
        "quant": "fp8-rowwise",
    }
    # torchtitan's per-op selective AC, as the runs' activation_checkpointing says
    assert phase.workload["checkpointing"] is True
    assert phase.workload["checkpoint_policy"] == "selective" and "selective AC" in req.note
    assert req.figure.work == 8192  # one sequence per GPU per step


def test_mi300x_rows_are_refused_where_no_cluster_ships(monkeypatch):
    monkeypatch.setattr(qv, "_shipped_cluster", lambda name: False)
    reason = qv.choose(RUNS["torchao-float8-mi300xx8-llama3-8b-fsdp8-train-bf16"])
    assert reason == "no nd-mi300x-v5 cluster ships in hardware/clusters"


def test_measured_speedup_is_the_runs_own_arithmetic():
    """baseline time / quantised time of the same work = value / baseline value, as the
    runs' derived.speedup_vs_baseline (rounded to 3 places): gpt-fast Llama-2-7B int4,
    196.80 / 104.9 = 1.876."""
    pairs = []
    for run in RUNS.values():
        if run.get("baseline_id") not in RUNS or isinstance(qv.choose(run), str):
            continue
        quantised = qv.QuantPrediction(run, qv.choose(run), qv.Prediction(
            _request(run["id"]), run["measured"]["value"], ()))  # fmt: skip
        base = RUNS[run["baseline_id"]]
        baseline = qv.QuantPrediction(base, qv.choose(base), qv.Prediction(
            _request(base["id"]), base["measured"]["value"], ()))  # fmt: skip
        pairs.append(qv.Speedup(quantised, baseline))
        derived = run["measured"]["derived"]["speedup_vs_baseline"]
        assert pairs[-1].measured == pytest.approx(derived, abs=5e-4), run["id"]
    assert len(pairs) == 18  # 5 gpt-fast (Mixtral TP 2 now too) + 9 torchao + 4 Float8 training


def test_every_run_is_predicted_or_refused_with_a_reason():
    choices = {rid: qv.choose(run) for rid, run in RUNS.items()}
    refused = {rid: c for rid, c in choices.items() if isinstance(c, str)}
    # 54 predicted: the 6 gpt-fast TP runs (TP 8 int8/int4, Mixtral TP 2 bf16 and int8)
    # with each rank's shards quantised
    assert len(RUNS) == 68 and len(refused) == 14
    assert all(reason.strip() for reason in refused.values())
    for rid, choice in choices.items():
        if rid in refused:
            continue
        run = RUNS[rid]
        if choice.kind == "train":  # a shipped cluster of the run's GPUs
            cluster = hardware.get_cluster(choice.hardware)
            assert cluster.accelerator.name == run["hardware"], rid
            assert run["parallelism"]["dp_shard"] == run["gpu_count"] == 8, rid
        elif run["parallelism"]["tp"] > 1:  # rank 0 of tp on a shipped cluster of its GPUs
            cluster = hardware.get_cluster(choice.hardware)
            assert cluster.accelerator.name == run["hardware"], rid
            assert choice.workload == {"tp": run["parallelism"]["tp"]}, rid
        else:  # one GPU: the run's own spec
            assert hardware.get(choice.hardware).name == run["hardware"], rid
            assert run["gpu_count"] == 1, rid


def test_quantised_tp_runs_are_priced_on_each_ranks_shards():
    rows = [
        rid
        for rid, run in RUNS.items()
        if run["parallelism"]["tp"] > 1 and run["regime"] != "train" and run["quant"] != "none"
    ]
    assert len(rows) == 5  # gpt-fast TP 8 int8/int4 (4) and Mixtral TP 2 int8
    for rid in rows:
        choice = qv.choose(RUNS[rid])
        assert not isinstance(choice, str), rid
        assert "quantises its tensor-parallel shards" in choice.note, rid


def test_the_checked_in_predictions_cover_every_run():
    predicted = [rid for rid, run in RUNS.items() if not isinstance(qv.choose(run), str)]
    assert [r["id"] for r in STORED["runs"]] == predicted
    refused = {r["id"]: r["reason"] for r in STORED["not_predicted"]}
    assert set(refused) | set(predicted) == set(RUNS) and not set(refused) & set(predicted)
    assert all(reason.strip() for reason in refused.values())
    assert STORED["summary"]["predicted"] == len(predicted)


def test_a_decode_run_predicted_live_equals_the_checked_in_prediction():
    run_id = "torchao-h100-llama31-8b-decode-bs1-int4wo-64"  # 8B, a 6-token prefill
    qv.mgv.quiet()
    (live,) = qv.predict([RUNS[run_id]], progress=lambda _: None)
    stored = next(r for r in STORED["runs"] if r["id"] == run_id)
    fresh = qv.prediction_json(live, {})
    assert fresh["request"] == stored["request"]
    assert fresh["predicted"] == pytest.approx(stored["predicted"], rel=1e-6)
    assert fresh["ratio"] == pytest.approx(stored["ratio"], rel=1e-6)
    for mine, theirs in zip(fresh["steps"], stored["steps"], strict=True):
        for key in ("step_ms", "compute_ms", "memory_per_rank_gb"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6), key

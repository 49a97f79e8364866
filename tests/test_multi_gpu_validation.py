"""examples/multi_gpu_validation.py: the conversions from priced steps to
published figures, on hand-made inputs with the arithmetic beside them; every published run
either mapped to a request or refused with a reason; one mapped run predicted live equals
the checked-in prediction."""

from __future__ import annotations

import json

import pytest
from conftest import load_example

from torchroof.report.estimate import Estimate, KernelEstimate

mgv = load_example("multi_gpu_validation")
DATA = mgv.load_data()
RUNS = {run["id"]: run for run in DATA["runs"]}


def _kernel(index: int, time_s: float, *, network: bool = False, exposed_s: float = 0.0):
    return KernelEstimate(
        index=index, name="c10d.allreduce_.default" if network else "aten.mm.default",
        ops=(), module="model.layers.0", phase="forward", flops=0 if network else 10**12,
        bytes_read=0, bytes_written=0, unit="network" if network else "tensor", dtype="bf16",
        counted=True, peak_flops_per_s=1e15, compute_s=time_s, memory_s=0.0, time_s=time_s,
        bound="network" if network else "compute", link="nvlink" if network else "",
        stream="communication" if network else "compute", exposed_s=exposed_s,
    )  # fmt: skip


def _estimate() -> Estimate:
    """Two compute kernels of 0.2 s and 0.1 s; a 0.15 s all-reduce of which 0.05 s made
    the compute stream wait: step = 0.3 + 0.05 = 0.35 s."""
    return Estimate(
        hardware="h100-sxm", hardware_display="test", hbm_bytes_per_s=1e12,
        reference_peak_flops_per_s=1e15, reference_dtype="bf16",
        kernels=[_kernel(0, 0.2), _kernel(1, 0.15, network=True, exposed_s=0.05),
                 _kernel(2, 0.1)],
        op_count=3, uncounted={}, step_time_s=0.35,
    )  # fmt: skip


def test_step_times_split_compute_exposed_and_hidden():
    times = mgv.step_times(_estimate())
    assert times.step_s == 0.35
    assert times.compute_s == pytest.approx(0.3)  # 0.2 + 0.1
    assert times.exposed_s == pytest.approx(0.05)
    assert times.hidden_s == pytest.approx(0.10)  # 0.15 - 0.05
    assert times.compute_s + times.exposed_s == pytest.approx(times.step_s)
    # MFU: 2e12 FLOPs / (0.35 s x 1e15 FLOP/s) = 0.005714...
    assert times.mfu == pytest.approx(2e12 / 0.35e15)
    assert times.fits is None  # no footprint on a hand-made estimate


def _train_run(**overrides):
    run = {
        "id": "hand-train", "regime": "train", "gpu_count": 32, "micro_batch": 2,
        "seq_len": 4096, "grad_accum": 3, "torch_compile": False,
        "model": {"torchroof_config": "llama-3-8b"},
        "parallelism": {"tp": 2, "dp_shard": 8, "dp_replicate": 2},
        "measured": {"value": 4096.0, "unit": "tokens/s per GPU"},
    }  # fmt: skip
    run.update(overrides)
    return run


def test_training_tokens_per_gpu_share_a_tensor_parallel_group():
    req = mgv.request(_train_run(), mgv.Choice("dgx-h100", "hand-made"))
    (phase,) = req.phases
    assert phase.workload == {
        "tp": 2, "batch": 2, "seq": 4096, "fsdp": 8, "dp": 2, "microbatches": 3,
        "precision": "mixed", "checkpointing": False,
    }  # fmt: skip
    # 2 sequences x 4096 tokens x 3 micro-batches / tp 2 = 12,288 tokens per GPU per step
    assert req.figure.work == 12288
    assert [p.fusion for p in req.eager] == ["eager"]  # not compiled: also priced eager
    times = mgv.step_times(_estimate())
    prediction = mgv.Prediction(req, 4096.0, (times,), (times,))
    assert prediction.predicted_s == 0.35
    assert prediction.predicted == pytest.approx(12288 / 0.35)  # 35,108.6 tokens/s per GPU
    # measured: 12,288 tokens / 4,096 tokens/s = 3 s; ratio 0.35 / 3 = 0.11667
    assert prediction.measured_s == pytest.approx(3.0)
    assert prediction.ratio == pytest.approx(0.35 / 3)
    assert prediction.eager_ratio == pytest.approx(0.35 / 3)


def test_sequence_parallel_is_read_from_the_run():
    par = {"tp": 8, "dp_shard": 8, "dp_replicate": 1}
    on = _train_run(parallelism={**par, "sequence_parallel": True, "loss_parallel": True})
    (phase,) = mgv.request(on, mgv.Choice("dgx-h100", "hand-made")).phases
    assert phase.workload["sequence_parallel"] is True
    # off (or not stated, as Megatron rows' null): the key is not written at all
    for stated in (False, None):
        off = _train_run(parallelism={**par, "sequence_parallel": stated})
        (phase,) = mgv.request(off, mgv.Choice("dgx-h100", "hand-made")).phases
        assert "sequence_parallel" not in phase.workload
    # torchroof's knob is torchtitan's plan: sequence parallel brings loss parallel with it
    alone = _train_run(parallelism={**par, "sequence_parallel": True, "loss_parallel": False})
    with pytest.raises(ValueError, match="sequence parallel without loss parallel"):
        mgv.request(alone, mgv.Choice("dgx-h100", "hand-made"))


def test_the_torchtitan_tp_rows_are_priced_with_sequence_parallel():
    tp_rows = [i for i in mgv.CHOICES if RUNS[i]["parallelism"]["tp"] > 1 and
               RUNS[i]["regime"] == "train" and i.startswith("tt-")]  # fmt: skip
    assert tp_rows == [
        "tt-h100x64-llama31-8b-fsdp8-tp8-bf16", "tt-h100x256-llama31-70b-fsdp32-tp8-bf16",
        "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-1f1b-fp8",
        "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-interleaved-fp8",
        "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-1f1b-seq32k-fp8",
    ]  # fmt: skip
    for run_id in tp_rows:
        req = mgv.request(RUNS[run_id], mgv.CHOICES[run_id])
        assert req.phases[0].workload["sequence_parallel"] is True, run_id
        assert "sequence + loss parallel" in req.note and "no sequence" not in req.note


def test_compiled_training_run_is_priced_once():
    req = mgv.request(_train_run(torch_compile=True), mgv.Choice("dgx-h100", "hand-made"))
    assert req.eager == ()


def _times(step_s: float):
    return mgv.StepTimes(step_s, step_s, 0.0, 0.0, None, None, None, 0.0)


def test_generate_call_is_its_prefill_plus_a_decode_step_per_further_token():
    run = {
        "id": "hand-decode", "regime": "decode", "gpu_count": 8, "batch": 4,
        "prompt_len": 100, "output_len": 201, "model": {"torchroof_config": "llama-3-8b"},
        "parallelism": {"tp": 8}, "measured": {"value": 50.0, "unit": "tokens/s per GPU"},
    }  # fmt: skip
    req = mgv.request(run, mgv.Choice("dgx-a100", "hand-made", dtype="fp16"))
    prefill, first, last = req.phases
    assert (prefill.regime, prefill.weight, prefill.workload["seq"]) == ("prefill", 1.0, 100)
    # 200 decode steps after the prefill's token; step k attends over 100 + k - 1 tokens:
    # k = 1 -> 100, k = 200 -> 299; each end weighted 200 / 2 = 100
    assert [(p.workload["context"], p.weight) for p in (first, last)] == [(100, 100), (299, 100)]
    assert first.workload["dtype"] == "fp16"
    # 4 sequences x 201 tokens / 8 GPUs = 100.5 tokens per GPU
    assert req.figure.work == pytest.approx(100.5)
    prediction = mgv.Prediction(req, 50.0, (_times(0.5), _times(0.01), _times(0.03)))
    # 0.5 + 100 x 0.01 + 100 x 0.03 = 4.5 s; 100.5 / 4.5 = 22.33 tokens/s per GPU
    assert prediction.predicted_s == pytest.approx(4.5)
    assert prediction.predicted == pytest.approx(100.5 / 4.5)
    # measured 100.5 / 50 = 2.01 s
    assert prediction.ratio == pytest.approx(4.5 / 2.01)
    assert prediction.main[0] is last  # 100 x 0.03 s: most of the time


def test_whole_cache_decode_is_one_step_at_the_full_cache_and_not_per_gpu():
    run = {
        "id": "hand-gptfast", "regime": "decode", "gpu_count": 8, "batch": 1,
        "prompt_len": 5, "new_tokens": 200, "model": {"torchroof_config": "llama-3-8b"},
        "parallelism": {"tp": 8}, "measured": {"value": 100.0, "unit": "tokens/s"},
    }  # fmt: skip
    choice = mgv.Choice("dgx-a100", "hand-made", whole_cache=True, per_gpu=False)
    prefill, decode = mgv.request(run, choice).phases
    assert (decode.workload["context"], decode.weight) == (205, 199)
    req = mgv.request(run, choice)
    assert req.figure.work == 200  # the whole group's tokens
    prediction = mgv.Prediction(req, 100.0, (_times(0.02), _times(0.01)))
    # 0.02 + 199 x 0.01 = 2.01 s for 200 tokens; measured 200 / 100 = 2 s
    assert prediction.ratio == pytest.approx(2.01 / 2.0)


def test_time_to_first_token_is_the_prefill_in_milliseconds():
    figure = mgv.Figure("ms", seconds_per_unit=1e-3)
    assert figure.seconds(249.2) == pytest.approx(0.2492)
    assert figure.value(0.176) == pytest.approx(176.0)


def test_anchor_measured_time_is_bus_factor_times_size_over_busbw():
    """The A100 sweep prints time and bus bandwidth both: 1 GiB all-reduce on 8 ranks,
    2 x 7/8 x 1,073,741,824 B / 229.04 GB/s = 8,203.9 us, the published time."""
    points = [a for a in mgv.anchors(DATA["collectives"]) if a.anchor_id.startswith("c-a100")]
    one_gib = next(a for a in points if a.size_bytes == 2**30)
    assert one_gib.measured_s == pytest.approx(8203.9e-6, rel=1e-4)
    # torchroof: 44.8 us + 1.75 x 2^30 B / (300 GB/s x 0.772) = 8,158.3 us
    time_s, busbw, algorithm = one_gib.predicted()
    assert time_s == pytest.approx(44.8e-6 + 1.75 * 2**30 / (300e9 * 0.772), rel=1e-6)
    assert busbw == pytest.approx(1.75 * 2**30 / time_s)
    assert algorithm == "ring"


def test_every_run_is_mapped_or_refused_with_a_reason():
    mapped, refused = set(mgv.CHOICES), set(mgv.NOT_PREDICTED)
    assert not mapped & refused
    assert mapped | refused == set(RUNS)
    assert all(reason.strip() for reason in mgv.NOT_PREDICTED.values())
    for run_id in mapped:
        run, req = RUNS[run_id], mgv.request(RUNS[run_id], mgv.CHOICES[run_id])
        workload = req.phases[0].workload
        ranks = workload["tp"] * workload.get("fsdp", 1) * workload.get("dp", 1)
        ranks *= workload.get("pp", 1) * workload.get("cp", 1)
        assert ranks == run["gpu_count"], run_id  # the request spans the run's GPUs
        assert mgv.get_cluster(req.phases[0].hardware)  # a shipped cluster


def test_every_context_parallel_run_is_predicted():
    """torchroof's cp composes with tp, fsdp, dp and pipeline stages: every run with CP > 1
    is asked, none is set aside (three with pipeline stages, three without)."""
    cp_rows = [i for i in RUNS if RUNS[i]["parallelism"]["cp"] > 1]
    assert not [i for i in cp_rows if i in mgv.NOT_PREDICTED]
    assert all(i in mgv.CHOICES for i in cp_rows)
    assert sum(RUNS[i]["parallelism"]["pp"] > 1 for i in cp_rows) == 3
    assert len(cp_rows) == 6


def test_every_collective_entry_is_compared():
    compared = {a.anchor_id for a in mgv.anchors(DATA["collectives"])}
    assert compared == {c["id"] for c in DATA["collectives"]}


def test_the_checked_in_predictions_cover_the_mapped_runs():
    stored = json.loads(mgv.PREDICTIONS_JSON.read_text())
    assert [r["id"] for r in stored["runs"]] == [i for i in RUNS if i in mgv.CHOICES]
    assert {r["id"] for r in stored["not_predicted"]} == set(mgv.NOT_PREDICTED)


def test_a_decode_run_predicted_live_equals_the_checked_in_prediction():
    run_id = "gptfast-a100x8-llama31-8b-tp8-decode-bs1"  # the cheapest: 8B, 5-token prefill
    mgv.quiet()
    (live,) = mgv.predict([RUNS[run_id]], progress=lambda _: None)
    stored = next(
        r for r in json.loads(mgv.PREDICTIONS_JSON.read_text())["runs"] if r["id"] == run_id
    )
    fresh = mgv.prediction_json(live, RUNS[run_id])
    assert fresh["request"] == stored["request"]
    assert fresh["predicted"] == pytest.approx(stored["predicted"], rel=1e-9)
    assert fresh["ratio"] == pytest.approx(stored["ratio"], rel=1e-9)
    for mine, theirs in zip(fresh["steps"], stored["steps"], strict=True):
        for key in ("step_ms", "compute_ms", "exposed_communication_ms", "memory_per_rank_gb"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-9), key


def _sizes(run_id: str, *names: str) -> tuple:
    """The request for a run, and the named sizes of its one phase's workload."""
    req = mgv.request(RUNS[run_id], mgv.CHOICES[run_id])
    return req, tuple(req.phases[0].workload[name] for name in names)


def test_pipeline_runs_share_tokens_over_pp_and_read_model_flops():
    # Llama 3 405B on 8,192 GPUs: 32 micro-batches of one 8,192-token sequence per
    # pipeline of pp 16 x tp 8 = 128 GPUs: 2,048 tokens per GPU per step, each worth
    # PaLM's 6 x 405e9 + 12 x 126 x 16,384 x 8,192 = 2.6329e12 FLOPs; 430 model TFLOP/s
    # per GPU is then 2,048 x 2.6329e12 / 1e12 / 430 = 12.54 s per step.
    names = ("pp", "tp", "cp", "fsdp", "microbatches", "pp_schedule", "virtual_stages")
    req, sizes = _sizes("llama3-405b-h100x8192-tp8-pp16-dp64", *names[:2], *names[3:])
    assert sizes == (16, 8, 64, 32, "interleaved-1f1b", 2)
    per_token = 6 * 405e9 + 12 * 126 * 16384 * 8192
    assert req.figure.seconds(430) == pytest.approx(2048 * per_token / 1e12 / 430)
    assert req.figure.seconds(430) == pytest.approx(12.54, abs=0.005)
    # its 128K stage adds cp 16 to the pipeline: 16 micro-batches of one 131,072-token
    # sequence over pp 16 x tp 8 x cp 16 = 2,048 GPUs, 1,024 tokens per GPU per step, each
    # 6 x 405e9 + 12 x 126 x 16,384 x 131,072 = 5.6770e12 FLOPs (the attention term 57% of
    # it); 380 model TFLOP/s per GPU is 1,024 x 5.6770e12 / 1e12 / 380 = 15.30 s per step
    req, sizes = _sizes("llama3-405b-h100x16384-tp8-cp16-pp16-dp8", *names)
    assert sizes == (16, 8, 16, 8, 16, "interleaved-1f1b", 2)
    per_token = 6 * 405e9 + 12 * 126 * 16384 * 131072
    assert req.figure.seconds(380) == pytest.approx(1024 * per_token / 1e12 / 380)
    assert req.figure.seconds(380) == pytest.approx(15.30, abs=0.005)


def test_expert_parallel_run_maps_ep_and_its_schedule():
    # DeepSeek-V3 on 256 GB200: pp 4 x vp 4, ep 64 over dp 64; 64 micro-batches of one
    # 4,096-token sequence per pipeline of 4 GPUs: 65,536 tokens per GPU per step.
    run_id = "mb2511-gb200x256-deepseekv3-pp4-vp4-ep64-bf16"
    req = mgv.request(RUNS[run_id], mgv.CHOICES[run_id])
    workload = req.phases[0].workload
    assert (workload["pp"], workload["virtual_stages"], workload["ep"], workload["dp"]) == (
        4,
        4,
        64,
        64,
    )
    assert req.figure.seconds(3139) == pytest.approx(65_536 / 3139)


def test_schedule_pairs_differ_only_in_their_schedule():
    # torchtitan's 405B at PP 8: 1F1B then interleaved 1F1B (2 stages per rank), the rest
    # equal; their measured ratio is 128 / 100 = 1.28x (tokens/s per GPU)
    for first, second, choice in mgv.SCHEDULE_PAIRS.values():
        a = mgv.request(RUNS[first], choice).phases[0].workload
        b = mgv.request(RUNS[second], choice).phases[0].workload
        differ = {k for k in {*a, *b} if a.get(k) != b.get(k)}
        assert differ <= {"pp_schedule", "virtual_stages"}, differ
        assert a["sequence_parallel"] is True  # torchtitan's plan, as the runs
    stored = json.loads(mgv.PREDICTIONS_JSON.read_text())["schedule_pairs"]
    assert [p["pair"] for p in stored] == list(mgv.SCHEDULE_PAIRS)
    assert stored[0]["measured_ratio"] == pytest.approx(128 / 100)

"""examples/runtime_validation.py: every measured run names its runtime, the collected runs
are asked in torchroof's terms with the arithmetic beside them, the stored predictions cover
every asked run, one run priced live equals its stored figures, and the pure roofline stays
a floor under every runtime."""

from __future__ import annotations

import json

import pytest
from conftest import load_example
from torchroof.hardware import get
from torchroof.hardware.runtime import available_runtimes

rv = load_example("runtime_validation")
ABOVE_THE_FLOOR = ("trtllm090-a100x2-mixtral-tp2-bs32-in2048-out2048-fp16",)
NEW = {run["id"]: run for run in rv.runtime_runs()}
RUNTIMES = {p.name for p in available_runtimes()} | {rv.UNKNOWN}


def test_every_model_run_names_a_shipped_runtime_or_unknown():
    files = ["single_gpu_runs", "multi_gpu_runs", "pp_ep_runs", "quant_runs", "runtime_runs"]
    for name in files:
        data = json.loads((rv.HERE / "validation" / f"{name}.json").read_text())
        for run in data["runs"]:
            if (run.get("kind") or run.get("regime")) in rv.sgv.KERNELS:
                assert "runtime" not in run, run["id"]
            else:
                assert run["runtime"] in RUNTIMES, run["id"]


def test_a_collected_training_run_is_tokens_per_gpu_of_its_micro_batches():
    """Megatron-Bridge, Llama-3-70B on 64 H100s at TP 4 PP 8 VP 5 and DP 2: one pipeline's
    step is 64 micro-batches of 1 x 8192 tokens shared by its tp x pp = 32 GPUs, 16,384
    tokens per GPU; Megatron's TP runs sequence parallel, its fp8 is priced as fp8."""
    req = rv.new_request(NEW["mb2511-h100x64-llama3-70b-tp4-pp8-vp5-fp8cs"])
    (phase,) = req.phases
    assert req.figure.work == 64 * 8192 / 32 == 16384
    assert phase.workload["tp"] == 4 and phase.workload["sequence_parallel"] is True
    assert phase.workload["pp"] == 8 and phase.workload["virtual_stages"] == 5
    assert phase.workload["dp"] == 2 and phase.workload["fsdp"] == 1
    assert phase.workload["quant"] == "fp8" and phase.workload["microbatches"] == 64
    assert "cp" not in phase.workload


def test_a_context_parallel_pipeline_shares_its_tokens_over_its_cp_ranks_too():
    """Megatron-Bridge, Llama-3.1-405B on 128 B200s at TP 4 PP 8 CP 2 VP 8 and DP 2: one
    pipeline's step is 32 micro-batches of 1 x 8192 tokens shared by its tp x pp x cp = 64
    GPUs, 4,096 tokens per GPU (661 tokens/s per GPU <=> a 6.2 s step)."""
    req = rv.new_request(NEW["mb2511-b200x128-llama31-405b-tp4-pp8-cp2-vp8-fp8cs"])
    (phase,) = req.phases
    assert req.figure.work == 32 * 8192 / 64 == 4096
    assert phase.workload["cp"] == 2 and phase.workload["pp"] == 8
    assert phase.workload["virtual_stages"] == 8 and phase.workload["dp"] == 2


def test_a_static_batch_is_its_prefill_and_the_first_and_last_decode_step():
    """TensorRT-LLM, Mistral-7B, batch 56, 2048 in / 2048 out on one A100: the prefill,
    then 2047 decode steps priced at contexts 2048 and 4094 (half the weight each);
    56 x 2048 output tokens over the one GPU."""
    req = rv.new_request(NEW["trtllm090-a100-mistral7b-bs56-in2048-out2048-fp16"])
    prefill, first, last = req.phases
    assert prefill.workload["seq"] == 2048 and prefill.weight == 1.0
    assert (first.workload["context"], last.workload["context"]) == (2048, 4094)
    assert first.weight == last.weight == 2047 / 2
    assert req.figure.work == 56 * 2048
    assert prefill.workload["dtype"] == "fp16"  # TensorRT-LLM's fp16 build


def test_quantised_serving_across_gpus_is_priced_on_each_ranks_shards():
    # vLLM's fp8 Llama-3.1-70B on 8 MI300X: rank 0 of tp 8, each rank's shards in fp8
    request = rv.new_request(NEW["vllm073-mi300x8-llama31-70b-tp8-fp8-bs1-in128-out2048"])
    assert not isinstance(request, str)
    assert {(p.workload["tp"], p.workload["quant"]) for p in request.phases} == {(8, "fp8")}
    refused = {row[0] for row in rv.not_predicted()}
    asked = {a.run["id"] for a in rv.asked_runs() if a.source == "runtime"}
    assert refused | asked == set(NEW) and not refused & asked


def test_the_stored_predictions_cover_every_asked_run_and_the_floor_holds():
    stored = json.loads(rv.PREDICTIONS_JSON.read_text())
    rows = stored["predictions"]
    asked = {a.run["id"] for a in rv.asked_runs()}
    assert asked <= {r["run"] for r in rows}
    assert len(asked) >= 90  # 95 when written: every model run a script can ask
    collected = [r for r in rows if r["source"] == "runtime"]
    assert len(collected) >= 15
    # the pure roofline stays a floor under every runtime but on the runs the docs page
    # names with their reason (docs/validation/runtimes.md, "Above the floor")
    above = {r["run"] for r in rows if r["pure_ratio"] > 1.0}
    assert above == set(ABOVE_THE_FLOOR)
    page = (rv.HERE.parent / "docs" / "validation" / "runtimes.md").read_text()
    for run_id in ABOVE_THE_FLOOR:
        assert f"`{run_id}`" in page
    for kind in ("train", "prefill", "decode", "kernel"):
        group = stored["by_kind"][kind]
        assert group["runs"] == sum(1 for r in rows if r["kind"] == kind)


def test_the_run_above_the_floor_is_faster_than_reading_its_weights_once_a_step():
    """TensorRT-LLM 0.9.0's Mixtral 8x7B on two A100s in fp16, batch 32, 2048 in / 2048
    out, 801 output tokens/s per GPU: 32 x 2048 tokens / (801 x 2) = 40.91 s for the
    batch, so each of its 2047 decode steps took at most 40.91 / 2047 = 19.99 ms (the
    prefill free). A decode step of 32 sequences routes 64 tokens over each layer's 8
    experts, so every expert is read (the chance one is untouched is (6/8)^32 = 1e-4).
    Each rank reads its half of every weight but the embedding (a lookup): 46.57e9
    parameters / 2 x 2 B = 46.57 GB, 22.84 ms at the A100's 2.039 TB/s, 14% above the
    measured step; the KV cache adds more. No kernel model can reach the measurement."""
    from torchroof.models.sources import build_model, load_config

    model = build_model(load_config("mixtral-8x7b"), "fp16")  # on meta: no weights
    read = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert read == pytest.approx(46.57e9, rel=1e-3)
    run = NEW["trtllm090-a100x2-mixtral-tp2-bs32-in2048-out2048-fp16"]
    batch_s = run["batch"] * run["generated_tokens"] / (run["measured"]["value"] * 2)
    assert batch_s == pytest.approx(run["measured"]["derived"]["batch_latency_s"], rel=1e-3)
    step_s = batch_s / (run["generated_tokens"] - 1)
    floor_s = read / 2 * 2 / get("a100-sxm").hbm_bytes_per_s.value  # 2.039 TB/s
    assert floor_s / step_s == pytest.approx(1.143, rel=1e-2)


def test_a_run_priced_live_equals_its_stored_figures():
    run_id = "sglang-pr1401-llama3-8b-decode-bs1-in128-flashinfer-cudagraph"
    rv.mgv.quiet()
    (asked,) = [a for a in rv.asked_runs() if a.run["id"] == run_id]
    (row,) = rv.price([asked], progress=lambda _: None)
    stored = next(
        r for r in json.loads(rv.PREDICTIONS_JSON.read_text())["predictions"] if r["run"] == run_id
    )
    assert row.runtime == "sglang"
    assert row.pure_s == pytest.approx(stored["pure_s"], rel=1e-9)
    assert row.realistic_s == pytest.approx(stored["realistic_s"], rel=1e-9)


# The runs that ran but are still called "does NOT fit" under their runtime, each with why
# (docs/validation/runtimes.md names them too); every other run that ran fits.
DOES_NOT_FIT = {
    "mb2511-gb200x256-deepseekv3-pp4-vp4-ep64-bf16": "its recompute is not modelled",
    "llama3-405b-h100x8192-tp8-pp16-dp64": "Meta's schedule is not published",
    "llama3-405b-h100x16384-tp8-pp16-dp128": "Meta's schedule is not published",
    "llama3-405b-h100x16384-tp8-cp16-pp16-dp8": "Meta's schedule is not published",
}
PUBLISHED_MEMORY_ABOVE = {
    "torchtune-a100-llama32-3b-full-bs2-seq4096-packed-compile-ckpt": "chunked cross-entropy",
    "torchao-float8-mi300xx8-llama3-8b-fsdp8-train-fp8-tensorwise": "MI300X reports less",
    "torchao-float8-mi300xx8-llama3-8b-fsdp8-train-fp8-rowwise": "MI300X reports less",
}


def test_every_run_that_ran_fits_but_the_named_ones():
    rows = json.loads(rv.PREDICTIONS_JSON.read_text())["predictions"]
    priced = [r for r in rows if r["memory_gib"] is not None]
    assert len(priced) >= 110  # 117 model runs when written (the kernels have no footprint)
    assert {r["run"] for r in priced if not r["fits"]} == set(DOES_NOT_FIT)
    page = (rv.HERE.parent / "docs" / "validation" / "runtimes.md").read_text()
    for run_id in DOES_NOT_FIT:
        assert f"`{run_id}`" in page


def test_published_peaks_bound_the_footprint():
    # torchroof counts the tensors a step holds at its peak; a published peak is the caching
    # allocator's (torchtitan logs its reserved memory), with its reserve, fragmentation,
    # NCCL's buffers and the CUDA context on top: the footprint stays below it, and above
    # 45% of it, but for the runs named with their reason (docs/validation/runtimes.md)
    rows = json.loads(rv.PREDICTIONS_JSON.read_text())["predictions"]
    published = {r["run"]: r for r in rows if r.get("published_memory_gib")}
    assert len(published) >= 25
    for run_id, row in published.items():
        share = row["memory_gib"] / row["published_memory_gib"]
        if run_id in PUBLISHED_MEMORY_ABOVE:
            assert share > 1.0, run_id
            continue
        assert 0.45 <= share <= 1.0, (run_id, round(share, 2))

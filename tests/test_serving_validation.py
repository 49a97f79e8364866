"""The serving validation (examples/serving_validation.py): every published run has its
stored prediction, the stored predictions are what the simulation gives today (one run
served live), and the runs say what their source says."""

import json

import pytest
from conftest import load_example

servv = load_example("serving_validation")


def test_every_run_has_its_prediction():
    runs = servv.load_runs()
    stored = json.loads(servv.PREDICTIONS_JSON.read_text())["predictions"]
    assert len(runs) == 36 and {r["id"] for r in runs} == set(stored)
    for run in runs:  # each figure the page divides by is measured and predicted
        for key, _ in servv.FIGURES:
            assert run["measured"][key] > 0 and stored[run["id"]][key] > 0


def test_the_runs_say_what_the_source_says():
    # TensorRT-LLM perf-overview at 258c754, "Online Serving Measurements", two rows
    # copied by hand: Llama 3.1 70B, TP 4, 467 in / 256 out at QPS 2, and Llama 3.1 8B,
    # 202 / 214, every request at once
    runs = {r["id"]: r for r in servv.load_runs()}
    first = runs["trtllm-0.14-h100-llama31-70b-tp4-467x256-qps2"]
    assert (first["tp"], first["requests"], first["rate"]) == (4, 500, 2.0)
    assert first["measured"] == {
        "requests_per_s": 2,
        "mean_ttft_ms": 62,
        "mean_itl_ms": 21,
        "total_tokens_per_s": 1406,
        "output_tokens_per_s": 498,
    }
    last = runs["trtllm-0.14-h100-llama31-8b-202x214-all-at-once"]
    assert last["rate"] is None and last["measured"]["mean_ttft_ms"] == 1657
    assert last["measured"]["output_tokens_per_s"] == 8291


def test_a_stored_prediction_is_what_the_simulation_gives():
    run_id = "trtllm-0.14-h100-llama31-8b-467x16-qps2"
    run = next(r for r in servv.load_runs() if r["id"] == run_id)
    stored = json.loads(servv.PREDICTIONS_JSON.read_text())["predictions"][run_id]
    now = servv.predict(run, {})
    for key, value in stored.items():
        assert now[key] == pytest.approx(value, rel=1e-9), key

"""examples/plan_against_practice.py: the checked-in ranks of the published training layouts
in torchroof's search are consistent with themselves, with the runs as asked today and with
the docs' table; the script's search runs live on a small model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_example

from torchroof.planning import TrainingLayout

practice = load_example("plan_against_practice")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads(practice.RESULTS_JSON.read_text())["runs"]
RUNS = {run["id"]: (run, choice) for run, choice in practice.training_runs()}
PREDICTED = {
    row["id"]: row
    for row in json.loads((ROOT / "examples/validation/multi_gpu_predictions.json").read_text())[
        "runs"
    ]
}


def test_every_training_run_is_searched_once():
    assert [row["id"] for row in RESULTS] == list(RUNS)


@pytest.mark.parametrize("row", RESULTS, ids=[row["id"] for row in RESULTS])
def test_each_rank_and_gain_follow_from_the_step_times(row):
    """The published plan's rank is among the fitting plans; the best is no slower; the
    gain is published / best - 1; rank 1 is a gain of 0."""
    if "rank" in row:
        assert 1 <= row["rank"] <= row["fitting"]
        assert row["best_step_s"] <= row["published_step_s"]
        assert row["gain"] == pytest.approx(row["published_step_s"] / row["best_step_s"] - 1)
        assert (row["rank"] == 1) == (row["gain"] == 0)
    else:
        assert row["published_status"]  # why it has no rank, said
        assert "gain" not in row  # no gain over a plan that does not fit


@pytest.mark.parametrize("row", RESULTS, ids=[row["id"] for row in RESULTS])
def test_each_run_is_asked_as_the_file_says(row):
    """The published layout and the space searched are what the script makes of the run
    today (its request in multi_gpu_validation.py): the file has not drifted."""
    if row.get("published") == "-":
        pytest.skip(row["published_status"])
    run, choice = RUNS[row["id"]]
    phase = practice.mgv.request(run, choice).phases[0]
    layout, _ = practice.published({k: v for k, v in phase.workload.items() if k != "seq"})
    assert layout.label() == row["published"]
    llama = practice.mgv.load_config(phase.model).model_type == "llama"
    space = practice.neighbourhood(layout, run["gpu_count"], llama)
    listed = {k: list(v) if isinstance(v, tuple) else v for k, v in space.items()}
    assert listed == row["space"]


@pytest.mark.parametrize("row", RESULTS, ids=[row["id"] for row in RESULTS])
def test_each_published_step_is_the_validation_prediction(row):
    """The published layout priced in the search is the step multi_gpu_validation.py
    predicts for the run (the same workload, cluster and pricing): the same seconds."""
    if "published_step_s" not in row:
        pytest.skip(row["published_status"])
    (step,) = PREDICTED[row["id"]]["steps"]
    assert row["published_step_s"] == pytest.approx(step["step_ms"] / 1e3, rel=1e-9)


def test_the_validation_overview_counts_the_file():
    """The validation overview's row counts the file: ranked first and second, runs where
    no plan fits, where only the published one does not, and those not searched."""
    ranks = [row.get("rank") for row in RESULTS]
    no_fit = sum(row.get("fitting") == 0 for row in RESULTS)
    own_over = sum("published_step_s" in row and "rank" not in row for row in RESULTS) - no_fit
    unsearched = sum(row["published"] == "-" for row in RESULTS)
    second = next(row for row in RESULTS if row.get("rank") == 2)
    cells = (
        f"| {len(RESULTS)} | {ranks.count(1)} first, {ranks.count(2)} second "
        f"({second['gain']:.0%} behind), {no_fit} with no plan fitting, {own_over} with "
        f"the published one over memory, {unsearched} not searched |"
    )
    assert cells in (ROOT / "docs" / "validation" / "index.md").read_text()


def test_the_docs_table_is_the_file():
    page = (ROOT / "docs" / "validation" / "plan-against-practice.md").read_text()
    assert practice.markdown(RESULTS) in page


def test_a_published_layout_is_ranked_among_its_neighbours():
    """A run on 8 GPUs of a 2-layer Llama (d = 256, 4 heads, 2 KV heads): published as
    FSDP 8, micro-batch 1, 2 sequences a rank (2 micro-batches), no recompute. The
    neighbourhood: tp 1 and 2 (tp 4 splits the 2 KV heads, tp 8 the 4 heads: refused) x
    the data ranks all sharded or all replicated = 4 layouts, all priced; the published one
    is ranked among the fitting ones at its own step time."""
    run = {
        "id": "tiny",
        "regime": "train",
        "gpu_count": 8,
        "seq_len": 256,
        "micro_batch": 1,
        "grad_accum": 2,
        "torch_compile": True,
        "model": {"torchroof_config": "llama-3-8b"},
        "measured": {"unit": "tokens/s per GPU"},
        "parallelism": {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp_shard": 8, "dp_replicate": 1},
    }
    tiny = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
    )
    choice = practice.mgv.Choice("dgx-h100", "a test", overrides=tiny)
    row = practice.search(run, choice)
    layout = TrainingLayout(fsdp=8, batch=1, microbatches=2)
    assert row["published"] == layout.label()
    assert row["fitting"] + row["over_memory"] == 4
    assert 1 <= row["rank"] <= row["fitting"]
    assert row["best_step_s"] <= row["published_step_s"]

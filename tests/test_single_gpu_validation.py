"""examples/single_gpu_validation.py: every published single-GPU run is
predicted or refused with a reason, the stored predictions still hold, and the pure roofline
stays a floor on every run."""

from __future__ import annotations

import json

import pytest
from conftest import load_example

sgv = load_example("single_gpu_validation")
RUNS = sgv.load_runs()
STORED = json.loads(sgv.PREDICTIONS_JSON.read_text())
BY_RUN = {p["run"]: p for p in STORED["predictions"]}


def test_every_run_is_predicted_or_refused_with_a_reason():
    predicted = set(BY_RUN)
    for run in RUNS:
        assert (run["id"] in predicted) != (run["id"] in sgv.NOT_PREDICTED), run["id"]
    assert all(reason.strip() for reason in sgv.NOT_PREDICTED.values())
    assert len(predicted) >= 20  # the floor: at least 20 single-GPU measurements


def test_the_pure_roofline_is_a_floor_on_every_stored_run():
    """Pure W/pi and Q/beta at datasheet peaks cannot beat a real kernel: ratio <= 1."""
    assert all(p["pure_ratio"] <= 1.0 for p in STORED["predictions"])
    assert STORED["summary"]["pure"]["above_1"] == 0


def test_the_stored_summary_is_the_stored_rows():
    kept = [p for p in STORED["predictions"] if p["run"] not in sgv.FIGURE_SOURCES]
    ratios = sorted(p["realistic_ratio"] for p in kept)
    assert STORED["summary"]["runs"] == len(kept)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    assert STORED["summary"]["realistic"]["median_ratio"] == pytest.approx(median)


def test_a_kernel_run_reprices_live_to_its_stored_figures():
    """mamf H100 bf16: 2048 x 2048 x 13312 at 794.5 TFLOP/s = 140.6 us measured; pure is
    W / 989.4 TFLOP/s = 112.9 us (0.80); realistic is its L2 roof with 256 x 128 tiles
    (8 x 16 = 128 CTAs, one wave on 132 SMs): (128 x 384 x 13312 x 2 B + 2048^2 x 2 B) /
    9 TB/s + 2 us launch = 148.3 us (1.06)."""
    run = next(r for r in RUNS if r["id"] == "mamf-h100sxm-bf16")
    row = sgv.kernel_row(run)
    stored = BY_RUN[run["id"]]
    assert row.measured_s == pytest.approx(2 * 2048 * 2048 * 13312 / 794.5e12)
    assert row.pure_s == pytest.approx(2 * 2048 * 2048 * 13312 / 989.4e12)
    l2_bytes = 128 * 384 * 13312 * 2 + 2048 * 2048 * 2
    assert row.realistic_s == pytest.approx(l2_bytes / 9e12 + 2e-6)
    assert (row.pure_s, row.realistic_s) == (
        pytest.approx(stored["pure_s"]),
        pytest.approx(stored["realistic_s"]),
    )


def test_a_stream_run_checks_the_seeds_85_percent():
    """BabelStream triad on an A100 80GB: 3 x 256 MiB at 1724.8 GB/s = 466.9 us; the
    realistic mode's 85% of 2039 GB/s = 1733 GB/s takes 464.7 us, plus its 2 us launch:
    0.9995 of the measured time."""
    run = next(r for r in RUNS if r["id"] == "babelstream-a100sxm80-fp64-triad")
    row = sgv.kernel_row(run)
    assert row.measured_s == pytest.approx(3 * 268435456 / 1724.827354e9)
    realistic_s = 3 * 268435456 / (0.85 * 2039e9) + 2e-6
    assert row.realistic_s == pytest.approx(realistic_s)
    assert row.realistic_ratio == pytest.approx(0.9995, abs=1e-4)

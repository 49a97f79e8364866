"""The expected range on every estimate and the calibrated mode (torchroof.accuracy): the
order statistics that bound a middle 80%, the groups and their fallbacks, the
leave-one-source-out check, the shipped fit held to the validation data it was fitted on,
and the range, the calibrated time and the nearest run on real estimates (summary, JSON,
HTML and the command line)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_example, small_llama
from hypothesis import given
from hypothesis import strategies as st

import torchroof
from torchroof.accuracy import fit
from torchroof.accuracy.expected import (
    ExpectedRange,
    NoRange,
    NotCalibratedError,
    expected_range,
    nearest_run,
    similar_group,
)
from torchroof.accuracy.measured import MeasuredRun, shipped_data
from torchroof.cli.main import main as cli_main
from torchroof.render.files import estimate_json
from torchroof.render.html import estimate_data
from torchroof.render.text import summary
from torchroof.report.estimate import Estimate
from torchroof.serving.composition import SequenceWork
from torchroof.serving.step_time import StepTimer

er = load_example("expected_ranges")


def run(name, source, kind="train", measured=1.0, realistic=1.0, roofline=None, **fields):
    """A measured run with its correction set by ``measured`` / ``realistic``."""
    values = {
        "runtime": "torchtitan",
        "accelerator": "h100-sxm",
        "hardware": "h100-sxm",
        "gpus": 8,
        "quant": "none",
        "benchmark": "",
        **fields,
    }
    pure = roofline if roofline is not None else realistic / 2
    return MeasuredRun(name, source, kind, measured_s=measured, roofline_s=pure,
                       realistic_s=realistic, **values)  # fmt: skip


# -- the order statistics -------------------------------------------------------------------


def test_the_middle_80_percent_of_nine_runs_is_their_outermost_pair():
    """n = 9: j = floor(0.1 x 10) = 1, the smallest and the largest; a further run falls
    between them with probability (10 - 2) / 10 = 0.8."""
    assert fit.middle_interval([5, 1, 9, 2, 8, 3, 7, 4, 6]) == (1, 9)


def test_nineteen_runs_drop_one_from_each_end_and_twenty_eight_still_one():
    """n = 19: j = floor(2.0) = 2, the 2nd smallest and 2nd largest (18 / 20 = 0.9 of a
    further run inside); n = 28: j = floor(2.9) = 2 as well."""
    assert fit.middle_interval(list(range(1, 20))) == (2, 18)
    assert fit.middle_interval(list(range(1, 29))) == (2, 27)
    assert fit.middle_interval(list(range(1, 30))) == (3, 27)  # n = 29: j = floor(3.0) = 3


@given(st.lists(st.floats(0.01, 100), min_size=9, max_size=200))
def test_the_bounds_hold_eighty_percent_and_leave_at_most_a_tenth_each_side(values):
    """At least 80% of the values lie within the bounds, and fewer than 0.1 (n + 1) below
    the lower or above the upper: so a further exchangeable run lands inside with
    probability at least (n + 1 - 2 x 0.1 (n + 1)) / (n + 1) = 0.8."""
    low, high = fit.middle_interval(values)
    n = len(values)
    assert sum(low <= v <= high for v in values) >= 0.8 * n
    assert sum(v < low for v in values) < 0.1 * (n + 1)
    assert sum(v > high for v in values) < 0.1 * (n + 1)


# -- groups ---------------------------------------------------------------------------------


def test_a_kind_with_nine_runs_from_three_sources_is_its_own_group():
    """Nine training runs, corrections 1.0 ... 1.8 (measured / realistic), three from each of
    sources a, b and c: the middle 80% is 1.0-1.8, the median 1.4; the pure roofline
    predicted half the realistic time, so its corrections are doubled: 2.0-3.6, median
    2.8."""
    runs = [run(f"t{i}", "abc"[i % 3], measured=1 + i / 10) for i in range(9)]
    group = fit.similar("train", runs)
    assert group is not None and group.name == "training steps"
    assert group.spread["realistic"] == fit.Spread(1.0, 1.4, 1.8)
    assert group.spread["roofline"] == fit.Spread(2.0, 2.8, 3.6)


def test_a_group_mostly_from_one_source_falls_back_to_every_model_step():
    """Ten decode runs from a and nine from b: a holds 10 of 19, more than half, so decode
    steps are no group, nor are the same 19 as model steps. Nine training runs from c make
    28 model steps, none over half (10 of 28): the decode step is compared with those.
    Kernel benchmarks never fall back to model steps."""
    decode = [run(f"d{i}", "a" if i < 10 else "b", kind="decode") for i in range(19)]
    assert fit.similar("decode", decode) is None
    train = [run(f"t{i}", "c") for i in range(9)]
    group = fit.similar("decode", decode + train)
    assert group is not None and group.name == fit.STEPS and len(group.runs) == 28
    trained = fit.similar("train", decode + train)  # training steps: all nine from c
    assert trained is not None and trained.name == fit.STEPS
    kernels = [run(f"k{i}", "a", kind="kernel") for i in range(9)]
    assert fit.similar("kernel", kernels + train + decode) is None


def test_leaving_a_source_out_checks_its_runs_against_the_others():
    """Sources a (nine runs at 1.0 ... 1.8) and b (nine runs at 2.0) and c (nine at 1.0):
    b left out, its runs are held to a and c's eighteen, whose middle 80% (j = floor(1.9)
    = 1) is 1.0-1.8: b's 2.0 falls outside, and its calibrated ratio is 2.0 / median 1.0 =
    2.0. a left out: b and c's 1.0 and 2.0 (median 1.5), j = 1, the range 1.0-2.0 holds
    all of a's runs."""
    runs = [run(f"a{i}", "a", measured=1 + i / 10) for i in range(9)]
    runs += [run(f"b{i}", "b", measured=2.0) for i in range(9)]
    runs += [run(f"c{i}", "c", measured=1.0) for i in range(9)]
    held = {h.run.run: h for h in fit.leave_one_source_out(runs)}
    assert held["b0"].inside["realistic"] is False
    assert held["b0"].calibrated == pytest.approx(2.0)
    assert all(held[f"a{i}"].inside["realistic"] for i in range(9))
    assert held["a0"].width["realistic"] == pytest.approx(2.0)
    cover = fit.coverage(list(held.values()), "train")
    # a: 9 inside; b: 0; c left out: a and b give 1.0 ... 2.0 (j = 1), c's 1.0 inside
    assert cover.inside["realistic"] == pytest.approx(18 / 27)


# -- the shipped fit ------------------------------------------------------------------------


def test_the_shipped_fit_is_the_fit_of_the_validation_data():
    """torchroof/accuracy/measured_runs.json is what examples/expected_ranges.py --write
    makes from examples/validation/runtime_predictions.json now: rerun it after the
    predictions change."""
    fresh = json.loads(json.dumps(er.shipped(er.measured_runs())))
    assert fresh == shipped_data()


def test_every_priced_run_is_in_the_fit_once_with_its_source():
    predictions = json.loads(er.PREDICTIONS.read_text())["predictions"]
    runs = shipped_data()["runs"]
    assert sorted(r["run"] for r in runs) == sorted(p["run"] for p in predictions)
    assert all(r["source"] and r["source"] != "?" for r in runs)


def test_the_evaluation_meets_what_it_is_published_to_meet():
    """The docs page states, leaving one source out: the calibrated median of every kind
    within 0.95-1.05; training's and decode's 80% ranges holding 75-85% of their runs;
    the realistic ranges narrower than the pure roofline's for every model step."""
    evaluation = shipped_data()["evaluation"]
    for kind, e in evaluation.items():
        assert 0.95 <= e["calibrated_median"] <= 1.05, kind
    for kind in ("train", "decode"):
        assert 0.75 <= evaluation[kind]["inside"]["realistic"] <= 0.85, kind
    for kind in ("train", "prefill", "decode"):
        assert evaluation[kind]["width"]["realistic"] < evaluation[kind]["width"]["roofline"]


# -- on estimates ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_trace():
    return torchroof.trace_model(small_llama(2), "decode", batch=4, seq=256)


def test_an_estimate_states_its_range_from_its_kind_in_its_mode(decode_trace):
    """A decode step's range is its own time (before calibration) times the shipped decode
    group's middle 80%: the pure roofline's in that mode, the realistic mode's in the other
    two."""
    for mode in ("roofline", "realistic", "calibrated"):
        est = decode_trace.estimate("h100-sxm", mode=mode)
        found = expected_range(est)
        group = similar_group("decode", mode)
        assert isinstance(found, ExpectedRange) and group is not None
        assert group.name == "decode steps" and found.runs == group.runs == 68
        base = est.time_s / est.correction
        assert found.low_s == pytest.approx(base * group.low)
        assert found.high_s == pytest.approx(base * group.high)
        assert found.line() in summary(est).splitlines()


def test_the_calibrated_mode_is_the_realistic_time_times_the_median(decode_trace):
    realistic = decode_trace.estimate("h100-sxm", mode="realistic")
    calibrated = decode_trace.estimate("h100-sxm", mode="calibrated")
    median = similar_group("decode", "calibrated").median
    assert median == shipped_data()["fit"]["decode steps"]["realistic"]["median"]
    assert calibrated.correction == median
    assert calibrated.time_s == pytest.approx(realistic.time_s * median)
    # the range is the realistic one: calibration moves the point, not the range
    low = expected_range(calibrated)
    assert isinstance(low, ExpectedRange)
    assert low.low_s == pytest.approx(expected_range(realistic).low_s)
    assert any(a.startswith(f"calibrated: the realistic time x {median:.2f}")
               for a in calibrated.assumptions)  # fmt: skip
    assert f"x {median:.2f})" in summary(calibrated).splitlines()[1]


def test_calibration_scales_every_time_so_every_share_is_the_realistic_modes():
    """FSDP over 4 GPUs of a DGX H100 with collectives on their own stream: the calibrated
    step is the realistic one times the factor, kernel by kernel and on the schedule, so the
    memory-bound share, the exposed communication's share and each phase's share are the
    realistic mode's."""
    trace = torchroof.trace_model(small_llama(2), "train", batch=2, seq=512, fsdp=4)
    realistic = trace.estimate("dgx-h100", mode="realistic")
    calibrated = trace.estimate("dgx-h100", mode="calibrated")
    factor = similar_group("train", "calibrated").median
    assert calibrated.correction == factor
    assert calibrated.time_s == pytest.approx(realistic.time_s * factor)
    for mine, theirs in zip(calibrated.kernels, realistic.kernels, strict=True):
        assert mine.time_s == pytest.approx(theirs.time_s * factor)
    assert calibrated.memory_bound_share == pytest.approx(realistic.memory_bound_share)
    ours, base = calibrated.communication(), realistic.communication()
    assert base.exposed_s > 0 and ours.exposed_share == pytest.approx(base.exposed_share)
    for phase in ("forward", "backward", "optimizer"):
        share = realistic.phase_time_s(phase) / realistic.time_s
        assert calibrated.phase_time_s(phase) / calibrated.time_s == pytest.approx(share)


def test_a_calibrated_pipeline_and_engine_step_take_the_factor_whole():
    """A two-stage pipeline's sends and a serving engine step's attention (timed apart from
    the priced decode step) take the factor as the kernels do."""
    trace = torchroof.trace_model(small_llama(4), "train", batch=2, seq=256, pp=2, microbatches=2)
    realistic = torchroof.estimate_trace(trace, "dgx-h100", mode="realistic")
    calibrated = torchroof.estimate_trace(trace, "dgx-h100", mode="calibrated")
    factor = similar_group("train", "calibrated").median
    assert calibrated.time_s == pytest.approx(realistic.time_s * factor)
    prepared = torchroof.prepare(small_llama(2), "decode", batch=1, seq=512)
    timers = [StepTimer(prepared, "h100-sxm", mode=m) for m in ("realistic", "calibrated")]
    decode = similar_group("decode", "calibrated").median
    for step in ([SequenceWork(1, 64)] * 8, [SequenceWork(1, 500)] * 32, [SequenceWork(400)]):
        plain, scaled = (t.time(step).time_s for t in timers)
        assert scaled == pytest.approx(plain * decode)


def test_a_calibrated_estimate_round_trips_and_its_json_carries_the_range(decode_trace):
    est = decode_trace.estimate("h100-sxm", mode="calibrated")
    data = json.loads(estimate_json(est))
    again = Estimate.from_dict(data)
    assert again.correction == est.correction and again.time_s == pytest.approx(est.time_s)
    expected = data["totals"]["expected"]
    assert expected["low_s"] == pytest.approx(expected_range(est).low_s)
    assert expected["group"] == "decode steps" and expected["mode"] == "realistic"
    data["correction"] = -1.0
    with pytest.raises(ValueError, match="a factor > 0"):
        Estimate.from_dict(data)


def test_the_html_page_scales_the_range_with_the_step(decode_trace):
    est = decode_trace.estimate("h100-sxm")
    data = estimate_data(est)["expected"]
    found = expected_range(est)
    assert data["low"] * est.time_s == pytest.approx(found.low_s)
    assert data["high"] * est.time_s == pytest.approx(found.high_s)
    assert "68 similar measured runs" in data["of"]


def test_a_step_traced_by_hand_has_no_range_and_is_not_calibrated():
    net = torch.nn.Linear(64, 64, device="meta")
    with torchroof.trace() as t:
        net(torch.randn(8, 64, device="meta"))
    found = expected_range(t.estimate("h100-sxm"))
    assert isinstance(found, NoRange) and "traced by hand" in found.line()
    with pytest.raises(NotCalibratedError, match="price it in the realistic mode"):
        t.estimate("h100-sxm", mode="calibrated")


def test_the_nearest_run_shares_the_most_with_the_step(decode_trace):
    """Two decode runs of the same length: the one on the step's accelerator is nearer
    (distance 1 for the runtime the step lacks, against 2 with the accelerator too)."""
    est = decode_trace.estimate("h100-sxm")
    time_s = est.time_s
    near = run("same-gpu", "a", kind="decode", realistic=time_s, roofline=time_s, gpus=1)
    far = run("other-gpu", "b", kind="decode", realistic=time_s, roofline=time_s, gpus=1,
              accelerator="a100-sxm", hardware="a100-sxm", measured=3.0 * time_s)  # fmt: skip
    assert nearest_run(est, [far, near], "roofline", time_s).run == "same-gpu"
    far_kind = run("train-same-gpu", "c", kind="train", realistic=time_s, gpus=1)
    assert nearest_run(est, [far_kind, far], "roofline", time_s).run == "other-gpu"


def test_the_command_line_prints_the_range_and_the_calibrated_time(capsys):
    code = cli_main(["estimate", "gpt2", "--regime", "decode", "--batch", "2", "--seq", "64",
                     "--mode", "calibrated", "--quiet"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "(calibrated: the realistic" in out
    assert "expected: " in out and "similar measured runs, decode steps" in out


def test_a_served_run_says_why_it_has_no_range(tmp_path, capsys):
    """The 36 serving runs of examples/validation/serving_runs.json all come from
    TensorRT-LLM's performance overview: one source holds all of them (more than half), so
    no group can be made; ``serve`` says so in its text and under the summary's
    ``expected``, and the script refuses to ship runs that would make a group."""
    served = json.loads(er.SERVING_RUNS.read_text())["runs"]
    assert len(served) == 36 and {r["source"] for r in served} == {"trtllm-0.14-online"}
    assert shipped_data()["serving"] == {
        "runs": 36,
        "sources": {"TensorRT-LLM performance overview": 36},
    }
    config = tmp_path / "llama.json"
    small_llama(2).to_json_file(config)
    path = tmp_path / "run.json"
    code = cli_main(["serve", str(config), "--concurrency", "1", "--requests", "2",
                     "--input-len", "16", "--output-len", "4", "--json", str(path),
                     "--quiet"])  # fmt: skip
    assert code == 0
    line = (
        "expected: no range, the 36 published serving runs the simulator is checked against "
        "come from 1 source (TensorRT-LLM performance overview: 36); a range needs at least "
        "9 runs, no source holding more than half of them"
    )
    assert line in capsys.readouterr().out
    assert json.loads(path.read_text())["summary"]["expected"] == {"none": line[20:]}


def test_the_script_refuses_serving_runs_that_would_make_a_group(tmp_path, monkeypatch):
    """Nine runs from three sources, three each: a group by the rules, for which no serving
    range is fitted yet."""
    runs = [{"id": f"r{i}", "source": f"s{i % 3}"} for i in range(9)]
    sources = {f"s{i}": {"title": f"Source {i}, a table"} for i in range(3)}
    path = tmp_path / "serving_runs.json"
    path.write_text(json.dumps({"runs": runs, "sources": sources}))
    monkeypatch.setattr(er, "SERVING_RUNS", path)
    with pytest.raises(SystemExit, match="9 runs from 3 sources would make a group"):
        er.serving_runs()
    path.write_text(json.dumps({"runs": runs[:8], "sources": sources}))
    assert er.serving_runs() == {
        "runs": 8,
        "sources": {"Source 0": 3, "Source 1": 3, "Source 2": 2},
    }

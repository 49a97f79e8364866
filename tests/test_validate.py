"""Calibration files and predicted-vs-measured validation (the roofline diagnosis of
torchroof.validation.diagnosis).

Only deterministic facts are asserted here: what a calibration writes and reads back, the
prediction ``validate`` makes for a fixed calibration (exactly, from the step's FLOPs), that
each repeat is calibrated just before its step and predicted with that calibration, the
median and spread over repeats, how measured kernels are mapped to predicted ones by name,
and the diagnosis questions answered in order on kernels and times built by hand. Measured
times are never asserted: a shared machine moves them by tens of percent. The measurement
itself (calibrate this CPU, run the steps, print predicted / measured and the ratios) is
``python examples/benchmark_validate_cpu.py``.
"""

import json
import sys
from dataclasses import replace

import pytest
from torchroof.hardware import Figure, get

from torchroof import KernelEstimate
from torchroof.validation.calibrate import Calibration, calibrate
from torchroof.validation.diagnosis import NEEDS_COUNTERS, QUESTIONS, MachineFigures, diagnose
from torchroof.validation.profiling import normalise
from torchroof.validation.results import KernelComparison, Repeat, Spread, Validation
from torchroof.validation.validate import SHORT_CALIBRATION, TINY_OVERRIDES, interleave, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A made-up calibration with round figures of a small CPU's order (copy 23.6 GB/s, triad
# 30.3 GB/s, fp32 matmul 0.17 TFLOP/s, 1 us per op): an input the tests price and diagnose
# with, never compared with a measurement.
FIXED = Calibration(
    device="cpu",
    device_name="fixed test CPU",
    torch_version="2.13.0",
    date="2025-01-01",
    copy_bytes_per_s=23.6e9,
    triad_bytes_per_s=30.3e9,
    matmul_flops_per_s={"fp32": 0.17e12, "bf16": 0.05e12},
    vector_flops_per_s=20e9,
    launch_overhead_s=1e-6,
    capacity_bytes=16 * 2**30,
    cache_bytes=32 * 2**20,
    compute_units=2,
)

# A machine whose only finite ceiling is a 1 TFLOP/s fp32 matmul: every other kernel takes
# ~1e-21 s, so a step's predicted time is its matmul and attention FLOPs / 1e12.
MATMUL_ONLY = replace(
    FIXED,
    copy_bytes_per_s=1e30,
    triad_bytes_per_s=1e30,
    matmul_flops_per_s={"fp32": 1e12},
    vector_flops_per_s=1e30,
    launch_overhead_s=0.0,
)


def _write(calibration: Calibration, folder, name: str) -> str:
    path = folder / f"{name}.toml"
    path.write_text(calibration.to_toml(name))
    return str(path)


def test_calibration_writes_a_hardware_file_every_command_reads(tmp_path):
    path = _write(FIXED, tmp_path, "cpu-fixed")
    spec = get(path)
    assert (spec.name, spec.display_name) == ("cpu-fixed", "fixed test CPU (measured)")
    # beta is the better of STREAM copy and triad: 30.3 GB/s
    assert spec.hbm_bytes_per_s.value == 30.3e9
    # the measured matmul rates price matmuls per dtype (fp32 on a CPU included)
    assert spec.tensor_peak("float32") == 0.17e12 and spec.tensor_peak("bfloat16") == 0.05e12
    assert spec.vector_peak("fp32") == 20e9
    # the SFU rate is taken as 1/4 of elementwise, marked approximate
    assert spec.sfu_flops_per_s.value == 5e9 and spec.sfu_flops_per_s.approximate
    assert spec.hbm_capacity_bytes.value == 16 * 2**30
    # the launch is the spec's figure, which realistic mode charges to every kernel
    assert spec.launch_overhead_s is not None and spec.launch_overhead_s.value == 1e-6
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    assert data["source"] == "measured"
    assert data["measured"] == {
        "copy_bytes_per_s": 23.6e9,
        "triad_bytes_per_s": 30.3e9,
        "device": "cpu",
        "date": "2025-01-01",
        "torch_version": "2.13.0",
    }


def test_a_real_calibration_has_every_figure_a_spec_needs(tmp_path):
    # tiny sizes: the figures are not checked (they are timings), only that every one is
    # measured and the file they make is read back to its 6 written digits
    result = calibrate("cpu", stream_bytes=4 * 2**20, matmul_sizes=(64,), elementwise_bytes=2**16)
    assert set(result.matmul_flops_per_s) == {"fp32", "bf16"}  # no fp16 matmul on a CPU
    figures = [result.copy_bytes_per_s, result.triad_bytes_per_s, result.vector_flops_per_s]
    assert all(f > 0 for f in figures + list(result.matmul_flops_per_s.values()))
    assert result.launch_overhead_s > 0
    spec = get(_write(result, tmp_path, "cpu-now"))
    assert f"{spec.hbm_bytes_per_s.value:.6g}" == f"{result.bandwidth_bytes_per_s:.6g}"
    assert f"{spec.tensor_peak('float32'):.6g}" == f"{result.matmul_flops_per_s['fp32']:.6g}"


# The tiny Llama validate builds on CPU (TINY_OVERRIDES): 2 layers, d = 256, 4 heads of 64,
# 2 KV heads, MLP 768, vocabulary 4096, fp32. Its projections hold, per layer, q and o
# 256·256, k and v 256·128, gate, up and down 3·256·768 = 786,432 parameters; 1,572,864 in
# the 2 layers.
LINEAR_PARAMS = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768)
# prefill of 64 tokens: 2·64·1,572,864 = 201,326,592 in the projections; the head on the
# last token only (logits_to_keep=1), 2·256·4096 = 2,097,152; causal flash attention keeps
# 64·65/2 = 2080 pairs per head, 2·4 heads·2080·(64 + 64) = 2,129,920 per layer
PREFILL_FLOPS = 2 * 64 * LINEAR_PARAMS + 2 * 256 * 4096 + 2 * 2 * 4 * 2080 * 128
# decode: one token through the projections and the head; attention over the whole static
# cache, sized context + the steps run: warmup + the traced step + per repeat (one re-warm,
# the timed iterations, one profiled) = 1 + 1 + 1·(1 + 1 + 1) = 5, so 69 tokens, with a
# mask, not causal: 2 layers · 2·4 heads·69·(64 + 64)
DECODE_FLOPS = 2 * LINEAR_PARAMS + 2 * 256 * 4096 + 2 * 2 * 4 * 69 * 128
# train: every projection and the head (on all 64 tokens, for the loss) forward, then its
# input and weight gradients (3x the forward); flash attention forward and its backward
# (2.5x): 3.5x the prefill's attention
TRAIN_FLOPS = 3 * 2 * 64 * (LINEAR_PARAMS + 256 * 4096) + 7 * 2 * 4 * 2080 * 128


@pytest.mark.parametrize(
    ("regime", "tensor_flops"),
    [
        ("prefill", PREFILL_FLOPS),
        ("decode", DECODE_FLOPS),
        ("train", TRAIN_FLOPS),
    ],
)
def test_validate_predicts_the_step_it_runs(regime, tensor_flops, tmp_path):
    assert (PREFILL_FLOPS, DECODE_FLOPS) == (207_683_584, 5_384_192)
    assert TRAIN_FLOPS == 1_021_542_400
    result = validate(
        "llama-3-8b",
        regime,
        hardware=_write(MATMUL_ONLY, tmp_path, "matmul-only"),
        seq=64,
        overrides=TINY_OVERRIDES,
        warmup=1,  # the traced and profiled steps are steady state (AdamW state exists)
        iterations=1,
        repeats=1,
        launch_overhead_s=1e-6,
    )
    # the prediction prices the very step that was run: the pure roofline is its matmul and
    # attention FLOPs at 1 TFLOP/s
    kernels = len(result.kernels)
    (repeat,) = result.repeats
    assert repeat.calibration is None  # a fixed hardware file: only the step is repeated
    assert result.predicted_total_s == pytest.approx(tensor_flops / 1e12, rel=1e-12)
    assert result.total_ratio == result.predicted_total_s / result.measured_total_s
    # realistic mode charges the 1 us launch to every eager kernel, on top of a body never
    # shorter than the pure roofline's
    assert repeat.predicted_s["realistic"] >= (tensor_flops / 1e12 + kernels * 1e-6) * (1 - 1e-12)
    # profiled kernels are matched to predicted ones by name (longest common subsequence):
    # none is left without a prediction, and every matmul and attention kernel (the whole
    # predicted time above) is found in the profile
    assert result.unmatched_measured == []
    heavy = [k for k in result.kernels if normalise(k.name) in ("mm", "sdpa", "sdpa_backward")]
    assert heavy and all(k.measured_s is not None for k in heavy)
    # the predicted kernels the CPU run does not launch as their own ops: autograd's
    # gradient-accumulation adds (train) and the attention output's layout copy after the
    # masked kernel (decode)
    missing = {k.name for k in result.kernels if k.measured_s is None}
    assert missing <= {"aten.add.Tensor", "aten.clone.default"}
    data = json.loads(json.dumps(result.to_dict()))
    assert data["predicted_total_s"] == result.predicted_total_s
    assert len(data["kernels"]) == kernels
    assert data["ratios"]["roofline"]["median"] == result.total_ratio


@pytest.fixture
def fixed_spec(tmp_path):
    """FIXED as a hardware file: beta 30.3 GB/s (triad), fp32 matmul 0.17 TFLOP/s, the fp32
    vector line 20 GFLOP/s (10 without FMA), no memory latency."""
    return get(_write(FIXED, tmp_path, "cpu-fixed"))


def _machine(spec, launch_s=1e-6):
    return MachineFigures(spec, FIXED.copy_bytes_per_s, FIXED.triad_bytes_per_s, launch_s)


def _kernel(
    time_s: float,
    *,
    unit: str = "vector",
    flops: int = 0,
    bytes_moved: int = 0,
    peak: float = 20e9,
    waves: int = 0,
    wave_efficiency: float = 1.0,
    in_flight_bytes: float = 0.0,
) -> KernelEstimate:
    return KernelEstimate(
        index=0,
        name="aten.mm.default" if unit == "tensor" else "aten.add.Tensor",
        ops=(),
        module="m",
        phase="forward",
        flops=flops,
        bytes_read=bytes_moved,
        bytes_written=0,
        unit=unit,
        dtype="float32",
        counted=True,
        peak_flops_per_s=peak,
        compute_s=flops / peak,
        memory_s=bytes_moved / 30.3e9,
        time_s=time_s,
        # as roofline.time_kernel calls it: compute-bound when W/pi exceeds Q/beta
        bound="compute" if flops / peak > bytes_moved / 30.3e9 else "memory",
        tile="256x128" if waves else "",
        waves=waves,
        wave_efficiency=wave_efficiency,
        in_flight_bytes=in_flight_bytes,
    )


def test_the_questions_come_in_the_seeds_order_and_a_small_kernel_is_its_launch(fixed_spec):
    # an add of 6,000 elements, 24,000 bytes, predicted 1 us, measured 5 us, launch 4 us
    small = _kernel(1e-6, flops=6_000, bytes_moved=24_000)
    diagnosis = diagnose(small, 5e-6, _machine(fixed_spec, launch_s=4e-6))
    assert [a.question for a in diagnosis.answers] == [
        "Are the tensor cores being used at all?",
        "Is HBM actually saturated?",
        "Is there enough parallel work in flight?",
        "Are the kernels too small?",
        "Is reuse happening where you assumed?",
        "Is the work quantised badly?",
    ]
    assert [q.text for q in QUESTIONS] == [a.question for a in diagnosis.answers]
    # 1: not a matmul; 2: 24,000 B / 5 us = 4.8 GB/s, 16% of triad's 30.3; 3: no latency
    # figure; 4: 1 us < 20 us, and 1 + 4 = 5 us >= 0.8 x 5 us; 5: no counters; 6: no tiles
    assert [a.explains for a in diagnosis.answers] == [False, False, False, True, False, False]
    assert [a.known for a in diagnosis.answers] == [True, True, False, True, False, True]
    assert diagnosis.ratio == pytest.approx(0.2)  # 1 us / 5 us
    assert diagnosis.explained_by == 3 and diagnosis.label == "too small"
    assert diagnosis.asked == diagnosis.answers[:4]  # stop at the first that explains
    assert diagnosis.verdict == (
        "too small: yes: predicted 1.0 us + launch 4.0 us = 5.0 us, 100% of the measured 5.0 us"
    )
    assert "4.8 GB/s is 16% of STREAM triad" in diagnosis.answers[1].answer
    assert diagnosis.answers[2].answer == "not known: no memory_latency_s in cpu-fixed"
    assert diagnosis.answers[4].answer == NEEDS_COUNTERS
    # measured 10 us: 1 + 4 = 5 us is 50% of it, under the 80% every question needs: the
    # size is answered, not taken as the explanation (a 1 us launch does not explain 10 us)
    tiny = diagnose(small, 10e-6, _machine(fixed_spec, launch_s=4e-6))
    assert not tiny.answers[3].explains and tiny.label == "unexplained"
    assert tiny.answers[3].answer == (
        "small, but predicted 1.0 us + launch 4.0 us = 5.0 us, 50% of the measured 10.0 us"
    )
    # measured 6.2 us: 5 us is 81% of it (>= 80%), explained
    assert diagnose(small, 6.2e-6, _machine(fixed_spec, launch_s=4e-6)).label == "too small"
    # measured 25 us: 5 us is 20% of it and it is not under 20 us; nothing else answers:
    # unexplained, and the questions this machine cannot answer are named
    slower = diagnose(small, 25e-6, _machine(fixed_spec, launch_s=4e-6))
    assert not any(a.explains for a in slower.answers) and slower.label == "unexplained"
    assert slower.answers[3].answer.startswith("small, but predicted 1.0 us + launch 4.0 us")
    assert slower.verdict.endswith("(not known here: in flight, reuse)")
    # a profiled kernel time carries the smallest profiled kernel's fixed cost: 4 us of it
    # with a 1 us launch explains the 5 us as well (1 + 4 = 5 us)
    profiled = replace(_machine(fixed_spec, launch_s=1e-6), smallest_kernel_s=4e-6)
    assert diagnose(small, 5e-6, profiled).verdict == (
        "too small: yes: predicted 1.0 us + smallest profiled kernel 4.0 us = 5.0 us, 100% of "
        "the measured 5.0 us"
    )
    # a prediction within 80% of the measurement is at the roof: nothing to explain
    assert diagnose(_kernel(0.9e-3, bytes_moved=24_000), 1e-3, _machine(fixed_spec)).label == (
        "at the roof"
    )


def test_a_prediction_slower_than_the_measurement_is_above_the_roof(fixed_spec):
    # predicted 234.5 us, measured 65.5 us: 234.5 / 65.5 = 3.58 > 1 / 0.8 = 1.25; the floor
    # is above what ran, so W, Q or the ceiling is wrong, and no question is asked to explain
    slow = _kernel(234.5e-6, bytes_moved=24_000)
    above = diagnose(slow, 65.5e-6, _machine(fixed_spec))
    assert (above.at_roof, above.above_roof) == (False, True)
    assert above.label == "above the roof" and above.explained_by is None
    assert above.verdict == (
        "above the roof: predicted 3.58x the measured time; W, Q or the ceiling is wrong for "
        "this kernel"
    )
    # the 80% rule both ways: 1.25x is still at the roof (125 / 100), 1.26x is above
    assert diagnose(_kernel(125e-6), 100e-6, _machine(fixed_spec)).label == "at the roof"
    assert diagnose(_kernel(126e-6), 100e-6, _machine(fixed_spec)).label == "above the roof"
    # the summary counts it apart from the kernels at the roof
    comparisons = [
        KernelComparison(
            i, "aten.add.Tensor", "m", "forward", "memory", "hbm", p, p, p, m, diagnose(k, m, mach)
        )
        for i, (k, p, m, mach) in enumerate(
            [
                (slow, 234.5e-6, 65.5e-6, _machine(fixed_spec)),
                (_kernel(0.9e-3), 0.9e-3, 1e-3, _machine(fixed_spec)),
            ]
        )
    ]
    repeats = [Repeat(1.0, {"roofline": 0.5, "realistic": 0.6})]
    result = Validation("m", "prefill", "cpu", "x", "roofline", comparisons, [], repeats)
    summary = result.summary()
    assert "that explains): 1 at the roof, 1 above the roof" in summary
    assert "predicted/measured is the median of the per-repeat ratios" in summary


def test_a_matmul_at_the_vector_line_is_on_the_wrong_pipe(fixed_spec):
    # 1.8e8 FLOPs priced at the fp32 matmul line 0.17 TFLOP/s: 1.06 ms; measured 10 ms is
    # 18 GFLOP/s, 90% of the fp32 vector line (20 GFLOP/s): at that line the FLOPs take
    # 9 ms >= 0.8 x 10 ms while its 3 MB take 0.1 ms at 30.3 GB/s
    gemm = _kernel(
        1.8e8 / 0.17e12, unit="tensor", flops=180_000_000, bytes_moved=3_000_000, peak=0.17e12
    )
    diagnosis = diagnose(gemm, 10e-3, _machine(fixed_spec))
    assert diagnosis.explained_by == 0 and diagnosis.label == "wrong pipe"
    # 0.17 TFLOP/s / 20 GFLOP/s = 8.5x
    assert diagnosis.answers[0].answer == (
        "no: 18 GFLOP/s measured, 90% of the fp32 vector (FMA) line, a pipe without MMA, "
        "8.5x under the 170 GFLOP/s it was priced on"
    )
    # the same matmul at 2 ms is 90 GFLOP/s: above the vector line, so on the matmul pipe
    on_pipe = diagnose(gemm, 2e-3, _machine(fixed_spec))
    assert on_pipe.answers[0].answer == (
        "yes: 90 GFLOP/s measured, above the fp32 vector line (20 GFLOP/s)"
    )
    assert not on_pipe.answers[0].explains


def test_the_pipe_question_needs_a_compute_bound_matmul_a_measured_line_and_a_margin(
    fixed_spec,
):
    # a k_proj-like matmul the prediction calls memory-bound: 1e6 FLOPs at 0.17 TFLOP/s is
    # 5.9 us, its 3 MB at 30.3 GB/s 99 us; measured 125 us is 8 MFLOP/s under the vector
    # line, but its pipe does not set its time: not asked
    narrow = _kernel(99e-6, unit="tensor", flops=1_000_000, bytes_moved=3_000_000, peak=0.17e12)
    answer = diagnose(narrow, 125e-6, _machine(fixed_spec)).answers[0]
    assert answer.answer.startswith("not asked: predicted memory-bound") and not answer.explains
    # priced on 30 GFLOP/s, 1.5x the 20 GFLOP/s vector line (< 2x): 1.8e8 FLOPs in 10 ms
    # (18 GFLOP/s) would be "on the vector line" by noise alone: no call
    close = _kernel(6e-3, unit="tensor", flops=180_000_000, bytes_moved=3_000_000, peak=30e9)
    answer = diagnose(close, 10e-3, _machine(fixed_spec)).answers[0]
    assert answer.answer.startswith("cannot tell: priced on 30 GFLOP/s, only 1.5x the fp32")
    assert not answer.explains
    # a file whose fp32 vector line is derived (approximate) has no measured line to compare
    derived = replace(
        fixed_spec, vector_flops_per_s={"fp32": Figure(20e9, "1/4 of something", True)}
    )
    gemm = _kernel(
        1.8e8 / 0.17e12, unit="tensor", flops=180_000_000, bytes_moved=3_000_000, peak=0.17e12
    )
    answer = diagnose(gemm, 10e-3, _machine(derived)).answers[0]
    assert answer.answer.startswith("not measured: 18 GFLOP/s measured")
    assert not answer.known and not answer.explains


def test_a_kernel_at_stream_bandwidth_is_saturated_and_the_gap_is_the_spec(fixed_spec):
    # priced on a datasheet's 100 GB/s: 100 MB in 1 ms; measured 4 ms is 25 GB/s, 82.5% of
    # STREAM triad's 30.3 GB/s measured on the machine (>= 80%): saturated
    datasheet = replace(fixed_spec, hbm_bytes_per_s=Figure(100e9, "a datasheet"))
    copy = _kernel(1e-3, bytes_moved=100_000_000)
    diagnosis = diagnose(copy, 4e-3, _machine(datasheet))
    assert diagnosis.ratio == pytest.approx(0.25)
    assert diagnosis.explained_by == 1 and diagnosis.label == "HBM saturated"
    assert diagnosis.answers[1].answer == (
        "yes: Q/t = 25 GB/s is 83% of STREAM triad (30.3 GB/s), 25% of the spec's 100 GB/s: "
        "the gap is the spec's bandwidth over STREAM's, not the kernel"
    )
    # measured 5 ms: 20 GB/s is 66% of STREAM, not saturated
    assert not diagnose(copy, 5e-3, _machine(datasheet)).answers[1].explains
    # against the spec alone (nothing measured) the question is not answered
    bare = diagnose(copy, 4e-3, MachineFigures(datasheet))
    assert not bare.answers[1].known and not bare.answers[1].explains


def test_too_little_in_flight_is_asked_before_the_size(fixed_spec):
    # with a 1 us latency the machine needs 30.3 GB/s x 1 us = 30,300 B in flight; a kernel
    # keeping 3,030 B in flight moves its 30,300 B at C / latency in 30,300 x 1 us / 3,030 =
    # 10 us >= 0.8 x 11 us measured
    spec = replace(fixed_spec, memory_latency_s=Figure(1e-6, "test"))
    shallow = _kernel(1e-6, bytes_moved=30_300, in_flight_bytes=3_030)
    diagnosis = diagnose(shallow, 11e-6, _machine(spec, launch_s=10e-6))
    # the size would explain it too (1 + 10 = 11 us), but it is asked after
    assert diagnosis.answers[3].explains
    assert diagnosis.explained_by == 2 and diagnosis.label == "too little in flight"
    assert diagnosis.asked == diagnosis.answers[:3]
    assert "3.03 KB in flight < beta x latency" in diagnosis.answers[2].answer


def test_measured_bytes_answer_the_reuse_question(fixed_spec):
    # 1 MB analytic, 33 us at 30.3 GB/s; measured 150 us. Counters measured 4 MB: at
    # 30.3 GB/s they take 132 us >= 0.8 x 150 us = 120 us: re-reads
    reread = _kernel(1e6 / 30.3e9, bytes_moved=1_000_000)
    diagnosis = diagnose(reread, 150e-6, _machine(fixed_spec), measured_bytes=4e6)
    assert diagnosis.explained_by == 4 and diagnosis.label == "re-reads"
    assert "measured Q 4 MB = 4.00x the analytic 1 MB" in diagnosis.answers[4].answer
    # without counters it is never guessed
    assert diagnose(reread, 150e-6, _machine(fixed_spec)).answers[4].answer == NEEDS_COUNTERS


def test_a_badly_quantised_grid_explains_its_gap(fixed_spec):
    # a GEMM of 1.7e8 FLOPs at 0.17 TFLOP/s: W/pi = 1 ms; measured 2 ms (85 GFLOP/s, above
    # the vector line; 4 MB / 2 ms = 2 GB/s, 7% of STREAM; 1 ms is not small). Two waves
    # 53% busy stretch it to 1 / 0.53 = 1.89 ms >= 0.8 x 2 ms
    gemm = _kernel(
        1e-3,
        unit="tensor",
        flops=170_000_000,
        bytes_moved=4_000_000,
        peak=0.17e12,
        waves=2,
        wave_efficiency=0.53,
    )
    diagnosis = diagnose(gemm, 2e-3, _machine(fixed_spec))
    assert diagnosis.ratio == pytest.approx(0.5)
    assert [a.explains for a in diagnosis.answers] == [False] * 5 + [True]
    assert diagnosis.label == "wave quantisation"
    assert diagnosis.answers[5].answer == (
        "yes: 2 waves of 256x128 tiles, 53% busy: W/pi 1.00 ms stretches to 1.89 ms, 94% of "
        "the measured 2.00 ms"
    )
    # 90% busy is not flagged
    even = diagnose(replace(gemm, wave_efficiency=0.9), 2e-3, _machine(fixed_spec))
    assert even.answers[5].answer == "no: 2 waves of 256x128 tiles, 90% busy"
    assert even.label == "unexplained"


def test_the_ratio_is_the_median_over_repeats_with_its_spread():
    assert Spread.of([0.5, 0.8, 0.6]) == Spread(0.6, 0.5, 0.8)
    assert str(Spread.of([0.5, 0.8, 0.6])) == "0.60 (0.50..0.80)"
    assert Spread.of([0.2, 0.4, 0.5, 0.9]).median == pytest.approx(0.45)  # (0.4 + 0.5) / 2
    repeats = [
        Repeat(0.100, {"roofline": 0.06, "realistic": 0.08}),
        Repeat(0.200, {"roofline": 0.05, "realistic": 0.09}),
        Repeat(0.125, {"roofline": 0.04, "realistic": 0.10}),
    ]
    result = Validation("m", "prefill", "cpu", "cpu-measured", "roofline", [], [], repeats)
    # roofline: 0.06/0.1 = 0.6, 0.05/0.2 = 0.25, 0.04/0.125 = 0.32 -> median 0.32
    assert result.ratio("roofline").to_dict() == pytest.approx(
        {"median": 0.32, "low": 0.25, "high": 0.6}
    )
    # realistic: 0.8, 0.45, 0.8 -> median 0.8
    assert result.ratio("realistic").to_dict() == pytest.approx(
        {"median": 0.8, "low": 0.45, "high": 0.8}
    )
    # the headline is the median of the ratios, not the ratio of the medians (0.05 / 0.125)
    assert result.total_ratio == pytest.approx(0.32)
    assert (result.predicted_total_s, result.measured_total_s) == (0.05, 0.125)


def test_each_repeat_calibrates_then_times_the_step():
    calls = []

    def calibrate_once():
        calls.append("calibrate")
        return len(calls)

    def time_step():
        calls.append("step")
        return len(calls)

    runs = interleave(3, calibrate_once, time_step)
    assert calls == ["calibrate", "step"] * 3
    assert runs == [(1, 2), (3, 4), (5, 6)]


def test_validate_predicts_each_repeat_with_its_own_calibration(monkeypatch):
    # matmul rates 100x apart, so the repeats' ratios keep their order whatever the
    # measured times (never 100x apart for the same step)
    rates = iter([1e14, 1e12, 1e16])
    asked = []

    def short_calibration(device, **sizes):
        asked.append((device, sizes))
        return replace(MATMUL_ONLY, matmul_flops_per_s={"fp32": next(rates)})

    monkeypatch.setattr("torchroof.validation.validate.calibrate", short_calibration)
    result = validate(
        "llama-3-8b",
        "prefill",
        seq=64,
        overrides=TINY_OVERRIDES,
        warmup=1,
        iterations=1,
        repeats=3,
    )
    assert asked == [("cpu", SHORT_CALIBRATION["cpu"])] * 3  # once per repeat, short
    # the prefill's matmul and attention FLOPs at each repeat's own matmul rate
    predicted = [r.predicted_s["roofline"] for r in result.repeats]
    assert predicted == pytest.approx(
        [PREFILL_FLOPS / 1e14, PREFILL_FLOPS / 1e12, PREFILL_FLOPS / 1e16], rel=1e-12
    )
    ratios = [r.predicted_s["roofline"] / r.measured_s for r in result.repeats]
    assert result.ratio("roofline") == Spread.of(ratios)
    assert all(r.predicted_s["realistic"] >= r.predicted_s["roofline"] for r in result.repeats)
    assert [r.calibration.matmul_flops_per_s["fp32"] for r in result.repeats] == [1e14, 1e12, 1e16]
    # the kernel table is the median repeat's: ratios ordered by rate, repeat 2 (1e16) lowest,
    # repeat 0 (1e14) next, repeat 1 (1e12) highest, so the median is repeat 0
    assert result.settings["median_repeat"] == 0
    assert all(k.diagnosis is not None for k in result.kernels if k.measured_s)


def test_profiler_names_map_to_recorded_ops():
    assert normalise("aten::mm") == normalise("aten.mm.default") == "mm"
    assert normalise("aten::_scaled_dot_product_flash_attention_for_cpu") == "sdpa"
    assert normalise("aten._scaled_dot_product_flash_attention_backward.default") == "sdpa_backward"

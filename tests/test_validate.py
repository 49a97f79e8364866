"""Calibration files and predicted-vs-measured validation (issue: fidelity; seed 000
"Performance diagnosis").

Only deterministic facts are asserted here: what a calibration writes and reads back, the
prediction ``validate`` makes for a fixed calibration (exactly, from the step's FLOPs), how
measured kernels are mapped to predicted ones by name, and the diagnosis rules. Measured
times are never asserted: a shared machine moves them by tens of percent. The measurement
itself (calibrate this CPU, run the steps, print predicted / measured and the ratios) is
``python examples/benchmark_validate_cpu.py``.
"""

import json
import sys
from dataclasses import replace

import pytest
from torchroof.hardware import get

from torchroof import KernelEstimate
from torchroof.calibrate import Calibration, calibrate
from torchroof.validate import TINY_OVERRIDES, diagnose, normalise, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The README's 2-core CPU, rounded: copy 23.6 GB/s, triad 30.3 GB/s, fp32 matmul 0.17
# TFLOP/s, 1 us per op.
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
    # the SFU rate is the seed's 1/4 of elementwise, marked approximate
    assert spec.sfu_flops_per_s.value == 5e9 and spec.sfu_flops_per_s.approximate
    assert spec.hbm_capacity_bytes.value == 16 * 2**30
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    assert data["source"] == "measured"
    assert data["measured"] == {
        "copy_bytes_per_s": 23.6e9,
        "triad_bytes_per_s": 30.3e9,
        "launch_overhead_s": 1e-6,
        "device": "cpu",
        "date": "2025-01-01",
        "torch_version": "2.13.0",
    }


def test_a_real_calibration_has_every_figure_a_spec_needs(tmp_path):
    # tiny sizes: the figures are not checked (they are timings), only that every one is
    # measured and the file they make is read back to its 6 written digits
    result = calibrate("cpu", stream_bytes=4 * 2**20, matmul_sizes=(64,))
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
# cache, sized context + warmup + iterations + 1 = 64 + 1 + 1 + 1 = 67 tokens, with a
# mask, not causal: 2 layers · 2·4 heads·67·(64 + 64)
DECODE_FLOPS = 2 * LINEAR_PARAMS + 2 * 256 * 4096 + 2 * 2 * 4 * 67 * 128
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
    assert (PREFILL_FLOPS, DECODE_FLOPS) == (207_683_584, 5_380_096)
    assert TRAIN_FLOPS == 1_021_542_400
    result = validate(
        "llama-3-8b",
        regime,
        hardware=_write(MATMUL_ONLY, tmp_path, "matmul-only"),
        seq=64,
        overrides=TINY_OVERRIDES,
        warmup=1,  # the traced and profiled steps are steady state (AdamW state exists)
        iterations=1,
        launch_overhead_s=1e-6,
    )
    # the prediction prices the very step that was run: its matmul and attention FLOPs at
    # 1 TFLOP/s, plus 1 us of launch overhead per eager kernel
    kernels = len(result.kernels)
    assert result.predicted_total_s == pytest.approx(
        tensor_flops / 1e12 + kernels * 1e-6, rel=1e-12
    )
    assert result.total_ratio == result.predicted_total_s / result.measured_total_s
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


def _kernel(bound: str, time_s: float) -> KernelEstimate:
    return KernelEstimate(
        index=0,
        name="aten.mm.default",
        ops=("aten.mm.default",),
        module="m",
        phase="forward",
        flops=1,
        bytes_read=1,
        bytes_written=1,
        unit="tensor",
        dtype="float32",
        counted=True,
        peak_flops_per_s=1.0,
        compute_s=time_s,
        memory_s=time_s,
        time_s=time_s,
        bound=bound,
    )


def test_diagnosis_follows_the_seeds_questions():
    # within 3x of the roof: nothing to say
    assert diagnose(_kernel("compute", 1e-3), 2.9e-3, 1e-6) == ""
    # 3x+ below and tiny: the launch dominates (asked first, it is the cheapest check)
    assert diagnose(_kernel("memory", 2e-6), 1e-5, 1e-6).startswith("too small")
    assert diagnose(_kernel("compute", 1e-3), 1e-2, 1e-6).startswith("below the compute roof")
    assert diagnose(_kernel("memory", 1e-3), 1e-2, 1e-6).startswith("below the bandwidth roof")


def test_profiler_names_map_to_recorded_ops():
    assert normalise("aten::mm") == normalise("aten.mm.default") == "mm"
    assert normalise("aten::_scaled_dot_product_flash_attention_for_cpu") == "sdpa"
    assert normalise("aten._scaled_dot_product_flash_attention_backward.default") == "sdpa_backward"

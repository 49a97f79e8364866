"""Calibration and predicted-vs-measured validation on this machine's CPU (issue: fidelity).

Timings are noisy on a shared machine, so the tests assert plausibility and coverage, not
speed: every figure positive and within physical bounds, and every measured kernel that
matters mapped to a predicted one.
"""

import json

import pytest
from torchroof.hardware import get

from torchroof.calibrate import calibrate
from torchroof.report import KernelEstimate
from torchroof.validate import TINY_OVERRIDES, diagnose, normalise, validate


@pytest.fixture(scope="module")
def cpu_toml(tmp_path_factory):
    result = calibrate("cpu", stream_bytes=128 * 2**20, matmul_sizes=(512, 1024))
    path = tmp_path_factory.mktemp("hw") / "cpu.toml"
    path.write_text(result.to_toml("cpu-measured"))
    return result, path


def test_calibration_is_positive_and_plausible(cpu_toml):
    result, path = cpu_toml
    # DRAM bandwidth of any CPU: above 0.5 GB/s and below 2 TB/s
    for bandwidth in (result.copy_bytes_per_s, result.triad_bytes_per_s):
        assert 0.5e9 < bandwidth < 2e12
    # fp32 matmul: at least 1 GFLOP/s, below 100 TFLOP/s
    assert 1e9 < result.matmul_flops_per_s["fp32"] < 1e14
    assert 1e8 < result.vector_flops_per_s < 1e14
    # one tiny op costs between 50 ns and 1 ms
    assert 5e-8 < result.launch_overhead_s < 1e-3
    text = path.read_text()
    assert 'source = "measured"' in text and result.torch_version in text and result.date in text
    spec = get(str(path))  # every other command accepts the file
    assert spec.name == "cpu-measured"
    best = max(result.copy_bytes_per_s, result.triad_bytes_per_s)
    assert spec.hbm_bytes_per_s.value == pytest.approx(best, rel=1e-5)  # 6 digits in the file
    # the measured fp32 matmul rate prices fp32 matmuls on this device
    assert spec.tensor_peak("float32") == pytest.approx(result.matmul_flops_per_s["fp32"], rel=1e-5)


@pytest.mark.parametrize("regime", ["prefill", "decode", "train"])
def test_validate_a_small_transformer_on_cpu(regime, cpu_toml, tmp_path):
    _, path = cpu_toml
    result = validate(
        "llama-3-8b",
        regime,
        hardware=str(path),
        seq=64,
        overrides=TINY_OVERRIDES,
        warmup=1,
        iterations=3,  # a median of three: one step slowed by a busy machine does not count
    )
    assert result.measured_total_s > 0 and result.predicted_total_s > 0
    assert 0.01 < result.total_ratio < 100
    # every measured kernel above 1% of the measured kernel time is mapped to a prediction
    threshold = 0.01 * (result.matched_measured_s + sum(t for _, t in result.unmatched_measured))
    assert [m for m in result.unmatched_measured if m[1] > threshold] == []
    assert sum(1 for k in result.kernels if k.measured_s) > 0.8 * len(result.kernels)
    out = tmp_path / "validation.json"
    result.to_json(out)
    data = json.loads(out.read_text())
    assert data["total_ratio"] == pytest.approx(result.total_ratio)
    assert {"layers", "kernels", "predicted_total_s", "measured_total_s"} <= set(data)


def _kernel(bound: str, time_s: float) -> KernelEstimate:
    return KernelEstimate(
        0,
        "aten.mm.default",
        ("aten.mm.default",),
        "m",
        "forward",
        1,
        1,
        1,
        "tensor",
        "float32",
        True,
        1.0,
        time_s,
        time_s,
        time_s,
        bound,
    )


def test_diagnosis_follows_the_seeds_questions():
    # close to the roof: nothing to say
    assert diagnose(_kernel("compute", 1e-3), 2e-3, 1e-6) == ""
    # 3x+ below and tiny: the launch dominates (asked first, it is the cheapest check)
    assert diagnose(_kernel("memory", 2e-6), 1e-5, 1e-6).startswith("too small")
    assert diagnose(_kernel("compute", 1e-3), 1e-2, 1e-6).startswith("below the compute roof")
    assert diagnose(_kernel("memory", 1e-3), 1e-2, 1e-6).startswith("below the bandwidth roof")


def test_profiler_names_map_to_recorded_ops():
    assert normalise("aten::mm") == normalise("aten.mm.default") == "mm"
    assert normalise("aten::_scaled_dot_product_flash_attention_for_cpu") == "sdpa"
    assert normalise("aten._scaled_dot_product_flash_attention_backward.default") == "sdpa_backward"

"""torchroof.sensitivity: the step priced again with each figure 10% lower and higher, the
moves derived by hand on steps bound by one figure, the links of a cluster, the capped
fractions, the routing imbalance of sharded experts, and the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import small_llama
from torchroof.hardware import get
from transformers import MixtralConfig

import torchroof
from torchroof.cli.main import main as cli_main
from torchroof.report.estimate import Estimate
from torchroof.sensitivity import sensitivity


def _traced(work) -> torchroof.Trace:
    with torchroof.trace() as t:
        work()
    return t


@pytest.fixture(scope="module")
def streaming():
    """c = a + b over 2^26 fp32 elements: 3 x 256 MiB of HBM traffic, 2^26 FLOPs; on an
    H100 SXM (3.35 TB/s, 66.9 TFLOP/s fp32) it is memory-bound by a factor of ~300."""
    a = torch.empty(2**26, device="meta")
    return _traced(lambda: a + a)


@pytest.fixture(scope="module")
def gemm():
    """An 8192^3 bf16 matmul: 2 x 8192^3 = 1.1 TFLOP over 3 x 128 MiB, 2,731 FLOP/B, far
    above the H100's ridge of 295: compute-bound."""
    x = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
    return _traced(lambda: x @ x)


def by_name(result):
    return {c.name: c for c in result.changes}


def test_a_memory_bound_step_moves_with_hbm_alone(streaming):
    """T = Q / beta: beta 10% lower gives T / 0.9 (+11.1%), 10% higher T / 1.1 (-9.1%); the
    tensor peak, the launch and the latency (the pure roofline reads neither) move
    nothing."""
    result = sensitivity(streaming, "h100-sxm")
    hbm = by_name(result)["HBM bandwidth"]
    assert hbm.lower_s == pytest.approx(result.base_s / 0.9)
    assert hbm.higher_s == pytest.approx(result.base_s / 1.1)
    assert result.changes[0].name == "HBM bandwidth"
    for name in ("tensor peak (every dtype)", "launch overhead per kernel", "HBM latency"):
        change = by_name(result)[name]
        assert change.lower_s == change.higher_s == pytest.approx(result.base_s), name
    assert "it rests most on HBM bandwidth (11.1%)" in result.lines()[0]


def test_a_compute_bound_step_moves_with_the_tensor_peak(gemm):
    """T = W / pi: the tensor peak 10% lower gives T / 0.9, 10% higher T / 1.1."""
    result = sensitivity(gemm, "h100-sxm")
    peak = by_name(result)["tensor peak (every dtype)"]
    assert peak.lower_s == pytest.approx(result.base_s / 0.9)
    assert peak.higher_s == pytest.approx(result.base_s / 1.1)
    assert by_name(result)["HBM bandwidth"].moves(result.base_s) == 0


def test_a_raised_fraction_is_capped_at_one(streaming):
    """An accelerator whose STREAM-like bandwidth is 0.95 of its peak: raised 10% it would
    pass the peak (1.045), so it stops at 1; the memory-bound step then takes 0.95 of its
    time at 0.95, lowered 10% (0.855) it takes 0.95 / 0.855 = 1.111 of it."""
    spec = get("h100-sxm")
    fraction = replace(spec.achievable_hbm_fraction, value=0.95)
    spec = replace(spec, achievable_hbm_fraction=fraction, launch_overhead_s=None)
    result = sensitivity(streaming, spec, mode="realistic", launch=False, latency_shelf=False)
    change = by_name(result)["achievable HBM fraction"]
    assert change.note == "capped at 1 when raised"
    assert change.higher_s == pytest.approx(result.base_s * 0.95)
    assert change.lower_s == pytest.approx(result.base_s / 0.9)
    assert "launch overhead per kernel" not in by_name(result)  # a figure the file lacks


def test_a_cluster_step_lists_its_links_and_their_latency_moves_it():
    """FSDP over 4 GPUs of a DGX H100 gathers and reduce-scatters over NVLink: its alpha
    (per collective) and bandwidth are listed, and moving alpha moves the step; the
    network's figures move nothing on one node."""
    trace = torchroof.trace_model(small_llama(2), "train", batch=2, seq=512, fsdp=4)
    result = sensitivity(trace, "dgx-h100")
    names = by_name(result)
    alpha = names["nvlink latency (alpha)"]
    assert alpha.lower_s < result.base_s < alpha.higher_s
    assert names["network bandwidth"].moves(result.base_s) == 0
    assert "MoE routing imbalance" not in names


def test_nvlink_bandwidth_moves_a_tensor_parallel_step_through_nvlink_sharp():
    """A TP 2 prefill on a DGX H100 all-reduces inside the node on NVLink SHARP (its own bus
    bandwidth, 480 GB/s): the link's bandwidth knob moves that rate with the line rate."""
    trace = torchroof.trace_model(small_llama(2), "prefill", batch=4, seq=1024, tp=2)
    result = sensitivity(trace, "dgx-h100")
    nvlink = by_name(result)["nvlink bandwidth"]
    assert nvlink.lower_s > result.base_s > nvlink.higher_s


def test_sharded_experts_get_the_routing_imbalance_raised_only():
    config = MixtralConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=1000,
    )  # fmt: skip
    trace = torchroof.trace_model(config, "train", batch=2, seq=256, ep=2, fsdp=2)
    routing = by_name(sensitivity(trace, "dgx-h100"))["MoE routing imbalance"]
    assert routing.lower_s is None and routing.note.startswith("balanced is its floor")
    unsharded = torchroof.trace_model(config, "prefill", batch=2, seq=256)
    assert "MoE routing imbalance" not in by_name(sensitivity(unsharded, "h100-sxm"))


def test_a_step_outside_zero_and_one_is_refused(streaming):
    for step in (0, 1, -0.1, True):
        with pytest.raises(ValueError, match="between 0 and 1"):
            sensitivity(streaming, "h100-sxm", step=step)


def test_the_command_line_prints_the_table_and_the_json_holds_it(capsys, tmp_path):
    path = tmp_path / "est.json"
    step = ["gpt2", "--regime", "decode", "--batch", "2", "--seq", "64", "--kernels", "0"]
    code = cli_main(["estimate", *step, "--sensitivity", "--json", str(path), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "sensitivity: the step time" in out and "it rests most on" in out
    assert "HBM bandwidth" in out and "10% lower: step" in out
    data = json.loads(path.read_text())
    est = Estimate.from_json(path)  # the estimate still reads back, the table beside it
    assert data["sensitivity"]["base_s"] == pytest.approx(est.time_s)
    hbm = next(c for c in data["sensitivity"]["changes"] if c["name"] == "HBM bandwidth")
    assert hbm["lower_s"] > est.time_s > hbm["higher_s"]


def test_under_a_runtime_the_devices_eager_launch_is_moved_and_the_file_launch_is_not():
    """A two-layer Llama decoding 4 sequences under --runtime eager on an H100 file that
    lists eager_launch_s 6 us (launch_overhead_s 2 us): every kernel launches eagerly at
    6 us, so 10% either way moves the step by 0.6 us per kernel each way, 1.2 us x the
    kernels from lowest to highest (one stream: launches add), and the file's launch
    overhead moves nothing, saying why."""
    trace = torchroof.trace_model(small_llama(2), "decode", batch=4, seq=128)
    from torchroof.hardware.toml_checks import Figure

    spec = replace(get("h100-sxm"), eager_launch_s=Figure(6e-6, "measured here"))
    kernels = len(torchroof.estimate_trace(trace, spec, mode="realistic", runtime="eager").kernels)
    result = by_name(sensitivity(trace, spec, mode="realistic", runtime="eager"))
    eager = result["eager launch per kernel (this device's)"]
    assert eager.higher_s - eager.lower_s == pytest.approx(1.2e-6 * kernels, rel=1e-9)
    overhead = result["launch overhead per kernel"]
    assert overhead.lower_s == overhead.higher_s
    assert overhead.note == "a runtime's launch applies (or the file's eager launch)"

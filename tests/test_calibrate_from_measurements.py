"""``torchroof calibrate --from-profile`` and ``--from-nccl-tests``: files rewritten figure by
figure, nccl-tests logs made here with a known alpha and bus bandwidth fitted back, profiles
made here from known launch times and fractions fitted back (Chrome trace on CPU and GPU,
CSV), and a profile of a real step run on this CPU making a file that predicts it."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import small_llama
from torchroof.hardware import get
from torchroof.hardware.cluster import get_cluster

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from torchroof.hardware.toml_checks import Figure
from transformers import LlamaConfig, LlamaForCausalLM

import torchroof
from torchroof.cli.main import main as cli_main
from torchroof.timing.network import collective_time
from torchroof.validation.calibrated_files import Fitted, rewrite
from torchroof.validation.nccl_tests import NcclTestsError, fit, parse
from torchroof.validation.profile_files import device_idle, profiled_ops
from torchroof.validation.profile_fit import (
    calibrated_accelerator,
    fit_profile,
    kernel_timer,
    with_figures,
)
from torchroof.validation.profiling import align, normalise

# -- files ----------------------------------------------------------------------------------


def test_a_file_is_rewritten_figure_by_figure():
    text = (
        '# a part\nname = "x"\ndisplay_name = "X"\naliases = ["y"]\n'
        'launch_overhead_s = { value = 2e-06, source = "typical" }\n\n'
        '[intra_node]\nkind = "nvlink"\nlatency_s = { value = 1e-05, source = "old" }\n'
    )
    out = rewrite(
        text,
        "x-calibrated",
        "X (calibrated)",
        {
            ("", "launch_overhead_s"): Fitted(3e-6, "fitted"),
            ("", "achievable_hbm_fraction"): Fitted(0.9, "fitted"),  # not in the file: added
            ("intra_node", "latency_s"): Fitted(2e-5, 'say "hi"'),
            ("network", "latency_s"): Fitted(4e-5, "fitted"),  # a table the file lacks
        },
    )
    data = tomllib.loads(out)
    assert data["name"] == "x-calibrated" and data["aliases"] == []
    assert data["launch_overhead_s"] == {"value": 3e-6, "source": "fitted"}
    assert data["achievable_hbm_fraction"]["value"] == 0.9
    assert data["intra_node"]["latency_s"] == {"value": 2e-5, "source": 'say "hi"'}
    assert data["intra_node"]["kind"] == "nvlink" and data["network"]["latency_s"]["value"] == 4e-5
    assert out.startswith("# a part\n")  # comments and untouched lines kept


# -- nccl-tests -----------------------------------------------------------------------------


def cluster_with(name, slot, fraction, alpha):
    """A shipped cluster with one link's achieved fraction and latency set."""
    cluster = get_cluster(name)
    link = getattr(cluster, slot)
    link = replace(
        link, achieved_fraction=Figure(fraction, "test"), latency_s=Figure(alpha, "test")
    )
    return replace(cluster, **{slot: link})


def nccl_log(collective, hosts, cluster, sizes=None, extra=""):
    """An nccl-tests log as nccl-tests prints it, each row's out-of-place time torchroof's
    own price of the collective on ``cluster`` (the in-place one 1% slower); ``extra``
    appends columns to the header and every row (a run with more columns)."""
    per_node = len(hosts) // len(set(hosts))
    ranks = [n * cluster.gpus_per_node + j for n in range(len(set(hosts))) for j in range(per_node)]
    kind = "all_to_all" if collective == "alltoall" else collective
    lines = ["# nThread 1 nGpus 1 minBytes 8 maxBytes 2147483648 step: 4(factor) warmup iters: 5",
             "#", "# Using devices"]  # fmt: skip
    for rank, host in enumerate(hosts):
        lines.append(f"#  Rank {rank:2d} Group  0 Pid {1000 + rank} on {host} device "
                     f"{rank % 8} [0x1b] NVIDIA H100 80GB HBM3")  # fmt: skip
    lines += [
        "#                                                    out-of-place          in-place",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong" + (" " + extra if extra else ""),
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)      "
        "      (us)  (GB/s)  (GB/s)",
    ]
    for size in sizes or [8 * 4**i for i in range(15)]:  # 8 B ... 2 GiB
        us = collective_time(kind, size, ranks, cluster).time_s * 1e6
        algbw = size / us / 1e3
        lines.append(
            f"{size:12d} {size // 4:13d}     float     sum      -1 {us:8.2f} {algbw:7.2f} "
            f"{algbw:7.2f}    N/A {us * 1.01:8.2f} {algbw:7.2f} {algbw:7.2f}    N/A"
            + (" 2026-12-06 10:00:00" if extra else "")
        )
    lines += ["# Out of bounds values : 0 OK", f"# Collective test concluded: {collective}_perf"]
    return "\n".join(lines) + "\n"


def test_the_made_log_is_torchroofs_model_by_hand():
    """8 GPUs of a DGX H100, all_gather of S = 1 GiB at fraction 0.8 and alpha 20 us: every
    rank sends 7/8 S over NVLink at 0.8 x 450 GB/s, 20 us + 939,524,096 / 360e9 = 2,629.8 us."""
    log = nccl_log("all_gather", ["h"] * 8, cluster_with("dgx-h100", "intra_node", 0.8, 20e-6),
                   sizes=[8, 1 << 30])  # fmt: skip
    assert parse(log).rows[1].time_s == pytest.approx(20e-6 + 7 / 8 * 2**30 / 360e9, abs=1e-8)


def test_an_all_gather_inside_a_node_gives_back_its_alpha_and_fraction():
    """Times printed to 0.01 us: the fit recovers alpha and the fraction within 0.1%."""
    made = cluster_with("dgx-h100", "intra_node", 0.8, 20e-6)
    found = fit(parse(nccl_log("all_gather", ["node1"] * 8, made)), get_cluster("dgx-h100"))
    assert found.link == "intra_node" and found.figure == "achieved_fraction"
    assert found.alpha_s == pytest.approx(20e-6, rel=1e-3)
    assert found.value == pytest.approx(0.8, rel=1e-3)
    assert found.beta_bytes_per_s == pytest.approx(360e9, rel=1e-3)
    assert found.worst_error < 1e-3


def test_half_of_a_full_mesh_node_fits_the_links_own_fraction():
    """4 of the 8 MI300X of an ND MI300X v5 node use 3 of each GPU's 7 xGMI links: the log
    runs at 3/7 of the node's bus bandwidth, and the fit gives back the link's 0.75."""
    made = cluster_with("nd-mi300x-v5", "intra_node", 0.75, 30e-6)
    found = fit(parse(nccl_log("all_gather", ["h"] * 4, made)), get_cluster("nd-mi300x-v5"))
    assert found.value == pytest.approx(0.75, rel=1e-3)


def test_a_run_over_nodes_fits_the_network_where_it_is_the_slower_phase(tmp_path, capsys):
    """2 hosts x 8 GPUs, all_reduce, a network at 0.5 of 50 GB/s and 50 us: the network phase
    carries 2 (2 - 1) / 2 x S / 8 per GPU at 25 GB/s, slower than NVLink's 2 x 7/8 x S at
    370 GB/s, so the log measures it. The file written has its latency and fraction, the
    intra-node figures as they were, and names the accelerator by its shipped name."""
    made = cluster_with("dgx-h100", "network", 0.5, 50e-6)
    path = tmp_path / "ar.log"
    path.write_text(nccl_log("all_reduce", ["a"] * 8 + ["b"] * 8, made))
    out = tmp_path / "cluster.toml"
    code = cli_main(["calibrate", "--from-nccl-tests", str(path), "--hardware", "dgx-h100",
                     "-o", str(out), "--quiet"])  # fmt: skip
    assert code == 0
    assert "all_reduce_perf on 16 GPUs over 2 nodes" in capsys.readouterr().out
    cluster, shipped = get_cluster(str(out)), get_cluster("dgx-h100")
    assert cluster.name == "dgx-h100-calibrated" and cluster.accelerator.name == "h100-sxm"
    assert cluster.network.latency_s.value == pytest.approx(50e-6, rel=1e-3)
    assert cluster.network.achieved_fraction.value == pytest.approx(0.5, rel=1e-3)
    assert cluster.intra_node == shipped.intra_node
    # HSDP over the two nodes: the replicas (ranks 0 and 8) all-reduce over the network
    trace = torchroof.trace_model(small_llama(2), "train", batch=2, seq=256, fsdp=8, dp=2)
    slow = torchroof.estimate_trace(trace, out).communication().by_link_s
    fast = torchroof.estimate_trace(trace, "dgx-h100").communication().by_link_s
    assert slow["network"] > fast["network"] > 0


def test_the_written_cluster_names_the_accelerator_asked_for(tmp_path):
    """--accelerator by a shipped name stays a name; by a file, its absolute path (so the
    cluster loads from wherever it is written)."""
    made = cluster_with("dgx-h100", "intra_node", 0.8, 20e-6)
    log = tmp_path / "ag.log"
    log.write_text(nccl_log("all_gather", ["h"] * 8, made))
    out = tmp_path / "named.toml"
    args = ["calibrate", "--from-nccl-tests", str(log), "--hardware", "dgx-h100", "--quiet"]
    assert cli_main([*args, "--accelerator", "h200-sxm", "-o", str(out)]) == 0
    assert get_cluster(str(out)).accelerator.name == "h200-sxm"
    assert 'accelerator = "h200-sxm"' in out.read_text()
    mine = tmp_path / "parts" / "my-h100.toml"  # an accelerator file of the user's
    mine.parent.mkdir()
    mine.write_text(Path(get("h100-sxm").path).read_text().replace('"h100-sxm"', '"my-h100"'))
    elsewhere = tmp_path / "out" / "cluster.toml"
    elsewhere.parent.mkdir()
    assert cli_main([*args, "--accelerator", str(mine), "-o", str(elsewhere)]) == 0
    assert f'accelerator = "{mine.resolve()}"' in elsewhere.read_text()
    assert get_cluster(str(elsewhere)).accelerator.name == "my-h100"


def test_a_run_over_nodes_bound_by_nvlink_cannot_measure_the_network():
    """The shipped DGX H100: per GPU the network carries S / 8 at 47 GB/s (2.66 ps per
    byte of S), NVLink 7/4 S at 370 GB/s (4.73 ps): NVLink binds at every size."""
    log = parse(nccl_log("all_reduce", ["a"] * 8 + ["b"] * 8, get_cluster("dgx-h100")))
    with pytest.raises(NcclTestsError, match="cannot measure the network"):
        fit(log, get_cluster("dgx-h100"))


def test_extra_columns_leave_the_time_column_where_the_header_says():
    made = cluster_with("dgx-h100", "intra_node", 0.8, 20e-6)
    text = nccl_log("all_gather", ["h"] * 8, made, extra="timestamp")
    assert fit(parse(text), get_cluster("dgx-h100")).value == pytest.approx(0.8, rel=1e-3)


def test_an_in_node_all_reduce_fits_nvlink_sharp_where_the_cluster_lists_it():
    shipped = get_cluster("dgx-h100")
    made = replace(shipped, intra_node=replace(
        shipped.intra_node, nvls_all_reduce_bus_bytes_per_s=Figure(450e9, "test")))  # fmt: skip
    found = fit(parse(nccl_log("all_reduce", ["h"] * 8, made)), shipped)
    assert found.figure == "nvls_all_reduce_bus_bytes_per_s"
    assert found.beta_bytes_per_s == pytest.approx(450e9, rel=1e-3)
    too_fast = parse(nccl_log("all_reduce", ["h"] * 8, shipped))  # NVLS's 480 GB/s
    with pytest.raises(NcclTestsError, match="exceeds .* line rate"):
        fit(too_fast, get_cluster("dgx-a100"))  # over NVLink 3's 300 GB/s: no NVLS there


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: "nothing here\n", "does not name its test"),
        (lambda t: t.replace("#  Rank", "# Dev"), "no '#  Rank"),
        (lambda t: t.replace("all_gather_perf", "sendrecv_perf"), "torchroof fits"),
        (lambda t: t.replace("size         count", "bytes   elements"), "no column header"),
    ],
)
def test_a_log_that_cannot_be_fitted_says_why(edit, message):
    made = cluster_with("dgx-h100", "intra_node", 0.8, 20e-6)
    with pytest.raises(NcclTestsError, match=message):
        parse(edit(nccl_log("all_gather", ["h"] * 8, made)))


def test_ranks_spread_unevenly_are_refused():
    made = cluster_with("dgx-h100", "intra_node", 0.8, 20e-6)
    log = parse(nccl_log("all_gather", ["a"] * 8 + ["b"] * 8, made).replace(" on b ", " on a ", 4))
    with pytest.raises(NcclTestsError, match="unevenly"):
        fit(log, get_cluster("dgx-h100"))


# -- profiles -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def timer():
    """A two-layer Llama's eager prefill in fp32 on an H100 SXM: its kernels, planned once,
    and the function that times them with other figures."""
    trace = torchroof.trace_model(small_llama(2), "prefill", batch=2, seq=256, dtype="fp32")
    return kernel_timer(trace, get("h100-sxm"))


def op_name(kernel):
    return "aten::" + kernel.name.removeprefix("aten.").split(".")[0]


def test_the_h100s_own_times_give_back_its_own_figures(timer):
    """The profile is torchroof's realistic price of every kernel on the shipped H100 SXM
    file (launch 2 us, 0.85 of the HBM bandwidth, 0.80 of the tensor peak), exactly what an
    estimate under --runtime eager prices on that file with its launch as the eager one:
    the fit gives those three back."""
    kernels, times = timer
    spec = get("h100-sxm")
    made = times(2e-6, 0.85, 0.80)
    assert made == [k.time_s for k in torchroof.estimate_trace(
        torchroof.trace_model(small_llama(2), "prefill", batch=2, seq=256, dtype="fp32"),
        with_figures(spec, 2e-6, 0.85, 0.80), fusion="eager", mode="realistic",
        runtime="eager").kernels]  # fmt: skip
    profile = [(normalise(k.name), t) for k, t in zip(kernels, made, strict=True)]
    fitted = fit_profile(kernels, profile, times, spec)
    assert fitted.launch_s == pytest.approx(2e-6, rel=0.01)
    assert fitted.hbm_fraction == pytest.approx(0.85, rel=0.01)
    assert fitted.tensor_fraction == pytest.approx(0.80, rel=0.01)
    assert fitted.memory_kernels > 3 and fitted.tensor_kernels > 3
    # the two layers' attention is compute-bound at 2 x 256 tokens but in fp32, which
    # FlashAttention does not run: no share is fitted, and the notes say why
    assert fitted.attention_kernels == (0, 0) and fitted.attention == (None, None)
    assert any("fused attention in float32 fits no share" in note for note in fitted.notes)


LAUNCH_S, HBM, TENSOR = 4e-6, 0.3, 0.2


def test_a_cpu_chrome_trace_gives_back_the_launch_and_fractions(timer, tmp_path):
    """Ops one after another on one thread, each with a priced op inside it (aten::mul, as
    a composite op calls others: the top-most op is the kernel), times in microseconds as
    the profiler writes them, from a part with launch 4 us, 0.3 of the HBM bandwidth and
    0.2 of the tensor peak."""
    kernels, times = timer
    events, clock = [], 0.0
    for k, t in zip(kernels, times(LAUNCH_S, HBM, TENSOR), strict=True):
        dur = t * 1e6
        events.append({"ph": "X", "cat": "cpu_op", "name": op_name(k), "pid": 1, "tid": 1,
                       "ts": clock, "dur": dur})  # fmt: skip
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1,
                       "ts": clock + dur / 4, "dur": dur / 4})  # fmt: skip
        clock += dur + 1.0
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"traceEvents": events}))
    names = {normalise(k.name) for k in kernels}
    fitted = fit_profile(kernels, profiled_ops(path, names), times, get("h100-sxm"))
    assert fitted.matched == len(kernels)
    assert fitted.launch_s == pytest.approx(LAUNCH_S, rel=0.01)
    assert fitted.hbm_fraction == pytest.approx(HBM, rel=0.01)
    assert fitted.tensor_fraction == pytest.approx(TENSOR, rel=0.01)


def test_a_gpu_trace_takes_the_device_time_of_each_ops_kernels(timer, tmp_path):
    """On a GPU trace an op's CPU time is only its launch: its time is the sum of the device
    kernels that carry its External id (here split into two kernels each)."""
    kernels, times = timer
    events, clock = [], 0.0
    for n, (k, t) in enumerate(zip(kernels, times(LAUNCH_S, HBM, TENSOR), strict=True)):
        events.append({"ph": "X", "cat": "cpu_op", "name": op_name(k), "pid": 1, "tid": 1,
                       "ts": clock, "dur": 3.0, "args": {"External id": n}})  # fmt: skip
        for half in range(2):
            events.append({"ph": "X", "cat": "kernel", "name": "sm90_kernel", "pid": 0, "tid": 7,
                           "ts": clock + half, "dur": t * 1e6 / 2,
                           "args": {"External id": n}})  # fmt: skip
        clock += 10.0
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    names = {normalise(k.name) for k in kernels}
    fitted = fit_profile(kernels, profiled_ops(path, names), times, get("h100-sxm"))
    assert fitted.hbm_fraction == pytest.approx(HBM, rel=0.01)
    assert fitted.launch_s == pytest.approx(LAUNCH_S, rel=0.01)


def test_a_gpu_traces_idle_time_is_the_span_less_the_kernels_union(tmp_path):
    """On GPU 0, kernels at 0-10 us and 15-20 us on one stream and 18-30 us on another: 30
    us from the first start to the last end, busy over [0, 10] and [15, 30] (25 us), idle 5
    us (17%). GPU 1's one kernel at 100-110 us is another device's: the busiest is told
    (over both, the span would be 110 us). A CPU trace and a CSV have no device time."""
    kernels = [(0, 0, 10, 7), (0, 15, 5, 7), (0, 18, 12, 8), (1, 100, 10, 7)]
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": pid, "tid": tid, "ts": ts,
               "dur": dur} for pid, ts, dur, tid in kernels]  # fmt: skip
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    idle = device_idle(path)
    assert idle is not None
    assert idle.span_s == pytest.approx(30e-6) and idle.idle_s == pytest.approx(5e-6)
    assert "0.005 ms of the 0.030 ms from the trace's first kernel to its last (17%)" in (
        idle.line()
    )
    cpu = tmp_path / "cpu.json"
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5}
    cpu.write_text(json.dumps({"traceEvents": [op]}))
    assert device_idle(cpu) is None and device_idle(tmp_path / "ops.csv") is None


def test_a_csv_of_op_timings_fits_the_same(timer, tmp_path):
    kernels, times = timer
    path = tmp_path / "ops.csv"
    rows = [f"{op_name(k)},{t * 1e3!r}" for k, t in
            zip(kernels, times(LAUNCH_S, HBM, TENSOR), strict=True)]  # fmt: skip
    path.write_text("name,time_ms\n" + "\n".join(rows) + "\n")
    names = {normalise(k.name) for k in kernels}
    fitted = fit_profile(kernels, profiled_ops(path, names), times, get("h100-sxm"))
    assert fitted.tensor_fraction == pytest.approx(TENSOR, rel=0.01)


@pytest.fixture(scope="module")
def training_timer():
    """A three-layer Llama's eager training step in bf16 on one sequence of 4,096 tokens on
    an H100 SXM: three fused attention kernels forward and three backward, each bound by the
    tensor units (causal, 4 heads of 32: 2 x 4 x 4096^2 x 32 FLOPs forward over some 4 MB,
    about 500 FLOPs a byte, above the ridge)."""
    return kernel_timer(training_trace_of(), get("h100-sxm"))


def training_trace_of():
    return torchroof.trace_model(small_llama(3), "train", batch=1, seq=4096)


def test_a_training_profile_gives_back_the_attention_kernels_shares(training_timer, tmp_path):
    """Profiled times made with FlashAttention-2 forward at 0.45 of the tensor peak and
    backward at 0.30 (the H100 file lists 0.337 and 0.290) beside launch 4 us and 0.3 of the
    HBM bandwidth: the fit gives the shares, launch and HBM fraction back (this model's
    GEMMs, 128 wide, are bound by HBM: the tensor fraction is not fitted and the file's
    0.80 is kept), and the file it writes holds the two shares under
    [attention_tensor_fraction], where an estimate under a runtime launching
    FlashAttention-2 reads them: under --runtime eager it prices every kernel as profiled."""
    kernels, times = training_timer
    spec = get("h100-sxm")
    made = times(LAUNCH_S, HBM, 0.80, 0.45, 0.30)
    assert made != times(LAUNCH_S, HBM, 0.80)  # the shares change the attention kernels
    profile = [(normalise(k.name), t) for k, t in zip(kernels, made, strict=True)]
    fitted = fit_profile(kernels, profile, times, spec)
    assert fitted.attention_kernels == (3, 3)
    assert fitted.attention_kernel == "fa2"
    assert fitted.attention[0] == pytest.approx(0.45, rel=0.01)
    assert fitted.attention[1] == pytest.approx(0.30, rel=0.01)
    assert fitted.launch_s == pytest.approx(LAUNCH_S, rel=0.01)
    assert fitted.hbm_fraction == pytest.approx(HBM, rel=0.01)
    assert fitted.tensor_kernels < 3 and fitted.tensor_fraction is None
    assert "fused attention (fa2) backward share of the tensor peak: 0.300" in "\n".join(
        fitted.lines()
    )
    path = tmp_path / "mine.toml"
    path.write_text(calibrated_accelerator(spec, fitted, "mine", "a test"))
    mine = get(str(path))
    assert mine.attention_share("fa2", backward=False) == pytest.approx(0.45, rel=0.01)
    assert mine.attention_share("fa2", backward=True) == pytest.approx(0.30, rel=0.01)
    assert mine.attention_share("fa3", backward=False) == spec.attention_share("fa3", False)
    # estimated as the docs say, under --runtime eager on the written file, every kernel's
    # time is the profiled one (the fitted launch replaces the runtime's 2.52 us)
    est = torchroof.estimate_trace(training_trace_of(), str(path), fusion="eager",
                                   mode="realistic", runtime="eager")  # fmt: skip
    ratios = [k.time_s / t for k, t in zip(est.kernels, made, strict=True)]
    assert max(abs(r - 1) for r in ratios) < 0.02
    assert "us per kernel launched eagerly (measured on" in "\n".join(est.assumptions)


def test_a_profile_of_several_steps_says_only_the_first_matched(timer):
    kernels, times = timer
    step = [(normalise(k.name), t) for k, t in zip(kernels, times(2e-6, 0.85, 0.8), strict=True)]
    fitted = fit_profile(kernels, step * 3, times, get("h100-sxm"))
    assert any("profile one step" in note for note in fitted.notes)


def test_a_profile_of_a_real_step_on_this_cpu_makes_a_file_that_predicts_it(tmp_path, capsys):
    """A two-layer Llama's prefill run here in fp32 under torch.profiler, exported as Chrome
    JSON. The H100's own file predicts the matched kernels' total over 20x faster than this
    CPU ran them (the median kernel over 3x faster); the file fitted to the profile
    puts the median kernel within 1.5x of its measured time and the matched kernels' total
    within 10x, at least 5x nearer than the H100's (a CPU is not a GPU: the realistic mode's
    GPU effects fit it loosely, and this machine's timings vary with its load)."""
    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                         max_position_embeddings=512)  # fmt: skip
    config.save_pretrained(tmp_path / "tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 2000, (2, 128))
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(ids, use_cache=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids, use_cache=False)
    trace_path = tmp_path / "step.json"
    prof.export_chrome_trace(str(trace_path))
    out = tmp_path / "cpu.toml"
    model_path = str(tmp_path / "tiny" / "config.json")
    workload = ["--regime", "prefill", "--batch", "2", "--seq", "128", "--dtype", "fp32"]
    code = cli_main(["calibrate", "--from-profile", str(trace_path), "--model", model_path,
                     "--hardware", "h100-sxm", "-o", str(out), "--quiet", *workload])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "matched" in printed and "GPU idle" not in printed  # a CPU trace
    trace = torchroof.trace_model(model_path, "prefill", batch=2, seq=128, dtype="fp32")

    def ratios(hardware):
        """(predicted / measured over the matched kernels' total, the median kernel's)."""
        est = torchroof.estimate_trace(trace, hardware, fusion="eager", mode="realistic")
        names = {normalise(k.name) for k in est.kernels}
        times, _ = align(est.kernels, profiled_ops(trace_path, names))
        pairs = [(k.time_s, t) for k, t in zip(est.kernels, times, strict=True) if t]
        total = sum(p for p, _ in pairs) / sum(m for _, m in pairs)
        return total, statistics.median(p / m for p, m in pairs)

    shipped, fitted = ratios("h100-sxm"), ratios(str(out))
    assert shipped[0] < 0.05 and shipped[1] < 0.33
    assert 0.67 < fitted[1] < 1.5
    assert 0.1 < fitted[0] < 4.0 and fitted[0] > 5 * shipped[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-profile", "x.json", "--hardware", "h100"], "give --model"),
        (["--from-profile", "x.json", "--model", "gpt2"], "give --hardware"),
        (["--from-profile", "x.json", "--model", "gpt2", "--hardware", "dgx-h100"],
         "not a cluster"),
        (["--from-nccl-tests", "x.log", "--hardware", "h100"], "give a cluster"),
        (["--from-profile", "a", "--from-nccl-tests", "b", "--hardware", "h100"], "one"),
        (["--batch", "4"], "--batch describe the profiled step"),
        (["--hardware", "dgx-h100"], "--hardware is read only by"),
        (["--from-nccl-tests", "x.log", "--hardware", "dgx-h100", "--model", "gpt2"],
         "--model is read only by --from-profile"),
        (["--from-profile", "x.json", "--model", "gpt2", "--hardware", "h100", "--device",
          "cuda"], "--device is read only by"),
    ],
)  # fmt: skip
def test_bad_calibrate_flags_get_one_line(args, message, capsys):
    assert cli_main(["calibrate", *args, "--quiet"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_eager_launch_measured_on_the_device_replaces_a_runtimes_but_not_a_graphs():
    """A file with launch_overhead_s 2 us and eager_launch_s 4 us: without a runtime a
    kernel takes 2 us; under a runtime launching eagerly at 2.52 us (eager's figure), 4 us,
    the device's own; replayed from a CUDA graph at 0.5 us, the graph's 0.5 us."""
    from torchroof.timing.roofline import launch_of
    from torchroof.timing.runtime import StepRuntime

    spec = replace(get("h100-sxm"), eager_launch_s=Figure(4e-6, "measured here"))
    assert spec.launch_overhead_s is not None and spec.launch_overhead_s.value == 2e-6
    assert launch_of(StepRuntime(), spec) == 2e-6
    assert launch_of(StepRuntime(launch_s=2.52e-6), spec) == 4e-6
    assert launch_of(StepRuntime(launch_s=0.5e-6, graph_replayed=True), spec) == 0.5e-6
    assert launch_of(StepRuntime(launch_s=2.52e-6), get("h100-sxm")) == 2.52e-6


def test_a_fa2_share_is_applied_to_half_precision_attention_only():
    """Under --runtime eager (FlashAttention-2), the H100 file's fa2_forward share (0.337)
    times bf16 attention; fp32 attention, which FlashAttention does not run, is timed as on a
    file listing no share at all."""
    spec = get("h100-sxm")
    bare = replace(spec, attention_tensor_fraction={})

    def attention_times(dtype, hardware):
        trace = torchroof.trace_model(small_llama(2), "prefill", batch=1, seq=2048, dtype=dtype)
        est = torchroof.estimate_trace(trace, hardware, mode="realistic", runtime="eager")
        return [k.time_s for k in est.kernels if normalise(k.name) == "sdpa"]

    assert attention_times("fp32", spec) == attention_times("fp32", bare)
    assert attention_times("bf16", spec) != attention_times("bf16", bare)

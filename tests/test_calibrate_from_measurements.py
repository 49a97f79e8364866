"""``torchroof calibrate --from-profile`` and ``--from-nccl-tests``: files rewritten figure by
figure, nccl-tests logs made here with a known alpha and bus bandwidth fitted back, profiles
made here from known launch times and fractions fitted back (Chrome trace on CPU and GPU,
CSV), and a profile of a real step run on this CPU making a file that predicts it."""

from __future__ import annotations

import json

import pytest
import tomllib
import torch
from conftest import small_llama
from torchroof.hardware import get
from torchroof.hardware.cluster import get_cluster
from transformers import LlamaConfig, LlamaForCausalLM

import torchroof
from torchroof.cli.main import main as cli_main
from torchroof.validation.calibrated_files import Fitted, rewrite
from torchroof.validation.nccl_tests import NcclTestsError, fit, link_bytes, parse
from torchroof.validation.profile_fit import fit_profile, profiled_ops
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


def nccl_log(collective, hosts, alpha_s, beta, sizes=None):
    """An nccl-tests log as nccl-tests prints it, each row's out-of-place time alpha +
    bytes-on-the-link / beta (torchroof's model), the in-place one 1% slower."""
    ranks = len(hosts)
    lines = [
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 4(factor) warmup iters: 5 "
        "iters: 20 agg iters: 1 validation: 1 graph: 0",
        "#",
        "# Using devices",
    ]
    for rank, host in enumerate(hosts):
        lines.append(
            f"#  Rank {rank:2d} Group  0 Pid {1000 + rank} on {host} device {rank % 8} "
            "[0x1b] NVIDIA H100 80GB HBM3"
        )
    lines += [
        "#                                                              out-of-place       "
        "                in-place",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)      "
        "      (us)  (GB/s)  (GB/s)",
    ]
    nodes = len(set(hosts))
    for size in sizes or [8 * 4**i for i in range(15)]:  # 8 B ... 2 GiB
        t = alpha_s + link_bytes(collective, size, ranks, nodes) / beta
        us = t * 1e6
        algbw = size / t / 1e9
        lines.append(
            f"{size:12d} {size // 4:13d}     float     sum      -1 {us:8.2f} {algbw:7.2f} "
            f"{algbw:7.2f}      0 {us * 1.01:8.2f} {algbw:7.2f} {algbw:7.2f}      0"
        )
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 1.0", "#",
              f"# Collective test concluded: {collective}_perf"]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_an_all_gather_inside_a_node_gives_back_its_alpha_and_bus_bandwidth():
    """8 GPUs on one host, all_gather: bytes per rank 7/8 S; alpha 20 us, beta 370 GB/s
    (nccl-tests' figure for a DGX H100's NVLink outside NVLS). The times are printed to
    0.01 us, so the fit recovers both within 0.1%."""
    log = parse(nccl_log("all_gather", ["node1"] * 8, 20e-6, 370e9))
    assert log.collective == "all_gather" and log.ranks == 8 and log.nodes == 1
    found = fit(log, get_cluster("dgx-h100"))
    assert found.link == "intra_node" and found.figure == "achieved_fraction"
    assert found.alpha_s == pytest.approx(20e-6, rel=1e-3)
    assert found.beta_bytes_per_s == pytest.approx(370e9, rel=1e-3)
    assert found.worst_error < 1e-3


def test_an_all_reduce_over_two_nodes_fits_the_network(tmp_path, capsys):
    """2 hosts x 8 GPUs, all_reduce: the network carries 2 (2 - 1) / 2 x S / 8 = S / 8 per
    GPU (the hierarchical algorithm's middle phase); alpha 50 us, beta 45 GB/s. The cluster
    file written has them as the network's latency and 45 / 50 = 0.9 of its line rate, and
    the intra-node figures as they were."""
    hosts = ["a"] * 8 + ["b"] * 8
    assert link_bytes("all_reduce", 1 << 20, 16, 2) == (1 << 20) / 8
    path = tmp_path / "ar.log"
    path.write_text(nccl_log("all_reduce", hosts, 50e-6, 45e9))
    out = tmp_path / "cluster.toml"
    code = cli_main(["calibrate", "--from-nccl-tests", str(path), "--hardware", "dgx-h100",
                     "-o", str(out), "--quiet"])  # fmt: skip
    assert code == 0
    assert "all_reduce_perf on 16 GPUs over 2 nodes" in capsys.readouterr().out
    cluster = get_cluster(str(out))
    shipped = get_cluster("dgx-h100")
    assert cluster.name == "dgx-h100-calibrated"
    assert cluster.network.latency_s.value == pytest.approx(50e-6, rel=1e-3)
    assert cluster.network.achieved_fraction.value == pytest.approx(0.9, rel=1e-3)
    assert cluster.intra_node == shipped.intra_node
    # an estimate on the calibrated cluster: HSDP over the two nodes
    trace = torchroof.trace_model(small_llama(2), "train", batch=2, seq=256, fsdp=8, dp=2)
    slow = torchroof.estimate_trace(trace, out).communication().by_link_s
    fast = torchroof.estimate_trace(trace, "dgx-h100").communication().by_link_s
    # the replicas (ranks 0 and 8) all-reduce over the network: 0.9 x 50 GB/s and 50 us,
    # not 0.94 x 50 GB/s and 47 us
    assert slow["network"] > fast["network"] > 0


def test_an_in_node_all_reduce_fits_nvlink_sharp_where_the_cluster_lists_it():
    log = parse(nccl_log("all_reduce", ["h"] * 8, 25e-6, 480e9))
    found = fit(log, get_cluster("dgx-h100"))
    assert found.figure == "nvls_all_reduce_bus_bytes_per_s"
    assert found.beta_bytes_per_s == pytest.approx(480e9, rel=1e-3)
    with pytest.raises(NcclTestsError, match="exceeds .* line rate"):
        fit(log, get_cluster("dgx-a100"))  # 480 GB/s over NVLink 3's 300: no NVLS there


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nothing here\n", "does not name its test"),
        (nccl_log("all_gather", ["h"] * 8, 1e-5, 1e11).replace("#  Rank", "# Dev"), "no '#  Rank"),
        (nccl_log("all_gather", ["h"] * 8, 1e-5, 1e11).replace("all_gather_perf", "sendrecv_perf"),
         "torchroof fits"),
        (nccl_log("all_gather", ["h"] * 8, 1e-5, 1e11, sizes=[8]), "at least 2 sizes"),
    ],
)  # fmt: skip
def test_a_log_that_cannot_be_fitted_says_why(text, message):
    with pytest.raises(NcclTestsError, match=message):
        parse(text)


def test_ranks_spread_unevenly_are_refused():
    log = parse(nccl_log("all_gather", ["a"] * 8 + ["b"] * 4, 1e-5, 1e11))
    with pytest.raises(NcclTestsError, match="unevenly"):
        fit(log, get_cluster("dgx-h100"))


# -- profiles -------------------------------------------------------------------------------

LAUNCH_S, HBM, TENSOR = 4e-6, 0.7, 0.6


@pytest.fixture(scope="module")
def predicted():
    trace = torchroof.trace_model(small_llama(2), "prefill", batch=2, seq=256, dtype="fp32")
    return torchroof.estimate_trace(trace, "h100-sxm", fusion="eager")


def made_times(estimate):
    """Each kernel's time as a part with launch 4 us, 0.7 of the HBM bandwidth and 0.6 of
    the tensor rate would take it (the fit's model); other kernels their roofline time
    plus the launch."""
    out = []
    for k in estimate.kernels:
        if k.unit == "tensor" and k.bound == "compute":
            out.append(LAUNCH_S + k.compute_s / TENSOR)
        elif k.bound == "memory":
            out.append(LAUNCH_S + k.memory_s / HBM)
        else:
            out.append(LAUNCH_S + k.time_s)
    return out


def op_name(kernel):
    return "aten::" + kernel.name.removeprefix("aten.").split(".")[0]


def test_a_cpu_chrome_trace_gives_back_the_launch_and_fractions(predicted, tmp_path):
    """Ops one after another on one thread, each with a priced op inside it (aten::mul, as
    a composite op calls others: the top-most op is the kernel), times in microseconds as
    the profiler writes them."""
    events, clock = [], 0.0
    for k, t in zip(predicted.kernels, made_times(predicted), strict=True):
        dur = t * 1e6
        events.append({"ph": "X", "cat": "cpu_op", "name": op_name(k), "pid": 1, "tid": 1,
                       "ts": clock, "dur": dur})  # fmt: skip
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1,
                       "ts": clock + dur / 4, "dur": dur / 4})  # fmt: skip
        clock += dur + 1.0
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"traceEvents": events}))
    names = {normalise(k.name) for k in predicted.kernels}
    fitted = fit_profile(predicted, profiled_ops(path, names), get("h100-sxm"))
    assert fitted.matched == len(predicted.kernels)
    assert fitted.launch_s == pytest.approx(LAUNCH_S, rel=1e-6)
    assert fitted.hbm_fraction == pytest.approx(HBM, rel=1e-6)
    assert fitted.tensor_fraction == pytest.approx(TENSOR, rel=1e-6)
    assert fitted.memory_kernels > 3 and fitted.tensor_kernels > 3


def test_a_gpu_trace_takes_the_device_time_of_each_ops_kernels(predicted, tmp_path):
    """On a GPU trace an op's CPU time is only its launch: its time is the sum of the device
    kernels that carry its External id (here split into two kernels each)."""
    events, clock = [], 0.0
    for n, (k, t) in enumerate(zip(predicted.kernels, made_times(predicted), strict=True)):
        events.append({"ph": "X", "cat": "cpu_op", "name": op_name(k), "pid": 1, "tid": 1,
                       "ts": clock, "dur": 3.0, "args": {"External id": n}})  # fmt: skip
        for half in range(2):
            events.append({"ph": "X", "cat": "kernel", "name": "sm90_kernel", "pid": 0, "tid": 7,
                           "ts": clock + half, "dur": t * 1e6 / 2,
                           "args": {"External id": n}})  # fmt: skip
        clock += 10.0
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    names = {normalise(k.name) for k in predicted.kernels}
    fitted = fit_profile(predicted, profiled_ops(path, names), get("h100-sxm"))
    assert fitted.hbm_fraction == pytest.approx(HBM, rel=1e-6)
    assert fitted.launch_s == pytest.approx(LAUNCH_S, rel=1e-6)


def test_a_csv_of_op_timings_fits_the_same(predicted, tmp_path):
    path = tmp_path / "ops.csv"
    rows = [f"{op_name(k)},{t * 1e3!r}" for k, t in
            zip(predicted.kernels, made_times(predicted), strict=True)]  # fmt: skip
    path.write_text("name,time_ms\n" + "\n".join(rows) + "\n")
    names = {normalise(k.name) for k in predicted.kernels}
    fitted = fit_profile(predicted, profiled_ops(path, names), get("h100-sxm"))
    assert fitted.tensor_fraction == pytest.approx(TENSOR, rel=1e-6)


def test_a_profile_of_a_real_step_on_this_cpu_makes_a_file_that_predicts_it(tmp_path, capsys):
    """A two-layer Llama's prefill run here in fp32 under torch.profiler, exported as Chrome
    JSON. The H100's own file predicts the matched kernels hundreds of times faster than
    this CPU ran them; the file fitted to the profile predicts them within a factor of 2."""
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
    assert "matched" in capsys.readouterr().out
    trace = torchroof.trace_model(model_path, "prefill", batch=2, seq=128, dtype="fp32")

    def matched_ratio(hardware):
        est = torchroof.estimate_trace(trace, hardware, fusion="eager", mode="realistic")
        names = {normalise(k.name) for k in est.kernels}
        times, _ = align(est.kernels, profiled_ops(trace_path, names))
        pairs = [(k.time_s, t) for k, t in zip(est.kernels, times, strict=True) if t]
        return sum(p for p, _ in pairs) / sum(m for _, m in pairs)

    assert matched_ratio("h100-sxm") < 0.05
    assert 0.5 < matched_ratio(str(out)) < 2.0


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
    ],
)  # fmt: skip
def test_bad_calibrate_flags_get_one_line(args, message, capsys):
    assert cli_main(["calibrate", *args, "--quiet"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

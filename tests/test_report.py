"""The estimate: per-layer rows, totals, MFU, JSON / CSV round trips; its analysis
(torchroof.report.analysis) and the one writer (torchroof.render.files.write)."""

import csv
import dataclasses
import json

import pytest
import torch

import torchroof
from torchroof.config import Workload
from torchroof.records.facts import StepFacts
from torchroof.render import files, text
from torchroof.render.files import CSV_COLUMNS, sweep_output, write
from torchroof.report import analysis
from torchroof.report.estimate import Estimate, KernelEstimate, collapse_repeats, layer_key
from torchroof.report.memory import MemoryFootprint
from torchroof.workloads.decode_figures import DecodeAnalysis, decode_analysis


@pytest.fixture
def llama_estimate(meta_lm):
    model = meta_lm("llama", num_hidden_layers=4).eval()
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids)
    return t.estimate("h100-sxm")


def test_layer_keys():
    assert layer_key("model.layers.3.self_attn.q_proj", "forward") == "model.layers.3"
    assert (
        layer_key("model.layers.3.self_attn.q_proj", "forward", depth=4)
        == "model.layers.3.self_attn"
    )
    assert layer_key("lm_head", "backward") == "lm_head"
    assert layer_key("", "forward") == "(top level)"
    assert layer_key("model.layers.0", "optimizer") == "optimizer"


def test_rows_are_blocks_in_execution_order_and_sum_to_the_total(llama_estimate):
    rows = llama_estimate.rows()
    names = [r.name for r in rows]
    blocks = [n for n in names if n.startswith("model.layers.")]
    assert blocks == ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]
    assert (
        names.index("model.embed_tokens") < names.index("model.layers.0") < names.index("lm_head")
    )
    assert sum(r.time_s for r in rows) == pytest.approx(llama_estimate.time_s)
    assert sum(r.flops for r in rows) == llama_estimate.flops
    assert sum(r.kernels for r in rows) == len(llama_estimate.kernels)
    # identical blocks cost the same, except where a kernel spans a seam (booked to the block
    # its first op ran in, as Inductor fuses the first block's RoPE with the rotary cos/sin
    # kernel and the last block's residual add with the final norm)
    layer_rows = [r for r in rows if r.name in blocks]
    assert len({(r.flops, r.bytes) for r in layer_rows[1:3]}) == 1
    assert (layer_rows[0].flops, layer_rows[0].bytes) != (layer_rows[1].flops, layer_rows[1].bytes)
    collapsed = collapse_repeats(rows)
    assert "model.layers.1-2 (x2)" in [r.name for r in collapsed]
    assert sum(r.time_s for r in collapsed) == pytest.approx(llama_estimate.time_s)


def test_totals_and_mfu(llama_estimate):
    est = llama_estimate
    assert est.time_s == pytest.approx(sum(k.time_s for k in est.kernels))
    assert est.mfu == pytest.approx(est.flops / (est.time_s * 989.4e12))
    assert 0 < est.memory_bound_share <= 1
    table = text.layer_table(est)
    assert "model.layers.1" in table and "total" in table
    summary = text.summary(est)
    assert "MFU" in summary and "coverage" in summary


def test_json_round_trip(tmp_path, llama_estimate):
    path = tmp_path / "est.json"
    files.estimate_json(llama_estimate, path)
    back = Estimate.from_json(path)
    assert back.kernels == llama_estimate.kernels
    assert back.time_s == pytest.approx(llama_estimate.time_s)
    assert text.layer_table(back) == text.layer_table(llama_estimate)
    assert back.options.fusion == "fused"  # the default policy


def test_csv_has_one_row_per_kernel(tmp_path, llama_estimate):
    path = tmp_path / "kernels.csv"
    files.write_csv(llama_estimate, path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(llama_estimate.kernels)
    assert sum(float(r["time_s"]) for r in rows) == pytest.approx(llama_estimate.time_s)


# -- analysis, by hand ------------------------------------------------------------------------
# A decode step at batch 4 on a made-up accelerator: HBM 2e12 B/s, bf16 peak 1e15 FLOP/s, so
# the ridge is I* = 1e15 / 2e12 = 500 FLOP/B.
def _kernel(index, name, unit, flops, read_by, time_s, bound):
    return KernelEstimate(
        index=index,
        name=name,
        ops=(name,),
        module=f"model.layers.{index}",
        phase="forward",
        flops=flops,
        bytes_read=sum(read_by.values()),
        bytes_written=0,
        unit=unit,
        dtype="bf16",
        counted=True,
        peak_flops_per_s=1e15,
        compute_s=flops / 1e15,
        memory_s=sum(read_by.values()) / 2e12,
        time_s=time_s,
        bound=bound,
        read_by=read_by,
    )


def _hand_estimate(regime: str) -> Estimate:
    kernels = [
        # weight GEMM: 2·B·P = 2 · 4 · 5e8 = 4e9 FLOPs over 1e9 weight bytes (bf16, P = 5e8);
        # memory-bound, 1e9 / 2e12 = 5e-4 s
        _kernel(0, "aten.mm.default", "tensor", 4_000_000_000, {"weights": 10**9}, 5e-4, "memory"),
        # decode attention: reads the 2e8-byte cache of 4 sequences, 2e8 / 2e12 = 1e-4 s
        _kernel(
            1, "aten.sdpa.default", "tensor", 600_000_000, {"kv_cache": 2 * 10**8}, 1e-4, "memory"
        ),
        # a compute-bound vector kernel: 4e11 / 1e15 = 4e-4 s
        _kernel(
            2,
            "aten.exp.default",
            "vector",
            400_000_000_000,
            {"activations": 10**8},
            4e-4,
            "compute",
        ),
    ]
    return Estimate(
        hardware="test",
        hardware_display="Test GPU",
        hbm_bytes_per_s=2e12,
        reference_peak_flops_per_s=1e15,
        reference_dtype="bf16",
        kernels=kernels,
        op_count=3,
        uncounted={},
        facts=StepFacts(
            workload=Workload(regime, batch=4, context=1000, cache="static"),
            tokens=4,
        ),
        # fixed 1e9 weight bytes of 3e9 leave 2e9 for (2e8 KV / 4 sequences = 5e7) each: 40
        memory=MemoryFootprint(
            weights_bytes=10**9,
            gradients_bytes=0,
            optimizer_state_bytes=0,
            kv_cache_bytes=2 * 10**8,
            activations_peak_bytes=0,
            capacity_bytes=3 * 10**9,
            batch=4,
        ),
    )


def test_analysis_figures_by_hand():
    est = _hand_estimate("decode")
    assert analysis.weight_bytes_read(est) == est.weight_bytes_read == 10**9
    assert analysis.kv_bytes_read(est) == est.kv_bytes_read == 2 * 10**8
    # B* = batch · I* / (weight-GEMM FLOPs per weight byte) = 4 · 500 / (4e9 / 1e9) = 500
    # (B* = s·I*/2 = 2 · 500 / 2 for bf16)
    assert analysis.ridge_batch(est) == est.ridge_batch == pytest.approx(500)
    # B_cross = weight bytes / KV bytes per sequence = 1e9 / (2e8 / 4) = 20
    assert analysis.kv_crossover_batch(est) == est.kv_crossover_batch == pytest.approx(20)
    # time 5e-4 + 1e-4 + 4e-4 = 1e-3 s, of which 6e-4 in memory-bound kernels
    assert analysis.memory_bound_share(est) == pytest.approx(0.6)
    # (4e9 + 6e8 + 4e11) / (1e-3 · 1e15) = 0.4046
    assert analysis.mfu(est) == est.mfu == pytest.approx(0.4046)
    assert analysis.tokens_per_s(est) == pytest.approx(4 / 1e-3)
    no_kv = dataclasses.replace(est, kernels=est.kernels[:1])
    assert analysis.kv_crossover_batch(no_kv) == float("inf")


def test_decode_analysis_figures():
    decode = decode_analysis(_hand_estimate("decode"))
    assert decode == DecodeAnalysis(
        weight_bytes_read=10**9,
        kv_bytes_read=2 * 10**8,
        kv_crossover_batch=pytest.approx(20),
        cache="static",
        context=1000,
        max_batch=40,
    )


def test_summary_adds_the_decode_lines_after_throughput_and_memory():
    lines = text.summary(_hand_estimate("decode")).splitlines()
    throughput = lines.index("throughput: 4,000.0 tokens/s")
    assert lines[throughput + 1] == (
        "decode: weights read 1.00 GB, KV read 0.200 GB per step (static cache); "
        "KV reads overtake weight reads at batch 20"
    )
    # capacities in GiB, as vendors quote them: 1.2e9 B = 1.12 GiB of 3e9 B = 2.79 GiB
    assert lines[throughput + 2].startswith("memory: 1.12 GiB of 2.79 GiB")
    assert lines[throughput + 3] == "largest decode batch that fits at context 1000: 40"
    prefill = text.summary(_hand_estimate("prefill")).splitlines()
    assert [line.split(":")[0] for line in prefill] == [
        "hardware",
        "step time",
        "expected",
        "timing",
        "work",
        "MFU",
        "traffic",
        "throughput",
        "memory",
        "coverage",
    ]


# -- a rank of a cluster, by hand -------------------------------------------------------------
# The matmul above (5e-4 s from t = 0) and an all-reduce of layer 1 on the communication
# stream over [3.5e-4, 5.5e-4] (2e-4 s, sending 1e6 bytes over NVLink): the compute stream
# ends at 5e-4 and idles until 5.5e-4 waiting for it, so 5e-5 s are exposed, 1.5e-4 hidden.
NETWORK_FIELDS = ("link", "wire_by_link", "network_s", "stream", "start_s", "exposed_s")


def _cluster_estimate() -> Estimate:
    est = _hand_estimate("prefill")
    matmul = dataclasses.replace(est.kernels[0], start_s=0.0)
    reduce = dataclasses.replace(
        _kernel(
            1, "c10d.allreduce_.default", "network", 0, {"activations": 10**6}, 2e-4, "network"
        ),
        link="nvlink",
        wire_by_link={"nvlink": 10**6},
        network_s=2e-4,
        stream="communication",
        start_s=3.5e-4,
        exposed_s=5e-5,
    )
    # ridge: the 1e15 FLOP/s peak over NVLink 4's 4.5e11 B/s line rate = 2,222.2 FLOP/B
    return dataclasses.replace(
        est,
        kernels=[matmul, reduce],
        cluster="dgx-h100",
        link_ridges={"nvlink": 1e15 / 4.5e11},
        step_time_s=5.5e-4,
    )


def test_a_cluster_estimate_by_hand():
    est = _cluster_estimate()
    assert est.time_s == 5.5e-4  # the schedule's step, not the 7e-4 sum
    # MFU = 4e9 / (5.5e-4 * 1e15) = 0.00727
    assert est.mfu == pytest.approx(4e9 / 5.5e11)
    comm = analysis.communication(est)
    assert (comm.time_s, comm.exposed_s, comm.by_link_s) == (2e-4, 5e-5, {"nvlink": 2e-4})
    assert comm.hidden_s == pytest.approx(1.5e-4)
    assert comm.exposed_share == pytest.approx(5e-5 / 5.5e-4)  # 9.1%
    # I_net = step FLOPs / bytes a rank sends over NVLink = 4e9 / 1e6 = 4,000 >= 2,222
    (nvlink,) = analysis.network_intensity(est).items()
    assert nvlink[0] == "nvlink" and nvlink[1].intensity == 4000.0 and nvlink[1].hides
    rows = {row.name: row for row in est.rows()}
    assert rows["model.layers.0"].bound == "memory"  # the memory-bound matmul
    layer1 = rows["model.layers.1"]
    assert layer1.bound == "network"
    assert layer1.exposed_communication_s == 5e-5
    assert layer1.hidden_communication_s == pytest.approx(1.5e-4)
    lines = text.summary(est).splitlines()
    assert lines[0].startswith("hardware: Test GPU (test) in cluster dgx-h100 (one rank priced)")
    assert lines[2].startswith("expected: ")  # torchroof.accuracy: tests/test_expected_ranges.py
    assert lines[3] == (
        "communication: 0.200 ms on the communication stream, 0.050 ms exposed (9.1% of the "
        "step), hidden behind compute: 0.150 ms; links: nvlink 0.200 ms"
    )
    assert lines[4] == (
        "network intensity (step FLOPs per byte a rank sends): nvlink 4,000 FLOP/B vs ridge "
        "2,222 (above: at peak the math outlasts the link's bytes, if they overlap)"
    )
    assert "exposed comm ms" in text.layer_table(est)
    assert "network (nvlink)" in text.kernel_table(est)


def test_phases_on_two_streams_add_up_to_the_step_and_the_global_batch_is_stated():
    """The all-reduce (backward) runs 2e-4 s on the communication stream, 5e-5 s of it
    exposed: on the compute stream the backward takes 5e-5 s, so forward 5e-4 + backward
    5e-5 = the 5.5e-4 s step (the kernels' own times, 5e-4 + 2e-4, would add to 7e-4)."""
    est = _cluster_estimate()
    reduce = dataclasses.replace(est.kernels[1], phase="backward")
    workload = Workload("train", batch=2, seq=1024, dp=2, fsdp=4)
    est = dataclasses.replace(
        est, kernels=[est.kernels[0], reduce], facts=StepFacts(workload=workload, tokens=2048)
    )
    lines = text.summary(est).splitlines()
    assert (
        "by phase, on the compute stream (collectives counted where it waited on them; 0.150 ms "
        "more ran hidden on the communication stream): forward 0.500 ms, backward 0.050 ms "
        "= 0.550 ms"
    ) in lines
    # 2 sequences per rank x dp 2 x fsdp 4 = 16 sequences of 1024 tokens
    assert (
        "global batch: 16 sequences x 1024 tokens = 16,384 tokens per step "
        "(batch 2 per rank x dp 2 x fsdp 4)"
    ) in lines


def test_on_chip_pressure_is_reported_only_where_a_spill_could_change_the_verdict():
    est = _hand_estimate("prefill")
    flag = "on-chip state 65,560 B per row exceeds the 65,536 B budget: may spill"
    memory_bound = [dataclasses.replace(k, flags=(flag,)) for k in est.kernels[:2]]
    quiet = dataclasses.replace(est, kernels=[*memory_bound, est.kernels[2]])
    assert "on-chip pressure" not in text.summary(quiet)  # memory-bound already: no change
    assert "[!]" not in text.kernel_table(quiet)
    compute = dataclasses.replace(est.kernels[2], flags=(flag,))
    loud = dataclasses.replace(est, kernels=[*est.kernels[:2], compute])
    assert (
        "on-chip pressure: 1 compute-bound fused kernel exceeds the on-chip budget; a spill "
        "would add memory traffic the estimate does not charge (e.g. #2 model.layers.2: "
        f"{flag})"
    ) in text.summary(loud).splitlines()
    assert "[!] " + flag in text.kernel_table(loud)


def test_cluster_fields_round_trip_and_old_estimates_load():
    est = _cluster_estimate()
    assert Estimate.from_dict(json.loads(json.dumps(est.to_dict()))) == est
    # an estimate saved before multi-GPU steps has none of the new keys: it loads as one GPU's
    single = _hand_estimate("prefill")
    old = json.loads(json.dumps(single.to_dict()))
    for key in ("cluster", "link_ridges", "step_time_s"):
        del old[key]
    for kernel in old["kernels"]:
        for key in NETWORK_FIELDS:
            del kernel[key]
    back = Estimate.from_dict(old)
    assert back == single
    assert back.time_s == 1e-3 and back.cluster is None
    assert all(k.link == "" and k.start_s is None and k.stream == "compute" for k in back.kernels)


# -- the writer -------------------------------------------------------------------------------
def test_writer_picks_the_format_by_suffix(tmp_path, llama_estimate):
    est = llama_estimate
    back = Estimate.from_dict(json.loads(write(est, tmp_path / "est.json").read_text()))
    assert back == est

    with write(est, tmp_path / "kernels.csv").open() as handle:
        table = list(csv.reader(handle))
    assert tuple(table[0]) == CSV_COLUMNS
    assert [int(row[0]) for row in table[1:]] == [k.index for k in est.kernels]

    trace = json.loads(write(est, tmp_path / "run.trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(est.kernels)
    assert sum(e["dur"] for e in events) == pytest.approx(est.time_s * 1e6)


def test_writer_draws_plots_by_suffix(tmp_path, llama_estimate):
    pytest.importorskip("matplotlib")
    est = llama_estimate
    assert write(est, tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write(est, tmp_path / "r.pdf").read_bytes()[:5] == b"%PDF-"
    roofline = write(est, tmp_path / "r.svg").read_text()
    layers = write(est, tmp_path / "r.layers.svg").read_text()
    assert "arithmetic intensity" in roofline and "arithmetic intensity" not in layers
    assert "per-layer budget" in layers


def test_writer_kind_overrides_the_suffix(tmp_path, llama_estimate):
    path = write(llama_estimate, tmp_path / "t.json", kind="timeline")
    assert "traceEvents" in json.loads(path.read_text())
    with pytest.raises(ValueError, match=r"plots are written as \.pdf, \.png or \.svg"):
        write(llama_estimate, tmp_path / "plot.jpg", kind="roofline")
    with pytest.raises(ValueError, match="unknown output kind 'xlsx'; choose from timeline"):
        write(llama_estimate, tmp_path / "x.xlsx", kind="xlsx")
    assert not (tmp_path / "plot.jpg").exists()


def test_writer_refuses_an_unknown_suffix_naming_the_supported_ones(tmp_path, llama_estimate):
    with pytest.raises(ValueError) as info:
        write(llama_estimate, tmp_path / "est.txt")
    message = str(info.value)
    assert message.startswith(f"cannot tell what to write to '{tmp_path / 'est.txt'}'")
    supported = message.split("supported: ")[1].split("; ")
    assert [entry.split(" ")[0] for entry in supported] == [
        ".trace.json",
        ".json",
        ".csv",
        ".html/.htm",
        ".layers.png/.layers.svg/.layers.pdf",
        ".png/.svg/.pdf",
    ]
    assert not (tmp_path / "est.txt").exists()


def test_sweep_outputs_by_suffix_or_kind():
    assert sweep_output("curve.CSV") == "csv" and sweep_output("curve.svg") == "plot"
    assert sweep_output("curve.dat", kind="csv") == "csv"  # the --csv flag takes any name
    with pytest.raises(ValueError, match=r"supported: \.csv \(one row per value \(CSV\)\); "):
        sweep_output("curve.txt")
    with pytest.raises(ValueError, match=r"got 'curve\.jpg'"):
        sweep_output("curve.jpg", kind="plot")


def test_a_layer_bound_by_the_network_names_its_link():
    from torchroof.report.estimate import LayerRow

    # 3 ms of collectives (2 on NVLink, 1 across nodes) against 1 ms of compute: the
    # network binds, and NVLink carries most of it
    row = LayerRow("layers.0", time_s=4e-3, exposed_communication_s=2e-3)
    row.hidden_communication_s = 1e-3
    row.link_s = {"nvlink": 2e-3, "network": 1e-3}
    assert (row.bound, row.boundary) == ("network", "network (nvlink)")
    row.memory_bound_s = 3.5e-3  # now memory holds most of the time: no link to name
    assert row.boundary == "memory"


def test_each_layer_has_its_mfu_and_memory_bound_share():
    """The per-layer time budget per row: layer 0's GEMM does 4e9 FLOPs in 5e-4 s against
    1e15 FLOP/s, MFU = 4e9 / (5e-4 x 1e15) = 0.8%, all of it memory-bound; layer 2's
    compute-bound exp: 4e11 / (4e-4 x 1e15) = 100%, memory-bound share 0. The JSON carries
    the same rows."""
    est = _hand_estimate("prefill")
    rows = {row.name: row for row in est.rows()}
    assert rows["model.layers.0"].mfu(1e15) == pytest.approx(0.008)
    assert rows["model.layers.0"].memory_bound_share == 1.0
    assert rows["model.layers.2"].mfu(1e15) == pytest.approx(1.0)
    assert rows["model.layers.2"].memory_bound_share == 0.0
    layers = {row["name"]: row for row in est.to_dict()["layers"]}
    assert layers["model.layers.0"]["mfu"] == pytest.approx(0.008)
    assert layers["model.layers.2"]["memory_bound_share"] == 0.0
    table = text.layer_table(est)
    assert "MFU %" in table and "mem-bound %" in table


def test_a_version_1_estimate_still_loads():
    """Version 2 added the hierarchy's kernel fields and the per-layer rows; a version-1
    file (without them) reads with the fields at their defaults."""
    data = _hand_estimate("prefill").to_dict()
    data["version"] = 1
    del data["layers"]
    for kernel in data["kernels"]:
        for key in ("boundary", "level_bytes", "tile", "waves", "wave_efficiency"):
            kernel.pop(key, None)
    est = Estimate.from_dict(data)
    assert [k.boundary for k in est.kernels] == ["", "", ""]
    assert est.time_s == pytest.approx(5e-4 + 1e-4 + 4e-4)
    data["version"] = 7
    with pytest.raises(ValueError, match="version 7 is not supported"):
        Estimate.from_dict(data)


def test_a_version_3_estimate_loads_without_the_fields_format_4_added():
    """Format 4 marks the fields added after 3 (a kernel's pipelined_with and lane, the
    estimate's host_overhead_s, offload_exposed_s and fp16_accumulate): a version-3 file
    without them reads with them at their defaults, and the same step time."""
    est = _hand_estimate("prefill")
    data = est.to_dict()
    assert data["version"] == 6
    data["version"] = 3
    data["options"].pop("cuda_graphs")
    for key in ("host_overhead_s", "offload_exposed_s", "fp16_accumulate"):
        data.pop(key, None)
    for kernel in data["kernels"]:
        kernel.pop("pipelined_with", None)
        kernel.pop("lane", None)
    old = Estimate.from_dict(data)
    assert (old.host_overhead_s, old.offload_exposed_s, old.fp16_accumulate) == (0.0, 0.0, False)
    assert {(k.pipelined_with, k.lane) for k in old.kernels} == {(None, "")}
    assert old.time_s == pytest.approx(est.time_s) == pytest.approx(5e-4 + 1e-4 + 4e-4)


def test_a_version_4_estimate_loads_with_cuda_graphs_on():
    """Format 5 adds the pricing options' cuda_graphs: a version-4 file reads with it at
    its default (the runtime's graphs replayed)."""
    data = _hand_estimate("prefill").to_dict()
    data["version"] = 4
    data["options"].pop("cuda_graphs")
    assert Estimate.from_dict(data).options.cuda_graphs is True


def test_a_version_5_pipeline_step_loads_without_its_ranks_memory():
    """Format 6 adds each pipeline rank's memory and floor: a rank row of a version-5 file
    reads with them at 0."""
    from torchroof.report.pipeline_step import PipelineStep, RankRow

    row = RankRow(1, (1,), 0.5, 0.75, memory_bytes=3 << 30, floor_bytes=2 << 30)
    step = PipelineStep("1f1b", 2, 4, (), (row,), 1.0, 1.0, 0.25, 0.0, "nvlink", 1, "", True)
    data = step.to_dict()
    assert data["ranks"][0]["memory_bytes"] == 3 << 30  # written by format 6
    assert PipelineStep.from_dict(data).ranks == (row,)
    for old in data["ranks"]:
        del old["memory_bytes"], old["floor_bytes"]
    (loaded,) = PipelineStep.from_dict(data).ranks
    assert (loaded.memory_bytes, loaded.floor_bytes, loaded.busy_s) == (0, 0, 0.5)

"""Runtime profiles (hardware/runtimes/*.toml): the file format and its one-line errors, the
kernel policy a runtime sets, and each effect on timing checked against numbers worked by
hand from the profile, the H100 datasheet and the DGX H100 cluster file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_LLAMA, small_llama
from torchroof.counters import Cost
from torchroof.hardware import get, get_cluster
from torchroof.hardware.runtime import (
    KERNEL_SETTINGS,
    RuntimeProfileError,
    available_runtimes,
    get_runtime,
    load_runtime_file,
)

import torchroof
from torchroof.cli.common import given_dests
from torchroof.cli.main import main
from torchroof.config import PricingOptions
from torchroof.config.errors import OptionError
from torchroof.pricing.runtime import (
    runtime_at,
    runtime_options,
    timing_of,
    with_knobs,
    workload_defaults,
)
from torchroof.timing.network import collective_time, custom_all_reduce_time
from torchroof.timing.roofline import time_kernel
from torchroof.timing.runtime import CustomAllReduce, StepRuntime, step_runtime

H100 = get("h100-sxm")
DGX = get_cluster("dgx-h100")
SHIPPED = (
    "deepspeed",
    "eager",
    "gpt-fast",
    "hf-trainer",
    "llama-cpp",
    "megatron-te",
    "sglang",
    "torchtitan",
    "torchtitan-compile",
    "torchtune",
    "trtllm",
    "vllm",
)

PROFILE = """\
name = "test-engine"
runs = "serving"

[kernels]
fusion = { value = "eager", source = "test" }
attention_kernel = { value = "fa3", source = "test" }

[launches]
kernel_launch_s = { value = 5e-6, source = "test" }
cuda_graphs = { value = "decode", source = "test" }
graph_kernel_launch_s = { value = 1e-6, source = "test" }
graph_max_batch = { value = 8, source = "test" }
host_overhead_s = { value = 1e-3, source = "test" }
"""


def _profile(tmp_path: Path, text: str = PROFILE) -> str:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    return str(path)


def test_every_shipped_runtime_loads_with_a_source_for_each_claim():
    profiles = {p.name: p for p in available_runtimes()}
    assert tuple(sorted(profiles)) == SHIPPED
    for profile in profiles.values():
        assert profile.settings["fusion"].value in ("eager", "fused")
        for claim in (*profile.settings.values(), *profile.figures.values()):
            assert claim.source.strip(), profile.name
        # a launch in (0.5 us, 50 us): a CUDA graph's node to an eager op's Python dispatch
        assert 0.5e-6 <= profile.launch_s("decode", 1) <= 50e-6


def test_a_bad_profile_names_every_problem_in_one_line(tmp_path):
    bad = _profile(
        tmp_path,
        """\
        name = "x"
        runs = "sometimes"
        colour = "blue"
        [kernels]
        fusion = { value = "compiled", source = "" }
        [launches]
        kernel_launch_s = { value = -1, source = "a" }
        graph_kernel_launch_s = { value = 1e-6, source = "a" }
        [defaults]
        zero_with_dp = { value = 4, source = "a" }
        """.replace("        ", ""),
    )
    with pytest.raises(RuntimeProfileError) as error:
        load_runtime_file(bad)
    message = str(error.value)
    assert "\n" not in message
    for problem in (
        "colour: unknown key",
        "kernels.fusion.value: expected one of eager, fused, got 'compiled'",
        "kernels.fusion.source: missing",
        "kernels.attention_kernel: required key is missing",
        "launches.kernel_launch_s.value: must be positive",
        "graph figures are given but cuda_graphs is none",
        "runs: expected one of training, serving, both",
        "defaults.zero_with_dp.value: a ZeRO stage is 0, 1, 2 or 3, got 4",
    ):
        assert problem in message, problem


def test_an_unknown_runtime_is_refused_before_tracing_with_the_known_names():
    with pytest.raises(OptionError, match=r"unknown runtime 'vlm'; did you mean vllm"):
        torchroof.estimate("gpt2", "decode", seq=64, runtime="vlm")


def test_a_runtime_sets_its_kernels_unless_they_are_given():
    assert runtime_options("torchtitan").fusion == "eager"
    assert runtime_options("torchtitan-compile").fusion == "fused"
    assert runtime_options("torchtitan", fusion="fused").fusion == "fused"
    assert with_knobs(None, {}).runtime == ""
    # a profile's kernel settings are the PricingOptions fields of the same name
    assert set(KERNEL_SETTINGS) <= set(PricingOptions().to_dict())


def test_a_serving_engine_does_not_train():
    with pytest.raises(OptionError, match="runtime vllm runs serving steps, not training"):
        torchroof.estimate("gpt2", "train", seq=64, runtime="vllm")


def test_a_runtime_at_a_batch_is_what_the_runtime_sets_there():
    """What a step timer asks per token count without building each count's workload:
    vLLM's (hardware/runtimes/vllm.toml) replays its full decode graph up to a batch of
    512 (1.37 us a kernel), launches eagerly past it, for a prefill and with cuda_graphs
    off (2.52 us); no runtime named sets nothing."""
    vllm = PricingOptions(runtime="vllm", mode="realistic")
    at = [
        (r.launch_s, r.graph_replayed)
        for r in (
            runtime_at(vllm, "decode", 512),
            runtime_at(vllm, "decode", 513),
            runtime_at(vllm, "prefill", 8),
            runtime_at(PricingOptions(runtime="vllm", cuda_graphs=False), "decode", 8),
        )
    ]
    assert at == [(1.37e-6, True), (2.52e-6, False), (2.52e-6, False), (2.52e-6, False)]
    assert runtime_at(PricingOptions(), "decode", 8) == StepRuntime()
    assert timing_of(vllm, None) == runtime_at(vllm, "prefill", 1)  # no workload: a prefill


def test_torchtitan_keeps_gathered_parameters_for_backward_under_a_pipeline():
    titan = PricingOptions(runtime="torchtitan")
    assert workload_defaults(titan, {"pp": 2})["reshard_after_forward"] is False
    assert "reshard_after_forward" not in workload_defaults(titan, {"pp": 1})
    given = workload_defaults(titan, {"pp": 2, "reshard_after_forward": True})
    assert given["reshard_after_forward"] is True
    assert workload_defaults(PricingOptions(), {"pp": 2}) == {"pp": 2}


def test_launch_is_the_graph_figure_up_to_the_captured_batch(tmp_path):
    profile = get_runtime(_profile(tmp_path))
    assert step_runtime(profile, "decode", 8).launch_s == 1e-6  # graph replayed
    assert step_runtime(profile, "decode", 9).launch_s == 5e-6  # past the capture limit
    assert step_runtime(profile, "prefill", 1).launch_s == 5e-6  # prefill is not captured
    # told to launch eagerly (vLLM's --enforce-eager, cuda_graphs=False): no graph at all
    eager = step_runtime(profile, "decode", 8, graphs_on=False)
    assert (eager.launch_s, eager.graph_replayed) == (5e-6, False)
    # one 16 KB copy kernel: realistic time = its body + the runtime's launch, not the
    # accelerator file's 2 us
    cost = Cost(0, 8192, 8192, "vector", "bfloat16")
    options = PricingOptions(mode="realistic", latency_shelf=False)
    plain = time_kernel(cost, H100, options)
    graphed = time_kernel(cost, H100, options, runtime=StepRuntime(launch_s=1e-6))
    assert plain.overhead_s == pytest.approx(2e-6)
    assert graphed.overhead_s == pytest.approx(1e-6)
    assert plain.time_s - graphed.time_s == pytest.approx(1e-6)
    # the pure roofline pays no launch under any runtime
    pure = time_kernel(cost, H100, PricingOptions(), runtime=StepRuntime(launch_s=1e-6))
    assert pure.overhead_s == 0.0


def test_no_cuda_graphs_launches_every_kernel_eagerly():
    # vLLM's profile: 1.37 us a kernel replayed from its decode graph, 2.52 us launched;
    # the same decode step, launched eagerly, pays the difference once per kernel
    knobs = dict(batch=8, context=16, mode="realistic", runtime="vllm")
    graphed = torchroof.estimate(small_llama(2), "decode", **knobs)
    eager = torchroof.estimate(small_llama(2), "decode", cuda_graphs=False, **knobs)
    assert eager.options.cuda_graphs is False
    difference = len(graphed.kernels) * (2.52e-6 - 1.37e-6)
    assert eager.time_s - graphed.time_s == pytest.approx(difference, rel=1e-9)


def test_host_overhead_is_added_once_per_step_in_realistic_mode(tmp_path):
    path = _profile(tmp_path)
    with torchroof.trace() as t:
        x = torch.empty(64, 64, device="meta")
        (x @ x).relu()
    real = t.estimate("h100-sxm", mode="realistic", runtime=path)
    assert real.host_overhead_s == 1e-3
    assert real.time_s == pytest.approx(sum(k.time_s for k in real.kernels) + 1e-3)
    pure = t.estimate("h100-sxm", runtime=path)
    assert pure.host_overhead_s == 0.0
    assert pure.time_s == pytest.approx(sum(k.time_s for k in pure.kernels))
    # the runtime's eager kernels: two kernels, the matmul and the relu, not one fused
    assert len(real.kernels) == 2
    line = next(line for line in real.assumptions if line.startswith("runtime: test-engine"))
    assert f"({Path(path).resolve()}): eager kernels" in line  # a user's file, by path
    # saved and loaded back, the step time keeps its host overhead
    again = torchroof.Estimate.from_dict(real.to_dict())
    assert again.host_overhead_s == 1e-3 and again.time_s == pytest.approx(real.time_s)


def test_flashattention_3_hides_the_softmax_under_its_matmuls(tmp_path):
    """FlashAttention-3's benchmark shape (as test_hierarchy's), on an H100 file without its
    measured attention shares: the matmuls take 2954.5 us at the sustained 80% of peak, the
    softmax's SFU and fp32 work 546.2 us; FA2 adds them (3500.7 us), FA3 overlaps them (the
    larger, 2954.5 us), each + the launch. With the shipped file's measured FA3 share,
    0.608, the same kernel takes 4 x pairs x 128 / (989.4e12 x 0.608) = 3887.6 us."""
    with torchroof.trace() as t:
        q = torch.empty(4, 16, 8448, 128, dtype=torch.float16, device="meta")
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    pairs = 64 * 8448**2
    matmul_s = 4 * pairs * 128 / (989.4e12 * 0.80)
    softmax_s = pairs / 16.725e12 + 4 * pairs / 66.9e12
    fa3 = _profile(tmp_path)
    shipped = Path(get("h100-sxm").path).read_text()
    modelled = tmp_path / "h100-modelled.toml"
    modelled.write_text(shipped[: shipped.index("[attention_tensor_fraction]")])
    served = t.estimate(str(modelled), mode="realistic", runtime=fa3, fusion="fused")
    assert served.kernels[0].time_s == pytest.approx(matmul_s + 5e-6, rel=1e-6)
    plain = t.estimate("h100-sxm", mode="realistic")
    assert plain.kernels[0].time_s == pytest.approx(matmul_s + softmax_s + 2e-6, rel=1e-6)
    measured = t.estimate("h100-sxm", mode="realistic", runtime=fa3, fusion="fused")
    fa3_s = 4 * pairs * 128 / (989.4e12 * 0.608)
    wave = measured.kernels[0].wave_efficiency
    assert measured.kernels[0].time_s == pytest.approx(fa3_s / wave + 5e-6, rel=1e-6)


def test_a_custom_all_reduce_takes_small_tensors_in_one_node():
    """vLLM's kernel on 8 GPUs of a DGX H100 (NVLink at 370 GB/s achieved per GPU):
    128 KiB one shot: 7 x 131072 B / 370e9 = 2.480 us + its latency; 2 MiB two shots:
    2 x 7/8 x 2097152 / 370e9 = 9.919 us + its latency. NCCL would take 25.6 us + the
    NVLS bus time for either."""
    custom = CustomAllReduce(max_bytes=8 * 2**20, one_shot_max_bytes=256 * 2**10, latency_s=5e-6)
    ranks = list(range(8))
    beta = 450e9 * 0.8222
    one = custom_all_reduce_time(131072, ranks, DGX, custom)
    assert one is not None and one.algorithm == "one-shot"
    assert one.time_s == pytest.approx(5e-6 + 7 * 131072 / beta, rel=1e-9)
    two = custom_all_reduce_time(2 * 2**20, ranks, DGX, custom)
    assert two is not None and two.algorithm == "two-shot"
    assert two.time_s == pytest.approx(5e-6 + 2 * 7 / 8 * 2 * 2**20 / beta, rel=1e-9)
    nccl = collective_time("all_reduce", 131072, ranks, DGX)
    assert nccl.time_s == pytest.approx(25.6e-6 + 2 * 7 / 8 * 131072 / 480e9, rel=1e-9)
    # NCCL's: past the runtime's limit, and across nodes
    assert custom_all_reduce_time(9 * 2**20, ranks, DGX, custom) is None
    assert custom_all_reduce_time(1024, [0, 8], DGX, custom) is None


def test_a_graph_replayed_nccl_collective_pays_nccls_modelled_latency():
    """NCCL's tuning model (src/graph/tuning.cc), LL protocol, ring on one node: 6.6 us +
    0.6 us per NVLink step, at LL's bus bandwidth (a quarter of the ring's for all-reduce,
    a third for the others, at most 87.7 GB/s). DGX A100 (NVLink 3 at 300 GB/s x 0.772 =
    231.6 GB/s achieved): an 8 KiB all-reduce over 8 GPUs, 14 steps: 6.6 + 14 x 0.6 = 15.0
    us, where nccl-tests' eager 44.8 us stood, + 2 x 7/8 x 8192 B / 57.9 GB/s = 0.2476 us.
    An all-gather over 4 GPUs, 3 steps: 8.4 us. A 4 MiB all-reduce keeps the eager ring
    (44.8 + 7,340,032 B / 231.6 GB/s = 76.5 us, against 15.0 + 126.8 us for LL). All-to-all,
    a group across nodes and an AMD node keep their measured figure; a group of 16 on a
    GB200 NVL72 (6.6 + 30 x 0.6 = 24.6 us) keeps the cluster's lower 15.4 us."""
    from torchroof.timing.graph_collectives import in_graph, nccl_model_latency_s

    a100 = get_cluster("dgx-a100")
    ring = 300e9 * 0.772
    eager = collective_time("all_reduce", 8192, list(range(8)), a100)
    graph = in_graph(eager, a100)
    assert eager.alpha_s == pytest.approx(44.8e-6)
    assert graph.alpha_s == pytest.approx(15.0e-6, rel=1e-9)
    assert graph.time_s == pytest.approx(15.0e-6 + 2 * 7 / 8 * 8192 / (ring / 4), rel=1e-9)
    gather = in_graph(collective_time("all_gather", 8192, [0, 1, 2, 3], a100), a100)
    assert gather.alpha_s == pytest.approx(8.4e-6, rel=1e-9)
    assert nccl_model_latency_s("all_reduce", 2, "nvlink") == pytest.approx(7.8e-6)
    assert nccl_model_latency_s("all_reduce", 2, "pcie") == pytest.approx(8.6e-6)
    large = collective_time("all_reduce", 4 * 2**20, list(range(8)), a100)
    assert large.time_s == pytest.approx(44.8e-6 + 2 * 7 / 8 * 4 * 2**20 / ring, rel=1e-9)
    unchanged = [
        large,
        collective_time("all_to_all", 8192, list(range(8)), a100),
        collective_time("all_reduce", 8192, [0, 8], a100),
    ]
    assert [in_graph(net, a100) for net in unchanged] == unchanged
    for name, ranks in (("nd-mi300x-v5", range(8)), ("gb200-nvl72", range(16))):
        cluster = get_cluster(name)
        net = collective_time("all_reduce", 8192, list(ranks), cluster)
        assert in_graph(net, cluster) == net


def test_gpt_fast_replays_its_tensor_parallel_all_reduces_from_the_graph():
    """A tiny Llama's decode step at TP 2 on a DGX A100: the embedding's, attention's and
    MLP's all-reduces (1 + 2 x 2 layers) and the head's all-gather. Under gpt-fast (decode
    replayed as one CUDA graph) each all-reduce's fixed cost is NCCL's modelled 6.6 + 2 x
    0.6 = 7.8 us and the all-gather's 6.6 + 0.6 = 7.2 us; launched eagerly (the eager
    runtime) each is the cluster's measured 44.8 us. The runtime line says which."""
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY_LLAMA)
    times = {}
    for runtime in ("gpt-fast", "eager"):
        est = torchroof.estimate(
            config, "decode", hardware="dgx-a100", batch=1, context=32, tp=2, runtime=runtime
        )
        comms = [k for k in est.kernels if k.unit == "network" and k.link == "nvlink"]
        kinds = [k.name.split(".")[1].removesuffix("_") for k in comms]
        assert kinds == ["all_reduce"] + ["allreduce"] * 4 + ["all_gather_into_tensor"]
        times[runtime] = [round(k.latency_s * 1e7) for k in comms]
        stated = [line for line in est.assumptions if line.startswith("runtime:")]
        graph_line = "6 NCCL collectives in a node timed by NCCL's own model inside the CUDA"
        assert (graph_line in stated[0]) is (runtime == "gpt-fast")
    assert times == {"gpt-fast": [78] * 5 + [72], "eager": [448] * 6}
    # on an AMD node RCCL keeps its measured latency: nothing re-timed, nothing claimed
    amd = torchroof.estimate(
        config, "decode", hardware="nd-mi300x-v5", batch=1, context=32, tp=2, runtime="gpt-fast"
    )
    assert {k.latency_s for k in amd.kernels if k.unit == "network"} == {25.6e-6}
    assert not any("NCCL's own model" in line for line in amd.assumptions)


def test_llama_cpp_times_fp16_matmuls_at_the_fp16_accumulate_rate_where_listed():
    """A 4096^3 fp16 matmul (2 x 4096^3 = 137.4 GFLOP; 3 x 4096^2 x 2 B = 100.7 MB, 0.1 ms
    at 1,008 GB/s) on an RTX 4090: under llama.cpp (cuBLAS with CUBLAS_COMPUTE_16F) at the
    330.3 TFLOP/s of fp16 accumulation, 0.4161 ms; under the eager runtime at 165.2, 0.8320
    ms. MFU's reference peak follows, and the HTML report's ceiling key names the rate so
    its re-pricing on another part takes that part's fp16 peak (an H100's one rate). On an
    H100, which lists no such figure, both runtimes give 137.4e9 / 989.4e12 = 0.1389 ms."""
    from torchroof.render.html import accelerators, estimate_data

    with torchroof.trace() as t:
        x = torch.empty(4096, 4096, dtype=torch.float16, device="meta")
        x @ x
    flops = 2 * 4096**3
    fast = t.estimate("rtx-4090", runtime="llama-cpp")
    slow = t.estimate("rtx-4090", runtime="eager")
    assert fast.kernels[0].time_s == pytest.approx(flops / 330.3e12, rel=1e-9)
    assert slow.kernels[0].time_s == pytest.approx(flops / 165.2e12, rel=1e-9)
    assert fast.reference_peak_flops_per_s == 330.3e12
    assert slow.reference_peak_flops_per_s == 165.2e12
    said = "fp16 matmuls accumulating in fp16 (330.3 TFLOP/s)"
    assert any(said in line for line in fast.assumptions)
    assert not any(said in line for line in slow.assumptions)
    for runtime in ("llama-cpp", "eager"):
        h100 = t.estimate("h100-sxm", runtime=runtime)
        assert h100.kernels[0].time_s == pytest.approx(flops / 989.4e12, rel=1e-9)
    keys = estimate_data(fast)["keys"]  # the kernel's ceiling and MFU's reference
    assert keys == ["tensor|float16|fp16acc", "tensor|fp16|fp16acc"]
    peaks = {a["name"]: a["peaks"][keys[0]] for a in accelerators(set(keys))}
    assert (peaks["rtx-4090"], peaks["h100-sxm"]) == (330.3e12, 989.4e12)
    assert estimate_data(slow)["keys"] == ["tensor|float16", "tensor|fp16"]
    # saved and loaded, the page still names the rate the kernels were timed at
    again = torchroof.Estimate.from_dict(fast.to_dict())
    assert again.fp16_accumulate and estimate_data(again)["keys"] == keys
    assert "fp16_accumulate" not in slow.to_dict()
    # priced on an H100 (one fp16 rate), the page re-prices it on the 4090 at 330.3
    h100 = t.estimate("h100-sxm", runtime="llama-cpp")
    assert h100.fp16_accumulate and estimate_data(h100)["keys"] == keys
    assert not any(said in line for line in h100.assumptions)  # nothing new on an H100
    # the roofline plot draws the roof those matmuls ran under, on a part that has it
    from torchroof.render.plots import roof_lines

    roof = ("fp16 tensor, fp16 accumulate", 330.3e12)
    assert roof in roof_lines(fast, get("rtx-4090"))
    assert roof not in roof_lines(slow, get("rtx-4090"))
    assert [label for label, _ in roof_lines(h100, get("h100-sxm"))] == [
        "fp8 tensor", "bf16 tensor", "tf32 tensor", "fp32 vector",
    ]  # fmt: skip


def test_realistic_attention_runs_at_its_kernels_measured_share_of_the_peak():
    """Causal attention, 2 x 16 heads x 8192 tokens x head dim 128 on an H100 SXM (989.4
    TFLOP/s bf16), the FlashAttention papers' benchmark shape. Under torchtitan (cuDNN's
    kernel) the realistic forward runs at the file's measured 0.535 of the peak and the
    backward at 0.472, softmax included: compute = W / (989.4e12 x share), stretched only
    by the waves. Without a runtime the kernel keeps the mechanistic model (the sustained
    GEMM rate, 0.80, and its softmax); the pure roofline ignores both. On an A100 (312)
    FlashAttention-2's fwd + bwd 182 TFLOP/s gives 0.583 each way; FlashAttention-3 lists
    none there (Hopper only) and keeps the model."""
    import torch.nn.functional as F

    q = torch.empty(2, 16, 8192, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with torchroof.trace() as t:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    def attention(est):
        found = [k for k in est.kernels if "attention" in k.name]
        assert len(found) == 2  # forward, backward
        return found

    fwd, bwd = attention(t.estimate("h100-sxm", mode="realistic", runtime="torchtitan"))
    assert fwd.flops == 4 * 2 * 16 * 128 * 8192 * 8193 // 2  # causal: s(s + 1)/2 pairs
    assert fwd.peak_flops_per_s == pytest.approx(989.4e12 * 0.535, rel=1e-9)
    assert bwd.peak_flops_per_s == pytest.approx(989.4e12 * 0.472, rel=1e-9)
    for k in (fwd, bwd):
        assert k.compute_s == pytest.approx(k.flops / k.peak_flops_per_s / k.wave_efficiency)
    plain_fwd, _ = attention(t.estimate("h100-sxm", mode="realistic"))
    assert plain_fwd.peak_flops_per_s == pytest.approx(989.4e12 * 0.80, rel=1e-9)
    assert plain_fwd.compute_s > plain_fwd.flops / plain_fwd.peak_flops_per_s  # + softmax
    pure_fwd, _ = attention(t.estimate("h100-sxm", runtime="torchtitan"))
    assert pure_fwd.peak_flops_per_s == 989.4e12
    a100_fwd, a100_bwd = attention(t.estimate("a100-sxm", mode="realistic", runtime="eager"))
    assert a100_fwd.peak_flops_per_s == a100_bwd.peak_flops_per_s == pytest.approx(312e12 * 0.583)
    vllm_fwd, _ = attention(t.estimate("a100-sxm", mode="realistic", runtime="vllm"))
    assert vllm_fwd.peak_flops_per_s == pytest.approx(312e12 * 0.87, rel=1e-9)
    # a serving step states the forward share only
    from transformers import LlamaConfig

    served = torchroof.estimate(
        LlamaConfig(**TINY_LLAMA), "prefill", hardware="h100-sxm", seq=64, runtime="vllm",
        mode="realistic",
    )  # fmt: skip
    (line,) = [line for line in served.assumptions if line.startswith("runtime:")]
    assert "fa3 attention at its measured 61% forward of the tensor peak" in line
    # attention written out as math (scores to memory) is not the fused kernel measured
    math = t.estimate("h100-sxm", mode="realistic", runtime="torchtitan", attention="math")
    assert all(k.peak_flops_per_s == pytest.approx(989.4e12 * 0.80) for k in attention(math))


def test_the_summary_says_which_runtime_is_assumed():
    with torchroof.trace() as t:
        x = torch.empty(64, 64, device="meta")
        x @ x
    lines = t.estimate("h100-sxm").assumptions
    assert any(line.startswith("runtime: none named (--runtime)") for line in lines)


def test_cli_runtime_flag_sets_the_kernels_and_is_stated(capsys):
    argv = ["estimate", "gpt2", "--seq", "64", "--regime", "train", "--kernels", "0"]
    code = main([*argv, "--runtime", "torchtitan"])
    out = capsys.readouterr().out
    assert code == 0
    assert "runtime: torchtitan" in out and "eager kernels" in out
    code = main([*argv, "--runtime", "torchtitan", "--fusion", "fused"])
    out = capsys.readouterr().out
    assert code == 0 and "fused kernels" in out
    assert main(["estimate", "gpt2", "--runtime", "nonesuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown runtime 'nonesuch'" in err
    # a training runtime's prefill is refused before the model is built
    assert main(["estimate", "gpt2", "--runtime", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert "building the model" not in err
    assert "runtime torchtitan runs training steps, not prefill (serving) steps" in err


def test_the_hardware_command_lists_the_runtimes_and_shows_one_with_sources(capsys):
    assert main(["hardware"]) == 0
    listing = capsys.readouterr().out.split("Runtimes (--runtime NAME")[1]
    for name in SHIPPED:
        assert f"\n{name} " in listing
    assert main(["hardware", "torchtitan"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("torchtitan (eager) (torchtitan), runs training steps")
    assert "reshard_after_forward_with_pp  False" in shown and "parallelize.py" in shown


def test_compare_varies_the_runtime_and_each_variant_takes_its_kernels(capsys):
    result = torchroof.compare(
        "gpt2", vary={"runtime": ["torchtitan", "torchtitan-compile"]}, regime="train", seq=64
    )
    eager, fused = (v.estimate for v in result.variants)
    assert (eager.options.fusion, fused.options.fusion) == ("eager", "fused")
    assert len(eager.kernels) > len(fused.kernels)
    # the command line passes only the pricing flags written, so each runtime's own
    # kernels apply there too
    argv = ["compare", "gpt2", "--regime", "train", "--seq", "64", "--vary"]
    assert main([*argv, "runtime=torchtitan,torchtitan-compile"]) == 0
    out = capsys.readouterr().out
    assert "runtime=torchtitan " in out and "runtime=torchtitan-compile" in out
    assert main([*argv, "runtime=vllm,torchtitan"]) == 2
    err = capsys.readouterr().err
    assert "variant runtime=vllm: runtime vllm runs serving steps, not training" in err


def test_cli_turns_a_profiles_boolean_settings_off_as_written():
    # megatron-te reduces gradients once a step, saves sequence parallel's inputs as shards
    # and fp8 inputs in fp8, and torchtitan keeps parameters gathered under a pipeline:
    # each has a flag for either value, and the one written wins over the profile
    from torchroof.cli.common import pricing_settings, workload_settings
    from torchroof.cli.main import _parser

    def settings(*flags: str) -> tuple[dict, dict]:
        argv = ["estimate", "llama-3-8b", "--regime", "train", "--dp", "2", "--microbatches",
                "2", "--tp", "2", "--sequence-parallel", *flags]  # fmt: skip
        parser = _parser()
        args = parser.parse_args(argv)
        args.given = given_dests(parser, argv)
        return workload_settings(args), pricing_settings(args)

    workload, pricing = settings("--runtime", "megatron-te")
    assert workload["defer_gradient_sync"] is True
    assert pricing["sequence_parallel_regather"] is True and pricing["save_fp8_inputs"] is True
    workload, pricing = settings(
        "--runtime", "megatron-te", "--no-defer-gradient-sync",
        "--no-sequence-parallel-regather", "--no-save-fp8-inputs",
    )  # fmt: skip
    assert workload["defer_gradient_sync"] is False
    assert pricing["sequence_parallel_regather"] is False and pricing["save_fp8_inputs"] is False
    assert settings("--defer-gradient-sync")[0]["defer_gradient_sync"] is True
    workload, _ = settings("--runtime", "torchtitan", "--pp", "2")
    assert workload["reshard_after_forward"] is False
    workload, _ = settings("--runtime", "torchtitan", "--pp", "2", "--reshard-after-forward")
    assert workload["reshard_after_forward"] is True

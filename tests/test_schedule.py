"""Collectives priced at the network boundary and laid on two streams:
torchroof.pricing.price.time_collective, torchroof.timing.streams, the estimate's communication
figures. Every start and end below is derived by hand beside its assertion; durations are
binary fractions (0.5, 1.5, ...) so the sums are exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchroof.hardware import get_cluster
from torchroof.hardware.cluster import CLUSTER_DIR
from transformers import LlamaConfig, LlamaForCausalLM

import torchroof
from torchroof.api import estimate_trace
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.parallel.fsdp import apply_fsdp, fake_parameters
from torchroof.parallel.mesh import build_mesh
from torchroof.parallel.program import fake_process_group
from torchroof.parallel.tensor import apply_tensor_parallel
from torchroof.pricing.collectives import ClusterRequiredError
from torchroof.pricing.hardware import resolve_hardware
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, TensorRef
from torchroof.records.trace import Trace
from torchroof.render import text
from torchroof.report.analysis import communication, network_intensity
from torchroof.timing.streams import COMMUNICATION, Task, schedule

# dgx-h100.toml: NVLink 4 at 450 GB/s line rate, 0.8222 of it reached by a ring, 480 GB/s
# NVLS all-reduce bus bandwidth, alpha 25.6 us.
ALPHA_S = 2.56e-05
RING_BYTES_PER_S = 4.5e11 * 0.8222
NVLS_BYTES_PER_S = 4.8e11


def _comm(duration: float, reads: set[int], writes: set[int]) -> Task:
    return Task(duration, COMMUNICATION, frozenset(reads), frozenset(writes))


def _compute(duration: float, reads: set[int], writes: set[int]) -> Task:
    return Task(duration, "compute", frozenset(reads), frozenset(writes))


# -- the schedule on hand-built tasks ---------------------------------------------------------


def _prefetching_layers() -> list[Task]:
    """Layer 1's all-gather (params 1 -> 2), layer 2's all-gather issued before layer 1's
    compute (params 3 -> 4), layer 1's compute (reads 2), layer 2's (reads 4, 6)."""
    return [
        _comm(1.0, {1}, {2}),
        _comm(2.0, {3}, {4}),
        _compute(3.0, {2, 5}, {6}),
        _compute(3.0, {4, 6}, {7}),
    ]


def test_prefetched_all_gather_hides_behind_the_previous_layer():
    tasks = _prefetching_layers()
    laid = schedule(tasks)
    # all-gather 1: [0, 1]. all-gather 2: its stream is free at 1, nothing feeds it: [1, 3].
    # layer 1 waits for all-gather 1 (wrote 2): [1, 4], the compute stream idle over [0, 1].
    # layer 2 waits for all-gather 2 (ended at 3) and its stream (free at 4): [4, 7].
    assert laid.start_s == (0.0, 1.0, 1.0, 4.0)
    assert laid.end_s == (1.0, 3.0, 4.0, 7.0)
    assert laid.step_time_s == 7.0
    # the idle [0, 1] is all-gather 1's; all-gather 2 ran inside layer 1's compute: hidden
    assert laid.exposed_s == (1.0, 0.0, 0.0, 0.0)


def test_tp_all_reduce_read_at_once_is_fully_exposed():
    # a row-wise matmul writes 2, the all-reduce reduces 2 in place, the residual add reads 2
    tasks = [_compute(2.0, {1}, {2}), _comm(1.5, {2}, {2}), _compute(0.5, {2, 3}, {4})]
    laid = schedule(tasks)
    # matmul [0, 2]; the all-reduce waits for it (it touched 2): [2, 3.5]; the add waits
    # for the all-reduce (it wrote 2): [3.5, 4]. The compute stream idles over [2, 3.5].
    assert laid.start_s == (0.0, 2.0, 3.5)
    assert laid.end_s == (2.0, 3.5, 4.0)
    assert laid.exposed_s == (0.0, 1.5, 0.0)
    assert laid.step_time_s == 4.0 == sum(t.duration_s for t in tasks)


def test_reduce_scatter_hides_behind_the_rest_of_backward_but_not_at_the_tail():
    # layer 2's gradient (written 1) is reduce-scattered into 2 while layer 1's backward
    # (reads 5) runs; the last reduce-scatter (of 6) has nothing left to hide behind
    tasks = [
        _compute(1.0, {0}, {1}),
        _comm(2.0, {1}, {2}),
        _compute(3.0, {5}, {6}),
        _comm(0.5, {6}, {7}),
    ]
    laid = schedule(tasks)
    # grad [0, 1]; reduce-scatter [1, 3]; layer 1 [1, 4]; the last reduce-scatter waits for
    # layer 1 (wrote 6): [4, 4.5]. Step 4.5; the compute stream idles over the tail [4, 4.5].
    assert laid.start_s == (0.0, 1.0, 1.0, 4.0)
    assert laid.step_time_s == 4.5
    assert laid.exposed_s == (0.0, 0.0, 0.0, 0.5)


def test_a_wait_behind_queued_collectives_is_shared_by_their_running_time():
    # two collectives queue on one stream; the compute reads only the second one's result
    tasks = [_comm(2.0, {1}, {2}), _comm(1.0, {3}, {4}), _compute(0.5, {4}, {5})]
    laid = schedule(tasks)
    # first [0, 2], second [2, 3], compute [3, 3.5]: the idle [0, 3] is 2 s of the first
    # and 1 s of the second, never more than a collective's own time
    assert laid.exposed_s == (2.0, 1.0, 0.0)
    assert laid.step_time_s == 3.5


def test_collectives_crossing_two_links_run_at_once_and_share_the_wait():
    # a matmul writes 1; an all-gather across the network (2 s) and an all-reduce within
    # the node (1 s) both read it; the next matmul reads both results
    network = Task(2.0, COMMUNICATION, frozenset({1}), frozenset({2}), lane="network")
    node = Task(1.0, COMMUNICATION, frozenset({1}), frozenset({3}), lane="intra-node")
    tasks = [_compute(1.0, {0}, {1}), network, node, _compute(0.5, {2, 3}, {4})]
    laid = schedule(tasks)
    # each on its own stream from 1: network [1, 3], intra-node [1, 2]; the matmul [3, 3.5].
    # On one stream they would queue: [1, 3], [3, 4], the matmul [4, 4.5].
    assert laid.start_s == (0.0, 1.0, 1.0, 3.0)
    assert laid.end_s == (1.0, 3.0, 2.0, 3.5)
    assert laid.step_time_s == 3.5
    # the idle [1, 3]: over [1, 2] both run, 0.5 s each; over [2, 3] the all-gather alone
    assert laid.exposed_s == (0.0, 1.5, 0.5, 0.0)
    assert sum(laid.exposed_s) == 2.0  # the compute stream's idle time, no more


def test_a_collective_waits_for_what_another_stream_reduced():
    # HSDP: the reduce-scatter within the node writes 2, the all-reduce across the network
    # reduces 2 in place, the optimizer reads 2
    tasks = [
        Task(1.0, COMMUNICATION, frozenset({1}), frozenset({2}), lane="intra-node"),
        Task(2.0, COMMUNICATION, frozenset({2}), frozenset({2}), lane="network"),
        _compute(0.5, {2}, {3}),
    ]
    laid = schedule(tasks)
    # the all-reduce starts when the reduce-scatter ends, not when its own stream is free:
    # [0, 1], [1, 3], the optimizer [3, 3.5]; the idle [0, 3] is 1 s and 2 s of them
    assert laid.waits == ((), (0,), (1,))
    assert laid.start_s == (0.0, 1.0, 3.0)
    assert laid.exposed_s == (1.0, 2.0, 0.0)


def test_without_overlap_every_kernel_waits_for_the_one_before():
    tasks = [_comm(1.0, {1}, {2}), _comm(2.0, {3}, {4}), _compute(3.0, {2}, {6})]
    laid = schedule(tasks, overlap=False)
    # back to back: [0, 1], [1, 3], [3, 6]; each collective wholly exposed
    assert laid.start_s == (0.0, 1.0, 3.0)
    assert laid.step_time_s == 6.0
    assert laid.exposed_s == (1.0, 2.0, 0.0)


def test_durations_given_apart_lay_the_same_tasks_at_other_times():
    # the prefetch case above with the all-gathers' and layers' times swapped: 3, 3, 1, 2
    tasks = _prefetching_layers()
    laid = schedule(tasks, durations=[3.0, 3.0, 1.0, 2.0])
    # all-gather 1 [0, 3], all-gather 2 [3, 6]; layer 1 waits for all-gather 1: [3, 4];
    # layer 2 for all-gather 2: [6, 8]. The compute stream idles over [0, 3] (all-gather
    # 1's, wholly) and [4, 6] (all-gather 2 runs over [3, 6]: 2 of its 3 s exposed)
    assert laid.start_s == (0.0, 3.0, 3.0, 6.0)
    assert laid.end_s == (3.0, 6.0, 4.0, 8.0)
    assert laid.exposed_s == (3.0, 2.0, 0.0, 0.0)
    times = [3.0, 3.0, 1.0, 2.0]
    moved = [dataclasses.replace(t, duration_s=d) for t, d in zip(tasks, times, strict=True)]
    assert schedule(moved) == laid
    # without overlap: back to back, 3 + 3 + 1 + 2
    assert schedule(tasks, overlap=False, durations=[3.0, 3.0, 1.0, 2.0]).step_time_s == 9.0
    with pytest.raises(ValueError, match="3 durations for 4 tasks"):
        schedule(tasks, durations=[1.0, 1.0, 1.0])


def test_an_explicit_wait_holds_a_communication_task():
    # FSDP2's one all-gather in flight: the copy-in (task 2) waits for the copy-out (task 1)
    tasks = [
        _comm(1.0, {1}, {2}),
        _compute(2.0, {2}, {3}),
        Task(0.5, COMMUNICATION, frozenset({8}), frozenset({9}), after=(1,)),
    ]
    laid = schedule(tasks)
    # all-gather [0, 1]; copy-out [1, 3]; the copy-in touches nothing computed, but waits
    # for the copy-out: [3, 3.5], the compute stream idle over the tail [3, 3.5]
    assert laid.start_s == (0.0, 1.0, 3.0)
    assert laid.exposed_s == (1.0, 0.0, 0.5)


# -- a hand-built trace through the pipeline --------------------------------------------------


def _t(shape: tuple[int, ...], storage: int) -> TensorMeta:
    stride = (shape[1], 1) if len(shape) == 2 else (1,)
    return TensorMeta(shape, stride, "bfloat16", storage)


def _mm(index: int, a: TensorMeta, b: TensorMeta, out: TensorMeta, module: str) -> OpRecord:
    args = {"self": TensorRef(0), "mat2": TensorRef(1)}
    return OpRecord(index, "aten.mm.default", (a, b), (out,), args, module, "forward")


def _tp_trace(ranks: list[int]) -> Trace:
    """A row-wise matmul, the functional all-reduce of its partial sums, autograd's wrap of
    the result (recorded under the collective's storage, as capture records it), and a
    matmul reading it at once."""
    x, w1, partial = _t((4096, 1024), 1), _t((1024, 4096), 2), _t((4096, 4096), 3)
    reduced, wrapped, w2, out = (
        _t((4096, 4096), 4),
        _t((4096, 4096), 4),
        _t((4096, 1024), 6),
        _t((4096, 1024), 7),
    )
    group = {"group_name": "0", "group_size": len(ranks), "group_ranks": ranks}
    return Trace(
        ops=[
            _mm(0, x, w1, partial, "layers.0.o_proj"),
            OpRecord(
                1,
                "_c10d_functional.all_reduce.default",
                (partial,),
                (reduced,),
                {"input": TensorRef(0), "reduce_op": "sum", **group},
                "layers.0.o_proj",
                "forward",
            ),
            OpRecord(
                2,
                "_c10d_functional._wrap_tensor_autograd.default",
                (reduced,),
                (wrapped,),
                {"t": TensorRef(0)},
                "layers.0.o_proj",
                "forward",
            ),
            _mm(3, wrapped, w2, out, "layers.1.up_proj"),
        ]
    )


def test_an_all_reduce_read_at_once_blocks_the_next_matmul():
    est = estimate_trace(_tp_trace(list(range(8))), "dgx-h100", fusion="eager")
    first, reduce, second = est.kernels
    assert (reduce.stream, reduce.link, reduce.bound) == ("communication", "nvlink", "network")
    # the wrap keeps the all-reduce's storage (4): the matmul reading it waits for it
    assert reduce.start_s == first.time_s
    assert second.start_s == first.time_s + reduce.time_s
    assert reduce.exposed_s == reduce.time_s
    assert est.time_s == second.start_s + second.time_s
    assert est.cluster == "dgx-h100" and est.hardware == "h100-sxm"
    rows = {row.name: row for row in est.rows()}
    assert rows["layers.0"].exposed_communication_s == reduce.time_s
    assert rows["layers.0"].hidden_communication_s == 0.0


def test_the_chrome_trace_lays_kernels_where_the_schedule_put_them():
    from torchroof.render.chrome_trace import chrome_trace

    est = estimate_trace(_tp_trace(list(range(8))), "dgx-h100", fusion="eager")
    first, reduce, second = est.kernels
    events = [e for e in chrome_trace(est)["traceEvents"] if e["ph"] == "X"]
    tracks = {
        e["args"]["name"]: e["tid"]
        for e in chrome_trace(est)["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    # matmul, all-reduce on the communication track, matmul waiting for it (microseconds)
    assert [e["tid"] for e in events] == [tracks["forward"], tracks["communication"],
                                          tracks["forward"]]  # fmt: skip
    assert [e["ts"] for e in events] == [0.0, first.time_s * 1e6, second.start_s * 1e6]
    assert events[1]["args"]["link"] == "nvlink"
    assert events[1]["args"]["exposed_us"] == reduce.time_s * 1e6


def test_collectives_on_a_bare_accelerator_are_refused():
    with pytest.raises(
        ClusterRequiredError,
        match=r"^this step has 1 collective over groups of up to 8 ranks: price it on a "
        r"cluster: aws-p5, dgx-h100$",
    ):
        estimate_trace(_tp_trace(list(range(8))), "h100-sxm")
    with pytest.raises(ClusterRequiredError, match="cluster of a10g .none ships"):
        estimate_trace(_tp_trace([0, 1]), "a10g")


def test_a_cluster_by_path_or_spec_prices_on_its_accelerator():
    path = CLUSTER_DIR / "dgx-h100.toml"
    spec, cluster = resolve_hardware(path)
    assert spec.name == "h100-sxm" and cluster is not None and cluster.name == "dgx-h100"
    assert resolve_hardware(cluster) == (spec, cluster)
    assert resolve_hardware("h100")[1] is None
    by_path = estimate_trace(_tp_trace([0, 1]), path)
    by_spec = estimate_trace(_tp_trace([0, 1]), cluster)
    assert by_path.time_s == by_spec.time_s and by_path.cluster == "dgx-h100"


# -- a traced TP=8 step on a DGX H100 ---------------------------------------------------------

B, T, D = 2, 16, 256


def _llama(**overrides: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        **{
            **dict(
                hidden_size=D,
                num_attention_heads=8,
                num_key_value_heads=8,
                intermediate_size=512,
                vocab_size=1024,
                num_hidden_layers=2,
            ),
            **overrides,
        }
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def tp8_prefill() -> Trace:
    plan = ParallelPlan(tp=8)
    with fake_process_group(plan.world):
        model = apply_tensor_parallel(_llama(), build_mesh(plan)["tp"])
        ids = torch.zeros(B, T, dtype=torch.long, device="meta")
        with torchroof.trace() as trace:
            with torch.no_grad():
                model(ids)
    return trace


def _o_proj_all_reduce(est):
    return next(
        k
        for k in est.kernels
        if k.module == "model.layers.0.self_attn.o_proj" and k.unit == "network"
    )


def test_tp8_all_reduce_is_alpha_plus_bus_bytes_over_beta(tp8_prefill):
    # S = B*T*d*2 bytes = 2*16*256*2 = 16,384; a ring sends 2(n-1)/n*S = 2*7/8*16,384
    # = 28,672 bytes per rank over NVLink. With NVLS (the default on an NVSwitch node)
    # beta is its bus bandwidth, 480 GB/s: 25.6 us + 28,672 / 4.8e11 = 25.65973 us.
    est = tp8_prefill.estimate("dgx-h100")
    kernel = _o_proj_all_reduce(est)
    assert kernel.wire_by_link == {"nvlink": 28_672}
    assert kernel.network_s == pytest.approx(ALPHA_S + 28_672 / NVLS_BYTES_PER_S, rel=1e-12)
    # HBM: 16,384 read + 16,384 written at 3.35 TB/s = 9.8 ns, far under the network time
    assert kernel.time_s == kernel.network_s and kernel.bound == "network"
    assert kernel.exposed_s == kernel.time_s  # read at once by the residual add
    # the ring itself, on the same node without NVLS: beta = 450 GB/s x 0.8222
    dgx = get_cluster("dgx-h100")
    ring_only = dataclasses.replace(
        dgx, intra_node=dataclasses.replace(dgx.intra_node, nvls_all_reduce_bus_bytes_per_s=None)
    )
    ring = _o_proj_all_reduce(tp8_prefill.estimate(ring_only))
    assert ring.time_s == pytest.approx(ALPHA_S + 28_672 / RING_BYTES_PER_S, rel=1e-12)


def test_overlap_off_is_the_plain_sum(tp8_prefill):
    est = tp8_prefill.estimate("dgx-h100", overlap_communication=False)
    assert est.time_s == sum(k.time_s for k in est.kernels)
    comm = communication(est)
    assert comm.exposed_s == comm.time_s and comm.hidden_s == 0.0
    # TP all-reduces are read at once: with overlap they are as exposed, and the step is
    # shorter only by the one kernel that does not wait for the embedding's all-reduce (the
    # rotary tables, module "model"), which runs beneath it
    overlapped = tp8_prefill.estimate("dgx-h100")
    (rotary,) = [k for k in overlapped.kernels if k.module == "model"]
    assert est.time_s - overlapped.time_s == pytest.approx(rotary.time_s, rel=1e-6)


def test_network_intensity_and_the_summary_name_the_link(tp8_prefill):
    est = tp8_prefill.estimate("dgx-h100")
    (nvlink,) = network_intensity(est).values()
    # every collective sends its bytes over NVLink: I_net = step FLOPs / those bytes; the
    # ridge is the H100's bf16 peak over NVLink 4's 450 GB/s (989.4e12 / 450e9: 2,198)
    wire = sum(k.wire_bytes for k in est.kernels)
    assert nvlink.wire_bytes == wire and nvlink.intensity == est.flops / wire
    assert nvlink.ridge == get_cluster("dgx-h100").link_ridges("bf16")["nvlink"]
    assert round(nvlink.ridge) == 2199 and not nvlink.hides
    summary = text.summary(est)
    comm = communication(est)
    assert (
        f"communication: {comm.time_s * 1e3:.3f} ms on the communication stream, "
        f"{comm.exposed_s * 1e3:.3f} ms exposed ({100 * comm.exposed_s / est.time_s:.1f}% of "
        f"the step), hidden behind compute: {comm.hidden_s * 1e3:.3f} ms; links: nvlink "
        f"{comm.by_link_s['nvlink'] * 1e3:.3f} ms"
    ) in summary
    assert f"nvlink {nvlink.intensity:,.0f} FLOP/B vs ridge 2,199" in summary
    assert "in cluster dgx-h100" in summary
    assert "exposed comm ms" in text.layer_table(est)
    assert "network (nvlink)" in text.kernel_table(est)


# -- FSDP2's real program ---------------------------------------------------------------------


def test_fsdp_all_gathers_and_reduce_scatters_hide_behind_layers():
    # 4 layers of d = 256 on 8 FSDP ranks, B*T = 8,192 tokens: a layer's forward (~50 us)
    # outlasts its all-gather (~28 us), so every all-gather after the first layer's hides;
    # a layer's gradient reduce-scatter hides behind the next layer's backward, except the
    # last two (the final layer's and the embedding's), with no backward left behind them.
    plan = ParallelPlan(fsdp=8)
    with fake_process_group(plan.world):
        model = apply_tensor_parallel(_llama(num_hidden_layers=4), build_mesh(plan)["tp"])
        apply_fsdp(model, build_mesh(plan))
        with fake_parameters(model):
            ids = torch.zeros(4, 2048, dtype=torch.long)
            with torchroof.trace() as trace:
                model(ids, labels=ids).loss.backward()
    est = trace.estimate("dgx-h100")
    gathers = [k for k in est.kernels if "allgather" in k.name]
    scatters = [k for k in est.kernels if "reduce_scatter" in k.name]
    forward = [k for k in gathers if k.phase == "forward" and ".layers." in k.module]
    assert [k.module for k in forward] == [f"model.layers.{i}" for i in range(4)]
    assert [k.exposed_s for k in forward[1:]] == [0.0, 0.0, 0.0]
    assert [k.exposed_s for k in scatters[:-2]] == [0.0] * (len(scatters) - 2)
    assert all(k.exposed_s > 0 for k in scatters[-2:])
    comm = communication(est)
    assert comm.copies_s > 0  # FSDP2's copy-in and chunk-cat ride the communication stream
    assert comm.exposed_s + comm.hidden_s == pytest.approx(comm.time_s, rel=1e-12)
    assert est.time_s < sum(k.time_s for k in est.kernels)


def test_fsdp_across_nodes_runs_beside_tensor_parallel_within_the_node():
    # FSDP 2 x TP 2 on H100 nodes of two GPUs: tensor-parallel collectives (ranks 0-1)
    # stay on the node, FSDP's (ranks 0 and 2) cross the network; the two streams overlap
    plan = ParallelPlan(fsdp=2, tp=2)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        model = apply_tensor_parallel(_llama(num_hidden_layers=2), mesh["tp"])
        apply_fsdp(model, mesh)
        with fake_parameters(model):
            ids = torch.zeros(2, 512, dtype=torch.long)
            with torchroof.trace() as trace:
                model(ids, labels=ids).loss.backward()
    two_per_node = dataclasses.replace(get_cluster("dgx-h100"), gpus_per_node=2)
    est = trace.estimate(two_per_node)
    comms = [k for k in est.kernels if k.communication]
    collectives = [k for k in comms if k.unit == "network"]
    assert {k.lane for k in collectives if k.link == "network"} == {"network"}
    assert {k.lane for k in collectives if k.link == "nvlink"} == {"intra-node"}
    # FSDP2's copy-in and chunk-cat feed the FSDP collectives: on the network's stream
    copies = [k for k in comms if k.unit != "network"]
    assert copies and {k.lane for k in copies} == {"network"}
    # some collective across the network runs while one within the node runs
    spans = {
        lane: [(k.start_s, k.start_s + k.time_s) for k in comms if k.lane == lane]
        for lane in ("network", "intra-node")
    }
    assert any(a < d and c < b for a, b in spans["network"] for c, d in spans["intra-node"])
    # the exposed charges add up to the compute stream's idle time and none exceeds its own
    compute_s = sum(k.time_s for k in est.kernels if not k.communication)
    assert sum(k.exposed_s for k in comms) == pytest.approx(est.time_s - compute_s, rel=1e-9)
    assert all(0.0 <= k.exposed_s <= k.time_s * (1 + 1e-12) for k in comms)
    # the estimate says so once; on one node of eight every collective stays inside it
    line = "collectives across the network run on their own stream beside those within the node"
    assert sum(a.startswith(line) for a in est.assumptions) == 1
    one_node = trace.estimate("dgx-h100")
    assert {k.lane for k in one_node.kernels if k.communication} == {"intra-node"}
    assert not any(a.startswith(line) for a in one_node.assumptions)
    # the summary names both streams; on one node it keeps the one
    from torchroof.render.text import summary

    both = "on the communication streams (within the node and across the network)"
    assert both in summary(est) and both not in summary(one_node)
    assert "ms on the communication stream, " in summary(one_node)
    # the timeline draws the network's stream on a track of its own
    from torchroof.render.chrome_trace import chrome_trace

    events = chrome_trace(est)["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    on_network = [
        e for e in events if e["ph"] == "X" and e["tid"] == names["communication (network)"]
    ]
    assert len(on_network) == sum(k.lane == "network" for k in comms)


# -- one GPU: nothing changes -----------------------------------------------------------------


def test_a_single_gpu_estimate_is_unchanged_to_the_last_digit():
    # README: `torchroof estimate` (Llama-3-8B prefill, 1 x 4096, H100 SXM) = 69.669 ms; the
    # figure below is the full float before collectives were priced
    est = torchroof.estimate("llama-3-8b")
    assert est.time_s == 0.06966915612708845
    assert est.step_time_s is None and est.cluster is None and est.link_ridges == {}
    assert all(k.start_s is None and k.stream == "compute" for k in est.kernels)
    assert "communication" not in text.summary(est) and "exposed comm" not in text.layer_table(est)

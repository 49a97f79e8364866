"""A collective replayed from a CUDA graph: NCCL's own latency model instead of nccl-tests'
eager small-message time.

A cluster file's ``latency_s`` is what nccl-tests measures for a tiny all-reduce launched
eagerly, one call after another: the host's launch of NCCL's kernel and its proxy thread's
work are inside it (44.8 us on eight A100s). A step replayed from a CUDA graph launches
nothing from the host (torch.compile's ``reduce-overhead`` captures the NCCL calls with the
rest of gpt-fast's decode step), so what is left is the kernel's own fixed cost. NCCL
models that cost itself, to choose an algorithm and protocol for each call
(``src/graph/tuning.cc``, ``ncclTopoTuneModel``): a base latency per algorithm and protocol
plus a hardware latency per step of the algorithm. For the LL protocol small messages take,
on one node:

- ring all-reduce: ``baseLat[ring][LL] + 2(n-1) x hwLat[link][ring][LL]``, 2(n-1) steps;
- ring all-gather and reduce-scatter: ``baseLat[ring][LL] + (n-1) x hwLat[link][ring][LL]``;
- tree all-reduce: ``baseLat[tree][LL] + 2(n-1) x hwLat[link][tree][LL]`` (one node), never
  below the ring's with NCCL's constants, so the ring's is taken.

With ``baseLat[ring][LL] = 6.6 us`` and ``hwLat = 0.6 us`` per NVLink step (1.0 us over
PCIe), an all-reduce over 8 NVLink GPUs is modelled at 6.6 + 14 x 0.6 = 15.0 us, over 2 at
7.8 us. Measured in-graph NCCL all-reduces on eight H100s take 16-23 us (sgl-project/sglang
#10571, vllm-project/vllm#24111), just above the model, so it stands for the pure floor and
the realistic time alike.

LL buys that latency with bandwidth: its bus bandwidth is a quarter of the ring's for an
all-reduce, a third for the others, and at most 87.7 GB/s on one Ampere or Hopper node
(``llMaxBws``). NCCL picks the fastest algorithm and protocol for each size, so a collective
in a graph takes the faster of the LL ring (the model's latency, LL's bandwidth) and the
cluster's own time (its measured latency and bandwidth, the other protocols' and NVLS's):
small messages the first, large ones the second. It is never priced above the cluster's time.

Only NVIDIA's links (NVLink, PCIe) on one node are modelled: RCCL's constants differ, and a
group across nodes keeps its measured network latency. All-to-all and send/recv are point
to point in NCCL, outside this model: they keep the cluster's figure.
"""

from __future__ import annotations

from dataclasses import replace

from torchroof.hardware.cluster import ClusterSpec
from torchroof.timing.network import CollectiveTime, intra_rate

# NVIDIA/nccl src/graph/tuning.cc @b647562: baseLat[ring][LL] = 6.6 us.
NCCL_RING_LL_BASE_S = 6.6e-6
# NVIDIA/nccl src/graph/tuning.cc @b647562: hwLat[NVLINK][ring][LL] = 0.6 us,
# hwLat[PCI][ring][LL] = 1.0 us per step.
NCCL_RING_LL_STEP_S = {"nvlink": 0.6e-6, "pcie": 1.0e-6}
# NVIDIA/nccl src/graph/tuning.cc @b647562: llMaxBws, one node of Ampere or Hopper: 87.7 GB/s.
NCCL_LL_MAX_BUS_BYTES_PER_S = 87.7e9
# tuning.cc: ring LL's bus bandwidth is busBw / 4 for all-reduce, busBw / 3 for the others
_LL_SHARE = {"all_reduce": 1 / 4, "all_gather": 1 / 3, "reduce_scatter": 1 / 3}
# ring steps per kind over n ranks (tuning.cc: nsteps)
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1}
_STEPS["reduce_scatter"] = _STEPS["all_gather"]


def nccl_model_latency_s(kind: str, group_size: int, link: str) -> float | None:
    """NCCL's modelled fixed cost of a small ``kind`` collective over ``group_size`` ranks of
    one node joined by ``link`` (LL protocol, ring), or None where the model does not apply
    (another kind, an AMD link, a group of one)."""
    step = NCCL_RING_LL_STEP_S.get(link)
    steps = _STEPS.get(kind)
    if step is None or steps is None or group_size < 2:
        return None
    return NCCL_RING_LL_BASE_S + steps(group_size) * step


def in_graph(net: CollectiveTime, cluster: ClusterSpec) -> CollectiveTime:
    """``net`` as a CUDA graph replays it: the LL ring at NCCL's modelled latency and LL's
    bandwidth where that is faster (a group on one node of ``cluster``, an NCCL
    algorithm); a runtime's own all-reduce, a group across nodes or a group of one is
    returned as it is, and so is a message the cluster's own time carries faster."""
    if net.nodes != 1 or net.algorithm not in ("ring", "nvls"):
        return net
    alpha = nccl_model_latency_s(net.kind, net.group_size, net.link)
    if alpha is None:
        return net
    ring = intra_rate(cluster.intra_node, net.group_size, cluster.gpus_per_node)
    beta = min(NCCL_LL_MAX_BUS_BYTES_PER_S, ring * _LL_SHARE[net.kind])
    time_s = alpha + net.intra_node_bytes_per_rank / beta
    if time_s >= net.time_s:
        return net
    return replace(net, algorithm="ring", time_s=time_s, alpha_s=alpha, beta_bytes_per_s=beta)

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
the realistic time alike. The model is never taken above the cluster's measured figure.

Only NVIDIA's links (NVLink, PCIe) on one node are modelled: RCCL's constants differ, and a
group across nodes keeps its measured network latency. All-to-all and send/recv are point
to point in NCCL, outside this model: they keep the cluster's figure.
"""

from __future__ import annotations

from dataclasses import replace

from torchroof.timing.network import CollectiveTime

# NVIDIA/nccl src/graph/tuning.cc @b647562: baseLat[ring][LL] = 6.6 us.
NCCL_RING_LL_BASE_S = 6.6e-6
# NVIDIA/nccl src/graph/tuning.cc @b647562: hwLat[NVLINK][ring][LL] = 0.6 us,
# hwLat[PCI][ring][LL] = 1.0 us per step.
NCCL_RING_LL_STEP_S = {"nvlink": 0.6e-6, "pcie": 1.0e-6}
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


def in_graph(net: CollectiveTime) -> CollectiveTime:
    """``net`` as a CUDA graph replays it: NCCL's modelled latency in place of the cluster's
    measured one where that is lower (a group on one node, an NCCL algorithm); a runtime's
    own all-reduce, a group across nodes or a group of one is returned as it is."""
    if net.nodes != 1 or net.algorithm not in ("ring", "nvls"):
        return net
    alpha = nccl_model_latency_s(net.kind, net.group_size, net.link)
    if alpha is None or alpha >= net.alpha_s:
        return net
    return replace(net, time_s=net.time_s - net.alpha_s + alpha, alpha_s=alpha)

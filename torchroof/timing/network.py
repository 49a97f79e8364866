"""Collectives priced at the network boundary: bytes on the wire per rank, and alpha + bytes/beta.

The network ridge (docs/concepts/network-ridges.md): the same roofline one level out. beta is
the rate at which bytes
cross the link in question and Q the bytes a rank sends; a collective's time is
``alpha + Q / beta`` on the link its group spans.

Message size and bus factor (nccl-tests doc/PERFORMANCE.md), stated once here. ``S`` is
``message_bytes``:

- all_reduce: the buffer every rank holds (input = output size). Factor 2(n-1)/n: a ring
  reduce-scatters then all-gathers, each step sending (n-1)/n of S.
- all_gather: the gathered output (n shards of S/n). Factor (n-1)/n.
- reduce_scatter: the full input (n shards of S/n). Factor (n-1)/n.
- all_to_all: each rank's send buffer (n chunks of S/n, one per peer). Factor (n-1)/n: a rank
  keeps its own chunk and sends the other n-1 once (links are full duplex).
- broadcast: the buffer. Factor 1: a pipelined chain, every rank forwards S once.
- send_recv: the message. Factor 1.
- A group of one sends nothing: the factor is 0 for every kind.

Bytes each rank sends = factor x S. Time on one link = alpha + factor x S / beta, with beta =
line rate x achieved fraction (the bus bandwidth nccl-tests reports), both from the cluster
spec. The link is chosen by the ranks, numbered node-major (rank r on node r // gpus_per_node):

- all ranks on one node: the intra-node link (NVLink, or xGMI on AMD). An all-reduce uses the
  cluster's NVLink SHARP (NVLS) bus bandwidth when it lists one and ``nvls`` is on (NCCL's
  default for all-reduce on Hopper NVSwitch nodes). On a ``full_mesh`` node of G GPUs, a
  group of k uses k-1 of each GPU's G-1 links: beta x (k-1)/(G-1).
- one rank per node: the network, each GPU through its own NIC.
- k ranks on each of m nodes, both > 1: hierarchical. The algorithm, per kind (every GPU
  drives its own NIC, one rail each, so the network carries 1/k of the data per GPU):
  all_reduce: reduce-scatter inside the node ((k-1)/k x S), all-reduce across nodes on the
  S/k shard (2(m-1)/m x S/k), all-gather inside the node ((k-1)/k x S).
  all_gather: all-gather across nodes on S/k ((m-1)/m x S/k), then inside ((k-1)/k x S);
  reduce_scatter the reverse, same bytes. broadcast: S/k per rail across nodes, an all-gather
  of (k-1)/k x S inside. all_to_all: direct sends, (k-1)/n x S to node peers and (n-k)/n x S
  over the NIC. The phases run pipelined chunk by chunk in one kernel, as NCCL's ring and
  tree do, so time = alpha_network + max(intra bytes / beta_intra, network bytes / beta_net).
  The network alpha is measured on groups of whole nodes, so it already holds the in-node
  hops. With uneven groups k is the busiest node's count. NB: the in-node phases run at the
  ring rate even where the switch offers NVLS (NCCL's NVLSTree would be faster).

Where this differs from PyTorch's alpha-beta model (``torch._inductor.comm_analysis``, adapted
from NCCL's tuning.cc), and why:

1. Reused: the form ``lat + nBytes x nsteps / (nRanks x busBw)``, which is alpha + factor x
   S / beta, and its ring factors for all-reduce, all-gather and reduce-scatter. Its
   per-generation NVLink bus bandwidths are our achieved rates (Hopper 370 GB/s = 0.822 x 450).
2. beta and alpha come from the cluster spec (sourced, per platform), not from the local
   GPU's generation, because the hardware is being priced before anyone owns it.
3. all_to_all: it counts 2(n-1) ring steps (factor 2(n-1)/n); we use nccl-tests' (n-1)/n,
   the bytes a rank actually sends.
4. Message size: it passes the collective's input bytes, which for all_gather is one shard
   (S/n); we take nccl-tests' S (the gathered output), to which the factor applies.
5. Across nodes it prices the whole ring at one NIC's rate per GPU (bwInter: 50 GB/s on
   Hopper, with NIC-efficiency corrections). That misses the rails: NCCL spreads a node's
   traffic over its k NICs, and a DGX A100 with 8x 200 Gb/s NICs measures ~192 GB/s
   all-reduce bus bandwidth across nodes (NVIDIA/nccl#812), 8x what one 25 GB/s NIC allows.
   The hierarchical form above reaches that (k x NIC rate) as the node count grows.
6. alpha: it builds latency from NCCL's per-step constants (baseLat + nsteps x hwLat, per
   algorithm and protocol) and picks the fastest of ring/tree x LL/LL128/Simple; we take one
   measured small-message time per link. NB: alpha does not grow with the group, so small
   collectives over hundreds of nodes are under-priced (NCCL's tree keeps that growth
   logarithmic), and there is no protocol choice: the mid-size ramp (1-64 MiB, where
   nccl-tests bus bandwidth climbs toward its peak) is alpha + S/beta only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from torchroof.counters.bus import bus_factor, check_kind
from torchroof.hardware.cluster import ClusterSpec, Link
from torchroof.timing.runtime import CustomAllReduce

NETWORK = "network"
HIERARCHICAL = "hierarchical"
NO_LINK = "none"  # a group of one: nothing crosses any link


class _Shape(TypedDict):
    """The fields of a CollectiveTime every link shares: what runs, over how many ranks."""

    kind: str
    message_bytes: float
    group_size: int
    nodes: int


@dataclass(frozen=True)
class CollectiveTime:
    """One collective on one rank: what crosses which link, and how long it takes.

    ``link`` is the boundary the report names: the intra-node link's kind (``"nvlink"``,
    ``"xgmi"``), ``"network"``, ``"hierarchical"`` (both), or ``"none"`` for a group of one.
    ``bound_link`` is the link whose bytes / beta set the time (for hierarchical, the slower
    of the two). ``beta_bytes_per_s`` is that link's achieved rate (0 when nothing crosses).
    """

    kind: str
    message_bytes: float
    group_size: int
    nodes: int
    ranks_per_node: int  # the busiest node's count
    link: str
    bound_link: str
    algorithm: str  # "ring", "nvls", "direct" (all_to_all, send_recv), "hierarchical", "none",
    # a runtime's own all-reduce: "one-shot" or "two-shot"
    time_s: float
    alpha_s: float
    beta_bytes_per_s: float
    intra_node_bytes_per_rank: float
    network_bytes_per_rank: float

    @property
    def wire_bytes_per_rank(self) -> float:
        """Bytes one rank sends over all links."""
        return self.intra_node_bytes_per_rank + self.network_bytes_per_rank


def _check_ranks(kind: str, group_ranks: Sequence[int], cluster: ClusterSpec) -> list[int]:
    ranks = list(group_ranks)
    if not ranks:
        raise ValueError("group_ranks is empty: a collective needs at least one rank")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ValueError(f"ranks are integers >= 0, got {bad[:4]!r}")
    if len(set(ranks)) != len(ranks):
        repeated = sorted(r for r, count in Counter(ranks).items() if count > 1)
        raise ValueError(f"group_ranks repeats ranks {repeated[:4]!r}")
    if kind == "send_recv" and len(ranks) != 2:
        raise ValueError(f"send_recv takes the two ranks of the pair, got {len(ranks)} ranks")
    nodes = {cluster.node_of(r) for r in ranks}
    if len(nodes) > 1 and cluster.network is None:
        raise ValueError(
            f"ranks {min(ranks)} and {max(ranks)} are on different nodes, but {cluster.name} "
            f"has no [network]: it is one node of {cluster.gpus_per_node} GPUs"
        )
    if cluster.max_nodes is not None and max(nodes) >= cluster.max_nodes:
        raise ValueError(
            f"rank {max(ranks)} is on node {max(nodes)}, but {cluster.name} has at most "
            f"{cluster.max_nodes} nodes of {cluster.gpus_per_node} GPUs"
        )
    return ranks


def intra_rate(link: Link, ranks_on_node: int, gpus_per_node: int) -> float:
    """Achieved per-GPU rate for a group of ``ranks_on_node`` GPUs sharing one node."""
    rate = link.achieved_bytes_per_s
    if link.topology == "full_mesh" and gpus_per_node > 1:
        rate *= max(ranks_on_node - 1, 1) / (gpus_per_node - 1)
    return rate


def _hierarchical_bytes(kind: str, size: float, n: int, k: int, m: int) -> tuple[float, float]:
    """(intra-node, network) bytes one rank sends: k ranks per node on m > 1 nodes, n in all.
    (send_recv never gets here: a pair is on one node or one rank per node.)"""
    if kind == "all_reduce":
        return 2 * (k - 1) / k * size, 2 * (m - 1) / m * size / k
    if kind in ("all_gather", "reduce_scatter"):
        return (k - 1) / k * size, (m - 1) / m * size / k
    if kind == "all_to_all":
        return (k - 1) / n * size, (n - k) / n * size
    return (k - 1) / k * size, size / k  # broadcast


def collective_time(
    kind: str,
    message_bytes: float,
    group_ranks: Sequence[int],
    cluster: ClusterSpec,
    *,
    nvls: bool = True,
) -> CollectiveTime:
    """Time of one collective of ``message_bytes`` (S, as defined in the module docstring)
    over ``group_ranks`` on ``cluster``: alpha + bytes / beta on the link the group spans.

    ``nvls=False`` prices an intra-node all-reduce as a ring even where the cluster lists an
    NVLink SHARP rate (``NCCL_ALGO=Ring``).
    """
    check_kind(kind)
    if (
        isinstance(message_bytes, bool)
        or not isinstance(message_bytes, (int, float))
        or not math.isfinite(message_bytes)
        or message_bytes < 0
    ):
        raise ValueError(f"message_bytes must be a finite number >= 0, got {message_bytes!r}")
    ranks = _check_ranks(kind, group_ranks, cluster)
    n = len(ranks)
    per_node = Counter(cluster.node_of(r) for r in ranks)
    m, k = len(per_node), max(per_node.values())
    size = float(message_bytes)
    shape: _Shape = {"kind": kind, "message_bytes": size, "group_size": n, "nodes": m}
    if n == 1:
        return CollectiveTime(
            **shape, ranks_per_node=1, link=NO_LINK, bound_link=NO_LINK, algorithm="none",
            time_s=0.0, alpha_s=0.0, beta_bytes_per_s=0.0,
            intra_node_bytes_per_rank=0.0, network_bytes_per_rank=0.0,
        )  # fmt: skip
    algorithm = "direct" if kind in ("all_to_all", "send_recv") else "ring"
    intra = cluster.intra_node
    if m == 1:  # one node: the intra-node link
        wire = bus_factor(kind, n) * size
        beta = intra_rate(intra, n, cluster.gpus_per_node)
        if kind == "all_reduce" and nvls and intra.nvls_all_reduce_bus_bytes_per_s is not None:
            beta, algorithm = intra.nvls_all_reduce_bus_bytes_per_s.value, "nvls"
        return CollectiveTime(
            **shape, ranks_per_node=n, link=intra.kind, bound_link=intra.kind,
            algorithm=algorithm, time_s=intra.alpha_s + wire / beta, alpha_s=intra.alpha_s,
            beta_bytes_per_s=beta, intra_node_bytes_per_rank=wire, network_bytes_per_rank=0.0,
        )  # fmt: skip
    network = cluster.network
    assert network is not None  # _check_ranks refused multi-node groups without one
    net_beta = network.achieved_bytes_per_s
    if k == 1:  # one rank per node: each through its own NIC
        wire = bus_factor(kind, n) * size
        return CollectiveTime(
            **shape, ranks_per_node=1, link=NETWORK, bound_link=NETWORK, algorithm=algorithm,
            time_s=network.alpha_s + wire / net_beta, alpha_s=network.alpha_s,
            beta_bytes_per_s=net_beta, intra_node_bytes_per_rank=0.0,
            network_bytes_per_rank=wire,
        )  # fmt: skip
    intra_bytes, network_bytes = _hierarchical_bytes(kind, size, n, k, m)
    intra_beta = intra_rate(intra, k, cluster.gpus_per_node)
    intra_s, network_s = intra_bytes / intra_beta, network_bytes / net_beta
    network_bound = network_s >= intra_s
    return CollectiveTime(
        **shape, ranks_per_node=k, link=HIERARCHICAL,
        bound_link=NETWORK if network_bound else intra.kind, algorithm=HIERARCHICAL,
        time_s=network.alpha_s + max(intra_s, network_s), alpha_s=network.alpha_s,
        beta_bytes_per_s=net_beta if network_bound else intra_beta,
        intra_node_bytes_per_rank=intra_bytes, network_bytes_per_rank=network_bytes,
    )  # fmt: skip


def custom_all_reduce_time(
    message_bytes: float,
    group_ranks: Sequence[int],
    cluster: ClusterSpec,
    custom: CustomAllReduce,
) -> CollectiveTime | None:
    """A runtime's own all-reduce (vLLM's and TensorRT-LLM's custom all-reduce kernels),
    or None where the runtime hands it to NCCL: a group on more than one node or over PCIe,
    an odd group or one above ``custom.max_ranks`` (vLLM takes 2, 4, 6 or 8 ranks), or a
    message of ``custom.max_bytes`` or more.

    One shot, up to ``custom.one_shot_max_bytes``: every rank reads each peer's whole
    buffer over NVLink and reduces locally, (n-1) x S bytes through each GPU's link. Two
    shots above it: a reduce-scatter, then an all-gather, 2(n-1)/n x S, as a ring moves
    but with the runtime's fixed cost instead of NCCL's (vLLM's csrc/custom_all_reduce.cuh,
    cross_device_reduce_1stage and _2stage)."""
    ranks = _check_ranks("all_reduce", group_ranks, cluster)
    n = len(ranks)
    nodes = {cluster.node_of(r) for r in ranks}
    if n == 1 or n % 2 or n > custom.max_ranks or len(nodes) > 1:
        return None
    if cluster.intra_node.kind == "pcie" or message_bytes >= custom.max_bytes:
        return None
    size = float(message_bytes)
    one_shot = size < custom.one_shot_max_bytes
    wire = (n - 1) * size if one_shot else 2 * (n - 1) / n * size
    beta = intra_rate(cluster.intra_node, n, cluster.gpus_per_node)
    return CollectiveTime(
        kind="all_reduce", message_bytes=size, group_size=n, nodes=1, ranks_per_node=n,
        link=cluster.intra_node.kind, bound_link=cluster.intra_node.kind,
        algorithm="one-shot" if one_shot else "two-shot",
        time_s=custom.latency_s + wire / beta, alpha_s=custom.latency_s,
        beta_bytes_per_s=beta, intra_node_bytes_per_rank=wire, network_bytes_per_rank=0.0,
    )  # fmt: skip

"""Collectives at the network boundary: alpha + wire bytes / beta on the link a group spans,
and the refusal of a step with collectives priced without a cluster."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from torchroof.config.errors import OptionError
from torchroof.counters import kind_of
from torchroof.counters.collectives import (
    collective_kind,
    group_size,
    message_bytes,
    pair_ranks,
)
from torchroof.hardware import ClusterSpec, HardwareSpec, available_clusters
from torchroof.kernels.fusion import Kernel
from torchroof.records.ops import OpRecord
from torchroof.report.estimate import KernelEstimate
from torchroof.report.kinds import Link
from torchroof.timing.graph_collectives import in_graph
from torchroof.timing.network import NETWORK, NO_LINK, collective_time, custom_all_reduce_time
from torchroof.timing.roofline import KernelTime
from torchroof.timing.runtime import StepRuntime


class ClusterRequiredError(OptionError):
    """A step with collectives priced on one accelerator: its network time has no link."""


def collective_op(kernel: Kernel) -> OpRecord:
    """The one collective of a kernel on the ``network`` unit (fusion never groups them)."""
    found = [op for op in kernel.ops if kind_of(op.packet) == "collective"]
    if len(found) != 1:
        raise ValueError(
            f"a network kernel holds {len(found)} collectives ({kernel.name}); expected one"
        )
    return found[0]


def time_collective(
    kernel: KernelEstimate,
    op: OpRecord,
    hbm: KernelTime,  # the roofline's time of its HBM bytes
    cluster: ClusterSpec | None,
    unpriced: list[int],
    runtime: StepRuntime | None = None,
    in_graph_ops: list[int] | None = None,
) -> KernelEstimate:
    """A collective at the network boundary (docs/concepts/network-ridges.md):
    alpha + wire bytes / beta on the link its group's ranks span
    (:func:`torchroof.timing.network.collective_time`), W = 0.

    Its time is max(HBM bytes / beta_hbm, network time): the rank reads what it sends and
    writes what it receives while the bytes cross the link, so the slower of the two pipes
    sets the time. No launch overhead is added: alpha is a measured small-message time,
    launch included. Bound "network" when the link is the slower pipe, else "memory". A
    group of one crosses no link: its HBM time only. Without a cluster, a group of more
    than one rank is noted in ``unpriced`` (its size) and the kernel returned as is, for
    the caller to refuse. A runtime with its own all-reduce for small tensors
    (``runtime.all_reduce``) runs the all-reduces it takes with that kernel
    (:func:`torchroof.timing.network.custom_all_reduce_time`). In a step replayed from a CUDA
    graph (``runtime.graph_replayed``) an NCCL collective within one node runs as NCCL's own
    model times it where that is faster than the cluster's measured time
    (:func:`torchroof.timing.graph_collectives.in_graph`); the op's index is then noted in
    ``in_graph_ops``."""
    ranks = op.arg("group_ranks")
    size = group_size(op)
    if size == 1:
        return replace(kernel, link=cast(Link, NO_LINK))
    if cluster is None:
        unpriced.append(size)
        return kernel
    if not isinstance(ranks, (list, tuple)) or len(ranks) != size:
        raise ValueError(
            f"op {op.index} ({op.name}) has no recorded group ranks (group_ranks={ranks!r}); "
            "trace it again with this torchroof, which records each collective's group"
        )
    kind, size = collective_kind(op), message_bytes(op)
    pairs = pair_ranks(op, list(ranks)) if kind == "send_recv" else [list(ranks)]
    pairs = [pair for pair in pairs if len(pair) > 1]
    if not pairs:  # a permutation onto the rank itself crosses no link
        return replace(kernel, link=cast(Link, NO_LINK))
    net = None
    if kind == "all_reduce" and runtime is not None and runtime.all_reduce is not None:
        net = custom_all_reduce_time(size, ranks, cluster, runtime.all_reduce)
    if net is None:
        timed = [collective_time(kind, size, pair, cluster) for pair in pairs]
        net = max(timed, key=lambda t: t.time_s)
        if runtime is not None and runtime.graph_replayed:
            eager, net = net, in_graph(net, cluster)
            if net is not eager and in_graph_ops is not None:
                in_graph_ops.append(op.index)
    wire = {cluster.intra_node.kind: round(net.intra_node_bytes_per_rank)}
    wire[NETWORK] = round(net.network_bytes_per_rank)
    return replace(
        kernel,
        time_s=max(hbm.memory_s, net.time_s),
        bound="network" if net.time_s >= hbm.memory_s else "memory",
        boundary="network" if net.time_s >= hbm.memory_s else "hbm",
        overhead_s=0.0,  # alpha holds the collective's fixed cost
        link=cast(Link, net.link),  # torchroof.timing.network names its links as str
        wire_by_link={link: sent for link, sent in wire.items() if sent},
        network_s=net.time_s,
        latency_s=net.alpha_s,
    )


def needs_cluster(count: int, largest: int, spec: HardwareSpec) -> str:
    """Why a step with collectives cannot be priced on ``spec`` alone, and where it can."""
    clusters = [c.name for c in available_clusters() if c.accelerator.name == spec.name]
    where = (
        f"price it on a cluster: {', '.join(clusters)}"
        if clusters
        else f"price it on a cluster of {spec.name} (none ships: write a cluster TOML, "
        "as hardware/clusters/*.toml)"
    )
    plural = "s" if count > 1 else ""
    return f"this step has {count} collective{plural} over groups of up to {largest} ranks: {where}"


def link_ridges(cluster: ClusterSpec | None, reference_peak: float) -> dict[str, float]:
    """FLOPs per byte crossing each of the cluster's links at which it stops binding: the
    step's reference peak over the link's line rate (docs/concepts/network-ridges.md;
    ClusterSpec.link_ridges at the step's dtype)."""
    if cluster is None:
        return {}
    return {k: reference_peak / link.line_bytes_per_s.value for k, link in cluster.links().items()}

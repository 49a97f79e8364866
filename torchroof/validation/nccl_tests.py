"""A cluster's link fitted from nccl-tests output: its per-collective latency (alpha) and the
bus bandwidth it achieves (beta).

nccl-tests (github.com/NVIDIA/nccl-tests) prints one row per message size: the size S in
bytes, then for the out-of-place and the in-place run its time in microseconds, algorithm
bandwidth S / t and bus bandwidth (doc/PERFORMANCE.md). torchroof prices a collective on one
link as ``alpha + bytes / beta`` (:mod:`torchroof.timing.network`), with the bytes a rank
sends over that link: the bus factor times S within a node, and for a run over m nodes of k
GPUs each, the network's share of the hierarchical algorithm (all-reduce: 2 (m - 1) / m of
S / k). So alpha and 1 / beta are the intercept and slope of a straight line through the
out-of-place (bytes, time) points, fitted by least squares on the relative error, so that
the 8-byte rows (alpha) weigh as much as the 8-GiB ones (beta).

Which link the run measured is read from its ``# Rank N ... on HOST device`` lines: every
rank on one host is the intra-node link (NVLink, xGMI); ranks on several hosts, the network.
An all-reduce inside a node of a cluster that lists an NVLink SHARP bandwidth fits that
figure (NCCL's default there); every other fit sets the link's achieved fraction, beta over
its line rate.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchroof.hardware import ClusterSpec
from torchroof.validation.calibrated_files import Fitted, rewrite

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "alltoall")
"""The nccl-tests binaries whose bytes per link torchroof models (``<name>_perf``)."""


class NcclTestsError(ValueError):
    """An nccl-tests log that cannot be read or fitted; the message says why."""


@dataclass(frozen=True)
class NcclRow:
    """One message size: S in bytes and the out-of-place time in seconds."""

    size: int
    time_s: float


@dataclass(frozen=True)
class NcclLog:
    """What one nccl-tests run measured: the collective, each rank's host, the rows."""

    collective: str
    hosts: tuple[str, ...]  # by rank
    rows: tuple[NcclRow, ...]

    @property
    def ranks(self) -> int:
        return len(self.hosts)

    @property
    def nodes(self) -> int:
        return len(set(self.hosts))


RANK_LINE = re.compile(r"#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device")
BINARY = re.compile(
    r"\b(" + "|".join((*COLLECTIVES, "broadcast", "reduce", "sendrecv")) + r")_perf"
)


def parse(text: str, collective: str | None = None) -> NcclLog:
    """The log's collective (named by ``collective`` or by the ``<name>_perf`` it mentions),
    its ranks' hosts and its rows."""
    if collective is None:
        found = BINARY.search(text)
        if found is None:
            raise NcclTestsError(
                "the log does not name its test (all_reduce_perf, ...): give --collective"
            )
        collective = found[1]
    if collective not in COLLECTIVES:
        raise NcclTestsError(
            f"{collective}_perf: torchroof fits {', '.join(c + '_perf' for c in COLLECTIVES)}"
        )
    hosts: dict[int, str] = {}
    rows = []
    for line in text.splitlines():
        rank = RANK_LINE.search(line)
        if rank:
            hosts[int(rank[1])] = rank[2]
            continue
        tokens = line.split()
        if len(tokens) < 9 or line.lstrip().startswith("#") or not tokens[0].isdigit():
            continue
        try:  # the out-of-place time is the 8th column from the end (time algbw busbw #wrong)
            time_us = float(tokens[-8])
        except ValueError:
            continue
        if time_us > 0:
            rows.append(NcclRow(int(tokens[0]), time_us * 1e-6))
    if not hosts:
        raise NcclTestsError(
            "the log has no '#  Rank N Group G Pid P on HOST device D' lines: run nccl-tests "
            "with its default output, which lists every rank and its host"
        )
    if len(rows) < 2:
        raise NcclTestsError(f"the log has {len(rows)} result rows: at least 2 sizes are needed")
    return NcclLog(collective, tuple(hosts[r] for r in sorted(hosts)), tuple(rows))


@dataclass(frozen=True)
class LinkFit:
    """alpha and beta of the link one nccl-tests run measured."""

    link: str  # "intra_node" or "network"
    figure: str  # the beta figure it sets: achieved_fraction or nvls_all_reduce_...
    alpha_s: float
    beta_bytes_per_s: float
    log: NcclLog
    worst_error: float  # the largest |fitted / measured - 1| over the rows

    def lines(self) -> list[str]:
        where = "inside one node" if self.link == "intra_node" else f"over {self.log.nodes} nodes"
        return [
            f"{self.log.collective}_perf on {self.log.ranks} GPUs {where}, "
            f"{len(self.log.rows)} sizes: alpha {self.alpha_s * 1e6:.2f} us, "
            f"bus bandwidth {self.beta_bytes_per_s / 1e9:.1f} GB/s "
            f"(fitted times within {100 * self.worst_error:.0f}% of the measured ones)"
        ]


def link_bytes(collective: str, size: int, ranks: int, nodes: int) -> float:
    """Bytes one rank sends over the link the run measured (torchroof.timing.network): the
    bus factor of S in a node; across m nodes of k GPUs, the network phase's share."""
    per_node = ranks // nodes
    n = ranks if nodes == 1 else nodes
    share = size if nodes == 1 else size / per_node
    if collective == "all_reduce":
        return 2 * (n - 1) / n * share
    if collective == "alltoall" and nodes > 1:
        return (ranks - per_node) / ranks * size
    return (n - 1) / n * share


def fit(log: NcclLog, cluster: ClusterSpec) -> LinkFit:
    """alpha and beta through the log's rows, for the link its ranks span."""
    per_host = Counter(log.hosts)
    if len(set(per_host.values())) > 1:
        raise NcclTestsError(
            "the ranks are spread unevenly over the hosts: fit runs of whole nodes"
        )
    if log.nodes > 1 and cluster.network is None:
        raise NcclTestsError(f"{cluster.name} has no network link for a run over several hosts")
    link = "intra_node" if log.nodes == 1 else "network"
    x = np.array([link_bytes(log.collective, r.size, log.ranks, log.nodes) for r in log.rows])
    t = np.array([r.time_s for r in log.rows])
    design = np.stack([np.ones_like(x), x], axis=1) / t[:, None]  # relative error
    (alpha, slope), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # no room for a latency: the line through the origin
        alpha, slope = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if slope <= 0:
        raise NcclTestsError("the times do not grow with the message size: no bandwidth to fit")
    beta = 1.0 / slope
    worst = float(np.max(np.abs((alpha + x / beta) / t - 1)))
    chosen = cluster.intra_node if link == "intra_node" else cluster.network
    assert chosen is not None  # refused above
    nvls = link == "intra_node" and log.collective == "all_reduce"
    figure = (
        "nvls_all_reduce_bus_bytes_per_s"
        if nvls and chosen.nvls_all_reduce_bus_bytes_per_s
        else "achieved_fraction"
    )
    if figure == "achieved_fraction" and beta > chosen.line_bytes_per_s.value * 1.0001:
        raise NcclTestsError(
            f"the fitted {beta / 1e9:.1f} GB/s exceeds {chosen.name}'s line rate "
            f"({chosen.line_bytes_per_s.value / 1e9:.1f} GB/s): an in-switch all-reduce? fit "
            "all_gather_perf or reduce_scatter_perf for the link"
        )
    return LinkFit(link, figure, float(alpha), float(beta), log, worst)


def calibrated_cluster(
    cluster: ClusterSpec, fits: list[LinkFit], name: str, source: str, accelerator: str = ""
) -> str:
    """The cluster's TOML with each fitted link's alpha and beta (``accelerator``: another
    accelerator file to name, such as one fitted by ``--from-profile``)."""
    figures: dict[tuple[str, str], Fitted] = {}
    for f in fits:
        link = cluster.intra_node if f.link == "intra_node" else cluster.network
        assert link is not None
        how = f"{source}: {f.log.collective}_perf on {f.log.ranks} GPUs, {len(f.log.rows)} sizes"
        figures[(f.link, "latency_s")] = Fitted(f.alpha_s, f"{how}, least-squares intercept")
        if f.figure == "achieved_fraction":
            fraction = f.beta_bytes_per_s / link.line_bytes_per_s.value
            beta = f"{f.beta_bytes_per_s / 1e9:.1f} GB/s"
            text = f"{how}, least-squares bus bandwidth {beta} / line rate"
            figures[(f.link, "achieved_fraction")] = Fitted(fraction, text)
        else:
            figures[(f.link, f.figure)] = Fitted(
                f.beta_bytes_per_s, f"{how}, least-squares bus bandwidth"
            )
    text = Path(cluster.path).read_text()
    strings = {"accelerator": accelerator} if accelerator else {}
    return rewrite(text, name, f"{cluster.display_name} (calibrated)", figures, strings)

"""A cluster's link fitted from nccl-tests output: its per-collective latency (alpha) and the
bus bandwidth it achieves (beta).

nccl-tests (github.com/NVIDIA/nccl-tests) prints one row per message size: the size S in
bytes, then for the out-of-place and the in-place run its time in microseconds, algorithm
bandwidth S / t and bus bandwidth (doc/PERFORMANCE.md). The column header names the
columns, so the out-of-place time is read where the header puts it, whatever extra columns
a run adds. The fit prices every row with torchroof's own collective model
(:func:`torchroof.timing.network.collective_time`) on the cluster with the link's figures
changed, so what is fitted is what estimates use: inside a node the bus factor of S (on a
full-mesh node a group smaller than the node uses fewer links), over m nodes of k GPUs the
hierarchical algorithm, whose time is the slower of its in-node and network phases. For
each candidate beta, alpha is the least-squares intercept on the relative error (so the
8-byte rows weigh as much as the 8-GiB ones); beta is the candidate that leaves the least
error, found on a log grid and refined by golden-section search.

Which link the run measured is read from its ``# Rank N ... on HOST device`` lines: every
rank on one host is the intra-node link (NVLink, xGMI); ranks on several hosts, the network.
An all-reduce inside a node of a cluster that lists an NVLink SHARP bandwidth fits that
figure (NCCL's default there); every other fit sets the link's achieved fraction of its
line rate.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from torchroof.hardware import ClusterSpec
from torchroof.hardware.toml_checks import Figure
from torchroof.timing.network import collective_time
from torchroof.validation.calibrated_files import Fitted, checked, rewrite
from torchroof.validation.search import minimum

KINDS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
}
"""The nccl-tests binaries torchroof fits (``<name>_perf``) -> torchroof's collective."""


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
TESTS = "all_reduce|all_gather|reduce_scatter|alltoall|broadcast|reduce|sendrecv|gather|scatter"
BINARY = re.compile(rf"\b({TESTS}|hypercube)_perf")


def _time_column(text: str) -> int:
    """Where the header line (``#  size  count  type ... time  algbw  busbw ...``) puts the
    first (out-of-place) time."""
    for line in text.splitlines():
        words = line.lstrip("#").split()
        if line.lstrip().startswith("#") and words[:2] == ["size", "count"] and "time" in words:
            return words.index("time")
    raise NcclTestsError(
        "the log has no column header ('#  size  count  type ... time  algbw  busbw'): "
        "give nccl-tests' output as it prints it"
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
    if collective not in KINDS:
        raise NcclTestsError(
            f"{collective}_perf: torchroof fits {', '.join(k + '_perf' for k in KINDS)}"
        )
    hosts: dict[int, str] = {}
    for line in text.splitlines():
        rank = RANK_LINE.search(line)
        if rank:
            hosts[int(rank[1])] = rank[2]
    if not hosts:
        raise NcclTestsError(
            "the log has no '#  Rank N Group G Pid P on HOST device D' lines: run nccl-tests "
            "with its default output, which lists every rank and its host"
        )
    column = _time_column(text)
    rows = []
    for line in text.splitlines():
        tokens = line.split()
        if line.lstrip().startswith("#") or len(tokens) <= column or not tokens[0].isdigit():
            continue
        try:
            time_us = float(tokens[column])
        except ValueError:
            continue
        if time_us > 0:
            rows.append(NcclRow(int(tokens[0]), time_us * 1e-6))
    if len(rows) < 2:
        raise NcclTestsError(f"the log has {len(rows)} result rows: at least 2 sizes are needed")
    return NcclLog(collective, tuple(hosts[r] for r in sorted(hosts)), tuple(rows))


@dataclass(frozen=True)
class LinkFit:
    """alpha and beta of the link one nccl-tests run measured."""

    link: str  # "intra_node" or "network"
    figure: str  # the figure beta sets: achieved_fraction or nvls_all_reduce_bus_bytes_per_s
    alpha_s: float
    beta_bytes_per_s: float  # the link's achieved bus bandwidth (line rate x fraction)
    value: float  # the figure's value: the achieved fraction, or the NVLink SHARP rate
    log: NcclLog
    worst_error: float  # the largest |fitted / measured - 1| over the rows

    def lines(self) -> list[str]:
        where = "inside one node" if self.link == "intra_node" else f"over {self.log.nodes} nodes"
        out = [
            f"{self.log.collective}_perf on {self.log.ranks} GPUs {where}, "
            f"{len(self.log.rows)} sizes: alpha {self.alpha_s * 1e6:.2f} us, "
            f"bus bandwidth {self.beta_bytes_per_s / 1e9:.1f} GB/s "
            f"(fitted times within {100 * self.worst_error:.0f}% of the measured ones)"
        ]
        if self.figure != "achieved_fraction":
            out.append(
                "note: its alpha is not written: the link's one alpha is its ring "
                "collectives' (fit it from all_gather_perf or reduce_scatter_perf)"
            )
        return out


def applied(cluster: ClusterSpec, fitted: LinkFit) -> ClusterSpec:
    """The cluster with the fitted figures (for the fits that follow, over more nodes)."""
    alpha = fitted.alpha_s if fitted.figure == "achieved_fraction" else None
    link = getattr(cluster, fitted.link)
    kept = link.latency_s.value if link.latency_s else 0.0
    return _with(
        cluster, fitted.link, fitted.figure, fitted.value, kept if alpha is None else alpha
    )


def _ranks(log: NcclLog, cluster: ClusterSpec) -> list[int]:
    """The run's ranks as torchroof numbers them: node-major, k on each of its m nodes."""
    per_node = log.ranks // log.nodes
    if per_node > cluster.gpus_per_node:
        raise NcclTestsError(
            f"{per_node} GPUs per host, but {cluster.name} has {cluster.gpus_per_node} per node"
        )
    return [n * cluster.gpus_per_node + j for n in range(log.nodes) for j in range(per_node)]


def _with(cluster: ClusterSpec, slot: str, figure: str, value: float, alpha: float) -> ClusterSpec:
    """The cluster with ``slot``'s link at ``figure`` = value and latency ``alpha``."""
    link = getattr(cluster, slot)
    fitted = {figure: Figure(value, "fitted"), "latency_s": Figure(alpha, "fitted")}
    return replace(cluster, **{slot: replace(link, **fitted)})


def fit(log: NcclLog, cluster: ClusterSpec) -> LinkFit:
    """alpha and beta of the link the log's ranks span, through its rows, each priced as
    torchroof prices the collective."""
    if len(set(Counter(log.hosts).values())) > 1:
        raise NcclTestsError(
            "the ranks are spread unevenly over the hosts: fit runs of whole nodes"
        )
    if log.nodes > 1 and cluster.network is None:
        raise NcclTestsError(f"{cluster.name} has no network link for a run over several hosts")
    slot = "intra_node" if log.nodes == 1 else "network"
    link = getattr(cluster, slot)
    nvls = slot == "intra_node" and log.collective == "all_reduce"
    nvls = nvls and link.nvls_all_reduce_bus_bytes_per_s is not None
    figure = "nvls_all_reduce_bus_bytes_per_s" if nvls else "achieved_fraction"
    ranks, kind = _ranks(log, cluster), KINDS[log.collective]
    sizes = [r.size for r in log.rows]
    t = np.array([r.time_s for r in log.rows])

    def priced(value: float) -> tuple[float, np.ndarray]:
        """(alpha, the fitted times) with the figure at ``value``: alpha the least-squares
        intercept of the relative error, sum((t - a - g) / t^2) = 0."""
        at = _with(cluster, slot, figure, value, 0.0)
        g = np.array([collective_time(kind, s, ranks, at).time_s for s in sizes])
        alpha = max(0.0, float(np.sum((t - g) / t**2) / np.sum(1 / t**2)))
        return alpha, alpha + g

    def error(log_value: float) -> float:
        return float(np.sum((priced(math.exp(log_value))[1] / t - 1) ** 2))

    scale = link.line_bytes_per_s.value if figure == "achieved_fraction" else 1.0
    low, high = math.log(1e7 / scale), math.log(1e14 / scale)
    value = math.exp(minimum(error, low, high, grid=300, steps=80))
    alpha, fitted = priced(value)
    if figure == "achieved_fraction" and value > 1.0001:
        raise NcclTestsError(
            f"the fitted {value * scale / 1e9:.1f} GB/s exceeds {link.name}'s line rate "
            f"({scale / 1e9:.1f} GB/s): an in-switch all-reduce? fit all_gather_perf or "
            "reduce_scatter_perf for the link"
        )
    at = _with(cluster, slot, figure, value, alpha)
    if slot == "network" and all(
        collective_time(kind, s, ranks, at).bound_link != "network" for s in sizes
    ):
        raise NcclTestsError(
            "the in-node phase was the slower one at every size, so the log cannot measure "
            "the network: fit it from a run with one GPU per node"
        )
    beta = value * scale if figure == "achieved_fraction" else value
    worst = float(np.max(np.abs(fitted / t - 1)))
    return LinkFit(slot, figure, alpha, beta, value, log, worst)


def calibrated_cluster(
    cluster: ClusterSpec, fits: list[LinkFit], name: str, source: str, accelerator: str
) -> str:
    """The cluster's TOML with each fitted link's alpha and beta, naming ``accelerator`` (a
    shipped name or an absolute path)."""
    figures: dict[tuple[str, str], Fitted] = {}
    for f in fits:
        how = f"{source}: {f.log.collective}_perf on {f.log.ranks} GPUs, {len(f.log.rows)} sizes"
        beta = f"{f.beta_bytes_per_s / 1e9:.1f} GB/s"
        if f.figure == "achieved_fraction":
            text = f"{how}, least-squares bus bandwidth {beta} / line rate"
        else:
            text = f"{how}, least-squares bus bandwidth {beta}"
        figures[(f.link, f.figure)] = Fitted(f.value, text)
        if f.figure == "achieved_fraction":  # a link has one alpha: its ring collectives'
            figures[(f.link, "latency_s")] = Fitted(f.alpha_s, f"{how}, least-squares alpha")
    text = Path(cluster.path).read_text()
    display = f"{cluster.display_name} (calibrated)"
    text = rewrite(text, name, display, figures, {"accelerator": accelerator})
    return checked(text, figures, cluster.path, cluster=True)

"""Cluster spec data model and loader: the links between accelerators, as data.

The roofline pointed at the interconnect (docs/concepts/network-ridges.md). I_net = FLOPs per byte
crossing a link, and its ridge is pi / beta_link: 2,198 for NVLink 4 (450 GB/s per GPU),
15,459 for PCIe Gen5 x16 (64 GB/s) and 19,788 for a 400 Gb/s fabric (50 GB/s per GPU) on an
H100 at its dense bf16 peak.

A cluster names one accelerator (a TOML in ``hardware/``), how many of them share one NVLink
or xGMI domain (``gpus_per_node``), and three link classes, each a rate per GPU per direction:

- ``[intra_node]``: the scale-up link inside the domain (NVLink through NVSwitch, xGMI mesh).
- ``[network]``: the NIC each GPU owns for traffic between nodes (one rail per GPU).
- ``[pcie]``: the GPU's host link (what activation offload crosses).

Line rate, the fraction of it a collective library reaches, and latency are separate sourced
figures (nccl-tests bus bandwidth: an 8x H100 node reaches ~370 of 450 GB/s). The format
(``hardware/clusters/*.toml``), every key a cluster file may hold:

- ``name`` (string, required), ``display_name`` (string), ``aliases`` (array of strings),
  ``source`` (string): as in an accelerator file.
- ``accelerator`` (string, required): an accelerator name, alias or TOML path (a relative
  path is looked up next to the cluster file first).
- ``gpus_per_node`` (figure, whole, required): GPUs in one NVLink/xGMI domain.
- ``max_nodes`` (figure, whole, optional): the largest number of nodes the platform offers.
- ``[intra_node]`` (required): ``kind`` (``"nvlink"``, ``"xgmi"`` or ``"pcie"``: names the
  link in reports), ``name`` (string), ``topology`` (``"switch"``, the default: any group
  reaches the full per-GPU rate; ``"full_mesh"``: a group of k GPUs on a node of G uses k - 1
  of its G - 1 point-to-point links), ``line_bytes_per_s``, ``achieved_fraction`` (0 < f <= 1
  of the line rate, as nccl-tests bus bandwidth), ``latency_s`` (alpha of one collective),
  and optionally ``nvls_all_reduce_bus_bytes_per_s`` (in-switch all-reduce, NVLink SHARP:
  the bus bandwidth nccl-tests reports with it, which may exceed the line rate).
- ``[network]`` (optional: without it the cluster is one node): ``name``,
  ``line_bytes_per_s``, ``achieved_fraction``, ``latency_s``, per GPU.
- ``[pcie]`` (optional): ``name``, ``line_bytes_per_s``.

A figure is ``{ value = <number>, source = "<where>", approximate = <bool> }`` exactly as in
an accelerator file (``torchroof.hardware.toml_checks``); a bad file raises one
:class:`ClusterSpecError` naming the file and every problem in it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from torchroof.hardware.spec import Boundary, HardwareSpec, UnknownHardwareError, get
from torchroof.hardware.toml_checks import (
    Figure,
    HardwareSpecError,
    ShippedSpecs,
    check_aliases,
    describe,
    misplaced,
    normalise_name,
    parse_figure,
    read_toml,
    unknown_key,
)

# The shipped cluster files, read as package data (a wheel, a zip or a checkout alike).
CLUSTER_DIR: Traversable = resources.files(__package__) / "clusters"

INTRA_NODE_KINDS = ("nvlink", "xgmi", "pcie")
TOPOLOGIES = ("switch", "full_mesh")


class ClusterSpecError(HardwareSpecError):
    """A cluster TOML file that cannot be used, with every problem found in it (one line,
    the file first, as :class:`HardwareSpecError`)."""


class UnknownClusterError(UnknownHardwareError):
    """No cluster with that name, alias or path."""


@dataclass(frozen=True)
class Link:
    """One class of link, per GPU per direction.

    ``achieved_fraction`` and ``latency_s`` are absent only on ``[pcie]``, the host link,
    which only activation offload crosses (at its line rate);
    ``nvls_all_reduce_bus_bytes_per_s`` only where the switch reduces in-fabric.
    """

    kind: str  # "nvlink", "xgmi", "pcie" (intra-node); "network"; "pcie" (host link)
    name: str
    line_bytes_per_s: Figure
    achieved_fraction: Figure | None = None
    latency_s: Figure | None = None
    topology: str = "switch"
    nvls_all_reduce_bus_bytes_per_s: Figure | None = None

    @property
    def achieved_bytes_per_s(self) -> float:
        """Line rate x achieved fraction: the bus bandwidth a large ring collective reaches."""
        if self.achieved_fraction is None:
            raise ValueError(f"{self.name} lists no achieved_fraction")
        return self.line_bytes_per_s.value * self.achieved_fraction.value

    @property
    def alpha_s(self) -> float:
        """The fixed time of one collective on this link (its small-message time)."""
        if self.latency_s is None:
            raise ValueError(f"{self.name} lists no latency_s")
        return self.latency_s.value

    def figures(self, table: str) -> dict[str, Figure]:
        named = {
            "line_bytes_per_s": self.line_bytes_per_s,
            "achieved_fraction": self.achieved_fraction,
            "latency_s": self.latency_s,
            "nvls_all_reduce_bus_bytes_per_s": self.nvls_all_reduce_bus_bytes_per_s,
        }
        return {f"{table}.{key}": fig for key, fig in named.items() if fig is not None}


@dataclass(frozen=True)
class ClusterSpec:
    """Accelerators joined by links. Ranks are numbered node-major: rank r is on node
    r // gpus_per_node."""

    name: str
    display_name: str
    accelerator: HardwareSpec
    gpus_per_node: int
    intra_node: Link
    network: Link | None = None  # None: one node, nothing to cross
    pcie: Link | None = None
    max_nodes: int | None = None
    aliases: tuple[str, ...] = ()
    source: str = ""
    path: str = ""
    count_figures: dict[str, Figure] = field(default_factory=dict, repr=False, compare=False)

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank`` (node-major numbering)."""
        return rank // self.gpus_per_node

    def links(self) -> dict[str, Link]:
        """Each link by the name reports use for it: the intra-node kind, "network", "pcie"."""
        out = {self.intra_node.kind: self.intra_node}
        if self.network is not None:
            out["network"] = self.network
        if self.pcie is not None and "pcie" not in out:
            out["pcie"] = self.pcie
        return out

    def link_ridges(self, dtype: str = "bf16", *, allow_tf32: bool = False) -> dict[str, float]:
        """FLOPs per byte crossing each link at which it stops being the bound.

        The network ridge (docs/concepts/network-ridges.md): I* = pi / beta with pi the
        accelerator's dense tensor peak in ``dtype`` and beta the link's line rate per GPU
        per direction (line rates from the vendor datasheets; the achieved rate, lower,
        moves each ridge up by 1 / fraction).
        """
        peak = self.accelerator.tensor_peak(dtype, allow_tf32=allow_tf32)
        return {key: peak / link.line_bytes_per_s.value for key, link in self.links().items()}

    def figures(self) -> dict[str, Figure]:
        """Every figure by dotted key, for listing sources."""
        out = dict(self.count_figures)
        out.update(self.intra_node.figures("intra_node"))
        if self.network is not None:
            out.update(self.network.figures("network"))
        if self.pcie is not None:
            out.update(self.pcie.figures("pcie"))
        return out


# The file format: the keys each place may hold. Figures: key -> (required, whole, unit).
_STRING_KEYS = {"name": True, "display_name": False, "source": False, "accelerator": True}
_COUNT_KEYS: dict[str, tuple[bool, str]] = {
    "gpus_per_node": (True, "GPUs"),
    "max_nodes": (False, "nodes"),
}
_LINK_FIGURES: dict[str, tuple[str, str]] = {  # key -> (unit, which tables require it)
    "line_bytes_per_s": ("B/s", "intra_node network pcie"),
    "achieved_fraction": ("fraction of the line rate", "intra_node network"),
    "latency_s": ("seconds", "intra_node network"),
    "nvls_all_reduce_bus_bytes_per_s": ("B/s", ""),
}
_LINK_ALLOWED: dict[str, tuple[str, ...]] = {
    "intra_node": ("kind", "name", "topology", *_LINK_FIGURES),
    "network": ("name", "line_bytes_per_s", "achieved_fraction", "latency_s"),
    "pcie": ("name", "line_bytes_per_s"),
}
_TABLES = {"intra_node": True, "network": False, "pcie": False}  # key: required
SCHEMA_KEYS: tuple[str, ...] = (*_STRING_KEYS, "aliases", *_COUNT_KEYS, *_TABLES)


def _link(table: str, raw: Any, problems: list[str]) -> Link | None:
    """Check one ``[table]`` of link figures; the link if it had no problem."""
    if not isinstance(raw, dict):
        problems.append(
            f"{table}: expected a table ([{table}] with its figures), got {describe(raw)}"
        )
        return None
    before = len(problems)
    allowed = _LINK_ALLOWED[table]
    strings: dict[str, str] = {}
    figures: dict[str, Figure | None] = {}
    for key, value in raw.items():
        dotted = f"{table}.{key}"
        if key not in allowed and key in SCHEMA_KEYS:
            problems.append(misplaced(table, key))
        elif key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            holds = f" (a [{table}] holds {', '.join(allowed)})"
            problems.append(
                f"{dotted}: unknown key{f'; did you mean {close[0]}?' if close else holds}"
            )
        elif key in ("kind", "name", "topology"):
            if not isinstance(value, str) or not value.strip():
                problems.append(f"{dotted}: expected a non-empty string, got {describe(value)}")
            else:
                strings[key] = value
        else:
            unit = _LINK_FIGURES[key][0]
            figure = parse_figure(dotted, value, False, unit, problems)
            if figure is not None and key == "achieved_fraction" and figure.value > 1:
                problems.append(
                    f"{dotted}.value: a fraction of the line rate is <= 1, got {figure.value:g}"
                )
                figure = None
            figures[key] = figure
    required = ["name"] + (["kind"] if table == "intra_node" else [])
    required += [key for key, (_, tables) in _LINK_FIGURES.items() if table in tables.split()]
    problems += [f"{table}.{key}: required key is missing" for key in required if key not in raw]
    kind = strings.get("kind", "network" if table == "network" else "pcie")
    if table == "intra_node" and "kind" in strings and kind not in INTRA_NODE_KINDS:
        problems.append(
            f"{table}.kind: expected one of {', '.join(INTRA_NODE_KINDS)}, got {kind!r}"
        )
    topology = strings.get("topology", "switch")
    if topology not in TOPOLOGIES:
        problems.append(
            f"{table}.topology: expected one of {', '.join(TOPOLOGIES)}, got {topology!r}"
        )
    if len(problems) > before:
        return None
    line = figures["line_bytes_per_s"]
    assert line is not None  # required, and any problem with it returned above
    return Link(
        kind=kind,
        name=strings["name"],
        line_bytes_per_s=line,
        achieved_fraction=figures.get("achieved_fraction"),
        latency_s=figures.get("latency_s"),
        topology=topology,
        nvls_all_reduce_bus_bytes_per_s=figures.get("nvls_all_reduce_bus_bytes_per_s"),
    )


def _accelerator(text: str, path: str | Path, problems: list[str]) -> HardwareSpec | None:
    """Resolve ``accelerator``: a name, alias or TOML path (relative paths next to the file)."""
    beside = Path(path).parent / text if str(path) and not Path(text).is_absolute() else None
    if text.endswith(".toml") and beside is not None and beside.is_file():
        text = str(beside)
    try:
        return get(text)
    except (UnknownHardwareError, HardwareSpecError) as error:
        problems.append(f"accelerator: {error}")
        return None


def parse_cluster(data: dict[str, Any], path: str | Path = "<cluster spec>") -> ClusterSpec:
    """Check a parsed cluster TOML as a whole; :class:`ClusterSpecError` lists every problem."""
    if "hbm_bytes_per_s" in data and "accelerator" not in data:
        raise ClusterSpecError(
            path,
            [
                "this is an accelerator file (it has hbm_bytes_per_s); a cluster file names "
                'one with accelerator = "<name or path>"'
            ],
        )
    problems: list[str] = []
    strings: dict[str, str] = {}
    aliases: tuple[str, ...] = ()
    counts: dict[str, Figure] = {}
    links: dict[str, Link | None] = {}
    for key, raw in data.items():  # in file order, so the message reads alongside the file
        if key in _STRING_KEYS:
            if not isinstance(raw, str) or (key in ("name", "accelerator") and not raw.strip()):
                problems.append(f"{key}: expected a non-empty string, got {describe(raw)}")
            else:
                strings[key] = raw
        elif key == "aliases":
            aliases = check_aliases(raw, problems)
        elif key in _COUNT_KEYS:
            figure = parse_figure(key, raw, True, _COUNT_KEYS[key][1], problems)
            if figure is not None:
                counts[key] = figure
        elif key in _TABLES:
            links[key] = _link(key, raw, problems)
        else:
            problems.append(unknown_key(key, SCHEMA_KEYS))
    required = [k for k, needed in _STRING_KEYS.items() if needed]
    required += [k for k, (needed, _) in _COUNT_KEYS.items() if needed]
    required += [k for k, needed in _TABLES.items() if needed]
    problems += [f"{key}: required key is missing" for key in required if key not in data]
    accelerator = None
    if "accelerator" in strings:
        accelerator = _accelerator(strings["accelerator"], path, problems)
    if problems:
        raise ClusterSpecError(path, problems)
    assert accelerator is not None and links["intra_node"] is not None
    max_nodes = counts.get("max_nodes")
    return ClusterSpec(
        name=strings["name"],
        display_name=strings.get("display_name", strings["name"]),
        accelerator=accelerator,
        gpus_per_node=int(counts["gpus_per_node"].value),
        intra_node=links["intra_node"],
        network=links.get("network"),
        pcie=links.get("pcie"),
        max_nodes=int(max_nodes.value) if max_nodes is not None else None,
        aliases=aliases,
        source=strings.get("source", ""),
        path=str(path),
        count_figures=counts,
    )


def load_cluster_file(path: str | Path | Traversable) -> ClusterSpec:
    """Parse one cluster TOML file (the format in this module's docstring)."""
    path = Path(path) if isinstance(path, str) else path
    return parse_cluster(read_toml(path, ClusterSpecError), str(path))


_SHIPPED = ShippedSpecs(CLUSTER_DIR, load_cluster_file, "cluster", UnknownClusterError)


def available_clusters() -> list[ClusterSpec]:
    """The shipped clusters, sorted by name."""
    return _SHIPPED.sorted_by_name()


def is_cluster(name: str | Path) -> bool:
    """Whether ``name`` is a shipped cluster (name or alias) or a TOML file that describes
    a cluster (it names an ``accelerator``) rather than an accelerator."""
    text = str(name)
    if Path(text).is_file():
        try:
            data = read_toml(Path(text), ClusterSpecError)
        except ClusterSpecError:  # not UTF-8 or not TOML
            return False
        return "accelerator" in data or "gpus_per_node" in data
    return normalise_name(text) in _SHIPPED.by_name_or_alias()


def get_cluster(name: str | Path | ClusterSpec) -> ClusterSpec:
    """A cluster by name (``dgx-h100``), alias or path to a TOML file."""
    if isinstance(name, ClusterSpec):
        return name
    return _SHIPPED.find(str(name))


# What each kind of link limits (the parallel strategies that cross it).
LINK_LIMITS = {
    "nvlink": "TP, intra-node FSDP",
    "xgmi": "TP, intra-node FSDP",
    "pcie": "host offload",
    "network": "inter-node collectives",
}


def boundary_table(spec: HardwareSpec) -> dict[str, Boundary]:
    """Every memory and network boundary of ``spec``, keyed: its on-device boundaries
    (``register file``, ``shared memory``, ``L2 cache``, ``HBM``:
    :meth:`HardwareSpec.boundaries`), then every
    link of every shipped cluster of this accelerator as ``<cluster>:<link>`` (``nvlink`` /
    ``xgmi``, ``pcie``, ``network``), line rate per GPU per direction, clusters by name."""
    rows = {boundary.name: boundary for boundary in spec.boundaries()}
    for cluster in available_clusters():
        if cluster.accelerator.name != spec.name:
            continue
        for key, link in cluster.links().items():
            rate = link.line_bytes_per_s
            name = f"{link.name} ({cluster.name})"
            rows[f"{cluster.name}:{key}"] = Boundary(
                name, rate.value, None, LINK_LIMITS.get(key, ""), rate
            )
    return rows


def distinct_boundaries(spec: HardwareSpec) -> list[Boundary]:
    """:func:`boundary_table`'s rows with each link once (NVLink 4 is in every H100 cluster):
    what ``torchroof hardware NAME`` prints and the roofline explorer draws."""
    seen: set[str] = set()
    rows = []
    for boundary in boundary_table(spec).values():
        link = boundary.name.rsplit(" (", 1)[0]
        if link not in seen:
            seen.add(link)
            rows.append(boundary)
    return rows

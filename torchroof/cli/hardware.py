"""``torchroof hardware``: the accelerators and their ridge points, or one device's figures."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from tabulate import tabulate

from torchroof.cli.common import Subparsers
from torchroof.hardware import (
    ClusterSpec,
    Figure,
    HardwareSpec,
    UnknownHardwareError,
    UnsupportedDtypeError,
    available,
    available_clusters,
    distinct_boundaries,
    get,
    get_cluster,
    is_cluster,
)
from torchroof.hardware.runtime import (
    RuntimeProfile,
    UnknownRuntimeError,
    available_runtimes,
    get_runtime,
)


def add_parser(commands: Subparsers) -> None:
    """The ``hardware`` command and its argument."""
    hw = commands.add_parser("hardware", help="list accelerators and their ridge points")
    hw.add_argument(
        "name",
        nargs="?",
        help="show one accelerator's, cluster's or runtime's figures and sources (a cluster: "
        "its link ridges)",
    )


def _print_figures(figures: dict[str, Figure]) -> None:
    rows = [
        [key, f"{fig.value:.4g}", "yes" if fig.approximate else "", fig.source]
        for key, fig in figures.items()
    ]
    print(tabulate(rows, headers=["figure", "value", "approx", "source"], disable_numparse=True))


def _print_cluster(cluster: ClusterSpec) -> None:
    """A cluster, its links and their ridges (docs/concepts/network-ridges.md: I* = pi / beta)."""
    accelerator = cluster.accelerator
    print(f"{cluster.display_name} ({cluster.name}); aliases: {', '.join(cluster.aliases)}")
    most = f"; at most {cluster.max_nodes} nodes" if cluster.max_nodes else ""
    node = f"{cluster.gpus_per_node} x {accelerator.display_name} ({accelerator.name})"
    print(f"{node} per node{most}")
    dtypes = [d for d in ("bf16", "fp8") if d in accelerator.tensor_flops_per_s]
    ridges = {dtype: cluster.link_ridges(dtype) for dtype in dtypes}
    rows = []
    for key, link in cluster.links().items():
        achieved = link.achieved_bytes_per_s if link.achieved_fraction else None
        latency = link.latency_s
        rows.append(
            [
                key,
                link.name,
                f"{link.line_bytes_per_s.value / 1e9:.0f}",
                f"{achieved / 1e9:.0f}" if achieved else "-",
                f"{latency.value * 1e6:.1f}" if latency else "-",
                *(f"{ridges[dtype][key]:,.1f}" for dtype in dtypes),
            ]
        )
    headers = ["link", "name", "line GB/s", "achieved GB/s", "alpha us"]
    headers += [f"I* {dtype}" for dtype in dtypes]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    print("(GB/s per GPU per direction; I* = FLOPs per byte crossing the link at line rate)")
    nvls = cluster.intra_node.nvls_all_reduce_bus_bytes_per_s
    if nvls is not None:
        print(f"in-switch all-reduce (NVLS): {nvls.value / 1e9:.0f} GB/s bus bandwidth")
    _print_figures(cluster.figures())


def _print_boundaries(spec: HardwareSpec) -> None:
    """The boundary table: each boundary's bandwidth, ridge pi_bf16 / beta, capacity and what
    it limits; on-chip rows are approximate aggregates (marked ~)."""
    dtype = "bf16" if "bf16" in spec.tensor_flops_per_s else next(iter(spec.tensor_flops_per_s))
    peak = spec.tensor_peak(dtype)
    rows = []
    for boundary in distinct_boundaries(spec):
        rate = boundary.bytes_per_s
        shown = f"{rate / 1e12:.2f} TB/s" if rate >= 1e12 else f"{rate / 1e9:.0f} GB/s"
        capacity = boundary.capacity_bytes
        if capacity is None:
            held = "-"
        elif boundary.name == "shared memory":
            held = f"{capacity / 1024:.0f} KiB / SM"
        else:
            held = (
                f"{capacity / 2**20:.0f} MiB" if capacity < 2**30 else f"{capacity / 2**30:.0f} GiB"
            )
        approx = "~" if boundary.figure.approximate else ""
        rows.append(
            [boundary.name, approx + shown, f"{boundary.ridge(peak):,.0f}", held, boundary.limits]
        )
    print(
        f"Memory boundaries, innermost first (ridge = pi_{dtype} / beta; "
        "~ an approximate aggregate):"
    )
    print(
        tabulate(
            rows,
            headers=["boundary", "beta", f"ridge I* {dtype}", "capacity", "what it limits"],
            disable_numparse=True,
        )
    )


def _unknown_hardware_or_cluster(name: str) -> UnknownHardwareError:
    """The error for a name that is neither an accelerator nor a cluster, with the closest
    of both and every known name."""
    accelerators = [spec.name for spec in available()]
    clusters = [cluster.name for cluster in available_clusters()]
    known = accelerators + clusters
    known += [alias for spec in [*available(), *available_clusters()] for alias in spec.aliases]
    close = difflib.get_close_matches(name.strip().lower(), known, n=4, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UnknownHardwareError(
        f"unknown accelerator or cluster {name!r}{hint} (accelerators: "
        f"{', '.join(accelerators)}; clusters: {', '.join(clusters)})"
    )


def _runtime_named(name: str) -> RuntimeProfile | None:
    """The shipped runtime profile ``name`` names (name or alias), else None."""
    try:
        return get_runtime(name) if not name.endswith(".toml") else None
    except UnknownRuntimeError:
        return None


def run(args: argparse.Namespace) -> None:
    if args.name and is_cluster(args.name):
        _print_cluster(get_cluster(args.name))
        return
    profile = _runtime_named(args.name) if args.name else None
    if profile is not None:
        _print_runtime(profile)
        return
    if args.name:
        try:
            spec = get(args.name)
        except UnknownHardwareError as error:
            if Path(args.name).suffix == ".toml":
                raise
            raise _unknown_hardware_or_cluster(args.name) from error
        print(f"{spec.display_name} ({spec.name}); aliases: {', '.join(spec.aliases)}")
        _print_figures(spec.figures())
        print()
        _print_boundaries(spec)
        return
    rows = []
    for spec in available():
        ridges = []
        for dtype in ("bf16", "fp8", "fp32"):
            try:
                ridges.append(f"{spec.ridge(dtype):.0f}")
            except UnsupportedDtypeError:
                ridges.append("-")
        fp8 = spec.tensor_flops_per_s.get("fp8")
        rows.append(
            [
                spec.name,
                f"{spec.hbm_bytes_per_s.value / 1e12:.2f}",
                f"{spec.hbm_capacity_bytes.value / 2**30:.0f}",
                f"{spec.tensor_peak('bf16') / 1e12:.0f}",
                f"{fp8.value / 1e12:.0f}" if fp8 else "-",
                f"{spec.vector_peak('fp32') / 1e12:.1f}",
                *ridges,
            ]
        )
    headers = [
        "name",
        "HBM TB/s",
        "GiB",
        "bf16 TF/s",
        "fp8 TF/s",
        "fp32 TF/s",
        "I* bf16",
        "I* fp8",
        "I* fp32",
    ]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    print()
    print("Runtimes (--runtime NAME; torchroof hardware NAME shows one with its sources):")
    _print_runtimes()


def _print_runtimes() -> None:
    """One row per shipped runtime profile: what it runs, its kernels and its launches."""
    rows = []
    for profile in available_runtimes():
        graphs = profile.setting("cuda_graphs") or "none"
        limit = profile.figure("graph_max_batch")
        host = profile.figure("host_overhead_s")
        custom = profile.figure("custom_all_reduce_max_bytes")
        rows.append(
            [
                profile.name,
                profile.runs,
                str(profile.setting("fusion")),
                str(profile.setting("attention_kernel")),
                f"{profile.launch_s('prefill', 1) * 1e6:.2f}",
                graphs + (f" (batch <= {limit:.0f})" if limit else ""),
                f"{host * 1e3:.2f}" if host else "-",
                f"{custom / 2**20:g} MiB" if custom else "-",
            ]
        )
    headers = ["runtime", "runs", "kernels", "attention", "launch us", "CUDA graphs"]
    headers += ["host ms/step", "own all-reduce"]
    print(tabulate(rows, headers=headers, disable_numparse=True))


def _print_runtime(profile: RuntimeProfile) -> None:
    """A runtime profile's settings and figures, each with its source."""
    aliases = f"; aliases: {', '.join(profile.aliases)}" if profile.aliases else ""
    print(f"{profile.display_name} ({profile.name}), runs {profile.runs} steps{aliases}")
    rows = [[key, str(s.value), "", s.source] for key, s in profile.settings.items()]
    rows += [
        [key, f"{fig.value:.4g}", "yes" if fig.approximate else "", fig.source]
        for key, fig in profile.figures.items()
    ]
    print(tabulate(rows, headers=["setting", "value", "approx", "source"], disable_numparse=True))

"""Where a step is priced: an accelerator, or a cluster whose accelerator runs the kernels."""

from __future__ import annotations

from pathlib import Path

from torchroof.hardware import ClusterSpec, HardwareSpec, get, get_cluster, is_cluster


def resolve_hardware(
    hardware: str | Path | HardwareSpec | ClusterSpec,
) -> tuple[HardwareSpec, ClusterSpec | None]:
    """(the accelerator, the cluster or None) for an accelerator or a cluster given by name,
    alias, TOML path or spec: a cluster prices its own accelerator's kernels."""
    if isinstance(hardware, ClusterSpec):
        return hardware.accelerator, hardware
    if isinstance(hardware, HardwareSpec):
        return hardware, None
    if is_cluster(hardware):
        cluster = get_cluster(hardware)
        return cluster.accelerator, cluster
    return get(hardware), None

"""Variants side by side and sweeps as data: which GPU, which batch, GQA or not, bf16 or fp8,
fused or eager — one estimate per variant (made by :mod:`torchroof.studies`, shown by
:mod:`torchroof.render`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchroof.report import analysis
from torchroof.report.estimate import Estimate


@dataclass
class Variant:
    label: str
    settings: dict[str, Any]
    estimate: Estimate


@dataclass
class Comparison:
    """One estimate per variant, in the order asked."""

    variants: list[Variant]


@dataclass(frozen=True)
class SweepPoint:
    value: int
    estimate: Estimate


@dataclass
class Sweep:
    """One estimate per value of a size (batch, context or seq)."""

    key: str
    points: list[SweepPoint]

    @property
    def ridge_batch(self) -> float:
        """B* from the first point (the same at every batch: it is a weights property)."""
        return self.points[0].estimate.ridge_batch

    @property
    def kv_crossover_batch(self) -> float:
        return self.points[0].estimate.kv_crossover_batch

    def rows(self) -> list[dict[str, Any]]:
        return [{self.key: point.value, **point_metrics(point.estimate)} for point in self.points]


def point_metrics(e: Estimate) -> dict[str, Any]:
    """What a sweep or grid reports of each point: time, throughput, GPUs, MFU, traffic by
    role, memory and whether it fits."""
    traffic = e.traffic()
    return {
        "step_time_s": e.time_s,
        "tokens_per_s": e.tokens_per_s,
        "gpus": analysis.ranks(e)[0],
        "tokens_per_s_per_gpu": analysis.tokens_per_s_per_gpu(e),
        "exposed_communication_s": analysis.communication(e).exposed_s,
        "mfu": e.mfu,
        "weight_bytes": traffic.get("weights", 0),
        "kv_bytes": traffic.get("kv_cache", 0),
        "activation_bytes": traffic.get("activations", 0),
        "memory_bytes": e.memory.total_bytes if e.memory else 0,
        "fits": e.memory.fits if e.memory else True,
    }


@dataclass
class GridPoint:
    values: dict[str, Any]  # axis -> its value at this point
    estimate: Estimate


@dataclass
class Grid:
    """One estimate per point of several axes at once (batch x context, hardware x tp),
    every combination, the first axis slowest."""

    axes: list[tuple[str, list[Any]]]
    points: list[GridPoint]

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.axes]

    def at(self, **values: Any) -> Estimate:
        """The estimate at the point with these axis values (every axis given)."""
        if set(values) != set(self.keys):
            raise KeyError(f"give a value for each axis: {', '.join(self.keys)}")
        for point in self.points:
            if point.values == values:
                return point.estimate
        raise KeyError(f"no point {values} in the grid")

    def rows(self) -> list[dict[str, Any]]:
        """One row per point: the axis values, then :func:`point_metrics`."""
        return [{**point.values, **point_metrics(point.estimate)} for point in self.points]

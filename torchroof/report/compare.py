"""Variants side by side and sweeps as data: which GPU, which batch, GQA or not, bf16 or fp8,
fused or eager — one estimate per variant (made by :mod:`torchroof.studies`, shown by
:mod:`torchroof.render`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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


class GridPoint:
    """One point of a grid: its axis values, its figures (:func:`point_metrics`) and its
    estimate, made when first asked for where the grid was priced from its figures (a
    grid of thousands of points keeps only those)."""

    def __init__(
        self,
        values: dict[str, Any],
        estimate: Estimate | None = None,
        *,
        metrics: dict[str, Any] | None = None,
        make: Callable[[], Estimate] | None = None,
    ) -> None:
        if estimate is None and make is None:
            raise ValueError("a grid point needs its estimate or a way to make it")
        self.values = values  # axis -> its value at this point
        self._estimate = estimate
        self._metrics = metrics
        self._make = make

    @property
    def estimate(self) -> Estimate:
        if self._estimate is None:
            assert self._make is not None
            self._estimate = self._make()
        return self._estimate

    @property
    def metrics(self) -> dict[str, Any]:
        if self._metrics is None:
            self._metrics = point_metrics(self.estimate)
        return self._metrics

    def __repr__(self) -> str:
        return f"GridPoint({self.values})"


@dataclass
class Grid:
    """One point per combination of several axes at once (batch x context, hardware x tp),
    the first axis slowest: each with its figures, and its estimate when asked for.
    ``notes`` say which points were traced or priced the long way, and why."""

    axes: list[tuple[str, list[Any]]]
    points: list[GridPoint]
    notes: list[str] = field(default_factory=list)

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
        return [{**point.values, **point.metrics} for point in self.points]

"""Each estimate's expected range and calibrated time, from the measured runs like it.

A step is compared with the shipped fit's group for its kind (:mod:`torchroof.accuracy.fit`):
its expected range is its own time (in the mode that priced it) times the middle 80% of that
group's measured / predicted; the calibrated mode multiplies the realistic time by the
group's median (:func:`correction`). The nearest measured run is the group's run that shares
the most with the step: its kind, runtime, accelerator and quantisation, then the nearest
GPU count and step length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchroof.accuracy.fit import MIN_RUNS, ladder
from torchroof.accuracy.measured import KIND_NAMES, MeasuredRun, shipped_data, shipped_runs
from torchroof.config import Workload
from torchroof.report import analysis
from torchroof.report.estimate import Estimate

MODE_NAMES = {"roofline": "pure roofline", "realistic": "realistic"}


@dataclass(frozen=True)
class Similar:
    """The shipped group a kind of step is compared with, and its spread in one mode."""

    name: str
    runs: int
    sources: int
    low: float
    median: float
    high: float
    holds: Callable[[MeasuredRun], bool]  # who belongs to it (its rung of the ladder)


def similar_group(kind: str, mode: str) -> Similar | None:
    """The shipped fit's group for ``kind`` and its spread in ``mode`` (realistic for the
    calibrated mode); None where no group is large enough."""
    groups = shipped_data()["fit"]
    spread_mode = "roofline" if mode == "roofline" else "realistic"
    for rung in ladder(kind):
        if rung.name in groups:
            g = groups[rung.name]
            s = g[spread_mode]
            spread = (s["low"], s["median"], s["high"])
            return Similar(rung.name, g["runs"], g["sources"], *spread, rung.holds)
    return None


class NotCalibratedError(ValueError):
    """The calibrated mode was asked of a step no measured group is like."""


def _calibrated(mode: str, workload: Workload | None) -> Similar | None:
    """The group the calibrated mode takes its median from (None in the other modes); a
    step no group is like is refused."""
    if mode != "calibrated":
        return None
    found = similar_group(workload.regime, mode) if workload is not None else None
    if found is None:
        what = f"a {workload.regime} step" if workload else "a step traced by hand"
        raise NotCalibratedError(
            f"calibrated mode: no measured runs are like {what}; price it in the realistic mode "
            "(--mode realistic)"
        )
    return found


def correction(mode: str, workload: Workload | None) -> float:
    """What the calibrated mode multiplies a step's realistic time by: the median measured /
    realistic of the runs like it (1 in the other modes)."""
    found = _calibrated(mode, workload)
    return found.median if found is not None else 1.0


def calibration_lines(mode: str, workload: Workload | None) -> list[str]:
    """The assumption a calibrated estimate states (none in the other modes)."""
    found = _calibrated(mode, workload)
    if found is None:
        return []
    return [
        f"calibrated: the realistic time x {found.median:.2f}, the median measured / realistic "
        f"time of {found.runs} published {found.name} from {found.sources} sources "
        f"(torchroof's docs: validation/expected-ranges)"
    ]


@dataclass(frozen=True)
class NearestRun:
    """The measured run most like the step, and its measured / predicted time."""

    run: str
    hardware: str
    runtime: str
    correction: float  # measured / predicted, in the estimate's mode

    def text(self, mode: str) -> str:
        runtime = f" under {self.runtime}" if self.runtime not in ("", "none", "unknown") else ""
        return (
            f"{self.run} on {self.hardware}{runtime}, measured {self.correction:.2f}x its "
            f"{MODE_NAMES[mode]} estimate"
        )


@dataclass(frozen=True)
class ExpectedRange:
    """Where the step's measured time is expected to fall: its estimate times the middle
    80% of measured / predicted over ``runs`` similar measured runs."""

    mode: str  # the spread's mode: roofline or realistic (the calibrated mode's)
    low_s: float
    high_s: float
    group: str
    runs: int
    sources: int
    nearest: NearestRun | None

    def line(self) -> str:
        nearest = f"; nearest: {self.nearest.text(self.mode)}" if self.nearest else ""
        return (
            f"expected: {_ms(self.low_s)}-{_ms(self.high_s)} ms (middle 80% of {self.runs} "
            f"similar measured runs, {self.group} from {self.sources} sources{nearest})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "low_s": self.low_s,
            "high_s": self.high_s,
            "mode": self.mode,
            "group": self.group,
            "runs": self.runs,
            "sources": self.sources,
            "nearest": None if self.nearest is None else vars(self.nearest),
        }


@dataclass(frozen=True)
class NoRange:
    """Why no range is stated."""

    reason: str

    def line(self) -> str:
        return f"expected: no range, {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"none": self.reason}


def serving_range() -> NoRange:
    """Why a simulated serving run states no expected range: the published serving runs its
    simulator is checked against are too few, or too much from one source, to make a group
    (the shipped ``serving`` record; the script that writes it refuses to ship runs that
    would make one)."""
    served = shipped_data()["serving"]
    sources = served["sources"]
    named = "; ".join(f"{title}: {n}" for title, n in sources.items())
    count = f"{len(sources)} source" + ("s" if len(sources) != 1 else "")
    return NoRange(
        f"the {served['runs']} published serving runs the simulator is checked against come "
        f"from {count} ({named}); a range needs at least {MIN_RUNS} runs, no source holding "
        f"more than half of them"
    )


def no_range_lines(found: dict[str, Any] | None) -> list[str]:
    """The line a served run's text states of its JSON's ``expected`` (none where absent)."""
    return [NoRange(found["none"]).line()] if found else []


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def expected_range(est: Estimate) -> ExpectedRange | NoRange:
    """The step's expected range (or why there is none)."""
    workload = est.workload
    if workload is None:
        return NoRange(
            "a step traced by hand is not a training step, prefill or decode step the "
            "measured runs can be compared with"
        )
    mode = "roofline" if est.options.mode == "roofline" else "realistic"
    found = similar_group(workload.regime, mode)
    if found is None:
        name = KIND_NAMES.get(workload.regime, workload.regime)
        return NoRange(
            f"fewer than {MIN_RUNS} measured {name}, none from a source holding most of them"
        )
    base = est.time_s / est.correction  # the estimate's own mode, before any calibration
    members = [r for r in shipped_runs() if found.holds(r)]
    return ExpectedRange(
        mode,
        base * found.low,
        base * found.high,
        found.name,
        found.runs,
        found.sources,
        nearest_run(est, members, mode, base),
    )


def nearest_run(
    est: Estimate, runs: list[MeasuredRun], mode: str, time_s: float
) -> NearestRun | None:
    """The run that shares the most with the step: the same kind (weight 4), runtime (1),
    accelerator (1) and quantisation (0.5), then the nearest GPU count (0.25 per factor of
    2) and predicted time (0.5 per factor of 10)."""
    workload = est.workload
    if workload is None or not runs:
        return None
    gpus = analysis.ranks(est)[0]

    def distance(run: MeasuredRun) -> float:
        length = abs(math.log10(run.predicted_s(mode) / time_s)) if time_s > 0 else 0.0
        return (
            4.0 * (run.kind != workload.regime)
            + 1.0 * (run.runtime != est.options.runtime)
            + 1.0 * (run.accelerator != est.hardware)
            + 0.5 * (run.quant != workload.quant)
            + 0.25 * abs(math.log2(run.gpus / gpus))
            + 0.5 * length
        )

    best = min(runs, key=lambda r: (distance(r), r.run))
    return NearestRun(best.run, best.hardware, best.runtime, best.correction(mode))

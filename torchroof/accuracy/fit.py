"""The spread of measured / predicted over the measured runs like a step, and how well that
spread predicts runs it was not fitted on.

The model is grouped order statistics, chosen because it can be read and stated:

- A step is compared with the measured runs of its kind (training steps, prefills, decode
  steps; a kernel with the kernel benchmarks). Where that group has fewer than
  :data:`MIN_RUNS` runs or one source holds more than half of them, a model step is
  compared with every model step, and where that fails as well, with none: no range is
  stated.
- The expected range is the middle 80% of the group's corrections (measured / predicted),
  taken as order statistics: of n corrections sorted, the j-th smallest and the j-th
  largest with j = floor(0.1 (n + 1)). A further run drawn from the same population falls
  between them with probability (n + 1 - 2j) / (n + 1), at least 80% (Wilks, "Determination
  of sample sizes for setting tolerance limits", Ann. Math. Statist. 12, 1941; the same
  argument gives split-conformal intervals: Lei et al., "Distribution-free predictive
  inference for regression", JASA 113, 2018, section 2.2). It needs n >= 9.
- The calibrated time is the realistic time times the group's median correction.

Runs of one source (one publication or benchmark repository) share their setup and
measurement habits, so they are not independent draws. :func:`leave_one_source_out`
therefore fits without each source in turn and checks that source's runs against the range
and the calibrated time fitted on the others. Further splits (runtime, accelerator family,
one GPU or several, quantisation recipe, step length; and the kind of kernel) were tried
under that evaluation (``examples/expected_ranges.py --features``). Quantisation and
accelerator family narrowed the training steps' range at the same coverage, and
quantisation raised the decode steps' coverage, but a split picked after seeing an
evaluation cannot be scored fairly by it, and each split group holds 9 to 20 runs where one
source's habits still weigh heavily, so the groups stay by kind.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchroof.accuracy.measured import KIND_NAMES, MODES, STEP_KINDS, MeasuredRun

MIDDLE = 0.8
"""The share of similar runs the expected range is meant to hold."""

MIN_RUNS = 9
"""The fewest runs whose outermost two bound a middle 80%: (n + 1 - 2) / (n + 1) >= 0.8."""

MAX_SOURCE_SHARE = 0.5
"""The most of a group's runs one source may hold: a group mostly from one source measures
that source (its setup, its way of measuring), not the kind of step."""

STEPS = "model steps"


@dataclass(frozen=True)
class Rung:
    """One group a run may be compared with: its name and who belongs to it."""

    name: str
    holds: Callable[[MeasuredRun], bool]


Split = Callable[[MeasuredRun], str]
"""A further feature to group by, tried before the kind alone (``--features``)."""


def ladder(kind: str, split: tuple[Split, str] | None = None) -> tuple[Rung, ...]:
    """The groups a run of ``kind`` is compared with, the narrowest first; ``split`` (a
    feature and the run's value of it) adds a narrower one."""
    first: tuple[Rung, ...] = ()
    if split is not None:
        feature, value = split
        first = (Rung(f"{kind}: {value}", lambda r: r.kind == kind and feature(r) == value),)
    mine = (Rung(KIND_NAMES.get(kind, kind), lambda r: r.kind == kind),)
    if kind not in STEP_KINDS:  # kernel benchmarks are not compared with model steps
        return first + mine
    return first + mine + (Rung(STEPS, lambda r: r.kind in STEP_KINDS),)


def middle_interval(values: Sequence[float], share: float = MIDDLE) -> tuple[float, float]:
    """The order statistics that bound the middle ``share`` of ``values``: the j-th smallest
    and j-th largest, j = floor((1 - share) / 2 (n + 1)) (at least 1)."""
    ordered = sorted(values)
    n = len(ordered)
    j = max(1, math.floor((1 - share) / 2 * (n + 1) + 1e-9))
    return ordered[j - 1], ordered[n - j]


@dataclass(frozen=True)
class Spread:
    """measured / predicted over a group's runs in one timing mode: the bounds of its
    middle 80% and its median."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, corrections: Sequence[float]) -> Spread:
        low, high = middle_interval(corrections)
        return cls(low, float(np.median(corrections)), high)

    def to_dict(self) -> dict[str, float]:
        return {"low": self.low, "median": self.median, "high": self.high}


@dataclass(frozen=True)
class Group:
    """The measured runs one step is compared with, and their spread in each mode."""

    name: str
    runs: tuple[MeasuredRun, ...]
    spread: dict[str, Spread]

    @property
    def sources(self) -> int:
        return len({r.source for r in self.runs})

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": len(self.runs),
            "sources": self.sources,
            **{mode: self.spread[mode].to_dict() for mode in MODES},
        }


def similar(
    kind: str, runs: Iterable[MeasuredRun], split: tuple[Split, str] | None = None
) -> Group | None:
    """The narrowest group of ``runs`` a step of ``kind`` is compared with that has at least
    :data:`MIN_RUNS` runs, no source holding more than half of them (None: no such
    group)."""
    pool = tuple(runs)
    for rung in ladder(kind, split):
        members = tuple(r for r in pool if rung.holds(r))
        largest = max(Counter(r.source for r in members).values(), default=0)
        if len(members) >= MIN_RUNS and largest <= MAX_SOURCE_SHARE * len(members):
            spread = {m: Spread.of([r.correction(m) for r in members]) for m in MODES}
            return Group(rung.name, members, spread)
    return None


def fit(runs: Sequence[MeasuredRun]) -> dict[str, dict[str, Any]]:
    """Every group some run is compared with, by name: its runs, sources and spreads (what
    ``measured_runs.json`` ships as its ``fit``)."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        found = similar(run.kind, runs)
        if found is not None and found.name not in out:
            out[found.name] = found.to_dict()
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class HeldOut:
    """One run checked against the group fitted without its source."""

    run: MeasuredRun
    group: str  # the group it was compared with ("" where none was large enough)
    inside: dict[str, bool]  # per mode: its correction fell inside the expected range
    width: dict[str, float]  # per mode: the range's high / low
    calibrated: float  # measured / calibrated time (nan where no group)


def leave_one_source_out(runs: Sequence[MeasuredRun], split: Split | None = None) -> list[HeldOut]:
    """Each run checked against the range and calibrated time fitted on the other sources'
    runs (``split``: grouped by that feature first)."""
    out = []
    for run in runs:
        others = [r for r in runs if r.source != run.source]
        found = similar(run.kind, others, (split, split(run)) if split else None)
        if found is None:
            out.append(HeldOut(run, "", {}, {}, math.nan))
            continue
        inside = {
            m: found.spread[m].low <= run.correction(m) <= found.spread[m].high for m in MODES
        }
        width = {m: found.spread[m].high / found.spread[m].low for m in MODES}
        calibrated = run.correction("realistic") / found.spread["realistic"].median
        out.append(HeldOut(run, found.name, inside, width, calibrated))
    return out


@dataclass(frozen=True)
class Coverage:
    """How one kind of run fared under :func:`leave_one_source_out`."""

    kind: str
    runs: int
    sources: int
    ranged: int  # runs that had a group once their source was left out
    compared: dict[str, int]  # the groups they were compared with, and how many each
    inside: dict[str, float]  # per mode: the share of ranged runs inside their range
    width: dict[str, float]  # per mode: the median of the ranges' high / low
    calibrated_median: float  # measured / calibrated: its median ...
    calibrated_quartiles: tuple[float, float]  # ... and the bounds of its middle half

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "sources": self.sources,
            "ranged": self.ranged,
            "compared": self.compared,
            "inside": self.inside,
            "width": self.width,
            "calibrated_median": self.calibrated_median,
            "calibrated_quartiles": list(self.calibrated_quartiles),
        }


def coverage(held: Sequence[HeldOut], kind: str) -> Coverage:
    """The leave-one-source-out figures of ``kind``'s runs."""
    mine = [h for h in held if h.run.kind == kind]
    ranged = [h for h in mine if h.group]
    if not ranged:
        nan = math.nan
        return Coverage(kind, len(mine), _sources(mine), 0, {}, {}, {}, nan, (nan, nan))
    calibrated = [h.calibrated for h in ranged]
    q1, q3 = np.percentile(calibrated, [25, 75])
    return Coverage(
        kind,
        len(mine),
        _sources(mine),
        len(ranged),
        dict(Counter(h.group for h in ranged).most_common()),
        {m: sum(h.inside[m] for h in ranged) / len(ranged) for m in MODES},
        {m: float(np.median([h.width[m] for h in ranged])) for m in MODES},
        float(np.median(calibrated)),
        (float(q1), float(q3)),
    )


def _sources(held: Sequence[HeldOut]) -> int:
    return len({h.run.source for h in held})


def evaluation(
    runs: Sequence[MeasuredRun], split: Split | None = None
) -> dict[str, dict[str, Any]]:
    """Leave-one-source-out coverage, width and calibrated error by kind (what
    ``measured_runs.json`` ships as its ``evaluation``; ``split``: grouped by that feature
    first)."""
    held = leave_one_source_out(runs, split)
    kinds = [k for k in (*STEP_KINDS, "kernel") if any(r.kind == k for r in runs)]
    return {kind: coverage(held, kind).to_dict() for kind in kinds}

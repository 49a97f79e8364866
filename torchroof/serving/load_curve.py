"""Latency and throughput against the offered request rate, and the knee where the tail
latency takes off.

The same requests are served at each rate: their lengths kept, their arrivals one draw of
gaps scaled by 1 / rate (as the rate search serves them,
:mod:`torchroof.serving.rate_search`), and once one at a time on each replica, the load
without queueing that the knee is measured against.

The knee, stated as a rule: going up the rates served, the last rate before the first whose
P99 TTFT is above ``factor`` times the P99 TTFT of the requests served one at a time (3 by
default). Past it, requests wait behind each other more than they are served: in an M/M/1
queue the mean time in the system is the service time over 1 - rho (Kleinrock, "Queueing
Systems" vol. 1, 1975, section 3.2), so 3 times the unloaded time is reached at a
utilisation rho of 2/3, and the time grows without bound as rho nears 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torchroof.accuracy.expected import serving_range
from torchroof.config.errors import OptionError
from torchroof.serving.rate_search import ONE_AT_A_TIME, RateSearch, check_targets
from torchroof.serving.requests import Request
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.simulate import simulate
from torchroof.serving.speculative import Drafter
from torchroof.serving.step_time import StepTimer

KNEE_FACTOR = 3.0


@dataclass(frozen=True)
class Knee:
    """The knee of a load curve: ``rate``, the highest rate before the P99 TTFT first passes
    ``factor`` x ``baseline_s`` (None when the lowest rate served is already past it), and
    ``first_past``, the first rate past it (None when no rate served is)."""

    rate: float | None
    first_past: float | None
    factor: float
    baseline_s: float  # the P99 TTFT of the requests served one at a time
    first_past_s: float | None = None  # the P99 TTFT at first_past

    @property
    def threshold_s(self) -> float:
        return self.factor * self.baseline_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "first_past": self.first_past,
            "factor": self.factor,
            "baseline_p99_ttft_s": self.baseline_s,
            "threshold_s": self.threshold_s,
            "first_past_p99_ttft_s": self.first_past_s,
        }


def check_factor(factor: float) -> None:
    """Refuse a knee factor that is not a finite number above 1."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise OptionError(f"the knee factor must be a number above 1, got {factor!r}")
    if not (factor > 1 and math.isfinite(factor)):
        raise OptionError(f"the knee factor must be above 1 (times the unloaded P99), got {factor}")


def find_knee(
    rates: Sequence[float],
    p99_ttft_s: Sequence[float],
    baseline_s: float,
    factor: float = KNEE_FACTOR,
) -> Knee:
    """The knee of the points (``rates[i]``, ``p99_ttft_s[i]``), taken in order of rate: the
    last rate before the first whose P99 TTFT is above ``factor`` x ``baseline_s``."""
    check_factor(factor)
    if len(rates) != len(p99_ttft_s):
        raise OptionError("a knee needs one P99 TTFT per rate")
    threshold = factor * baseline_s
    below: float | None = None
    for rate, p99 in sorted(zip(rates, p99_ttft_s, strict=True)):
        if p99 > threshold:
            return Knee(below, rate, factor, baseline_s, p99)
        below = rate
    return Knee(below, None, factor, baseline_s)


@dataclass(frozen=True)
class RatePoint:
    """One load served: its offered rate (for the one-at-a-time load, the requests over the
    time they took) and the run."""

    rate: float
    result: ServeResult
    how: str = ""


@dataclass(frozen=True)
class LoadCurve:
    """Every rate served in increasing order, the one-at-a-time run, and the targets (None
    where not given)."""

    points: tuple[RatePoint, ...]
    alone: RatePoint
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_search(cls, search: RateSearch) -> LoadCurve:
        """The open-arrival rates a rate search served (not every request at once), with
        its one-at-a-time run and its targets."""
        first = search.tried[0]
        alone = RatePoint(first.rate, first.result, first.how)
        by_rate = {t.rate: t for t in reversed(search.tried[1:]) if not t.how}
        points = tuple(RatePoint(r, by_rate[r].result) for r in sorted(by_rate))
        return cls(points, alone, search.ttft_s, search.tpot_s)

    def rows(self) -> list[dict[str, Any]]:
        """Per rate: throughput (requests, output tokens), goodput and the share within the
        targets where any is given, P50 and P99 TTFT and TPOT (seconds)."""
        return [self._row(point) for point in self.points]

    def knee(self, factor: float = KNEE_FACTOR) -> Knee:
        """The knee by the module's rule."""
        baseline = self.alone.result.summary()["ttft_s"]["p99"]
        rows = self.rows()
        return find_knee(
            [row["rate"] for row in rows], [row["p99_ttft_s"] for row in rows], baseline, factor
        )

    def to_dict(self, factor: float = KNEE_FACTOR) -> dict[str, Any]:
        """The targets, the one-at-a-time run's row, each rate's row and the knee
        (JSON-ready)."""
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "one_at_a_time": self._row(self.alone),
            "rates": self.rows(),
            "knee": self.knee(factor).to_dict(),
            "engine": self.alone.result.engine,
            "expected": serving_range().to_dict(),  # why no range is stated
        }

    def _row(self, point: RatePoint) -> dict[str, Any]:
        summary = point.result.summary(self.ttft_s, self.tpot_s)
        targets = self.ttft_s is not None or self.tpot_s is not None
        return {
            "rate": point.rate,
            "how": point.how,
            "request_throughput_per_s": summary["request_throughput_per_s"],
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "goodput_per_s": summary["goodput_per_s"] if targets else None,
            "within_targets": (
                summary["requests_meeting_slo"] / summary["requests"] if targets else None
            ),
            "p50_ttft_s": summary["ttft_s"]["p50"],
            "p99_ttft_s": summary["ttft_s"]["p99"],
            "p50_tpot_s": summary["tpot_s"]["p50"],
            "p99_tpot_s": summary["tpot_s"]["p99"],
            "preemptions": summary["preemptions"],
        }


def check_rates(rates: Sequence[float]) -> list[float]:
    """The rates in increasing order; refuses none, one not above 0, and one given twice."""
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence) or not rates:
        raise OptionError("give the request rates to serve as a list of numbers per second")
    for rate in rates:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise OptionError(f"a request rate is a number per second, got {rate!r}")
        if not (rate > 0 and math.isfinite(rate)):
            raise OptionError(f"a request rate must be above 0 per second, got {rate}")
    ordered = sorted(float(rate) for rate in rates)
    twice = [a for a, b in zip(ordered, ordered[1:], strict=False) if a == b]
    if twice:
        raise OptionError(f"the rate {twice[0]:g} is listed twice")
    return ordered


def check_load(rates: Sequence[float], ttft_s: float | None, tpot_s: float | None) -> list[float]:
    """The rates in increasing order (:func:`check_rates`); refuses a target given that is
    not a positive time."""
    ordered = check_rates(rates)
    if ttft_s is not None or tpot_s is not None:
        check_targets(ttft_s, tpot_s, 1.0)
    return ordered


def load_curve(
    timer: StepTimer,
    requests: Sequence[Request],
    rates: Sequence[float],
    *,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    engine: EngineConfig | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    drafter: Drafter | None = None,
    random_state: int = 0,
) -> LoadCurve:
    """Serve ``requests`` (arriving at 1 per second in their own times, which are scaled)
    one at a time on each replica, then at each of ``rates``."""
    ordered = check_load(rates, ttft_s, tpot_s)
    if any(r.arrival_s is None for r in requests):
        raise OptionError(
            "serving at a list of rates scales the requests' arrival times: give them"
        )
    # one closed-loop client per replica, each request sent to a free replica when the last
    # ends (the rate search's first load); its rate is the requests over the time they took
    alone = simulate(
        timer,
        requests,
        engine=engine,
        concurrency=replicas,
        replicas=replicas,
        router="least-loaded",
        drafter=drafter,
        random_state=random_state,
    )
    points = []
    for rate in ordered:
        load = [replace(r, arrival_s=(r.arrival_s or 0.0) / rate) for r in requests]
        result = simulate(
            timer,
            load,
            engine=engine,
            replicas=replicas,
            router=router,
            drafter=drafter,
            random_state=random_state,
        )
        points.append(RatePoint(rate, result))
    alone_rate = len(requests) / alone.duration_s if alone.duration_s else math.inf
    return LoadCurve(tuple(points), RatePoint(alone_rate, alone, ONE_AT_A_TIME), ttft_s, tpot_s)

"""The highest request rate a deployment serves within its latency targets.

A rate meets the targets when at least ``attainment`` of its requests see a TTFT and a
TPOT within them (DistServe's SLO attainment, Zhong et al. 2024; 90% by default). The
requests keep their lengths at every rate tried, and their arrivals keep one draw of
exponential (or gamma) gaps, scaled by 1 / rate: a higher rate sends the same requests
closer together, so attainment falls as the rate rises (mostly: it need not fall
steadily). The search serves the requests one at a time on each replica first (where even
that fails, no rate meets the targets) and then every request at once (where that passes,
no rate limits them); then it doubles the rate from ``start`` until a rate fails (or halves
it until one passes), and halves the interval between the last rate that met the targets
and the first that did not until it is within ``tolerance`` of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torchroof.accuracy.expected import serving_range
from torchroof.config.errors import OptionError
from torchroof.serving.requests import Request
from torchroof.serving.results import ServeResult
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.simulate import simulate
from torchroof.serving.speculative import Drafter
from torchroof.serving.step_time import StepTimer

MAX_DOUBLINGS = 30

ONE_AT_A_TIME = "one at a time"
ALL_AT_ONCE = "all at once"


@dataclass(frozen=True)
class RateTried:
    """One rate the search served, and the share of requests within the targets; ``how``
    names the two loads that are not open arrivals at a rate."""

    rate: float
    attainment: float
    result: ServeResult
    how: str = ""


@dataclass(frozen=True)
class RateSearch:
    """The highest rate found within the targets (None when no rate meets them), every
    rate tried in order, and the targets."""

    best: RateTried | None
    tried: tuple[RateTried, ...]
    ttft_s: float | None
    tpot_s: float | None
    attainment: float

    def to_dict(self) -> dict[str, Any]:
        """The targets, each rate tried with its attainment and P99 latencies, and the
        best rate's whole summary (JSON-ready)."""

        def row(t: RateTried) -> dict[str, Any]:
            summary = t.result.summary(self.ttft_s, self.tpot_s)
            return {
                "rate": t.rate if math.isfinite(t.rate) else None,
                "how": t.how,
                "attainment": t.attainment,
                "p99_ttft_s": summary["ttft_s"]["p99"],
                "p99_tpot_s": summary["tpot_s"]["p99"],
            }

        best = None
        if self.best is not None:
            best = {**row(self.best), "summary": self.best.result.summary(self.ttft_s, self.tpot_s)}
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "attainment": self.attainment,
            "tried": [row(t) for t in self.tried],
            "best": best,
            "engine": self.tried[0].result.engine if self.tried else {},
            "expected": serving_range().to_dict(),  # why no range is stated
        }


def check_targets(ttft_s: float | None, tpot_s: float | None, attainment: float) -> None:
    """Refuse a search without a target, a target that is not a positive time, or an
    attainment outside (0, 1]."""
    if ttft_s is None and tpot_s is None:
        raise OptionError("a rate search needs a TTFT or a TPOT target")
    for name, value in (("ttft", ttft_s), ("tpot", tpot_s)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise OptionError(f"the {name} target must be above 0 seconds, got {value}")
    if not 0 < attainment <= 1:
        raise OptionError(f"attainment must be in (0, 1], got {attainment}")


def search_rate(
    timer: StepTimer,
    requests: Sequence[Request],
    *,
    ttft_s: float | None,
    tpot_s: float | None,
    attainment: float = 0.9,
    start: float = 1.0,
    tolerance: float = 0.05,
    engine: EngineConfig | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    drafter: Drafter | None = None,
    random_state: int = 0,
) -> RateSearch:
    """Search the highest rate at which ``requests`` (arriving at 1 per second in their
    own times, which are scaled) meet the targets."""
    check_targets(ttft_s, tpot_s, attainment)
    if not (start > 0 and math.isfinite(start)) or not 0 < tolerance < 1:
        raise OptionError("start must be above 0 per second and tolerance in (0, 1)")
    if any(r.arrival_s is None for r in requests):
        raise OptionError("a rate search scales the requests' arrival times: give them")
    times = [r.arrival_s or 0.0 for r in requests]
    if len(requests) > 1 and max(times) == min(times):
        raise OptionError(
            "the requests all arrive at one time: a rate search needs their arrivals spread"
        )
    tried: list[RateTried] = []

    def served(
        load: Sequence[Request], rate: float | None, how: str = "", **how_served: Any
    ) -> RateTried:
        """``load`` served and recorded; a rate of None is the requests over their time."""
        kwargs = {
            "replicas": replicas,
            "router": router,
            "drafter": drafter,
            "random_state": random_state,
            **how_served,
        }
        result = simulate(timer, load, engine=engine, **kwargs)
        met = result.summary(ttft_s, tpot_s)["requests_meeting_slo"] / len(requests)
        if rate is None:
            rate = len(requests) / result.duration_s
        tried.append(RateTried(rate, met, result, how))
        return tried[-1]

    def serve(rate: float) -> RateTried:
        return served([replace(r, arrival_s=(r.arrival_s or 0.0) / rate) for r in requests], rate)

    # one at a time on each replica: one closed-loop client per replica, each request sent
    # when its client's last one ends, to the least-loaded replica (always a free one); its
    # rate is the requests over the time they took
    alone = served(requests, None, ONE_AT_A_TIME, concurrency=replicas, router="least-loaded")
    if alone.attainment < attainment:
        return RateSearch(None, tuple(tried), ttft_s, tpot_s, attainment)
    # every request at time 0: where even this meets the targets, no rate limits them
    together = served([replace(r, arrival_s=0.0) for r in requests], math.inf, ALL_AT_ONCE)
    if together.attainment >= attainment:
        return RateSearch(together, tuple(tried), ttft_s, tpot_s, attainment)
    low, rate = None, start
    for _ in range(MAX_DOUBLINGS):  # up from start while the rate meets the targets
        point = serve(rate)
        if point.attainment < attainment:
            break
        low, rate = point, rate * 2
    else:  # every rate passed though every request at once did not (attainment need not
        # fall steadily with the rate)
        raise OptionError(f"every rate up to {rate:g} per second meets the targets")
    high = rate
    while low is None and rate > start / 2**MAX_DOUBLINGS:  # start failed: down from it
        rate /= 2
        point = serve(rate)
        if point.attainment >= attainment:
            low = point
        else:
            high = rate
    if low is None:
        return RateSearch(None, tuple(tried), ttft_s, tpot_s, attainment)
    while (high - low.rate) / low.rate > tolerance:
        # halve the interval, or its ratio while it spans more than a doubling
        middle = math.sqrt(low.rate * high) if high > 2 * low.rate else (low.rate + high) / 2
        point = serve(middle)
        if point.attainment >= attainment:
            low = point
        else:
            high = middle
    return RateSearch(low, tuple(tried), ttft_s, tpot_s, attainment)

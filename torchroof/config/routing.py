"""MoE routing as a pricing option: balanced, expected (uniform random) or a measured
histogram of the experts' shares (:mod:`torchroof.pricing.routing` prices it)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from torchroof.config.errors import OptionError

BALANCED, EXPECTED, HISTOGRAM = "balanced", "expected", "histogram"


@dataclass(frozen=True)
class Routing:
    """How routed rows spread over the experts: ``kind`` balanced, expected (uniform
    random) or histogram; ``shares`` each expert's share of the routed rows (a histogram's,
    summing to 1; empty otherwise)."""

    kind: str = BALANCED
    shares: tuple[float, ...] = ()
    source: str = ""  # where a histogram came from (the file, or "given")

    def shares_of(self, experts: int) -> tuple[float, ...]:
        """Each of ``experts`` experts' share of the routed rows (uniform unless a
        histogram says otherwise; a histogram must name every expert)."""
        if self.kind != HISTOGRAM:
            return (1.0 / experts,) * experts
        if len(self.shares) != experts:
            raise OptionError(
                f"the routing histogram ({self.source}) has {len(self.shares)} shares but "
                f"the model routes over {experts} experts: give one share per expert"
            )
        return self.shares


def routing_kind(text: str) -> str:
    """balanced, expected or histogram, from an option's text alone (no file is read)."""
    text = str(text).strip()
    return text if text in (BALANCED, EXPECTED) else HISTOGRAM


def inline_routing(text: str) -> str:
    """The option's text with a histogram file replaced by its normalised shares, so that
    options (and an estimate saved with them) do not depend on the file afterwards."""
    routing = parse_routing(text)
    if routing.kind != HISTOGRAM or routing.source == "given":
        return str(text)
    return ",".join(f"{share:.6g}" for share in routing.shares)


def parse_routing(text: str) -> Routing:
    """``balanced``, ``expected``, or a histogram: numbers separated by commas or white
    space, given inline or in a file (``path/to/histogram.txt``); negative shares, a zero
    total or anything that is not a number is a one-line OptionError."""
    text = str(text).strip()
    if text in (BALANCED, EXPECTED):
        return Routing(kind=text)
    path = Path(text).expanduser()
    if path.is_file():
        body, source = path.read_text(encoding="utf-8"), str(path.resolve())
    elif re.fullmatch(r"[\d.eE+\-,\s]+", text):
        body, source = text, "given"
    else:
        raise OptionError(
            f"routing is balanced, expected, or a histogram of the experts' shares (numbers "
            f"separated by commas, or a file of them), got {text!r}"
        )
    try:
        values = [float(v) for v in re.split(r"[,\s]+", body.strip()) if v]
    except ValueError as err:
        raise OptionError(f"the routing histogram ({source}) holds a non-number: {err}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise OptionError(
            f"the routing histogram ({source}) needs non-negative finite shares with a "
            f"positive total, got {values[:8]}{'...' if len(values) > 8 else ''}"
        )
    total = sum(values)
    return Routing(kind=HISTOGRAM, shares=tuple(v / total for v in values), source=source)

"""The requests a simulated engine serves: their lengths and their arrivals, drawn again
alike from the same random state.

Lengths come from a fixed number or a distribution written ``KIND:ARGS`` (``512``,
``uniform:128,2048``, ``normal:512,128``, ``lognormal:512,0.6``, ``zipf:1.5,4096``), or
from a file of requests. Arrivals are Poisson at a rate, gamma-distributed gaps at a rate
with a coefficient of variation (burstier above 1), closed-loop clients at a concurrency,
or the file's own times. Everything random draws from one ``numpy`` generator the caller
starts from one random state, so the same inputs give the same requests.

A file is JSONL (one object per line) or CSV (a header row) with ``input_len`` and
``output_len`` per request and, optionally, ``arrival_s`` (seconds from the start) and
``prefix_group`` and ``prefix_len`` (the prompt's first ``prefix_len`` tokens are its
group's): the lengths a benchmark trace such as ShareGPT's conversations reduces to.

Drawn requests share prefixes by :class:`Prefixes`: each is given one of ``groups``
prefixes at random, whose ``length`` tokens start its prompt before its own drawn
``input_len`` tokens (like the prefix-repetition and generated-shared-prefix datasets of
vLLM's and SGLang's serving benchmarks, which give each prefix an equal number of prompts
instead).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchroof.config.errors import OptionError

LENGTH_KINDS = ("uniform", "normal", "lognormal", "zipf")
OPTIONAL_COLUMNS = ("arrival_s", "prefix_group", "prefix_len")
LONGEST = 10_000_000
"""The longest length a distribution may name or draw (longer than any model's context)."""


@dataclass(frozen=True)
class Request:
    """One request: when it arrives (None for a closed-loop client's, which arrives when
    its client sends it), its prompt's tokens and the tokens it generates."""

    index: int
    input_len: int
    output_len: int
    arrival_s: float | None = None
    prefix_group: int | None = None  # requests of a group start with the same tokens
    prefix_len: int = 0  # the prompt's tokens that are its group's

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(
                    f"request {self.index}: {name} must be a whole number >= 1, got {value!r}"
                )
        group, shared = self.prefix_group, self.prefix_len
        if group is not None and (
            isinstance(group, bool) or not isinstance(group, int) or group < 0
        ):
            raise OptionError(
                f"request {self.index}: prefix_group must be a whole number >= 0, got {group!r}"
            )
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise OptionError(
                f"request {self.index}: prefix_len must be a whole number >= 0, got {shared!r}"
            )
        if shared > self.input_len:
            raise OptionError(
                f"request {self.index}: prefix_len {shared} is longer than its prompt of "
                f"{self.input_len} tokens"
            )
        if shared and group is None:
            raise OptionError(f"request {self.index}: a prefix_len needs a prefix_group")
        arrival = self.arrival_s
        if arrival is not None and not (
            isinstance(arrival, (int, float)) and math.isfinite(arrival) and arrival >= 0
        ):
            raise OptionError(
                f"request {self.index}: arrival_s must be 0 or more seconds, got {arrival!r}"
            )


@dataclass(frozen=True)
class Lengths:
    """A length distribution, parsed from ``512`` or ``KIND:A,B``.

    - ``uniform:LO,HI``: every whole length from LO to HI equally likely;
    - ``normal:MEAN,SD`` and ``lognormal:MEDIAN,SIGMA`` (SIGMA of the log), rounded;
    - ``zipf:A,MAX``: P(k) proportional to k^-A for k = 1..MAX (A > 1 gives a long tail);

    every draw is at least 1 (``minimum``) and at most ``maximum`` where given.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int, what: str) -> Lengths:
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)
        if not isinstance(text, str):
            raise OptionError(f"{what} must be a length or KIND:A,B, got {text!r}")
        kind, _, args = text.partition(":")
        if not args:
            number = _number(kind, what)
            if number < 1 or number != int(number) or number > LONGEST:
                raise OptionError(
                    f"{what} must be a whole number of tokens from 1 to {LONGEST:,}, got {text}"
                )
            return cls("fixed", number)
        if kind not in LENGTH_KINDS:
            raise OptionError(
                f"{what}: unknown distribution {kind!r} (known: {', '.join(LENGTH_KINDS)})"
            )
        values = [_number(part, what) for part in args.split(",")]
        if len(values) != 2:
            raise OptionError(f"{what}: {kind} takes two numbers, {kind}:A,B, got {text!r}")
        a, b = values
        _check(kind, a, b, what, text)
        return cls(kind, a, b)

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` lengths, each a whole number >= 1."""
        if self.kind == "fixed":
            values = np.full(count, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b) + 1, size=count)
        elif self.kind == "normal":
            values = rng.normal(self.a, self.b, size=count)
        elif self.kind == "lognormal":
            values = self.a * np.exp(rng.normal(0.0, self.b, size=count))
        else:  # zipf over 1..MAX: numpy's zipf has no upper bound, so draw by weights
            support = np.arange(1, int(self.b) + 1)
            weights = support.astype(float) ** -self.a
            values = rng.choice(support, size=count, p=weights / weights.sum())
        # clipped before the cast: a draw past any model's positions is refused later
        return np.clip(np.rint(values), 1, LONGEST).astype(np.int64)

    def largest(self) -> float:
        """The largest length a draw can take (inf for normal and lognormal)."""
        return {"fixed": self.a, "uniform": self.b, "zipf": self.b}.get(self.kind, math.inf)


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise OptionError(f"{what}: {text!r} is not a number") from None


def _check(kind: str, a: float, b: float, what: str, text: str) -> None:
    if kind == "uniform" and not (1 <= a <= b and a == int(a) and b == int(b)):
        raise OptionError(f"{what}: uniform:LO,HI needs whole 1 <= LO <= HI, got {text}")
    if kind in ("normal", "lognormal") and not (a >= 1 and b >= 0):
        raise OptionError(f"{what}: {kind} needs a centre >= 1 and a spread >= 0, got {text}")
    if kind == "zipf" and not (a > 0 and b >= 1 and b == int(b)):
        raise OptionError(f"{what}: zipf:A,MAX needs A > 0 and a whole MAX >= 1, got {text}")
    if max(a, b) > LONGEST:
        raise OptionError(f"{what}: {text} names lengths past {LONGEST:,} tokens")


@dataclass(frozen=True)
class Arrivals:
    """How requests arrive: ``poisson`` at ``rate`` per second, ``gamma`` at ``rate`` with
    gaps of coefficient of variation ``cv`` (1 is Poisson), or ``closed`` loops of
    ``concurrency`` clients, each sending its next request when its last one ends."""

    kind: str
    rate: float = 0.0
    cv: float = 1.0
    concurrency: int = 0

    def __post_init__(self) -> None:
        if self.kind in ("poisson", "gamma"):
            if not (
                isinstance(self.rate, (int, float)) and self.rate > 0 and math.isfinite(self.rate)
            ):
                raise OptionError(f"the request rate must be above 0 per second, got {self.rate}")
            if self.kind == "gamma" and not self.cv > 0:
                raise OptionError(f"a gamma arrival's cv must be above 0, got {self.cv}")
        elif self.kind == "closed":
            if (
                isinstance(self.concurrency, bool)
                or not isinstance(self.concurrency, int)
                or self.concurrency < 1
            ):
                raise OptionError(
                    f"concurrency must be a whole number >= 1, got {self.concurrency!r}"
                )
        elif self.kind != "file":
            raise OptionError(f"unknown arrivals {self.kind!r} (poisson, gamma, closed, file)")

    def times(self, rng: np.random.Generator, count: int) -> list[float | None]:
        """Each request's arrival time in seconds (None for a closed loop's)."""
        if self.kind == "closed":
            return [None] * count
        if self.kind == "poisson":
            gaps = rng.exponential(1.0 / self.rate, size=count)
        else:  # gamma: shape k = 1/cv^2, mean 1/rate
            shape = 1.0 / self.cv**2
            gaps = rng.gamma(shape, 1.0 / (self.rate * shape), size=count)
        return [float(t) for t in np.cumsum(gaps)]


@dataclass(frozen=True)
class Prefixes:
    """Drawn prompts that start with one of ``groups`` shared prefixes of ``length``
    tokens, chosen at random (a system prompt or a document many questions are asked of)."""

    groups: int
    length: int

    def __post_init__(self) -> None:
        for name in ("groups", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(f"prefix {name} must be a whole number >= 1, got {value!r}")


def make_requests(
    count: int,
    input_len: Lengths,
    output_len: Lengths,
    arrivals: Arrivals,
    random_state: int,
    prefixes: Prefixes | None = None,
) -> list[Request]:
    """``count`` requests drawn from ``random_state``: lengths first, then arrival times,
    then each one's prefix group (its prompt the prefix then its drawn tokens)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise OptionError(f"the number of requests must be a whole number >= 1, got {count!r}")
    if isinstance(random_state, bool) or not isinstance(random_state, int) or random_state < 0:
        raise OptionError(f"random_state must be a whole number >= 0, got {random_state!r}")
    if prefixes is not None and not isinstance(prefixes, Prefixes):
        raise OptionError(f"prefixes must be a Prefixes(groups, length), got {prefixes!r}")
    rng = np.random.default_rng(random_state)
    inputs, outputs = input_len.draw(rng, count), output_len.draw(rng, count)
    times = arrivals.times(rng, count)
    if prefixes is None:
        return [Request(i, int(inputs[i]), int(outputs[i]), times[i]) for i in range(count)]
    groups = rng.integers(prefixes.groups, size=count)
    return [
        Request(
            i,
            prefixes.length + int(inputs[i]),
            int(outputs[i]),
            times[i],
            int(groups[i]),
            prefixes.length,
        )
        for i in range(count)
    ]


def read_requests(path: str | Path) -> list[Request]:
    """The requests of a JSONL or CSV file (``input_len``, ``output_len``, optional
    ``arrival_s``); a bad row is refused with its line number."""
    path = Path(path)
    if not path.is_file():
        raise OptionError(f"request file {path} does not exist")
    rows = _csv_rows(path) if path.suffix.lower() == ".csv" else _jsonl_rows(path)
    requests = [_request(i, line, row, path) for i, (line, row) in enumerate(rows)]
    if not requests:
        raise OptionError(f"{path} holds no requests")
    timed = [r.arrival_s is not None for r in requests]
    if any(timed) and not all(timed):
        raise OptionError(f"{path}: give arrival_s on every row or on none")
    return requests


def _jsonl_rows(path: Path) -> list[tuple[int, dict[str, object]]]:
    rows = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise OptionError(f"{path} line {number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise OptionError(f"{path} line {number}: an object per line, got {text[:40]!r}")
        rows.append((number, row))
    return rows


def _csv_rows(path: Path) -> list[tuple[int, dict[str, object]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return [(number, dict(row)) for number, row in enumerate(reader, start=2)]


def _request(index: int, line: int, row: dict[str, object], path: Path) -> Request:
    where = f"{path} line {line}"
    values: dict[str, float] = {}
    for name in ("input_len", "output_len", "arrival_s", "prefix_group", "prefix_len"):
        value = row.get(name)
        if value in (None, "") and name in OPTIONAL_COLUMNS:
            continue
        if value in (None, ""):
            raise OptionError(f"{where}: no {name}")
        try:
            values[name] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise OptionError(f"{where}: {name} {value!r} is not a number") from None
        if not math.isfinite(values[name]):
            raise OptionError(f"{where}: {name} {value!r} is not a finite number")
    for name in ("input_len", "output_len", "prefix_group", "prefix_len"):
        least = 1 if name in ("input_len", "output_len") else 0
        if name in values and (values[name] < least or values[name] != int(values[name])):
            raise OptionError(
                f"{where}: {name} must be a whole number >= {least}, got {row[name]!r}"
            )
    arrival = values.get("arrival_s")
    if arrival is not None and not (arrival >= 0 and math.isfinite(arrival)):
        raise OptionError(f"{where}: arrival_s must be 0 or more seconds, got {row['arrival_s']!r}")
    group = values.get("prefix_group")
    try:
        return Request(
            index,
            int(values["input_len"]),
            int(values["output_len"]),
            arrival,
            None if group is None else int(group),
            int(values.get("prefix_len", 0)),
        )
    except OptionError as error:  # a prefix that does not fit its prompt: the row named
        raise OptionError(f"{where}: {str(error).split(': ', 1)[1]}") from None


def check_lengths(requests: Sequence[Request], max_positions: int | None) -> None:
    """Refuse a request whose prompt and output together exceed the model's positions."""
    if max_positions is None:
        return
    for request in requests:
        if request.input_len + request.output_len > max_positions:
            raise OptionError(
                f"request {request.index} needs {request.input_len} + {request.output_len} = "
                f"{request.input_len + request.output_len} positions; the model has "
                f"{max_positions}"
            )

"""What accelerator files (``hardware/*.toml``) and cluster files (``hardware/clusters/*.toml``)
share: the figure format, its checks, the error a bad file raises, reading a file, and finding a
shipped file by name or alias.

Hardware specs are data: a source for every figure, ``approximate = true`` on derived
ones. A figure is an inline table ``{ value = <number>, source = "<where it came from>",
approximate = <bool, optional> }``; its value is finite and positive, and where ``whole`` also a
whole number (bytes, counts). Checks add each problem to a list, so that one error names every
problem in a file.
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

FIGURE_FIELDS = ("value", "source", "approximate")


class HardwareSpecError(ValueError):
    """A hardware TOML file that cannot be used, with every problem found in it.

    ``str()`` is one line, the file first: ``PATH: N problems: FIRST; SECOND; ...`` (the
    command line prints it after ``torchroof: error:``). ``problems`` holds each problem
    alone, each starting with the dotted key it concerns; ``path`` is the file.
    """

    def __init__(self, path: str | Path, problems: list[str] | tuple[str, ...]) -> None:
        self.path = str(path)
        self.problems = tuple(problems)
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{count} {noun}: {'; '.join(self.problems)}")

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling (worker processes)
        return (type(self), (self.path, self.problems))


@dataclass(frozen=True)
class Figure:
    """One published or derived number, with where it came from."""

    value: float
    source: str
    approximate: bool = False

    @classmethod
    def parse(cls, key: str, raw: Any, *, whole: bool = False, unit: str = "") -> Figure:
        """One figure; every problem with it in one :class:`HardwareSpecError`."""
        problems: list[str] = []
        figure = parse_figure(key, raw, whole, unit, problems)
        if figure is None:
            raise HardwareSpecError("", problems)
        return figure


def describe(raw: Any) -> str:
    """A TOML value as the user wrote it, for an error message."""
    if isinstance(raw, bool):
        return f"{'true' if raw else 'false'} (a boolean)"
    if isinstance(raw, (int, float)):
        return f"{raw!r} (a number)"
    if isinstance(raw, str):
        text = raw if len(raw) <= 40 else raw[:37] + "..."
        return f"{text!r} (a string)"
    if isinstance(raw, list):
        return f"an array of {len(raw)} item{'' if len(raw) == 1 else 's'}"
    if isinstance(raw, dict):
        return "a table"
    return f"{raw!r} (a {type(raw).__name__})"


def is_number(raw: Any) -> bool:
    """An integer or float TOML value (TOML's booleans are not numbers here)."""
    return isinstance(raw, (int, float)) and not isinstance(raw, bool)


def parse_figure(key: str, raw: Any, whole: bool, unit: str, problems: list[str]) -> Figure | None:
    """Check one figure, adding each problem to ``problems``; the figure if there were none."""
    shape = '{ value = <number>, source = "<where it came from>" }'
    if not isinstance(raw, dict):
        problems.append(f"{key}: expected a figure {shape}, got {describe(raw)}")
        return None
    before = len(problems)
    for field_name in raw:
        if field_name not in FIGURE_FIELDS:
            problems.append(
                f"{key}.{field_name}: unknown field (a figure has {', '.join(FIGURE_FIELDS)})"
            )
    value: Any = raw.get("value")  # a TOML value: any type until checked below
    units = f" of {unit}" if unit else ""
    if "value" not in raw:
        problems.append(f"{key}.value: missing (a number{units})")
    elif not is_number(value):
        problems.append(f"{key}.value: expected a number{units}, got {describe(value)}")
    elif not math.isfinite(value):
        problems.append(f"{key}.value: expected a finite number{units}, got {value}")
    elif value <= 0:
        problems.append(f"{key}.value: must be positive, got {value!r}")
    elif whole and not float(value).is_integer():
        problems.append(
            f"{key}.value: {unit or 'this figure'} must be a whole number, got {value!r}"
        )
    else:
        implausible(key, float(value), unit, problems)
    source: Any = raw.get("source")
    if "source" not in raw:
        problems.append(f"{key}.source: missing (every figure names where it came from)")
    elif not isinstance(source, str):
        problems.append(f"{key}.source: expected a string, got {describe(source)}")
    elif not source.strip():
        problems.append(f"{key}.source: must not be empty")
    approximate = raw.get("approximate", False)
    if not isinstance(approximate, bool):
        problems.append(f"{key}.approximate: expected true or false, got {describe(approximate)}")
    if len(problems) > before:
        return None
    return Figure(float(value), source, approximate)


class HardwareFigureWarning(UserWarning):
    """A hardware or cluster figure outside the range real devices have, but usable: the
    figure, its unit and the unit it looks typed in are named."""


# Plausible ranges of a figure, by its unit (and, where one unit covers different things,
# by its key's last part): a little beyond every device shipped or announced.
_RANGES: dict[str, tuple[float, float]] = {
    "B/s": (1e8, 1e16),
    "FLOP/s": (1e9, 1e17),  # from a busy CPU core to past any announced accelerator
    # a calibrated CPU's transcendental rate is a quarter of its elementwise one: one slow
    # core measures well under 1 GFLOP/s
    "sfu_flops_per_s": (1e7, 1e17),
    "hbm_capacity_bytes": (2**30, 2**44),
    "l2_bytes": (2**16, 2**33),
    "shared_memory_bytes_per_sm": (2**12, 2**23),
    "SMs or CUs": (1, 1e5),
    "memory_latency_s": (1e-8, 1e-4),
    "launch_overhead_s": (1e-8, 1e-3),
    "eager_launch_s": (1e-8, 1e-3),
    "latency_s": (1e-8, 1e-2),
    "GPUs": (1, 1e5),
    "nodes": (1, 1e6),
}
# A typical figure of a unit whose range is wide on one side (FLOP/s runs down to a CPU
# core): 100 TFLOP/s, so "989.4" reads as TFLOP/s rather than GFLOP/s.
_TYPICAL: dict[str, float] = {"FLOP/s": 1e14}
# The units a figure may have been typed in by mistake, with their size in the figure's.
_PREFIXES: dict[str, tuple[tuple[str, float], ...]] = {
    "B/s": (("KB/s", 1e3), ("MB/s", 1e6), ("GB/s", 1e9), ("TB/s", 1e12)),
    "FLOP/s": (("GFLOP/s", 1e9), ("TFLOP/s", 1e12), ("PFLOP/s", 1e15)),
    "bytes": (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40), ("bits", 1 / 8)),
    "s": (("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)),
}
# past the plausible range by more than this on the costly side (a time too long, a rate or
# size too small): an error, as every kernel touching the figure would be priced absurdly;
# on the free side (1e30 B/s, a 1 ns launch) a warning only, as that what-if is a fair question
UNUSABLE_FACTOR = 1e6


def implausible(key: str, value: float, unit: str, problems: list[str]) -> None:
    """Warn (:class:`HardwareFigureWarning`) about a figure outside its plausible range,
    or add a problem when it is so far outside that no estimate from it means anything
    (1e-300 B/s prices every kernel at inf ms); both name the unit it looks typed in."""
    leaf = key.rsplit(".", 1)[-1]
    bounds = _RANGES.get(leaf) or _RANGES.get(unit)
    if bounds is None:
        return
    low, high = bounds
    if low <= value <= high:
        return
    family = "s" if unit in ("s", "seconds") else unit
    # the likeliest unit lands nearest a typical figure (else the range's middle)
    middle = math.log10(_TYPICAL.get(unit, math.sqrt(low * high)))
    guesses = sorted(
        (abs(math.log10(value * size) - middle), name)
        for name, size in _PREFIXES.get(family, ())
        if low <= value * size <= high
    )
    hint = f"; it looks typed in {guesses[0][1]}" if guesses else ""
    shown = "s" if family == "s" else unit
    text = (
        f"{key}.value: {value:g} {shown} is outside the plausible range "
        f"{low:g}-{high:g} {shown}{hint}"
    )
    # a time far too long, or a rate or size far too small, prices every kernel absurdly;
    # the other way it only makes a resource free
    unusable = value > high * UNUSABLE_FACTOR if family == "s" else value < low / UNUSABLE_FACTOR
    if unusable:
        problems.append(text)
    else:
        import warnings

        warnings.warn(text, HardwareFigureWarning, stacklevel=2)


def misplaced(table: str, key: str) -> str:
    """The problem of a top-level ``key`` written below a ``[table]`` header (TOML puts it in
    that table)."""
    return (
        f"{table}.{key}: {key} is a top-level key, but written below the [{table}] header it "
        f"belongs to that table; move it above the first [table] header"
    )


def unknown_key(key: str, known: Iterable[str]) -> str:
    """The problem of a top-level ``key`` the format does not have, with the closest known."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{key}: unknown key{hint}"


def check_aliases(raw: Any, problems: list[str]) -> tuple[str, ...]:
    """``aliases``: an array of strings; () with a problem added if it is anything else."""
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        problems.append(f"aliases: expected an array of strings, got {describe(raw)}")
        return ()
    return tuple(raw)


def read_toml(
    path: Path | Traversable, error_factory: Callable[[Path, list[str]], HardwareSpecError]
) -> dict[str, Any]:
    """The table a TOML file holds; a file that is not UTF-8 or not TOML raises
    ``error_factory(path, [problem])``."""
    raw = path.read_bytes()
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 text ({error.reason} at byte {error.start})"
        raise error_factory(path, [problem]) from None
    except tomllib.TOMLDecodeError as error:  # its message ends "(at line L, column C)"
        raise error_factory(path, [f"not valid TOML: {error}"]) from None


def normalise_name(name: str) -> str:
    """A name or alias as lookups compare it: trimmed, lower case, ``-`` for ``_`` and spaces."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


class Named(Protocol):
    """A loaded spec: found by its name or one of its aliases."""

    @property
    def name(self) -> str: ...

    @property
    def aliases(self) -> tuple[str, ...]: ...


SpecT = TypeVar("SpecT", bound=Named)


class ShippedSpecs(Generic[SpecT]):
    """The spec files shipped in one folder, read on first use; a spec is found by its name,
    an alias or a path to a TOML file of one's own."""

    def __init__(
        self,
        folder: Traversable,
        load: Callable[[Traversable], SpecT],
        what: str,
        unknown: Callable[[str], Exception],
    ) -> None:
        self.folder = folder
        self.load = load  # parses one file of this kind
        self.what = what  # "hardware" or "cluster", as error messages name the kind
        self.unknown = unknown  # the error for a name or path that finds nothing

    @cached_property
    def by_name(self) -> dict[str, SpecT]:
        """Every ``*.toml`` in the folder, loaded (in file-name order) and keyed by its name."""
        files = sorted(
            (entry for entry in self.folder.iterdir() if entry.name.endswith(".toml")),
            key=lambda entry: entry.name,
        )
        return {spec.name: spec for spec in map(self.load, files)}

    def sorted_by_name(self) -> list[SpecT]:
        """The shipped specs, sorted by name."""
        return [spec for _, spec in sorted(self.by_name.items())]

    def by_name_or_alias(self) -> dict[str, SpecT]:
        """Each shipped spec under its name and each of its aliases (normalised)."""
        out: dict[str, SpecT] = {}
        for spec in self.by_name.values():
            out[spec.name] = spec
            out.update({normalise_name(alias): spec for alias in spec.aliases})
        return out

    def find(self, text: str) -> SpecT:
        """A spec by path to a TOML file (loaded) or by a shipped spec's name or alias; else
        ``unknown`` with up to four close names and every shipped name."""
        if text.endswith(".toml") or Path(text).is_file():
            if not Path(text).is_file():
                raise self.unknown(f"{self.what} file {text} does not exist")
            return self.load(text)
        wanted = normalise_name(text)
        lookup = self.by_name_or_alias()
        if wanted in lookup:
            return lookup[wanted]
        close = difflib.get_close_matches(wanted, list(lookup), n=4, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        names = ", ".join(sorted(self.by_name))
        raise self.unknown(f"unknown {self.what} {text!r}{hint} (known: {names})")

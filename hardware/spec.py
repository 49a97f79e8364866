"""Hardware spec data model and loader.

seed 000 Table 1: the ridge point I* = pi / beta for the HBM boundary, per datatype.
Internal units are FLOP/s, bytes/s and bytes; convert only when rendering.
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SPEC_DIR = Path(__file__).resolve().parent

# torch dtype name -> the spec's datatype key.
_DTYPE_KEYS = {
    "float64": "fp64",
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2fnuz": "fp8",
    "float8_e8m0fnu": "fp8",
    "float4_e2m1fn_x2": "fp4",
    "int8": "int8",
    "uint8": "int8",
}
_SPEC_KEYS = {"fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8"}


class UnknownHardwareError(KeyError):
    """No spec with that name, alias or path."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


class UnsupportedDtypeError(ValueError):
    """The part has no ceiling for that datatype (e.g. fp8 on an A100)."""


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


def spec_dtype(dtype: str) -> str:
    """Map a torch dtype name (``bfloat16``) or a spec key (``bf16``) to a spec key."""
    key = dtype.removeprefix("torch.")
    if key in _SPEC_KEYS:
        return key
    if key in _DTYPE_KEYS:
        return _DTYPE_KEYS[key]
    raise UnsupportedDtypeError(
        f"dtype {dtype!r} has no hardware ceiling; known: {sorted(_SPEC_KEYS | set(_DTYPE_KEYS))}"
    )


# The file format. Every key a hardware TOML may hold; anything else is an error (a
# misspelt optional key would otherwise vanish without a word). The README's
# "Accelerators" section documents the same keys (tests/test_hardware.py checks it).
#
# A figure is an inline table { value = <number>, source = "<where it came from>",
# approximate = <bool, optional> }. Its value is finite and positive; where ``whole``,
# also a whole number (bytes, counts).
_FIGURE_KEYS: dict[str, tuple[bool, bool, str]] = {
    # key: (required, whole number, unit)
    "hbm_bytes_per_s": (True, False, "B/s"),
    "hbm_capacity_bytes": (True, True, "bytes"),
    "sfu_flops_per_s": (True, False, "FLOP/s"),
    "shared_memory_bytes_per_sm": (False, True, "bytes"),
    "l2_bytes": (False, True, "bytes"),
    "compute_units": (False, True, "SMs or CUs"),
}
_VECTOR_KEYS = ("fp32", "fp64")
_TABLE_KEYS: dict[str, tuple[bool, tuple[str, ...] | None, tuple[str, ...], str]] = {
    # [table]: (required, allowed keys (None: any), keys it must hold, unit of each figure)
    "tensor_flops_per_s": (True, tuple(sorted(_SPEC_KEYS)), (), "FLOP/s"),
    "vector_flops_per_s": (True, _VECTOR_KEYS, ("fp32",), "FLOP/s"),
    "interconnect_bytes_per_s": (False, None, (), "B/s"),
}
_STRING_KEYS = {"name": True, "display_name": False, "source": False}  # key: required
_OTHER_KEYS = ("aliases", "measured")  # a list of strings; calibrate's record (a table)
_FIGURE_FIELDS = ("value", "source", "approximate")
SCHEMA_KEYS: tuple[str, ...] = (
    *_STRING_KEYS,
    *_OTHER_KEYS,
    *_FIGURE_KEYS,
    *_TABLE_KEYS,
)


def _describe(raw: Any) -> str:
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


def _is_number(raw: Any) -> bool:
    return isinstance(raw, (int, float)) and not isinstance(raw, bool)


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
        figure = _figure(key, raw, whole, unit, problems)
        if figure is None:
            raise HardwareSpecError("", problems)
        return figure


def _figure(key: str, raw: Any, whole: bool, unit: str, problems: list[str]) -> Figure | None:
    """Check one figure, adding each problem to ``problems``; the figure if there were none."""
    shape = '{ value = <number>, source = "<where it came from>" }'
    if not isinstance(raw, dict):
        problems.append(f"{key}: expected a figure {shape}, got {_describe(raw)}")
        return None
    before = len(problems)
    for field_name in raw:
        if field_name not in _FIGURE_FIELDS:
            problems.append(
                f"{key}.{field_name}: unknown field (a figure has {', '.join(_FIGURE_FIELDS)})"
            )
    value = raw.get("value")
    units = f" of {unit}" if unit else ""
    if "value" not in raw:
        problems.append(f"{key}.value: missing (a number{units})")
    elif not _is_number(value):
        problems.append(f"{key}.value: expected a number{units}, got {_describe(value)}")
    elif not math.isfinite(value):
        problems.append(f"{key}.value: expected a finite number{units}, got {value}")
    elif value <= 0:
        problems.append(f"{key}.value: must be positive, got {value!r}")
    elif whole and not float(value).is_integer():
        problems.append(
            f"{key}.value: {unit or 'this figure'} must be a whole number, got {value!r}"
        )
    source = raw.get("source")
    if "source" not in raw:
        problems.append(f"{key}.source: missing (every figure names where it came from)")
    elif not isinstance(source, str):
        problems.append(f"{key}.source: expected a string, got {_describe(source)}")
    elif not source.strip():
        problems.append(f"{key}.source: must not be empty")
    approximate = raw.get("approximate", False)
    if not isinstance(approximate, bool):
        problems.append(f"{key}.approximate: expected true or false, got {_describe(approximate)}")
    if len(problems) > before:
        return None
    return Figure(float(value), source, approximate)


def _figure_table(
    key: str,
    raw: Any,
    allowed: tuple[str, ...] | None,
    needed: tuple[str, ...],
    unit: str,
    problems: list[str],
) -> dict[str, Figure]:
    if not isinstance(raw, dict):
        problems.append(
            f"{key}: expected a table of figures ([{key}] with lines like "
            f'bf16 = {{ value = ..., source = "..." }}), got {_describe(raw)}'
        )
        return {}
    out: dict[str, Figure] = {}
    for name, figure_raw in raw.items():
        dotted = f"{key}.{name}"
        if name in SCHEMA_KEYS:
            problems.append(_misplaced(key, name))
            continue
        if allowed is not None and name not in allowed:
            problems.append(f"{dotted}: unknown datatype (known: {', '.join(allowed)})")
            continue
        figure = _figure(dotted, figure_raw, False, unit, problems)
        if figure is not None:
            out[name] = figure
    for name in needed:
        if name not in raw:
            problems.append(f"{key}.{name}: required figure is missing")
    return out


def _misplaced(table: str, key: str) -> str:
    return (
        f"{table}.{key}: {key} is a top-level key, but written below the [{table}] header it "
        f"belongs to that table; move it above the first [table] header"
    )


def _check_measured(raw: Any, problems: list[str]) -> None:
    """calibrate's record: free-form, but validate reads ``launch_overhead_s``."""
    if not isinstance(raw, dict):
        problems.append(f"measured: expected a table, got {_describe(raw)}")
        return
    problems += [_misplaced("measured", key) for key in raw if key in SCHEMA_KEYS]
    if "launch_overhead_s" in raw:
        value = raw["launch_overhead_s"]
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            problems.append(
                "measured.launch_overhead_s: expected a number of seconds >= 0, "
                f"got {_describe(value)}"
            )


@dataclass(frozen=True)
class HardwareSpec:
    """Ceilings of one accelerator (dense peaks only, DESIGN rule 3)."""

    name: str
    display_name: str
    hbm_bytes_per_s: Figure
    hbm_capacity_bytes: Figure
    tensor_flops_per_s: dict[str, Figure]  # per spec dtype key: fp64, tf32, bf16, fp16, fp8, int8
    vector_flops_per_s: dict[str, Figure]  # non-tensor-core: fp32 (and fp64)
    sfu_flops_per_s: Figure
    # on-chip shared memory (NVIDIA) or LDS (AMD) per SM/CU: the GEMM workbench's tile budget
    shared_memory_bytes_per_sm: Figure | None = None
    l2_bytes: Figure | None = None  # informational: read by nothing yet
    compute_units: Figure | None = None  # informational: SMs (NVIDIA) or CUs (AMD)
    interconnect_bytes_per_s: dict[str, Figure] = field(default_factory=dict)  # informational
    aliases: tuple[str, ...] = ()
    path: str = ""

    def tensor_peak(self, dtype: str, *, allow_tf32: bool = False) -> float:
        """Dense tensor-core FLOP/s for a matmul in ``dtype``.

        fp32 matmuls use tf32 tensor cores only when ``allow_tf32``; otherwise they run on
        the fp32 vector units (DESIGN rule 4; seed 000: the 14.8x cliff on H100).
        """
        key = spec_dtype(dtype)
        if key == "fp32":
            if allow_tf32 and "tf32" in self.tensor_flops_per_s:
                return self._tensor("tf32")
            if "fp32" in self.tensor_flops_per_s:  # a measured (e.g. CPU) fp32 matmul rate
                return self._tensor("fp32")
            if allow_tf32:
                return self._tensor("tf32")
            return self.vector_peak("fp32")
        if key == "fp64" and "fp64" not in self.tensor_flops_per_s:
            return self.vector_peak("fp64")
        return self._tensor(key)

    def _tensor(self, key: str) -> float:
        figure = self.tensor_flops_per_s.get(key)
        if figure is None:
            have = ", ".join(sorted(self.tensor_flops_per_s))
            raise UnsupportedDtypeError(
                f"{self.display_name} has no {key} tensor cores (it has: {have}); "
                f"cast the model to one of those or choose another accelerator"
            )
        return figure.value

    def vector_peak(self, dtype: str = "fp32") -> float:
        """Non-tensor-core FLOP/s: the fp64 rate for fp64 data, else the fp32 rate (half,
        8-bit and integer elementwise code computes in 32-bit registers)."""
        key = "fp64" if dtype.removeprefix("torch.") in ("float64", "fp64") else "fp32"
        figure = self.vector_flops_per_s.get(key)
        if figure is None:
            raise UnsupportedDtypeError(f"{self.display_name} lists no {key} vector peak")
        return figure.value

    def peak(self, unit: str, dtype: str, *, allow_tf32: bool = False) -> float:
        """The ceiling an op on ``unit`` in ``dtype`` can reach (DESIGN rule 4)."""
        if unit == "tensor":
            return self.tensor_peak(dtype or "bf16", allow_tf32=allow_tf32)
        if unit == "vector":
            return self.vector_peak(dtype or "fp32")
        if unit == "sfu":
            return self.sfu_flops_per_s.value
        return float("inf")

    def ridge(self, dtype: str, *, allow_tf32: bool = False) -> float:
        """Machine balance I* = pi / beta at the HBM boundary (seed 000 Table 1)."""
        return self.tensor_peak(dtype, allow_tf32=allow_tf32) / self.hbm_bytes_per_s.value

    def shared_memory_per_sm(self) -> int:
        """Bytes of shared memory one SM (LDS of one CU) offers a kernel's tiles."""
        figure = self.shared_memory_bytes_per_sm
        if figure is None:
            where = f" to {self.path}" if self.path else ""
            raise ValueError(
                f"{self.display_name} lists no shared_memory_bytes_per_sm; add it{where} "
                "or give the on-chip budget explicitly (--local-budget-kib)"
            )
        return int(figure.value)

    def figures(self) -> dict[str, Figure]:
        """Every figure by dotted key, for listing sources (optional ones when present)."""
        optional = {
            "shared_memory_bytes_per_sm": self.shared_memory_bytes_per_sm,
            "l2_bytes": self.l2_bytes,
            "compute_units": self.compute_units,
        }
        out = {
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "hbm_capacity_bytes": self.hbm_capacity_bytes,
            **{key: figure for key, figure in optional.items() if figure is not None},
            "sfu_flops_per_s": self.sfu_flops_per_s,
        }
        for group, table in (
            ("tensor_flops_per_s", self.tensor_flops_per_s),
            ("vector_flops_per_s", self.vector_flops_per_s),
            ("interconnect_bytes_per_s", self.interconnect_bytes_per_s),
        ):
            out.update({f"{group}.{k}": v for k, v in table.items()})
        return out


def parse(data: dict[str, Any], path: str | Path = "<hardware spec>") -> HardwareSpec:
    """Check a parsed hardware TOML as a whole; :class:`HardwareSpecError` lists every problem."""
    problems: list[str] = []
    strings: dict[str, str] = {}
    aliases: tuple[str, ...] = ()
    figures: dict[str, Figure | None] = {}
    tables: dict[str, dict[str, Figure]] = {}
    for key, raw in data.items():  # in file order, so the message reads alongside the file
        if key in _STRING_KEYS:
            if not isinstance(raw, str):
                problems.append(f"{key}: expected a string, got {_describe(raw)}")
            elif key == "name" and not raw.strip():
                problems.append("name: must not be empty")
            else:
                strings[key] = raw
        elif key == "aliases":
            if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
                problems.append(f"aliases: expected an array of strings, got {_describe(raw)}")
            else:
                aliases = tuple(raw)
        elif key == "measured":
            _check_measured(raw, problems)
        elif key in _FIGURE_KEYS:
            _, whole, unit = _FIGURE_KEYS[key]
            figures[key] = _figure(key, raw, whole, unit, problems)
        elif key in _TABLE_KEYS:
            _, allowed, needed, unit = _TABLE_KEYS[key]
            tables[key] = _figure_table(key, raw, allowed, needed, unit, problems)
        else:
            close = difflib.get_close_matches(key, SCHEMA_KEYS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key}: unknown key{hint}")
    required = [k for k, needed in _STRING_KEYS.items() if needed]
    required += [k for k, (needed, _, _) in _FIGURE_KEYS.items() if needed]
    required += [k for k, (needed, *_) in _TABLE_KEYS.items() if needed]
    problems += [f"{key}: required key is missing" for key in required if key not in data]
    if problems:
        raise HardwareSpecError(path, problems)
    return HardwareSpec(
        name=strings["name"],
        display_name=strings.get("display_name", strings["name"]),
        hbm_bytes_per_s=_present(figures["hbm_bytes_per_s"]),
        hbm_capacity_bytes=_present(figures["hbm_capacity_bytes"]),
        tensor_flops_per_s=tables["tensor_flops_per_s"],
        vector_flops_per_s=tables["vector_flops_per_s"],
        sfu_flops_per_s=_present(figures["sfu_flops_per_s"]),
        shared_memory_bytes_per_sm=figures.get("shared_memory_bytes_per_sm"),
        l2_bytes=figures.get("l2_bytes"),
        compute_units=figures.get("compute_units"),
        interconnect_bytes_per_s=tables.get("interconnect_bytes_per_s", {}),
        aliases=aliases,
        path=str(path),
    )


def _present(figure: Figure | None) -> Figure:
    assert figure is not None  # parse() raised on every figure with a problem
    return figure


def load_file(path: str | Path) -> HardwareSpec:
    """Parse one hardware TOML file (the format of the files shipped in this folder, which
    the README's "Accelerators" section documents)."""
    path = Path(path)
    with path.open("rb") as handle:
        raw = handle.read()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 text ({error.reason} at byte {error.start})"
        raise HardwareSpecError(path, [problem]) from None
    except tomllib.TOMLDecodeError as error:  # its message ends "(at line L, column C)"
        raise HardwareSpecError(path, [f"not valid TOML: {error}"]) from None
    return parse(data, path)


@lru_cache(maxsize=1)
def _shipped() -> dict[str, HardwareSpec]:
    return {spec.name: spec for spec in map(load_file, sorted(SPEC_DIR.glob("*.toml")))}


def available() -> list[HardwareSpec]:
    """The shipped specs, sorted by name."""
    return [spec for _, spec in sorted(_shipped().items())]


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get(name: str | Path | HardwareSpec) -> HardwareSpec:
    """A spec by name (``h100-sxm``), alias (``h100``) or path to a TOML file."""
    if isinstance(name, HardwareSpec):
        return name
    text = str(name)
    if text.endswith(".toml") or Path(text).is_file():
        if not Path(text).is_file():
            raise UnknownHardwareError(f"hardware file {text} does not exist")
        return load_file(text)
    wanted = _normalise(text)
    lookup: dict[str, HardwareSpec] = {}
    for spec in _shipped().values():
        lookup[spec.name] = spec
        lookup.update({_normalise(alias): spec for alias in spec.aliases})
    if wanted in lookup:
        return lookup[wanted]
    close = difflib.get_close_matches(wanted, list(lookup), n=4, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    names = ", ".join(sorted(_shipped()))
    raise UnknownHardwareError(f"unknown hardware {text!r}{hint} (known: {names})")

"""Hardware spec data model and loader.

seed 000 Table 1: the ridge point I* = pi / beta for the HBM boundary, per datatype.
Internal units are FLOP/s, bytes/s and bytes; convert only when rendering.
"""

from __future__ import annotations

import difflib
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


@dataclass(frozen=True)
class Figure:
    """One published or derived number, with where it came from."""

    value: float
    source: str
    approximate: bool = False

    @classmethod
    def parse(cls, key: str, raw: Any) -> Figure:
        if not isinstance(raw, dict) or "value" not in raw or "source" not in raw:
            raise ValueError(f'{key}: expected {{ value = ..., source = "..." }}, got {raw!r}')
        value = float(raw["value"])
        if value <= 0:
            raise ValueError(f"{key}: value must be positive, got {value}")
        return cls(value, str(raw["source"]), bool(raw.get("approximate", False)))


@dataclass(frozen=True)
class HardwareSpec:
    """Ceilings of one accelerator (dense peaks only, DESIGN rule 3)."""

    name: str
    display_name: str
    hbm_bytes_per_s: Figure
    hbm_capacity_bytes: Figure
    l2_bytes: Figure
    compute_units: Figure  # SMs (NVIDIA) or CUs (AMD)
    tensor_flops_per_s: dict[str, Figure]  # per spec dtype key: fp64, tf32, bf16, fp16, fp8, int8
    vector_flops_per_s: dict[str, Figure]  # non-tensor-core: fp32 (and fp64)
    sfu_flops_per_s: Figure
    interconnect_bytes_per_s: dict[str, Figure] = field(default_factory=dict)
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

    def figures(self) -> dict[str, Figure]:
        """Every figure by dotted key, for listing sources."""
        out = {
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "hbm_capacity_bytes": self.hbm_capacity_bytes,
            "l2_bytes": self.l2_bytes,
            "compute_units": self.compute_units,
            "sfu_flops_per_s": self.sfu_flops_per_s,
        }
        for group, table in (
            ("tensor_flops_per_s", self.tensor_flops_per_s),
            ("vector_flops_per_s", self.vector_flops_per_s),
            ("interconnect_bytes_per_s", self.interconnect_bytes_per_s),
        ):
            out.update({f"{group}.{k}": v for k, v in table.items()})
        return out


def _table(data: dict[str, Any], key: str, required: bool = True) -> dict[str, Figure]:
    raw = data.get(key)
    if raw is None:
        if required:
            raise ValueError(f"missing table [{key}]")
        return {}
    return {k: Figure.parse(f"{key}.{k}", v) for k, v in raw.items()}


def load_file(path: str | Path) -> HardwareSpec:
    """Parse one hardware TOML file (the format of the files shipped in this folder)."""
    path = Path(path)
    with path.open("rb") as handle:
        data = tomllib.load(handle)
    try:
        spec = HardwareSpec(
            name=data["name"],
            display_name=data.get("display_name", data["name"]),
            hbm_bytes_per_s=Figure.parse("hbm_bytes_per_s", data["hbm_bytes_per_s"]),
            hbm_capacity_bytes=Figure.parse("hbm_capacity_bytes", data["hbm_capacity_bytes"]),
            l2_bytes=Figure.parse("l2_bytes", data["l2_bytes"]),
            compute_units=Figure.parse("compute_units", data["compute_units"]),
            tensor_flops_per_s=_table(data, "tensor_flops_per_s"),
            vector_flops_per_s=_table(data, "vector_flops_per_s"),
            sfu_flops_per_s=Figure.parse("sfu_flops_per_s", data["sfu_flops_per_s"]),
            interconnect_bytes_per_s=_table(data, "interconnect_bytes_per_s", required=False),
            aliases=tuple(data.get("aliases", ())),
            path=str(path),
        )
    except KeyError as missing:
        raise ValueError(f"{path}: missing field {missing}") from None
    except ValueError as bad:
        raise ValueError(f"{path}: {bad}") from None
    for key in spec.tensor_flops_per_s:
        if key not in _SPEC_KEYS:
            raise ValueError(f"{path}: unknown datatype {key!r} in tensor_flops_per_s")
    return spec


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

"""Hardware spec data model and loader.

The ridge point I* = pi / beta for the HBM boundary, per datatype (Williams, Waterman &
Patterson 2009, "Roofline"; the peaks from the vendor datasheets).
Internal units are FLOP/s, bytes/s and bytes; convert only when rendering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from torchroof.hardware.runtime import ATTENTION_KERNELS
from torchroof.hardware.toml_checks import (
    Figure,
    HardwareSpecError,
    ShippedSpecs,
    check_aliases,
    describe,
    is_number,
    misplaced,
    parse_figure,
    read_toml,
    unknown_key,
)

# The shipped accelerator files, read as package data (a wheel, a zip or a checkout alike).
SPEC_DIR: Traversable = resources.files(__package__)

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


# The file format. Every key a hardware TOML may hold; anything else is an error (a
# misspelt optional key would otherwise vanish without a word). The README's
# "Accelerators" section documents the same keys (tests/test_hardware.py checks it).
#
# A figure is an inline table { value, source, approximate } (toml_checks.parse_figure).
_FIGURE_KEYS: dict[str, tuple[bool, bool, str]] = {
    # key: (required, whole number, unit)
    "hbm_bytes_per_s": (True, False, "B/s"),
    "hbm_capacity_bytes": (True, True, "bytes"),
    "sfu_flops_per_s": (True, False, "FLOP/s"),
    "shared_memory_bytes_per_sm": (False, True, "bytes"),
    "l2_bytes": (False, True, "bytes"),
    "compute_units": (False, True, "SMs or CUs"),
    # GeForce parts run fp16 tensor cores at twice the rate when they also accumulate in
    # fp16 (NVIDIA Ada whitepaper, appendix A); a runtime that does (llama.cpp's cuBLAS
    # calls) is timed against it (runtime profile: [kernels] fp16_accumulate)
    "fp16_accumulate_tensor_flops_per_s": (False, False, "FLOP/s"),
    # The hierarchical roofline (Yang, Kurth & Williams 2020) and Little's law (Little 1961;
    # docs/concepts/littles-law.md): the on-chip boundaries (aggregate,
    # approximate), the memory latency, the per-kernel launch cost and the achievable
    # fractions of peak that torchroof's realistic mode reads (torchroof/timing/roofline.py,
    # torchroof/timing/hierarchy.py)
    "l2_bytes_per_s": (False, False, "B/s"),
    "shared_memory_bytes_per_s": (False, False, "B/s"),
    "register_bytes_per_s": (False, False, "B/s"),
    "memory_latency_s": (False, False, "s"),
    "launch_overhead_s": (False, False, "s"),
    # one kernel launched eagerly, measured on this device (calibrate --from-profile): under
    # a runtime it replaces the runtime's eager launch, a figure from another machine
    "eager_launch_s": (False, False, "s"),
    "achievable_hbm_fraction": (False, False, "fraction of hbm_bytes_per_s"),
    "achievable_tensor_fraction": (False, False, "fraction of the tensor peaks"),
}
# The optional figures realistic mode and the hierarchical roofline read.
REALISTIC_KEYS = (
    "l2_bytes_per_s",
    "shared_memory_bytes_per_s",
    "register_bytes_per_s",
    "memory_latency_s",
    "launch_overhead_s",
    "eager_launch_s",
    "achievable_hbm_fraction",
    "achievable_tensor_fraction",
)
_VECTOR_KEYS = ("fp32", "fp64")
# [attention_tensor_fraction]: a fused attention kernel's measured share of the tensor peak,
# by kernel and direction (realistic mode: torchroof/timing/roofline.py)
ATTENTION_SHARE_KEYS = tuple(
    f"{kernel}_{direction}" for kernel in ATTENTION_KERNELS for direction in ("forward", "backward")
)
_TABLE_KEYS: dict[str, tuple[bool, tuple[str, ...] | None, tuple[str, ...], str]] = {
    # [table]: (required, allowed keys (None: any), keys it must hold, unit of each figure)
    "tensor_flops_per_s": (True, tuple(sorted(_SPEC_KEYS)), (), "FLOP/s"),
    "vector_flops_per_s": (True, _VECTOR_KEYS, ("fp32",), "FLOP/s"),
    "interconnect_bytes_per_s": (False, None, (), "B/s"),
    "attention_tensor_fraction": (False, ATTENTION_SHARE_KEYS, (), "fraction of the tensor peak"),
}
_STRING_KEYS = {"name": True, "display_name": False, "source": False}  # key: required
_OTHER_KEYS = ("aliases", "measured")  # a list of strings; calibrate's record (a table)
SCHEMA_KEYS: tuple[str, ...] = (
    *_STRING_KEYS,
    *_OTHER_KEYS,
    *_FIGURE_KEYS,
    *_TABLE_KEYS,
)


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
            f'bf16 = {{ value = ..., source = "..." }}), got {describe(raw)}'
        )
        return {}
    out: dict[str, Figure] = {}
    for name, figure_raw in raw.items():
        dotted = f"{key}.{name}"
        if name in SCHEMA_KEYS:
            problems.append(misplaced(key, name))
            continue
        if allowed is not None and name not in allowed:
            what = "datatype" if key.endswith("flops_per_s") else "name"
            problems.append(f"{dotted}: unknown {what} (known: {', '.join(allowed)})")
            continue
        figure = parse_figure(dotted, figure_raw, False, unit, problems)
        if figure is not None and unit.startswith("fraction") and figure.value > 1:
            problems.append(
                f"{dotted}.value: a fraction of peak is at most 1, got {figure.value!r}"
            )
        elif figure is not None:
            out[name] = figure
    for name in needed:
        if name not in raw:
            problems.append(f"{key}.{name}: required figure is missing")
    return out


def _check_measured(raw: Any, problems: list[str]) -> None:
    """calibrate's record: free-form, but validate reads ``launch_overhead_s``."""
    if not isinstance(raw, dict):
        problems.append(f"measured: expected a table, got {describe(raw)}")
        return
    # calibrate's launch_overhead_s predates the top-level figure of that name: its own
    problems += [
        misplaced("measured", key)
        for key in raw
        if key in SCHEMA_KEYS and key != "launch_overhead_s"
    ]
    if "launch_overhead_s" in raw:
        value = raw["launch_overhead_s"]
        if not is_number(value) or not math.isfinite(value) or value < 0:
            problems.append(
                "measured.launch_overhead_s: expected a number of seconds >= 0, "
                f"got {describe(value)}"
            )


@dataclass(frozen=True)
class Boundary:
    """One memory boundary (docs/concepts/hierarchical-roofline.md): its bandwidth, what it
    holds, what it limits."""

    name: str
    bytes_per_s: float
    capacity_bytes: float | None  # per SM for shared memory; None where not a store
    limits: str
    figure: Figure  # the bandwidth figure, with its source and whether it is approximate

    def ridge(self, peak_flops_per_s: float) -> float:
        """I* = pi / beta at this boundary."""
        return peak_flops_per_s / self.bytes_per_s


@dataclass(frozen=True)
class HardwareSpec:
    """Ceilings of one accelerator (dense peaks only, never the 2:4-sparsity figures)."""

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
    # dense fp16 tensor rate accumulating in fp16, where it exceeds tensor_flops_per_s.fp16
    fp16_accumulate_tensor_flops_per_s: Figure | None = None
    interconnect_bytes_per_s: dict[str, Figure] = field(default_factory=dict)  # informational
    # aggregate on-chip bandwidths of the hierarchical roofline (approximate: issue width x clock)
    l2_bytes_per_s: Figure | None = None
    shared_memory_bytes_per_s: Figure | None = None
    register_bytes_per_s: Figure | None = None
    # Little's law (bytes in flight = beta x latency) and launch costs (realistic mode)
    memory_latency_s: Figure | None = None  # HBM load-to-use latency
    launch_overhead_s: Figure | None = None  # one kernel's launch, device side
    eager_launch_s: Figure | None = None  # an eager launch measured here: beats a runtime's
    achievable_hbm_fraction: Figure | None = None  # STREAM-like bandwidth / hbm_bytes_per_s
    achievable_tensor_fraction: Figure | None = None  # sustained tensor rate / the peaks
    # a fused attention kernel's measured share of the tensor peak, by "<kernel>_<direction>"
    attention_tensor_fraction: dict[str, Figure] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    path: str = ""

    def tensor_peak(
        self, dtype: str, *, allow_tf32: bool = False, fp16_accumulate: bool = False
    ) -> float:
        """Dense tensor-core FLOP/s for a matmul in ``dtype``.

        fp32 matmuls use tf32 tensor cores only when ``allow_tf32``; otherwise they run on
        the fp32 vector units (the unit follows the op; on an H100 SXM that is a 14.8x cliff,
        989.4 / 66.9 TFLOP/s from NVIDIA's datasheet). An fp16 matmul that accumulates in
        fp16 (``fp16_accumulate``) runs at ``fp16_accumulate_tensor_flops_per_s`` where the
        part lists one (GeForce: 330.3 against 165.2 TFLOP/s on an RTX 4090).
        """
        key = spec_dtype(dtype)
        if key == "fp16" and fp16_accumulate and self.fp16_accumulate_tensor_flops_per_s:
            return self.fp16_accumulate_tensor_flops_per_s.value
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

    def attention_share(self, kernel: str, backward: bool) -> float | None:
        """The share of the tensor peak ``kernel`` (a runtime's attention kernel: fa2, fa3,
        cudnn, ...) is measured to reach on this part, forward or ``backward``; None where the
        file lists none."""
        figure = self.attention_tensor_fraction.get(
            f"{kernel}_{'backward' if backward else 'forward'}"
        )
        return figure.value if figure is not None else None

    def vector_peak(self, dtype: str = "fp32") -> float:
        """Non-tensor-core FLOP/s: the fp64 rate for fp64 data, else the fp32 rate (half,
        8-bit and integer elementwise code computes in 32-bit registers)."""
        key = "fp64" if dtype.removeprefix("torch.") in ("float64", "fp64") else "fp32"
        figure = self.vector_flops_per_s.get(key)
        if figure is None:
            raise UnsupportedDtypeError(f"{self.display_name} lists no {key} vector peak")
        return figure.value

    def peak(
        self, unit: str, dtype: str, *, allow_tf32: bool = False, fp16_accumulate: bool = False
    ) -> float:
        """The ceiling an op on ``unit`` in ``dtype`` can reach (the unit follows the op)."""
        if unit == "tensor":
            return self.tensor_peak(
                dtype or "bf16", allow_tf32=allow_tf32, fp16_accumulate=fp16_accumulate
            )
        if unit == "vector":
            return self.vector_peak(dtype or "fp32")
        if unit == "sfu":
            return self.sfu_flops_per_s.value
        return float("inf")

    def ridge(self, dtype: str, *, allow_tf32: bool = False) -> float:
        """Machine balance I* = pi / beta at the HBM boundary (Williams et al. 2009)."""
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

    def ceilings(self) -> dict[str, float]:
        """Compute ceilings (Williams et al. 2009): each pipe's FLOP/s ceiling, highest first —
        every tensor-core datatype the part has, the fp32 vector units with FMA (two FLOPs
        per instruction) and without (one: half the rate), the fp64 vector units where
        listed, and the SFU."""
        pipes = {f"{key} tensor core": f.value for key, f in self.tensor_flops_per_s.items()}
        fp32 = self.vector_peak("fp32")
        pipes["fp32 vector (FMA)"] = fp32
        pipes["fp32 vector without FMA"] = fp32 / 2
        if "fp64" in self.vector_flops_per_s:
            pipes["fp64 vector"] = self.vector_flops_per_s["fp64"].value
        pipes["transcendental (SFU)"] = self.sfu_flops_per_s.value
        return dict(sorted(pipes.items(), key=lambda item: -item[1]))

    def boundaries(self) -> list[Boundary]:
        """The hierarchical roofline's memory boundaries this file lists, innermost first (register
        file, shared memory, L2, HBM); on-chip rows are the approximate aggregates."""
        rows = [
            ("register file", self.register_bytes_per_s, None, "MMA operand supply"),
            (
                "shared memory",
                self.shared_memory_bytes_per_s,
                self.shared_memory_bytes_per_sm,
                "warp-tile reuse",
            ),
            ("L2 cache", self.l2_bytes_per_s, self.l2_bytes, "threadblock-tile reuse"),
            ("HBM", self.hbm_bytes_per_s, self.hbm_capacity_bytes, "weights, activations, KV"),
        ]
        return [
            Boundary(name, rate.value, capacity.value if capacity else None, limits, rate)
            for name, rate, capacity, limits in rows
            if rate is not None
        ]

    def figures(self) -> dict[str, Figure]:
        """Every figure by dotted key, for listing sources (optional ones when present)."""
        optional = {
            "shared_memory_bytes_per_sm": self.shared_memory_bytes_per_sm,
            "l2_bytes": self.l2_bytes,
            "compute_units": self.compute_units,
            "fp16_accumulate_tensor_flops_per_s": self.fp16_accumulate_tensor_flops_per_s,
            **{key: getattr(self, key) for key in REALISTIC_KEYS},
        }
        optional = {key: figure for key, figure in optional.items() if figure is not None}
        out = {
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "hbm_capacity_bytes": self.hbm_capacity_bytes,
            **optional,
            "sfu_flops_per_s": self.sfu_flops_per_s,
        }
        for group, table in (
            ("tensor_flops_per_s", self.tensor_flops_per_s),
            ("vector_flops_per_s", self.vector_flops_per_s),
            ("interconnect_bytes_per_s", self.interconnect_bytes_per_s),
            ("attention_tensor_fraction", self.attention_tensor_fraction),
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
                problems.append(f"{key}: expected a string, got {describe(raw)}")
            elif key == "name" and not raw.strip():
                problems.append("name: must not be empty")
            else:
                strings[key] = raw
        elif key == "aliases":
            aliases = check_aliases(raw, problems)
        elif key == "measured":
            _check_measured(raw, problems)
        elif key in _FIGURE_KEYS:
            _, whole, unit = _FIGURE_KEYS[key]
            figures[key] = parse_figure(key, raw, whole, unit, problems)
            fraction = figures[key]
            if key.startswith("achievable_") and fraction is not None and fraction.value > 1:
                problems.append(
                    f"{key}.value: a fraction of peak is at most 1, got {fraction.value!r}"
                )
        elif key in _TABLE_KEYS:
            _, allowed, needed, unit = _TABLE_KEYS[key]
            tables[key] = _figure_table(key, raw, allowed, needed, unit, problems)
        else:
            problems.append(unknown_key(key, SCHEMA_KEYS))
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
        fp16_accumulate_tensor_flops_per_s=figures.get("fp16_accumulate_tensor_flops_per_s"),
        **{key: figures.get(key) for key in REALISTIC_KEYS},
        interconnect_bytes_per_s=tables.get("interconnect_bytes_per_s", {}),
        attention_tensor_fraction=tables.get("attention_tensor_fraction", {}),
        aliases=aliases,
        path=str(path),
    )


def _present(figure: Figure | None) -> Figure:
    assert figure is not None  # parse() raised on every figure with a problem
    return figure


def load_file(path: str | Path | Traversable) -> HardwareSpec:
    """Parse one hardware TOML file (the format of the files shipped in this folder, which
    the README's "Accelerators" section documents)."""
    path = Path(path) if isinstance(path, str) else path
    return parse(read_toml(path, HardwareSpecError), str(path))


_SHIPPED = ShippedSpecs(SPEC_DIR, load_file, "hardware", UnknownHardwareError)


def available() -> list[HardwareSpec]:
    """The shipped specs, sorted by name."""
    return _SHIPPED.sorted_by_name()


def get(name: str | Path | HardwareSpec) -> HardwareSpec:
    """A spec by name (``h100-sxm``), alias (``h100``) or path to a TOML file."""
    if isinstance(name, HardwareSpec):
        return name
    return _SHIPPED.find(str(name))

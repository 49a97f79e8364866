"""The roofline explorer as plain functions: attainable FLOP/s at an intensity, at any boundary.

The roofline (Williams, Waterman & Patterson 2009): P = min(pi, beta·I), fraction of peak
P/pi = min(1, I/I*). Compute ceilings: the ceiling is the pipe the instruction mix
uses (a tensor-core datatype, fp32 with or without FMA, the SFU). The hierarchical roofline
(Yang, Kurth & Williams 2020; docs/concepts/hierarchical-roofline.md): every memory
boundary has its own beta and ridge (register file, shared memory, L2, HBM, then the links:
NVLink, PCIe, the network); the on-chip rates are approximate aggregates.

The GEMM workbench is torchroof/labs/gemm_workbench.py; the fusion bench is
torchroof/labs/fusion_bench.py; the FlashAttention and chunked cross-entropy bounds are
torchroof/labs/io_bounds.py; the pictures are torchroof/labs/plots.py.
CLI: ``torchroof roofline``, ``torchroof gemm``, ``torchroof fusion-bench``, ``torchroof lab
flash`` and ``torchroof lab cross-entropy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchroof.hardware import (
    LINK_LIMITS,
    Boundary,
    HardwareSpec,
    boundary_table,
    get,
    spec_dtype,
)
from torchroof.records.tensors import dtype_itemsize

_SPEC_TO_TORCH = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp64": "float64",
    "fp8": "float8_e4m3fn",
    "int8": "int8",
    "tf32": "float32",
}


def tensor_peak(spec: HardwareSpec, dtype: str) -> float:
    """The peak FLOP/s of ``dtype``'s tensor core on ``spec`` (the fallback: HardwareSpec)."""
    key = spec_dtype(dtype)
    return spec.tensor_peak(key, allow_tf32=key == "tf32")


def _default_pipe(spec: HardwareSpec, dtype: str) -> str:
    """The name spec.ceilings() gives the pipe tensor_peak() picks for ``dtype``: its tensor
    core, else (fp32 without a measured fp32 matmul rate, fp64 on a part without fp64 MMA)
    its vector line, as HardwareSpec.tensor_peak falls back."""
    key = spec_dtype(dtype)
    if key == "fp32" and "fp32" not in spec.tensor_flops_per_s:
        return "fp32 vector (FMA)"
    if key == "fp64" and "fp64" not in spec.tensor_flops_per_s:
        return "fp64 vector"
    return f"{key} tensor core"


def itemsize(dtype: str) -> int:
    """Bytes per element of a spec or torch dtype name (bf16 -> 2)."""
    key = spec_dtype(dtype)
    return dtype_itemsize(_SPEC_TO_TORCH.get(key, key))


def _key(text: str) -> str:
    return text.strip().lower().replace("_", "-").replace(" ", "-")


# ---------------------------------------------------------------------------------------
# The roofline explorer · kernel presets (GEMM shapes, elementwise ops, attention, the loss)


@dataclass(frozen=True)
class KernelPreset:
    """A kernel's intensity as W / (operand elements x s + fixed bytes), per element, row
    or problem as docs/concepts/compulsory-bytes.md counts it; ``fixed_bytes`` are bytes
    whose width does not follow the activation dtype (fp32 optimizer state, fp32 logits)."""

    flops: float
    operand_elements: float  # elements at s bytes each
    fixed_bytes: float
    arithmetic: str  # the derivation, in one line
    seed: str  # its bf16 number

    def intensity(self, itemsize: int) -> float:
        return self.flops / (self.operand_elements * itemsize + self.fixed_bytes)


_SEED_GEMM = 4096
PRESETS: dict[str, KernelPreset] = {
    # the GEMV of batch-1 decode: M = 1, I = 2N/(s(1 + N)) -> 2/s
    "decode-gemv": KernelPreset(2, 1, 0, "M = 1: 2N/(s(1+N)) -> 2/s", "bf16: 1.0 FLOP/B"),
    "decode-gemm-b64": KernelPreset(
        2 * 64 * 8192, 2 * 64 + 8192, 0, "2Md/(s(2M+d)), M = 64, d = 8192", "bf16: 63 FLOP/B"
    ),
    "prefill-gemm-32k": KernelPreset(
        2 * 32768 * 8192,
        2 * 32768 + 8192,
        0,
        "2Md/(s(2M+d)), M = 32768, d = 8192",
        "bf16: 3641 FLOP/B",
    ),
    "residual-add": KernelPreset(
        1, 3, 0, "x + y -> z: 1 FLOP / (3 tensors x s)", "bf16: 0.17 FLOP/B"
    ),
    "adam": KernelPreset(
        12, 0, 30, "12 FLOP / 30 B (fp32 master, grad, m, v; bf16 param)", "bf16: 0.40 FLOP/B"
    ),
    "swiglu": KernelPreset(6, 3, 0, "~6 FLOP / (3 tensors x s)", "bf16: 1.00 FLOP/B"),
    "rmsnorm": KernelPreset(5, 2, 0, "~5 FLOP / (2 tensors x s)", "bf16: 1.25 FLOP/B"),
    "softmax": KernelPreset(
        6, 2, 0, "online, one pass: ~6 FLOP / (2 tensors x s)", "bf16: 1.50 FLOP/B"
    ),
    "layernorm": KernelPreset(
        9, 2, 0, "mean + var: ~9 FLOP / (2 tensors x s)", "bf16: 2.25 FLOP/B"
    ),
    "gelu": KernelPreset(12, 2, 0, "tanh form: ~12 FLOP / (2 tensors x s)", "bf16: 3.00 FLOP/B"),
    "fused-norm-swiglu-residual": KernelPreset(
        12, 2, 0, "~12 FLOP / (2 tensors x s)", "bf16: 3.00 FLOP/B"
    ),
    "cross-entropy": KernelPreset(
        6,
        0,
        16,
        "6 FLOP / 16 B: fp32 logits read, softmax written, read, grad written",
        "bf16: 0.38 FLOP/B",
    ),
    "decode-attention": KernelPreset(4, 2, 0, "4Nd / (2sNd) = 2/s per head", "bf16: 1 FLOP/B"),
    "decode-attention-gqa8": KernelPreset(
        4 * 8,
        2,
        0,
        "g = h/h_kv = 8 heads share the K/V bytes: 2g/s",
        "bf16: 8 FLOP/B, Llama-3-70B",
    ),
    "naive-attention": KernelPreset(128, 1, 0, "Nd/(s(N+d)) -> d/s, d = 128", "bf16: 64 FLOP/B"),
    "flash-attention-tiled": KernelPreset(
        2 * 128, 1, 0, "4N^2 d/(s(2Nd + 2N^2 d/B_r)) -> 2B_r/s, B_r = 128", "bf16: 128 FLOP/B"
    ),
    "flash-attention-compulsory": KernelPreset(
        4 * 2048**2 * 128,
        4 * 2048 * 128,
        0,
        "4N^2 d/(4sNd) = N/s, N = 2048",
        "bf16: 1024 FLOP/B",
    ),
    "gemm-4096-compulsory": KernelPreset(
        2 * _SEED_GEMM**3,
        3 * _SEED_GEMM**2,
        0,
        "2n^3/(3sn^2) = 2n/(3s), n = 4096",
        "bf16: 1365 FLOP/B",
    ),
    "gemm-tiled-128x128": KernelPreset(
        2, 2 / 128, 0, "2/(s(1/T_m + 1/T_n)) -> T/s", "bf16: 64 FLOP/B"
    ),
    "gemm-tiled-256x128": KernelPreset(
        2,
        1 / 256 + 1 / 128,
        0,
        "2/(s(1/256 + 1/128)), the L2 boundary's I",
        "bf16: ~85 FLOP/B",
    ),
    "lm-head": KernelPreset(
        2 * 8192 * 4096 * 100_000,
        8192 * 4096 + 4096 * 100_000 + 8192 * 100_000,
        0,
        "2 N_t d V / (s(N_t d + dV + N_t V)), N_t = 8192, d = 4096, V = 100k",
        "bf16: 2660 FLOP/B",
    ),
}


# ---------------------------------------------------------------------------------------
# The roofline explorer · boundaries and pipes

# boundary_table's on-device rows (their display names) by their short keys
_TABLE_KEYS = {
    "register file": "registers",
    "shared memory": "smem",
    "L2 cache": "l2",
    "HBM": "hbm",
}
_BOUNDARY_ALIASES = {
    "register-file": "registers",
    "rf": "registers",
    "shared-memory": "smem",
    "l2-cache": "l2",
    "dram": "hbm",
}


def boundaries(spec: HardwareSpec) -> dict[str, Boundary]:
    """The boundary table's rows for ``spec`` (``hardware.boundary_table``), keyed: registers,
    smem, l2, hbm (those the file lists), then each link by its kind (``network``: the first
    shipped cluster's by name that has one, else the accelerator file's own figure), then
    every cluster's own (``aws-p5:network``)."""
    table = {_TABLE_KEYS.get(key, key): row for key, row in boundary_table(spec).items()}
    on_device = {key: row for key, row in table.items() if ":" not in key}
    by_cluster = {key: row for key, row in table.items() if ":" in key}
    links: dict[str, Boundary] = {}
    for key, row in by_cluster.items():
        links.setdefault(key.split(":", 1)[1], row)
    for key, figure in spec.interconnect_bytes_per_s.items():
        links.setdefault(key, Boundary(key, figure.value, None, LINK_LIMITS.get(key, ""), figure))
    return {**on_device, **links, **by_cluster}


def find_boundary(spec: HardwareSpec, name: str) -> tuple[str, Boundary]:
    """(key, Boundary) for ``name``: registers / smem / l2 / hbm (or their long names), a
    link (nvlink, xgmi, pcie, network) or ``<cluster>:<link>``."""
    table = boundaries(spec)
    key = _BOUNDARY_ALIASES.get(_key(name), _key(name))
    if key not in table:
        raise ValueError(
            f"{spec.display_name} has no boundary {name!r}; choose from {', '.join(table)}"
        )
    return key, table[key]


def find_pipe(spec: HardwareSpec, name: str) -> tuple[str, float]:
    """(pipe name, FLOP/s) from :func:`pipes`: the full name ("fp32 vector without FMA"), a
    dtype ("bf16": its tensor core; fp32 and fp64 fall back to their vector line where the
    part has no such tensor core), or fp32-fma / fp32-no-fma / fp64-vector / sfu."""
    ceilings = spec.ceilings()
    by_key = {_key(p): p for p in ceilings}
    aliases = {
        "fp32-fma": "fp32 vector (FMA)",
        "fp32-vector": "fp32 vector (FMA)",
        "fp32-no-fma": "fp32 vector without FMA",
        "fp32-nofma": "fp32 vector without FMA",
        "fp64-vector": "fp64 vector",
        "sfu": "transcendental (SFU)",
        "transcendental": "transcendental (SFU)",
    }
    key = _key(name)
    found = aliases.get(key) or by_key.get(key) or by_key.get(f"{key}-tensor-core")
    if found is None and key in ("fp32", "fp64"):  # no such tensor core: the vector line
        found = {"fp32": "fp32 vector (FMA)", "fp64": "fp64 vector"}[key]
    if found is None or found not in ceilings:
        raise ValueError(
            f"{spec.display_name} has no pipe {name!r}; choose from "
            f"{', '.join(ceilings)} (or fp32-fma, fp32-no-fma, fp64-vector, sfu)"
        )
    return found, ceilings[found]


@dataclass(frozen=True)
class RooflineReading:
    """The roofline explorer's readouts for one point of the plane, one boundary, one pipe."""

    hardware: str
    dtype: str
    intensity: float  # FLOP per byte crossing ``boundary``
    peak_flops_per_s: float
    bandwidth_bytes_per_s: float
    pipe: str = ""
    boundary: str = "HBM"
    boundary_key: str = "hbm"  # what find_boundary() was given: hbm, l2, dgx-h100:network
    approximate: bool = False  # the boundary's rate is an approximate aggregate
    preset: str = ""
    spec: HardwareSpec | None = field(default=None, repr=False, compare=False)

    @property
    def machine_balance(self) -> float:
        """I* = pi / beta, the ridge at this boundary (Williams et al. 2009)."""
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s

    @property
    def attainable_flops_per_s(self) -> float:
        return min(self.peak_flops_per_s, self.bandwidth_bytes_per_s * self.intensity)

    @property
    def fraction_of_peak(self) -> float:
        return self.attainable_flops_per_s / self.peak_flops_per_s

    @property
    def regime(self) -> str:
        return "compute-bound" if self.intensity >= self.machine_balance else "memory-bound"

    @property
    def seconds_per_tflop(self) -> float:
        return 1e12 / self.attainable_flops_per_s if self.attainable_flops_per_s else math.inf

    def lines(self) -> list[str]:
        shortfall = self.machine_balance / self.intensity if self.intensity else math.inf
        where = "" if self.boundary == "HBM" else f" at the {self.boundary} boundary"
        verdict = (
            f"memory-bound{where}: {shortfall:.1f}x more intensity "
            f"({_ridge(self.machine_balance)} FLOP/B) reaches the ridge"
            if self.regime == "memory-bound"
            else f"compute-bound: {self.intensity / self.machine_balance:.1f}x past the ridge"
        )
        approx = " (approximate)" if self.approximate else ""
        out = [
            f"{self.hardware}, {self.dtype}, {self.boundary} boundary{approx}, "
            f"I = {self.intensity:g} FLOP/B",
        ]
        if self.preset:
            p = PRESETS[self.preset]
            out.append(f"preset {self.preset}: {p.arithmetic} ({p.seed})")
        out += [
            f"pipe: {self.pipe or self.dtype} at {self.peak_flops_per_s / 1e12:.2f} TFLOP/s; "
            f"boundary: {_rate(self.bandwidth_bytes_per_s)}{approx}",
            f"machine balance I*: {_ridge(self.machine_balance)} FLOP/B{approx}",
            f"attainable: {self.attainable_flops_per_s / 1e12:.2f} TFLOP/s "
            f"of {self.peak_flops_per_s / 1e12:.0f}",
            f"fraction of peak: {100 * self.fraction_of_peak:.2f}%",
            f"time for 1 TFLOP: {self.seconds_per_tflop * 1e3:.3f} ms",
            f"regime: {verdict}",
        ]
        return out


def _ridge(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _rate(bytes_per_s: float) -> str:
    return (
        f"{bytes_per_s / 1e12:.3g} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.0f} GB/s"
    )


def roofline_point(
    hardware: str | HardwareSpec,
    dtype: str,
    intensity: float | None = None,
    *,
    boundary: str = "hbm",
    pipe: str | None = None,
    preset: str | None = None,
) -> RooflineReading:
    """Where intensity ``I`` (or a named kernel ``preset``, evaluated at ``dtype``'s width)
    lands on the accelerator's roofline at ``boundary`` under ``pipe`` (default: the
    dtype's tensor-core peak)."""
    if (intensity is None) == (preset is None):
        raise ValueError("give an intensity or a preset (one of them)")
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        intensity = PRESETS[preset].intensity(itemsize(dtype))
    assert intensity is not None
    if not math.isfinite(intensity) or intensity <= 0:
        raise ValueError(f"intensity must be a finite positive FLOP per byte, got {intensity}")
    spec = get(hardware)
    if pipe is None:
        pipe_name, peak = _default_pipe(spec, dtype), tensor_peak(spec, dtype)
    else:
        pipe_name, peak = find_pipe(spec, pipe)
    key, wall = find_boundary(spec, boundary)
    return RooflineReading(
        spec.name,
        spec_dtype(dtype),
        intensity,
        peak,
        wall.bytes_per_s,
        pipe_name,
        wall.name,
        key,
        wall.figure.approximate,
        preset or "",
        spec,
    )


# ---------------------------------------------------------------------------------------
# The GEMM workbench

"""The seed's roofline explorer (Lab 1) and GEMM workbench (Lab 2) as plain functions.

seed 000 "The roofline equation and its geometry": P = min(pi, beta·I), fraction of peak
P/pi = min(1, I/I*). "pi is the top of a stack": the ceiling is the pipe the instruction mix
uses (a tensor-core datatype, fp32 with or without FMA, the SFU). Table 4: every memory
boundary has its own beta and ridge (register file, shared memory, L2, HBM, then the links:
NVLink, PCIe, the network); the on-chip rates are approximate aggregates.
"GEMM II · tiles set the intensity": Q_tiled = s·(MNK(1/T_n + 1/T_m) + MN), I_tiled ->
2/(s(1/T_m + 1/T_n)); L2 absorbs a fraction of the re-reads (Lab 2's slider).
"The hierarchical roofline": the same GEMM at every boundary (torchroof/timing/hierarchy.py counts
the bytes, split-K's fp32 partial sums included when it splits a small grid), the binding
level and the waves of its tile grid.
seed 004 "Reject a tile that cannot stay on chip": two input tiles plus an fp32 accumulator
against a local budget; the same footprint sets how many CTAs share an SM, and a tile that
does not fit gets no waves.

Lab 3 (the fusion bench) is torchroof/labs/fusion_bench.py; the FlashAttention and chunked
cross-entropy bounds are torchroof/labs/io_bounds.py; the pictures are torchroof/labs/plots.py.
CLI: ``torchroof roofline``, ``torchroof gemm``, ``torchroof fusion-bench``, ``torchroof lab
flash`` and ``torchroof lab cross-entropy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from torchroof.hardware import (
    LINK_LIMITS,
    Boundary,
    HardwareSpec,
    boundary_table,
    get,
    spec_dtype,
)
from torchroof.records.trace import dtype_itemsize
from torchroof.timing.hierarchy import (
    FP32_BYTES,
    LEVELS,
    GemmTile,
    Levels,
    Waves,
    gemm_levels,
    split_k,
    tiled_bytes,
    waves,
)
from torchroof.timing.kernel_shape import KernelShape

_SPEC_TO_TORCH = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp64": "float64",
    "fp8": "float8_e4m3fn",
    "int8": "int8",
    "tf32": "float32",
}


def _peak(spec: HardwareSpec, dtype: str) -> float:
    key = spec_dtype(dtype)
    return spec.tensor_peak(key, allow_tf32=key == "tf32")


def _default_pipe(spec: HardwareSpec, dtype: str) -> str:
    """The name spec.ceilings() gives the pipe _peak() picks for ``dtype``: its tensor core, else
    (fp32 without a measured fp32 matmul rate, fp64 on a part without fp64 MMA) its vector
    line, as HardwareSpec.tensor_peak falls back."""
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
# Lab 1 · kernel presets (seed 000 Tables 2 and 3, and the sections that derive each)


@dataclass(frozen=True)
class KernelPreset:
    """A kernel's intensity as W / (operand elements x s + fixed bytes), per element, row
    or problem as the seed counts it; ``fixed_bytes`` are bytes whose width does not follow
    the activation dtype (fp32 optimizer state, fp32 logits)."""

    flops: float
    operand_elements: float  # elements at s bytes each
    fixed_bytes: float
    arithmetic: str  # the seed's derivation, in one line
    seed: str  # where the seed states it, with its bf16 number

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
# Lab 1 · boundaries and pipes

# boundary_table's on-device rows (Table 4's names) by their short keys
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
    """seed 000 Table 4's rows for ``spec`` (``hardware.boundary_table``), keyed: registers,
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
    """Lab 1's readouts for one point of the plane at one boundary under one pipe."""

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
        """I* = pi / beta (seed 000 Table 1; Table 4 at the other boundaries)."""
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
    dtype's tensor-core peak) (seed 000 Lab 1)."""
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
        pipe_name, peak = _default_pipe(spec, dtype), _peak(spec, dtype)
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
# Lab 2 · the GEMM workbench


def parse_tile(tile: int | str | tuple[int, int] | GemmTile) -> GemmTile:
    """``128`` -> 128x128, ``"256x128"`` -> T_m = 256, T_n = 128."""
    if isinstance(tile, GemmTile):
        return tile
    if isinstance(tile, int):
        sizes: tuple[int, ...] = (tile, tile)
    elif isinstance(tile, tuple):
        sizes = tile
    else:
        try:
            sizes = tuple(int(part) for part in tile.lower().split("x"))
        except ValueError:
            raise ValueError(f"a tile is T or T_mxT_n (128, 256x128), got {tile!r}") from None
        if len(sizes) == 1:
            sizes = (sizes[0], sizes[0])
    if len(sizes) != 2 or min(sizes) <= 0:
        raise ValueError(f"a tile is T or T_mxT_n with positive sizes, got {tile!r}")
    return GemmTile(*sizes)


@dataclass(frozen=True)
class LevelReading:
    """One boundary of the hierarchical readout: the bytes the tile grid pulls across it."""

    level: str  # hierarchy.LEVELS: registers, smem, l2, hbm
    name: str  # Table 4's row: register file, shared memory, L2 cache, HBM
    bytes: float
    bytes_per_s: float
    approximate: bool

    def intensity(self, flops: float) -> float:
        return flops / self.bytes

    def cap(self, flops: float, peak: float) -> float:
        """beta_l·I_l / pi: the share of peak this boundary alone allows."""
        return self.bytes_per_s * self.intensity(flops) / peak


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


@dataclass(frozen=True)
class GemmReading:
    """Lab 2's readouts for C[M,N] = A[M,K] @ B[K,N] with T_m x T_n output tiles.

    One byte count runs through every line: Q modelled (compulsory, the tiled re-reads L2
    lets through, and split-K's fp32 partial sums when hierarchy.split_k splits the grid)
    is the HBM row of the hierarchical readout and sets the predicted time. One tile
    footprint too: seed 004's fit test (two input tiles and the fp32 accumulator) is checked
    against the local budget and says how many CTAs share an SM; a tile that does not fit
    gets no waves. NB: the pipeline's tile chooser (hierarchy.choose_tile) counts a CTA's
    pipelined operand stages instead, the accumulator in registers."""

    m: int
    n: int
    k: int
    dtype: str
    tile: GemmTile
    l2_absorption: float  # share of the tiled re-reads L2 absorbs (Lab 2: 80-95% typical)
    itemsize: int
    peak_flops_per_s: float
    bandwidth_bytes_per_s: float
    local_budget_bytes: int
    spec: HardwareSpec = field(repr=False, compare=False)

    @property
    def levels(self) -> Levels:
        """The tile grid's bytes at every boundary (hierarchy.gemm_levels), given the
        streamed bytes at HBM; it adds split-K's partial sums at L2 and HBM."""
        shape = KernelShape("gemm", self.itemsize, batch=1, m=self.m, n=self.n, k=self.k)
        return gemm_levels(shape, self.streamed_bytes, self.tile, self.spec, self.itemsize)

    @property
    def tiles(self) -> int:
        """ceil(M/T_m)·ceil(N/T_n) output tiles."""
        return math.ceil(self.m / self.tile.m) * math.ceil(self.n / self.tile.n)

    @property
    def split(self) -> int:
        """hierarchy.split_k: K split in this many parts (1: not split)."""
        return split_k(self.tiles, self.k, self.spec)

    @property
    def partial_bytes(self) -> float:
        """Split-K's fp32 partial sums, written and read back (hierarchy.gemm_levels)."""
        return self.levels.hbm - self.streamed_bytes

    @property
    def waves(self) -> Waves | None:
        """seed 000 "Is the work quantised badly?": the grid's CTAs over the SMs, as many
        per SM as the tile fits the local budget; None when it does not fit at all."""
        if not self.tile_fits:
            return None
        grid = waves(self.levels, self.spec)
        return replace(grid, slots=grid.sms * self.ctas_per_sm)

    @property
    def ctas_per_sm(self) -> int:
        """local budget // tile footprint (0: the tile does not fit)."""
        return self.local_budget_bytes // self.tile_bytes

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def compulsory_bytes(self) -> int:
        """s·(MK + KN + MN): every element once (seed 000 "GEMM from first principles")."""
        return self.itemsize * (self.m * self.k + self.k * self.n + self.m * self.n)

    @property
    def output_bytes(self) -> int:
        """s·MN: C written once."""
        return self.itemsize * self.m * self.n

    @property
    def tiled_bytes(self) -> float:
        """Each T_m x T_n tile reads a T_m x K panel of A and a K x T_n panel of B
        (hierarchy.tiled_bytes), and C is written once (seed 000 "GEMM II")."""
        panels = tiled_bytes(self.m, self.n, self.k, (self.tile.m, self.tile.n), self.itemsize)
        return panels + self.output_bytes

    @property
    def streamed_bytes(self) -> float:
        """Compulsory plus the re-reads L2 does not absorb (Lab 2's slider)."""
        return self.compulsory_bytes + (1 - self.l2_absorption) * (
            self.tiled_bytes - self.compulsory_bytes
        )

    @property
    def modelled_bytes(self) -> float:
        """The streamed bytes plus split-K's partial sums: the HBM row's bytes."""
        return self.levels.hbm

    @property
    def effective_tile(self) -> tuple[float, float]:
        """The rows and columns a tile holds on average, dim / ceil(dim / T): min(T, dim)
        when T divides the dimension or exceeds it (M = 64 under T_m = 256 holds 64)."""
        return (
            self.m / math.ceil(self.m / self.tile.m),
            self.n / math.ceil(self.n / self.tile.n),
        )

    @property
    def tiled_intensity_limit(self) -> float:
        """2/(s(1/T_m + 1/T_n)) with the effective tile, what the tiled intensity tends to
        for large K (T/s square): the panels' bytes grow with K, the output's do not."""
        tm, tn = self.effective_tile
        return 2 / (self.itemsize * (1 / tm + 1 / tn))

    def intensity(self, which: str) -> float:
        size = {
            "compulsory": self.compulsory_bytes,
            "tiled": self.tiled_bytes,
            "modelled": self.modelled_bytes,
        }[which]
        return self.flops / size

    @property
    def time_s(self) -> float:
        """Roofline lower bound W / min(pi, beta·I_modelled) (Lab 2: a floor, not a forecast)."""
        attainable = min(
            self.peak_flops_per_s, self.bandwidth_bytes_per_s * self.intensity("modelled")
        )
        return self.flops / attainable

    @property
    def fraction_of_peak(self) -> float:
        return self.flops / self.time_s / self.peak_flops_per_s

    @property
    def tile_bytes(self) -> int:
        """seed 004: an A tile T_m x T_k and a B tile T_k x T_n in the operand dtype plus an
        fp32 T_m x T_n accumulator. NB: T_k = min(T_m, T_n), so a square tile T keeps the
        seed's 2·T²·s + 4·T²."""
        tm, tn = self.tile.m, self.tile.n
        return (tm + tn) * min(tm, tn) * self.itemsize + tm * tn * FP32_BYTES

    @property
    def tile_fits(self) -> bool:
        return self.tile_bytes <= self.local_budget_bytes

    def hierarchy(self) -> list[LevelReading]:
        """The tile grid's bytes at every boundary the spec lists a rate for, innermost
        first, named as Table 4 names them (seed 000 "The hierarchical roofline")."""
        table = boundaries(self.spec)
        found = self.levels.by_level()
        return [
            LevelReading(
                level,
                table[level].name,
                found[level],
                table[level].bytes_per_s,
                table[level].figure.approximate,
            )
            for level in LEVELS
            if level in found and level in table
        ]

    @property
    def binding(self) -> LevelReading | None:
        """The boundary whose beta·I is smallest, or None when every one clears pi."""
        worst = min(self.hierarchy(), key=lambda r: r.cap(self.flops, self.peak_flops_per_s))
        return worst if worst.cap(self.flops, self.peak_flops_per_s) < 1 else None

    @property
    def hierarchical_cap(self) -> float:
        """min(pi, beta_l·I_l over the levels) / pi."""
        caps = [r.cap(self.flops, self.peak_flops_per_s) for r in self.hierarchy()]
        return min([1.0, *caps])

    @property
    def hierarchical_time_s(self) -> float:
        """W / (pi x the hierarchical cap): the floor once every boundary is counted."""
        return self.flops / (self.peak_flops_per_s * self.hierarchical_cap)

    def _limit_text(self) -> str:
        tm, tn = self.effective_tile
        value = self.tiled_intensity_limit
        if tm == tn:
            return f"T/s = {value:.0f}" if value.is_integer() else f"T/s = {value:.1f}"
        return f"2/(s(1/{tm:g} + 1/{tn:g})) = {value:.1f}"

    def lines(self) -> list[str]:
        fit = "fits" if self.tile_fits else "does NOT fit: choose a smaller tile"
        tm, tn, s = self.tile.m, self.tile.n, self.itemsize
        out = [
            f"GEMM {self.m} x {self.n} x {self.k}, {self.dtype}, tile {self.tile.label()}, "
            f"L2 absorption {100 * self.l2_absorption:.0f}%",
            f"W: {self.flops / 1e9:.1f} GFLOP",
            f"Q compulsory: {self.compulsory_bytes / 1e6:.1f} MB "
            f"(I = {self.intensity('compulsory'):.1f})",
            f"Q tiled: {self.tiled_bytes / 1e6:.1f} MB (I = {self.intensity('tiled'):.1f}, "
            f"-> {self._limit_text()} as K grows)",
        ]
        modelled = f"compulsory + {100 * (1 - self.l2_absorption):.0f}% of the tiled re-reads"
        if self.split > 1:
            sms = waves(self.levels, self.spec).sms
            out.append(
                f"split-K: {_count(self.tiles, 'tile')} fill at most half of "
                f"{_count(sms, 'SM')}, so K is split in {self.split} ({self.k // self.split} "
                f"of K each); fp32 partial sums {self.partial_bytes / 1e6:.1f} MB written and "
                "read back"
            )
            modelled += " + the split-K partial sums"
        out += [
            f"Q modelled: {self.modelled_bytes / 1e6:.1f} MB "
            f"(I = {self.intensity('modelled'):.1f}): {modelled}",
            f"predicted time: {self.time_s * 1e6:.1f} us, "
            f"{100 * self.fraction_of_peak:.1f}% of peak",
            f"tile fit: ({tm} + {tn}) x {min(tm, tn)} x {s} B inputs + {tm} x {tn} x 4 B "
            f"accumulator = {self.tile_bytes / 1024:.0f} KiB against "
            f"{self.local_budget_bytes / 1024:.0f} KiB: {fit} (it sets the CTAs per SM)",
            "hierarchical roofline (one roof per memory level): level, I, ridge, cap",
        ]
        for r in self.hierarchy():
            intensity = r.intensity(self.flops)
            extra = ""
            if r.level == "l2":
                without = self.flops / (r.bytes - self.output_bytes)
                extra = f" (-> {without:.1f} without the output write)"
            if r.level == "smem":
                extra = f" (warp tile {self.tile.warp[0]}x{self.tile.warp[1]})"
            if r.level == "hbm":
                extra = " (Q modelled)"
            approx = " ~" if r.approximate else " "
            out.append(
                f"  {r.name}: I = {intensity:.1f}{extra}, ridge{approx}"
                f"{self.peak_flops_per_s / r.bytes_per_s:.1f}, "
                f"cap {100 * r.cap(self.flops, self.peak_flops_per_s):.1f}% of peak"
            )
        binding = self.binding
        out.append(
            f"binds: {binding.name}, {100 * self.hierarchical_cap:.1f}% of peak, floor "
            f"{self.hierarchical_time_s * 1e6:.1f} us"
            if binding is not None
            else "binds: compute (every boundary clears the peak)"
        )
        w = self.waves
        if w is None:
            out.append("waves: none: the tile does not fit the local budget, so it cannot run")
        else:
            out.append(
                f"waves: {_count(w.ctas, 'CTA')} over {_count(w.sms, 'SM')} x "
                f"{self.ctas_per_sm} CTA/SM ({self.local_budget_bytes // 1024} KiB // "
                f"{self.tile_bytes // 1024} KiB) = {_count(w.count, 'wave')}, "
                f"{100 * w.efficiency:.1f}% busy (last wave {100 * w.tail:.0f}% full)"
            )
        return out


def gemm_workbench(
    m: int,
    n: int,
    k: int,
    *,
    dtype: str = "bf16",
    tile: int | str | tuple[int, int] | GemmTile = 128,
    l2_absorption: float = 0.85,
    hardware: str | HardwareSpec = "h100-sxm",
    local_budget_bytes: float | None = None,
) -> GemmReading:
    """seed 000 Lab 2 with rectangular tiles (``256x128``) and the hierarchical readout.
    ``local_budget_bytes`` (positive) defaults to the hardware's shared memory per SM (an
    H100 SM's 228 KB, seed 000 "GEMM II")."""
    gemm_tile = parse_tile(tile)
    for name, value in (("M", m), ("N", n), ("K", k)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0 <= l2_absorption <= 1:
        raise ValueError(f"l2_absorption must be in [0, 1], got {l2_absorption}")
    if local_budget_bytes is not None and not (
        math.isfinite(local_budget_bytes) and local_budget_bytes >= 1
    ):
        raise ValueError(
            "the local budget must be a finite positive number of bytes "
            f"(--local-budget-kib > 0), got {local_budget_bytes} B"
        )
    spec = get(hardware)
    return GemmReading(
        m,
        n,
        k,
        spec_dtype(dtype),
        gemm_tile,
        l2_absorption,
        itemsize(dtype),
        _peak(spec, dtype),
        spec.hbm_bytes_per_s.value,
        spec.shared_memory_per_sm() if local_budget_bytes is None else int(local_budget_bytes),
        spec,
    )

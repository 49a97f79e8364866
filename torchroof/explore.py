"""The seed's roofline explorer (Lab 1) and GEMM workbench (Lab 2) as plain functions.

seed 000 "The roofline equation and its geometry": P = min(pi, beta·I), fraction of peak
P/pi = min(1, I/I*). "GEMM II · tiles set the intensity": Q_tiled = s·(MNK(1/T_n + 1/T_m)
+ MN), I_tiled -> T/s; L2 absorbs a fraction of the re-reads (Lab 2's slider).
seed 004 "Reject a tile that cannot stay on chip": two input tiles plus an fp32 accumulator
against a local budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchroof.hardware import HardwareSpec, get, spec_dtype
from torchroof.records import dtype_itemsize

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


def _itemsize(dtype: str) -> int:
    key = spec_dtype(dtype)
    return dtype_itemsize(_SPEC_TO_TORCH.get(key, key))


@dataclass(frozen=True)
class RooflineReading:
    """Lab 1's readouts for one point of the plane."""

    hardware: str
    dtype: str
    intensity: float  # FLOP/byte at the HBM boundary
    peak_flops_per_s: float
    bandwidth_bytes_per_s: float

    @property
    def machine_balance(self) -> float:
        """I* = pi / beta (seed 000 Table 1)."""
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
        verdict = (
            f"memory-bound: {shortfall:.1f}x more intensity ({self.machine_balance:.0f} FLOP/B) "
            "reaches the ridge"
            if self.regime == "memory-bound"
            else f"compute-bound: {self.intensity / self.machine_balance:.1f}x past the ridge"
        )
        return [
            f"{self.hardware}, {self.dtype}, HBM boundary, I = {self.intensity:g} FLOP/B",
            f"machine balance I*: {self.machine_balance:.0f} FLOP/B",
            f"attainable: {self.attainable_flops_per_s / 1e12:.2f} TFLOP/s "
            f"of {self.peak_flops_per_s / 1e12:.0f}",
            f"fraction of peak: {100 * self.fraction_of_peak:.2f}%",
            f"time for 1 TFLOP: {self.seconds_per_tflop * 1e3:.3f} ms",
            f"regime: {verdict}",
        ]


def roofline_point(hardware: str | HardwareSpec, dtype: str, intensity: float) -> RooflineReading:
    """Where intensity ``I`` lands on the accelerator's roofline (seed 000 Lab 1)."""
    if intensity <= 0:
        raise ValueError(f"intensity must be positive, got {intensity}")
    spec = get(hardware)
    return RooflineReading(
        spec.name, spec_dtype(dtype), intensity, _peak(spec, dtype), spec.hbm_bytes_per_s.value
    )


@dataclass(frozen=True)
class GemmReading:
    """Lab 2's readouts for C[M,N] = A[M,K] @ B[K,N] with square T x T output tiles."""

    m: int
    n: int
    k: int
    dtype: str
    tile: int
    l2_absorption: float  # share of the tiled re-reads L2 absorbs (Lab 2: 80-95% typical)
    itemsize: int
    peak_flops_per_s: float
    bandwidth_bytes_per_s: float
    local_budget_bytes: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def compulsory_bytes(self) -> int:
        """s·(MK + KN + MN): every element once (seed 000 "GEMM from first principles")."""
        return self.itemsize * (self.m * self.k + self.k * self.n + self.m * self.n)

    @property
    def tiled_bytes(self) -> int:
        """Each of the ceil(M/T)·ceil(N/T) tiles reads a T x K panel of A and a K x T panel
        of B and writes its T x T block (seed 000 "GEMM II")."""
        tiles = math.ceil(self.m / self.tile) * math.ceil(self.n / self.tile)
        per_tile = 2 * self.tile * self.k + self.tile * self.tile
        return self.itemsize * tiles * per_tile

    @property
    def modelled_bytes(self) -> float:
        """Compulsory plus the re-reads L2 does not absorb."""
        return self.compulsory_bytes + (1 - self.l2_absorption) * (
            self.tiled_bytes - self.compulsory_bytes
        )

    @property
    def tiled_intensity_limit(self) -> float:
        """T/s, what the tiled intensity tends to for large K."""
        return self.tile / self.itemsize

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
        """Two input tiles in the operand dtype plus an fp32 accumulator (seed 004)."""
        return 2 * self.tile * self.tile * self.itemsize + self.tile * self.tile * 4

    @property
    def tile_fits(self) -> bool:
        return self.tile_bytes <= self.local_budget_bytes

    def lines(self) -> list[str]:
        fit = "fits" if self.tile_fits else "does NOT fit: choose a smaller tile"
        return [
            f"GEMM {self.m} x {self.n} x {self.k}, {self.dtype}, tile {self.tile}, "
            f"L2 absorption {100 * self.l2_absorption:.0f}%",
            f"W: {self.flops / 1e9:.1f} GFLOP",
            f"Q compulsory: {self.compulsory_bytes / 1e6:.1f} MB "
            f"(I = {self.intensity('compulsory'):.1f})",
            f"Q tiled: {self.tiled_bytes / 1e6:.1f} MB (I = {self.intensity('tiled'):.1f}, "
            f"-> T/s = {self.tiled_intensity_limit:.0f} as K grows)",
            f"Q modelled: {self.modelled_bytes / 1e6:.1f} MB "
            f"(I = {self.intensity('modelled'):.1f})",
            f"predicted time: {self.time_s * 1e6:.1f} us, "
            f"{100 * self.fraction_of_peak:.1f}% of peak",
            f"tile fit: 2 x {self.tile}^2 x {self.itemsize} B inputs + {self.tile}^2 x 4 B "
            f"accumulator = {self.tile_bytes / 1024:.0f} KiB against "
            f"{self.local_budget_bytes / 1024:.0f} KiB: {fit}",
        ]


def gemm_workbench(
    m: int,
    n: int,
    k: int,
    *,
    dtype: str = "bf16",
    tile: int = 128,
    l2_absorption: float = 0.85,
    hardware: str | HardwareSpec = "h100-sxm",
    local_budget_bytes: int | None = None,
) -> GemmReading:
    """seed 000 Lab 2. ``local_budget_bytes`` defaults to the hardware's shared memory per SM
    (an H100 SM's 228 KB, seed 000 "GEMM II")."""
    for name, value in (("M", m), ("N", n), ("K", k), ("tile", tile)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0 <= l2_absorption <= 1:
        raise ValueError(f"l2_absorption must be in [0, 1], got {l2_absorption}")
    spec = get(hardware)
    return GemmReading(
        m,
        n,
        k,
        spec_dtype(dtype),
        tile,
        l2_absorption,
        _itemsize(dtype),
        _peak(spec, dtype),
        spec.hbm_bytes_per_s.value,
        spec.shared_memory_per_sm() if local_budget_bytes is None else local_budget_bytes,
    )

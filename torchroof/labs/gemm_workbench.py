"""The GEMM workbench: a tiled matmul's intensity and bound at each memory level.

Tiles set the intensity (NVIDIA, Matrix Multiplication Background User's Guide):
Q_tiled = s·(MNK(1/T_n + 1/T_m) + MN), I_tiled -> 2/(s(1/T_m + 1/T_n)); L2 absorbs a
fraction of the re-reads (the workbench's slider).
The hierarchical roofline: the same GEMM at every boundary (torchroof/timing/hierarchy.py counts
the bytes, split-K's fp32 partial sums included when it splits a small grid), the binding
level and the waves of its tile grid.
A tile that cannot stay on chip is rejected: two input tiles plus an fp32 accumulator
against a local budget; the same footprint sets how many CTAs share an SM, and a tile that
does not fit gets no waves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from torchroof.hardware import (
    HardwareSpec,
    get,
    spec_dtype,
)
from torchroof.labs.explore import boundaries, itemsize, tensor_peak
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
    name: str  # the boundary's row: register file, shared memory, L2 cache, HBM
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
    """The GEMM workbench's readouts for C[M,N] = A[M,K] @ B[K,N] with T_m x T_n output tiles.

    One byte count runs through every line: Q modelled (compulsory, the tiled re-reads L2
    lets through, and split-K's fp32 partial sums when hierarchy.split_k splits the grid)
    is the HBM row of the hierarchical readout and sets the predicted time. One tile
    footprint too: the fit test (two input tiles and the fp32 accumulator) is checked
    against the local budget and says how many CTAs share an SM; a tile that does not fit
    gets no waves. NB: the pipeline's tile chooser (hierarchy.choose_tile) counts a CTA's
    pipelined operand stages instead, the accumulator in registers."""

    m: int
    n: int
    k: int
    dtype: str
    tile: GemmTile
    l2_absorption: float  # share of the tiled re-reads L2 absorbs (80-95% typical)
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
        """Wave quantisation (NVIDIA, Matrix Multiplication Background): the grid's CTAs
        over the SMs, as many per SM as the tile fits the local budget; None when it does
        not fit at all."""
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
        """s·(MK + KN + MN): every element once (docs/concepts/compulsory-bytes.md)."""
        return self.itemsize * (self.m * self.k + self.k * self.n + self.m * self.n)

    @property
    def output_bytes(self) -> int:
        """s·MN: C written once."""
        return self.itemsize * self.m * self.n

    @property
    def tiled_bytes(self) -> float:
        """Each T_m x T_n tile reads a T_m x K panel of A and a K x T_n panel of B
        (hierarchy.tiled_bytes), and C is written once."""
        panels = tiled_bytes(self.m, self.n, self.k, (self.tile.m, self.tile.n), self.itemsize)
        return panels + self.output_bytes

    @property
    def streamed_bytes(self) -> float:
        """Compulsory plus the re-reads L2 does not absorb (the workbench's slider)."""
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
        """Roofline lower bound W / min(pi, beta·I_modelled) (a floor, not a forecast)."""
        attainable = min(
            self.peak_flops_per_s, self.bandwidth_bytes_per_s * self.intensity("modelled")
        )
        return self.flops / attainable

    @property
    def fraction_of_peak(self) -> float:
        return self.flops / self.time_s / self.peak_flops_per_s

    @property
    def tile_bytes(self) -> int:
        """An A tile T_m x T_k and a B tile T_k x T_n in the operand dtype plus an fp32
        T_m x T_n accumulator. NB: T_k = min(T_m, T_n), so a square tile T keeps
        2·T²·s + 4·T²."""
        tm, tn = self.tile.m, self.tile.n
        return (tm + tn) * min(tm, tn) * self.itemsize + tm * tn * FP32_BYTES

    @property
    def tile_fits(self) -> bool:
        return self.tile_bytes <= self.local_budget_bytes

    def hierarchy(self) -> list[LevelReading]:
        """The tile grid's bytes at every boundary the spec lists a rate for, innermost
        first, named as the boundary table names them (the hierarchical roofline)."""
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
    """The GEMM workbench with rectangular tiles (``256x128``) and the hierarchical readout.
    ``local_budget_bytes`` (positive) defaults to the hardware's shared memory per SM (an
    H100 SM's 228 KB, NVIDIA Hopper Tuning Guide)."""
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
        tensor_peak(spec, dtype),
        spec.hbm_bytes_per_s.value,
        spec.shared_memory_per_sm() if local_budget_bytes is None else int(local_budget_bytes),
        spec,
    )

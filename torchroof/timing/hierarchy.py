"""The hierarchical roofline: one kernel's bytes at every memory boundary, its tiles and waves.

The hierarchical roofline (Yang, Kurth & Williams 2020): P <= min(pi, beta_smem·I_smem,
beta_L2·I_L2, beta_HBM·I_HBM); each level has its own ridge and the level that binds is the
smallest term. Tiles set the intensity (NVIDIA, Matrix Multiplication Background User's Guide;
CUTLASS): a T_m x T_n threadblock tile streams a T_m x K panel of A and a K x T_n panel of B,
so the traffic into the tile is s·MNK·(1/T_m + 1/T_n) + out·MN and I -> 2 / (s·(1/T_m +
1/T_n)); the same count with the warp tile gives the shared-memory level and with the MMA
instruction's operands the register level. L2 absorbs the panel re-reads, so HBM sees the
compulsory bytes (the traced Q) and the re-reads cross the L2 boundary instead.
Wave quantisation (same guide): tiles are dispatched in waves over the SMs.
Little's law (Little 1961; Volkov 2016): bytes in flight = beta x latency; a kernel that keeps
fewer in flight runs at C / latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchroof.hardware import HardwareSpec
from torchroof.timing.kernel_shape import (
    ATTENTION_BLOCK_ROWS,
    ATTENTION_WARPGROUP_ROWS,
    STREAM_ELEMENTS_PER_CTA,
    KernelShape,
)

# The MMA instruction the register level is counted for: mma.sync m16n8k16 reads a 16 x 16
# A fragment and a 16 x 8 B fragment from registers per 2·16·8·16 FLOPs (I = 5.3 in bf16).
MMA_TILE = (16, 8)
# Threadblock tiles a GEMM library chooses among (CUTLASS's usual Hopper/Ampere shapes), K
# step 64; the warp tile is 64 x 64 (32 x 32 for tiles under 128).
GEMM_TILES: tuple[tuple[int, int], ...] = (
    (256, 128),
    (128, 256),
    (128, 128),
    (128, 64),
    (64, 128),
    (64, 64),
)
TILE_K = 64
PIPELINE_STAGES = 4  # operand stages buffered in shared memory (CUTLASS's default for sm80+)
FP32_BYTES = 4
# Split-K is worth it only while each split keeps at least this much of K.
MIN_SPLIT_K = 128

LEVELS = ("registers", "smem", "l2", "hbm")

# Compute ceilings below the tensor peak: a fused attention kernel's softmax does not run on the
# tensor cores. Per (query, key) pair it kept, the forward takes one exponential (the SFU)
# and about four fp32 operations (running max, scale-and-subtract, sum, rescale); the
# backward recomputes P (one exponential) and forms dS = P·(dP - D) scaled (about four).
SOFTMAX_EXPS_PER_PAIR = 1
SOFTMAX_VECTOR_FLOPS_PER_PAIR = 4


@dataclass(frozen=True)
class GemmTile:
    """A threadblock tile T_m x T_n (K step TILE_K) and the warp tile inside it."""

    m: int
    n: int

    @property
    def warp(self) -> tuple[int, int]:
        size = 64 if min(self.m, self.n) >= 128 else 32
        return (min(size, self.m), min(size, self.n))

    def smem_bytes(self, itemsize: int) -> int:
        """The operand stages one CTA holds in shared memory."""
        return PIPELINE_STAGES * (self.m + self.n) * TILE_K * itemsize

    def label(self) -> str:
        return f"{self.m}x{self.n}"


def tiled_bytes(m: int, n: int, k: int, tile: tuple[int, int], itemsize: int) -> float:
    """Operand bytes a (m x k) @ (k x n) product pulls across a boundary when each
    tile[0] x tile[1] block of C streams its two panels (tiled GEMM): A once per
    column of tiles, B once per row of tiles, s·(m·k·ceil(n/T_n) + n·k·ceil(m/T_m)); for
    whole tiles that is s·MNK·(1/T_n + 1/T_m), and ragged edges load only the rows there are."""
    return itemsize * k * (m * math.ceil(n / tile[1]) + n * math.ceil(m / tile[0]))


@dataclass(frozen=True)
class Levels:
    """Bytes crossing each boundary of one kernel (None: the kernel does not use the level
    in a way this model counts), the grid it launches and how many of its CTAs fit on an SM
    at once."""

    hbm: float
    l2: float
    smem: float | None
    registers: float | None
    ctas: int
    ctas_per_sm: int
    tile: str = ""  # the GEMM tile, "256x128"; "" for other kernels

    def by_level(self) -> dict[str, float]:
        out = {"hbm": self.hbm, "l2": self.l2}
        if self.smem is not None:
            out["smem"] = self.smem
        if self.registers is not None:
            out["registers"] = self.registers
        return out


def _ctas_per_sm(tile: GemmTile, itemsize: int, spec: HardwareSpec) -> int:
    if spec.shared_memory_bytes_per_sm is None:
        return 1
    return max(1, int(spec.shared_memory_bytes_per_sm.value) // tile.smem_bytes(itemsize))


def gemm_levels(
    shape: KernelShape, hbm_bytes: float, tile: GemmTile, spec: HardwareSpec, out_itemsize: int
) -> Levels:
    """A GEMM under ``tile``: L2 sees every tile's panels plus the output (and, with split-K,
    the fp32 partial sums written and read back); HBM the traced compulsory bytes (L2
    absorbs the re-reads) plus those partials; shared memory the warp tiles' operands;
    registers the MMA fragments."""
    b, m, n, k, s = shape.batch, shape.m, shape.n, shape.k, shape.itemsize
    grid = math.ceil(m / tile.m) * math.ceil(n / tile.n)
    split = split_k(b * grid, k, spec)
    partials = 2 * (split - 1) * m * n * FP32_BYTES if split > 1 else 0
    l2 = b * (tiled_bytes(m, n, k, (tile.m, tile.n), s) + m * n * out_itemsize + partials)
    smem = b * tiled_bytes(m, n, k, tile.warp, s)
    registers = b * tiled_bytes(m, n, k, MMA_TILE, s)
    return Levels(
        hbm=hbm_bytes + b * partials,
        l2=max(l2, hbm_bytes),
        smem=smem,
        registers=registers,
        ctas=b * grid * split,
        ctas_per_sm=_ctas_per_sm(tile, s, spec),
        tile=tile.label(),
    )


def split_k(tiles: int, k: int, spec: HardwareSpec) -> int:
    """Split-K (the fixed-split decomposition in Osama et al. 2023, Stream-K): a grid (every
    batch's tiles) of
    fewer tiles than SMs splits K into as many parts as still fit one wave, while each split
    keeps >= MIN_SPLIT_K of K."""
    sms = _sms(spec)
    if tiles * 2 > sms or k < 2 * MIN_SPLIT_K:
        return 1
    return max(1, min(sms // tiles, k // MIN_SPLIT_K))


def attention_levels(shape: KernelShape, hbm_bytes: float, spec: HardwareSpec) -> Levels:
    """Flash attention (Dao et al. 2022): each block of B_r query rows streams
    the kept K/V blocks through shared memory, so L2 sees s·(N/B_r)·N_k·(d + d_v) per head on
    top of Q and O (I -> 2B_r/s), the K/V re-reads absorbed before HBM; each 64-row warpgroup
    reads the K/V block from shared memory. The query heads that share a K/V head (GQA) are
    packed into one block when their rows fit (decode kernels do), so K/V streams once per
    block of B_r rows of the group. Backward streams Q and dO per key block of B_c rows and
    accumulates dQ in fp32. A grid smaller than the SMs splits the keys over more blocks
    (flash-decoding), as many as still fit one wave."""
    q_rows, kv_rows, d, s = shape.m, shape.n, shape.k, shape.itemsize
    dv = shape.value_dim or d
    kv_heads = shape.kv_batch or shape.batch
    group = max(1, shape.batch // kv_heads)
    kept_kv = kv_rows * shape.kept
    if shape.backward:
        key_blocks = math.ceil(kv_rows / ATTENTION_BLOCK_ROWS)
        per_row = (d + dv) * s + 2 * FP32_BYTES * d  # Q and dO in, dQ read and written
        l2 = shape.batch * key_blocks * q_rows * shape.kept * per_row
        warpgroups = math.ceil(kv_rows / ATTENTION_WARPGROUP_ROWS)
        smem = shape.batch * warpgroups * q_rows * shape.kept * (d + dv) * s
        ctas = shape.batch * key_blocks
    else:
        rows = q_rows * group  # one K/V head's query rows
        blocks = math.ceil(rows / ATTENTION_BLOCK_ROWS)
        l2 = shape.batch * q_rows * (d + dv) * s + kv_heads * blocks * kept_kv * (d + dv) * s
        warpgroups = math.ceil(rows / ATTENTION_WARPGROUP_ROWS)
        smem = kv_heads * warpgroups * kept_kv * (d + dv) * s
        ctas = kv_heads * blocks
        sms = _sms(spec)
        if 0 < ctas * 2 <= sms:  # flash-decoding: split the keys, within one wave
            splits = min(math.ceil(kv_rows / ATTENTION_BLOCK_ROWS), sms // ctas)
            ctas *= max(1, splits)
    return Levels(
        hbm=hbm_bytes,
        l2=max(l2, hbm_bytes),
        smem=smem,
        registers=None,
        ctas=max(1, ctas),
        ctas_per_sm=2 if d <= 64 else 1,
    )


def softmax_seconds(shape: KernelShape, spec: HardwareSpec) -> float:
    """Time a fused attention kernel spends off the tensor cores: its kept pairs' exponentials
    at the SFU rate and their fp32 bookkeeping at the vector rate (FlashAttention-2 runs
    them between its matmuls; FlashAttention-3 overlaps part of them, not modelled)."""
    pairs = shape.batch * shape.m * shape.n * shape.kept
    exps = pairs * SOFTMAX_EXPS_PER_PAIR / spec.sfu_flops_per_s.value
    return exps + pairs * SOFTMAX_VECTOR_FLOPS_PER_PAIR / spec.vector_peak("fp32")


def stream_levels(shape: KernelShape, hbm_bytes: float) -> Levels:
    """An elementwise or reduction kernel streams its bytes once through L2 (no reuse to
    absorb); it tiles nothing in shared memory."""
    ctas = max(1, math.ceil(shape.elements / STREAM_ELEMENTS_PER_CTA))
    return Levels(hbm=hbm_bytes, l2=hbm_bytes, smem=None, registers=None, ctas=ctas, ctas_per_sm=8)


def _sms(spec: HardwareSpec) -> int:
    return int(spec.compute_units.value) if spec.compute_units is not None else 1


@dataclass(frozen=True)
class Waves:
    """Wave quantisation (NVIDIA, Matrix Multiplication Background): ``ctas`` blocks are
    dispatched over ``slots``
    = SMs x CTAs per SM in ceil(ctas / slots) waves; CTAs that share an SM share its
    throughput, so the busy share of the SMs' time is ctas / (ceil(ctas / SMs) x SMs)."""

    ctas: int
    slots: int
    sms: int

    @property
    def count(self) -> int:
        return max(1, math.ceil(self.ctas / self.slots))

    @property
    def efficiency(self) -> float:
        """ctas / (ceil(ctas / SMs) x SMs): 140 tiles on 132 SMs, 140 / 264 = 0.53."""
        return self.ctas / (math.ceil(self.ctas / self.sms) * self.sms) if self.ctas else 1.0

    @property
    def tail(self) -> float:
        rest = self.ctas - (self.count - 1) * self.slots
        return rest / self.slots


def waves(levels: Levels, spec: HardwareSpec) -> Waves:
    return Waves(levels.ctas, _sms(spec) * levels.ctas_per_sm, _sms(spec))


def in_flight_bytes(levels: Levels, spec: HardwareSpec, bandwidth_bytes_per_s: float) -> float:
    """Little's law (Little 1961; Volkov 2016): the bytes a kernel keeps in flight. The machine
    needs beta x latency (~2 MB on an H100, ~15 KB per SM); a kernel's CTAs reach at most
    the SMs they occupy, and it can never have more in flight than it moves."""
    if spec.memory_latency_s is None:
        return math.inf
    needed = bandwidth_bytes_per_s * spec.memory_latency_s.value
    sms = _sms(spec)
    active = min(sms, levels.ctas)
    return min(levels.hbm, needed * active / sms)


def effective_bandwidth(
    in_flight: float, spec: HardwareSpec, bandwidth_bytes_per_s: float
) -> float:
    """beta_eff = min(beta, C / latency) for C = ``in_flight`` bytes (Little's law,
    docs/concepts/littles-law.md)."""
    if spec.memory_latency_s is None or in_flight <= 0:
        return bandwidth_bytes_per_s
    return min(bandwidth_bytes_per_s, in_flight / spec.memory_latency_s.value)


def choose_tile(
    shape: KernelShape,
    hbm_bytes: float,
    spec: HardwareSpec,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    out_itemsize: int,
) -> GemmTile:
    """The tile heuristic (a small autotuner, like cuBLAS's): among GEMM_TILES that fit the
    SM's shared memory, the one whose slowest term — W over the peak stretched by its waves,
    its HBM bytes at the bandwidth its grid keeps in flight, its L2 and shared-memory bytes
    — is smallest; ties go to the earlier (larger) tile."""
    flops = 2 * shape.batch * shape.m * shape.n * shape.k
    rates = level_rates(spec)
    best: tuple[float, GemmTile] | None = None
    for tm, tn in GEMM_TILES:
        tile = GemmTile(tm, tn)
        smem_per_sm = spec.shared_memory_bytes_per_sm
        if smem_per_sm is not None and tile.smem_bytes(shape.itemsize) > smem_per_sm.value:
            continue
        levels = gemm_levels(shape, hbm_bytes, tile, spec, out_itemsize)
        body = flops / peak_flops_per_s / waves(levels, spec).efficiency
        in_flight = in_flight_bytes(levels, spec, bandwidth_bytes_per_s)
        body = max(body, levels.hbm / effective_bandwidth(in_flight, spec, bandwidth_bytes_per_s))
        for level, rate in rates.items():
            if level != "registers":
                body = max(body, levels.by_level()[level] / rate)
        if best is None or body < best[0] * (1 - 1e-9):
            best = (body, tile)
    # none fits the part's shared memory with its stages (fp32 operands on a 100 KiB SM): a
    # real kernel runs the smallest tile with fewer stages, which costs the same traffic; an
    # implausibly small figure is warned about when the hardware file is read
    return best[1] if best is not None else GemmTile(*GEMM_TILES[-1])


def level_rates(spec: HardwareSpec) -> dict[str, float]:
    """The on-chip bandwidths the file lists (the hierarchical roofline's levels), by level."""
    rates = {
        "l2": spec.l2_bytes_per_s,
        "smem": spec.shared_memory_bytes_per_s,
        "registers": spec.register_bytes_per_s,
    }
    return {level: figure.value for level, figure in rates.items() if figure is not None}

"""The hierarchical roofline: one kernel's bytes at every memory boundary, its tiles and waves.

seed 000 "The hierarchical roofline": P <= min(pi, beta_smem·I_smem, beta_L2·I_L2,
beta_HBM·I_HBM); each level has its own ridge and the level that binds is the smallest term.
seed 000 "GEMM II · tiles set the intensity": a T_m x T_n threadblock tile streams a T_m x K
panel of A and a K x T_n panel of B, so the traffic into the tile is
s·MNK·(1/T_m + 1/T_n) + out·MN and I -> 2 / (s·(1/T_m + 1/T_n)); the same count with the
warp tile gives the shared-memory level and with the MMA instruction's operands the
register level. L2 absorbs the panel re-reads, so HBM sees the compulsory bytes (the traced
Q) and the re-reads cross the L2 boundary instead.
seed 000 "Is the work quantised badly?": tiles are dispatched in waves over the SMs.
seed 000 "The third regime: latency": bytes in flight = beta x latency; a kernel that keeps
fewer in flight runs at C / latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchroof.hardware import HardwareSpec
from torchroof.kernel_shape import (
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
    tile[0] x tile[1] block of C streams its two panels (seed 000 "GEMM II"):
    ceil(m/T_m)·ceil(n/T_n)·(T_m' + T_n')·k·s, with T' = min(T, the dimension)."""
    tm, tn = min(tile[0], m), min(tile[1], n)
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    return tiles * (tm + tn) * k * itemsize


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
    grid = math.ceil(m / min(tile.m, m)) * math.ceil(n / min(tile.n, n))
    split = split_k(grid, k, spec)
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
    """Split-K (seed 000 "Split-K and stream-K scheduling"): a grid of fewer tiles than SMs
    splits K so every SM gets work, while each split keeps >= MIN_SPLIT_K of K."""
    sms = _sms(spec)
    if tiles >= sms or k < 2 * MIN_SPLIT_K:
        return 1
    return max(1, min(math.ceil(sms / tiles), k // MIN_SPLIT_K))


def attention_levels(shape: KernelShape, hbm_bytes: float, spec: HardwareSpec) -> Levels:
    """Flash attention (seed 000 "FlashAttention"): each block of B_r query rows streams
    the kept K/V blocks through shared memory, so L2 sees s·(N/B_r)·2·N_k·d per head on top
    of Q and O (I -> 2B_r/s), the K/V re-reads absorbed before HBM; each 64-row warpgroup
    reads the K/V block from shared memory. Backward streams Q and dO per key block of
    B_c rows and accumulates dQ in fp32. A grid smaller than the SMs splits the keys over
    more blocks (flash-decoding), as decode kernels do."""
    b, q_rows, kv_rows, d, s = shape.batch, shape.m, shape.n, shape.k, shape.itemsize
    kept_kv = kv_rows * shape.kept
    if shape.backward:
        key_blocks = math.ceil(kv_rows / ATTENTION_BLOCK_ROWS)
        streamed = key_blocks * q_rows * shape.kept * d * (2 * s + 2 * FP32_BYTES)
        l2 = b * streamed
        smem = b * math.ceil(kv_rows / ATTENTION_WARPGROUP_ROWS) * q_rows * shape.kept * 2 * d * s
        ctas = b * key_blocks
    else:
        query_blocks = math.ceil(q_rows / ATTENTION_BLOCK_ROWS)
        l2 = b * (2 * q_rows * d * s + query_blocks * kept_kv * 2 * d * s)
        groups = math.ceil(q_rows / ATTENTION_WARPGROUP_ROWS)
        smem = b * groups * kept_kv * 2 * d * s
        ctas = b * query_blocks
        if ctas < _sms(spec):  # flash-decoding: split the keys until every SM has a block
            splits = min(math.ceil(kv_rows / ATTENTION_BLOCK_ROWS), math.ceil(_sms(spec) / ctas))
            ctas *= max(1, splits)
    return Levels(
        hbm=hbm_bytes,
        l2=max(l2, hbm_bytes),
        smem=smem,
        registers=None,
        ctas=ctas,
        ctas_per_sm=2 if d <= 64 else 1,
    )


def stream_levels(shape: KernelShape, hbm_bytes: float) -> Levels:
    """An elementwise or reduction kernel streams its bytes once through L2 (no reuse to
    absorb); it tiles nothing in shared memory."""
    ctas = max(1, math.ceil(shape.elements / STREAM_ELEMENTS_PER_CTA))
    return Levels(hbm=hbm_bytes, l2=hbm_bytes, smem=None, registers=None, ctas=ctas, ctas_per_sm=8)


def _sms(spec: HardwareSpec) -> int:
    return int(spec.compute_units.value) if spec.compute_units is not None else 1


@dataclass(frozen=True)
class Waves:
    """seed 000 "Is the work quantised badly?": ``ctas`` blocks over ``slots`` = SMs x
    CTAs per SM run in ceil(ctas / slots) waves; the last is ``tail`` full."""

    ctas: int
    slots: int

    @property
    def count(self) -> int:
        return max(1, math.ceil(self.ctas / self.slots))

    @property
    def efficiency(self) -> float:
        """Busy share of the SM-time the waves take: ctas / (waves x slots)."""
        return self.ctas / (self.count * self.slots) if self.ctas else 1.0

    @property
    def tail(self) -> float:
        rest = self.ctas - (self.count - 1) * self.slots
        return rest / self.slots


def waves(levels: Levels, spec: HardwareSpec) -> Waves:
    return Waves(levels.ctas, _sms(spec) * levels.ctas_per_sm)


def in_flight_bytes(levels: Levels, spec: HardwareSpec, bandwidth_bytes_per_s: float) -> float:
    """seed 000 "The third regime: latency": the bytes a kernel keeps in flight. The machine
    needs beta x latency (~2 MB on an H100, ~15 KB per SM); a kernel's CTAs reach at most
    the SMs they occupy, and it can never have more in flight than it moves."""
    if spec.memory_latency_s is None:
        return math.inf
    needed = bandwidth_bytes_per_s * spec.memory_latency_s.value
    sms = _sms(spec)
    active = min(sms, levels.ctas)
    return min(levels.hbm, needed * active / sms)


def effective_bandwidth(levels: Levels, spec: HardwareSpec, bandwidth_bytes_per_s: float) -> float:
    """beta_eff = min(beta, C / latency) (seed 000 "The third regime: latency")."""
    if spec.memory_latency_s is None:
        return bandwidth_bytes_per_s
    in_flight = in_flight_bytes(levels, spec, bandwidth_bytes_per_s)
    if in_flight <= 0:
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
        body = max(body, levels.hbm / effective_bandwidth(levels, spec, bandwidth_bytes_per_s))
        for level, rate in rates.items():
            if level != "registers":
                body = max(body, levels.by_level()[level] / rate)
        if best is None or body < best[0] * (1 - 1e-9):
            best = (body, tile)
    return best[1] if best is not None else GemmTile(*GEMM_TILES[-1])


def level_rates(spec: HardwareSpec) -> dict[str, float]:
    """The on-chip bandwidths the file lists (seed 000 Table 4), by level."""
    rates = {
        "l2": spec.l2_bytes_per_s,
        "smem": spec.shared_memory_bytes_per_s,
        "registers": spec.register_bytes_per_s,
    }
    return {level: figure.value for level, figure in rates.items() if figure is not None}

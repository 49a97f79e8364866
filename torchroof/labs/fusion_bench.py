"""The fusion bench: one chain of elementwise ops, kernel boundaries toggled.

Fusion (docs/concepts/fusion.md): residual add, RMSNorm, elementwise scale, SiLU,
elementwise multiply, dropout — six kernels, six launches, each a kernel boundary that is a
memory boundary.
Q_fused = s·n·(r_ext + w_ext); I_fused = sum f_i / [s(r_ext + w_ext)]: the numerator adds,
the denominator does not. Turning a boundary off never changes W (fusion changes Q, never
W), only Q. The bench warns when a fused group would need more than roughly 64 KB of live
state per 256-thread block (64 32-bit registers per thread: past it fused kernels lose
occupancy or spill; CUDA C++ Programming Guide, registers per SM).

The chain (n = tokens x d_model elements at s bytes; FLOPs per element as the counters
count them, ~12 in all like the ``fused-norm-swiglu-residual`` preset):

    residual add   h = x + r                 1   reads x, r (the sublayer output, the stream)
    RMSNorm        y = h · rsqrt(mean(h²))   3   square, accumulate, scale (a row reduction)
    scale          z = y · gamma             1   gamma: d_model weights
    SiLU           a = z · sigmoid(z)        4   negate, exp, add, divide
    multiply       m = a · u                 1   u: SwiGLU's up branch, an external input
    dropout        o = m · mask / (1 - p)    2   compare, scale (mask drawn in-kernel)

``h`` is the residual stream the next block adds to, so it is written whatever is fused;
``o`` is the chain's output. NB: the GEMMs a real block runs
between RMSNorm and SwiGLU are left out, and the dropout mask a backward pass would keep is
not stored.

Register pressure (crude): a 256-thread block holds, per thread, the
elements it processes x the tensors live at once x 4 B (fp32 in registers, fp32
accumulation). A group holding a row reduction keeps the whole row on chip until its
norm is known, d_model / 256 elements per thread; any other group 8 elements per thread (one
16-byte bf16 load).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchroof.hardware import HardwareSpec, get, spec_dtype
from torchroof.labs.explore import itemsize

BLOCK_THREADS = 256
LIVE_STATE_LIMIT_BYTES = 64 * 1024  # roughly 64 KB per 256-thread block (64 registers/thread)
REGISTER_BYTES = 4  # live values are fp32 in registers
STREAM_ELEMENTS_PER_THREAD = 8  # one 16-byte load of bf16 per thread


@dataclass(frozen=True)
class ChainOp:
    """One op of the chain: FLOPs per element, the n-element tensors it reads and the one it
    writes; ``row_reduction`` when it needs a whole row first; ``weight`` when it reads a
    d_model vector."""

    name: str
    flops_per_element: int
    reads: tuple[str, ...]
    writes: str
    row_reduction: bool = False
    weight: bool = False


FUSION_CHAIN: tuple[ChainOp, ...] = (
    ChainOp("residual add", 1, ("x", "r"), "h"),
    ChainOp("RMSNorm", 3, ("h",), "y", row_reduction=True),
    ChainOp("scale", 1, ("y",), "z", weight=True),
    ChainOp("SiLU", 4, ("z",), "a"),
    ChainOp("multiply", 1, ("a", "u"), "m"),
    ChainOp("dropout", 2, ("m",), "o"),
)
CHAIN_OUTPUTS = ("h", "o")  # read after the chain: the residual stream and the output
ALL_SPLIT = (True,) * (len(FUSION_CHAIN) - 1)


@dataclass(frozen=True)
class FusedKernel:
    """One kernel of the bench: a run of the chain's ops between two boundaries."""

    ops: tuple[ChainOp, ...]
    reads: tuple[str, ...]  # n-element tensors read from HBM
    writes: tuple[str, ...]  # n-element tensors written to HBM
    elements: int  # n
    d_model: int
    itemsize: int
    live_tensors: int  # most tensors live at once in the kernel

    @property
    def name(self) -> str:
        return " + ".join(op.name for op in self.ops)

    @property
    def flops(self) -> int:
        return self.elements * sum(op.flops_per_element for op in self.ops)

    @property
    def bytes(self) -> int:
        """s·n·(r_ext + w_ext), plus gamma's d_model values if the kernel scales by it."""
        weight = self.d_model if any(op.weight for op in self.ops) else 0
        return self.itemsize * (self.elements * (len(self.reads) + len(self.writes)) + weight)

    @property
    def elements_per_thread(self) -> int:
        if any(op.row_reduction for op in self.ops):
            return math.ceil(self.d_model / BLOCK_THREADS)
        return STREAM_ELEMENTS_PER_THREAD

    @property
    def live_state_bytes(self) -> int:
        """Live values per thread x 256 threads x 4 B (the bench's register check)."""
        per_thread = self.elements_per_thread * self.live_tensors
        return per_thread * BLOCK_THREADS * REGISTER_BYTES

    @property
    def spills(self) -> bool:
        return self.live_state_bytes > LIVE_STATE_LIMIT_BYTES

    def time_s(self, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
        return max(self.flops / peak_flops_per_s, self.bytes / bandwidth_bytes_per_s)


def _kernel(
    ops: tuple[ChainOp, ...], later: set[str], elements: int, d_model: int, size: int
) -> FusedKernel:
    made = {op.writes for op in ops}
    reads = tuple(dict.fromkeys(t for op in ops for t in op.reads if t not in made))
    writes = tuple(t for t in (op.writes for op in ops) if t in later or t in CHAIN_OUTPUTS)
    # liveness: at op i, its operands and result plus what a later op of the kernel reads
    live = 0
    for i, op in enumerate(ops):
        needed_later = {t for later_op in ops[i + 1 :] for t in later_op.reads}
        held = {t for prior in ops[:i] for t in (prior.writes, *prior.reads)} & needed_later
        live = max(live, len({*op.reads, op.writes} | held))
    return FusedKernel(ops, reads, writes, elements, d_model, size, live)


@dataclass(frozen=True)
class FusionBench:
    """The fusion bench's readouts for one setting of the boundaries."""

    tokens: int
    d_model: int
    dtype: str
    boundaries_on: tuple[bool, ...]  # after each op but the last: True = written to HBM
    kernels: tuple[FusedKernel, ...]
    peak_flops_per_s: float  # the fp32 vector units (the unit follows the op: pointwise ops)
    bandwidth_bytes_per_s: float
    all_split_time_s: float

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def time_s(self) -> float:
        """Roofline times summed as if kernels ran back to back (the per-layer budget's rule)."""
        return sum(
            k.time_s(self.peak_flops_per_s, self.bandwidth_bytes_per_s) for k in self.kernels
        )

    @property
    def speedup(self) -> float:
        return self.all_split_time_s / self.time_s

    def warnings(self) -> list[str]:
        return [
            f"kernel '{k.name}' needs {k.live_state_bytes / 1024:.0f} KiB of live state per "
            f"{BLOCK_THREADS}-thread block ({k.elements_per_thread} elements x "
            f"{k.live_tensors} tensors x {REGISTER_BYTES} B per thread), over "
            f"{LIVE_STATE_LIMIT_BYTES // 1024} KiB: expect spills"
            for k in self.kernels
            if k.spills
        ]

    def lines(self) -> list[str]:
        out = [
            f"fusion bench: {self.tokens} tokens x d_model {self.d_model}, {self.dtype}",
            f"kernels launched: {len(self.kernels)}",
        ]
        for k in self.kernels:
            out.append(
                f"  {k.name}: reads {','.join(k.reads)} writes {','.join(k.writes)}, "
                f"{k.bytes / 1e9:.2f} GB, I = {k.flops / k.bytes:.2f}, "
                f"live {k.live_state_bytes / 1024:.0f} KiB/block"
            )
        out += [
            f"HBM traffic: {self.bytes / 1e9:.2f} GB",
            f"FLOPs: {self.flops / 1e9:.2f} GFLOP",
            f"intensity: {self.intensity:.2f} FLOP/B",
            f"time (roofline): {self.time_s * 1e3:.3f} ms",
            f"speed-up vs all-split: {self.speedup:.2f}x",
        ]
        out += [f"warning: {w}" for w in self.warnings()]
        return out


def _groups(boundaries_on: Sequence[bool]) -> list[tuple[ChainOp, ...]]:
    groups: list[list[ChainOp]] = [[FUSION_CHAIN[0]]]
    for op, split in zip(FUSION_CHAIN[1:], boundaries_on, strict=True):
        if split:
            groups.append([])
        groups[-1].append(op)
    return [tuple(g) for g in groups]


def _kernels(
    boundaries_on: Sequence[bool], elements: int, d_model: int, size: int
) -> tuple[FusedKernel, ...]:
    groups = _groups(boundaries_on)
    kernels = []
    for i, ops in enumerate(groups):
        later = {t for g in groups[i + 1 :] for op in g for t in op.reads}
        kernels.append(_kernel(ops, later, elements, d_model, size))
    return tuple(kernels)


def fusion_bench(
    tokens: int = 65536,
    d_model: int = 8192,
    dtype: str = "bf16",
    hardware: str | HardwareSpec = "h100-sxm",
    boundaries_on: Sequence[bool] = ALL_SPLIT,
) -> FusionBench:
    """The fusion bench (defaults: 65,536 tokens x d_model 8192). ``boundaries_on`` has
    one flag per boundary between consecutive ops of FUSION_CHAIN (five): True writes the
    intermediate to HBM and ends the kernel; all False fuses the chain into one kernel."""
    flags = tuple(bool(b) for b in boundaries_on)
    if len(flags) != len(FUSION_CHAIN) - 1:
        raise ValueError(
            f"boundaries_on needs {len(FUSION_CHAIN) - 1} flags (one after each of "
            f"{', '.join(op.name for op in FUSION_CHAIN[:-1])}), got {len(flags)}"
        )
    if tokens <= 0 or d_model <= 0:
        raise ValueError(f"tokens and d_model must be positive, got {tokens}, {d_model}")
    spec = get(hardware)
    size, elements = itemsize(dtype), tokens * d_model
    peak, beta = spec.vector_peak("fp32"), spec.hbm_bytes_per_s.value
    split = _kernels(ALL_SPLIT, elements, d_model, size)
    return FusionBench(
        tokens,
        d_model,
        spec_dtype(dtype),
        flags,
        _kernels(flags, elements, d_model, size),
        peak,
        beta,
        sum(k.time_s(peak, beta) for k in split),
    )


def parse_boundaries(text: str) -> tuple[bool, ...]:
    """``11111`` (all split, the default), ``00000`` (one kernel), ``fused``, ``split``, or
    one 0/1 per boundary: ``10000`` ends a kernel only after the residual add."""
    count = len(FUSION_CHAIN) - 1
    words = {"split": "1" * count, "fused": "0" * count}
    bits = words.get(text.strip().lower(), text.strip())
    if len(bits) != count or set(bits) - {"0", "1"}:
        raise ValueError(
            f"--boundaries takes {count} digits of 0/1 (1 = written to HBM), 'split' or "
            f"'fused', got {text!r}"
        )
    return tuple(bit == "1" for bit in bits)

"""The cost of one op or kernel: FLOPs (W) and compulsory bytes (Q) across the HBM boundary.

Compulsory bytes (docs/concepts/compulsory-bytes.md; Williams, Waterman & Patterson 2009):
an unqualified Q is the *compulsory* count — every input
read once, every output written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torchroof.records.tensors import TensorMeta

Unit = Literal["tensor", "vector", "sfu", "none", "network"]
"""Which ceiling an op can reach (the unit follows the op): tensor cores for matmul-class ops, the
vector units for pointwise and reductions, the SFU for transcendental-only ops, ``none`` for
pure data movement (its time is Q/beta alone), ``network`` for collectives (W = 0; their
bytes cross a link, torchroof.counters.collectives.wire_bytes; Q is the HBM side)."""


@dataclass(frozen=True, slots=True)
class Cost:
    """Work and traffic of an op; adds like tinygrad's ``Estimates``."""

    flops: int = 0  # floating-point operations, FMA = 2
    bytes_read: int = 0  # compulsory bytes read across the HBM boundary
    bytes_written: int = 0  # compulsory bytes written across the HBM boundary
    unit: Unit = "none"
    dtype: str = ""  # compute dtype that selects the peak (e.g. "bfloat16"); "" = n/a
    counted: bool = True  # False when no rule exists and only bytes were charged
    # Which tensors the bytes come from, when a rule does not read each input and write each
    # output once in full (gathers, scatters, in-place copies, synthetic kernels); empty
    # means exactly that.
    reads: tuple[tuple[TensorMeta, int], ...] = ()
    writes: tuple[tuple[TensorMeta, int], ...] = ()

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity I = W / Q in FLOP/byte (inf when Q = 0 and W > 0)."""
        if self.bytes == 0:
            return float("inf") if self.flops else 0.0
        return self.flops / self.bytes

    def __add__(self, other: Cost) -> Cost:
        # The sum keeps the unit and dtype of the larger-FLOP part: a kernel that mixes a
        # matmul with an elementwise epilogue still runs at the matmul's ceiling.
        lead = (
            self
            if (self.flops, self.unit != "none") >= (other.flops, other.unit != "none")
            else other
        )
        return Cost(
            flops=self.flops + other.flops,
            bytes_read=self.bytes_read + other.bytes_read,
            bytes_written=self.bytes_written + other.bytes_written,
            unit=lead.unit,
            dtype=lead.dtype or self.dtype or other.dtype,
            counted=self.counted and other.counted,
            reads=self.reads + other.reads,
            writes=self.writes + other.writes,
        )

    def scaled(self, factor: float) -> Cost:
        """W and Q multiplied by ``factor`` (e.g. causal masking's 1/2)."""
        return Cost(
            round(self.flops * factor),
            round(self.bytes_read * factor),
            round(self.bytes_written * factor),
            self.unit,
            self.dtype,
            self.counted,
            tuple((t, round(n * factor)) for t, n in self.reads),
            tuple((t, round(n * factor)) for t, n in self.writes),
        )


ZERO = Cost()

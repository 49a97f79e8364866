"""The fusion pass's working records: a group of ops becoming one kernel, and the storage graph."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchroof.counters import Cost, kind_of
from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.records.ops import OpRecord


@dataclass
class Group:
    """Ops that become one kernel, in the order they joined."""

    members: list[int] = field(default_factory=list)
    first_outside_read: int | None = None  # first op outside the group reading its output
    kind: str = "fusable"  # fusable | anchor | epilogue (a matmul taking followers) | loss
    # holds a reduction of a whole large tensor to a scalar (a tensorwise amax): what reads
    # the scalar and the tensor again is a second pass, another kernel (_reads_after_scalar)
    reduced_to_scalar: bool = False


class Graph:
    """Who writes and who reads each storage, in execution order (views excluded)."""

    def __init__(self, ops: Sequence[OpRecord], costs: Sequence[Cost]) -> None:
        self.readers: dict[int, list[int]] = defaultdict(list)
        self.writers: dict[int, list[int]] = defaultdict(list)
        for i, (op, cost) in enumerate(zip(ops, costs, strict=True)):
            if not (cost.flops or cost.bytes):
                continue  # a view or metadata op touches nothing
            for t in read_tensors(op):
                self.readers[t.storage].append(i)
            for t in written_tensors(op):
                self.writers[t.storage].append(i)

    def read_after(self, storage: int, index: int, group: set[int]) -> bool:
        """Is ``storage`` read after op ``index`` by an op outside ``group``?"""
        return any(j > index and j not in group for j in self.readers.get(storage, ()))

    def read_later(self, storage: int, index: int) -> bool:
        return any(j > index for j in self.readers.get(storage, ()))


def own_loop_order(op: OpRecord) -> bool:
    """A column reduction that cannot run inside a row kernel starts a kernel of its own
    (torchroof/kernels/column_reductions.py); a mix-order partial may join one (a final kernel is
    never mix-order)."""
    return kind_of(op.packet) == "column_reduction" and not op.arg("mix_order")

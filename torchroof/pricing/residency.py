"""What a step's fused kernels keep in device memory: the storages none of them writes out.

A compiled runtime's kernel keeps its intermediates in registers and shared memory, and a
forward tensor its backward rebuilds (AOTAutograd's min-cut partitioner recomputes cheap
pointwise ops instead of saving their outputs: PyTorch docs, ``torch.compile``'s
"activation checkpointing and the partitioner"; Inductor fuses the rebuild into the
backward kernel) is never stored. Both exist on the op list the trace records, so the
activations an eager step holds overstate what the compiled step holds; these are what
:func:`torchroof.report.memory.transient_peak` leaves out under the fused policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchroof.counters import kind_of
from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.kernels.fusion import FUSED_KINDS, Kernel
from torchroof.report.memory import Residency


def kernel_residency(kernels: Sequence[Kernel], roles: Mapping[int, str]) -> Residency:
    """The storages the member ops of ``kernels`` write that no kernel writes out (a
    kernel's external writes are its cost's ``writes``; a cost that lists none but writes
    bytes writes every output in full), and the storages each kernel reads beyond its
    members' inputs, at its last member. A lone op that is not fusable keeps every output
    (its rule's bytes may count less than the whole tensor); a storage any kernel writes,
    or one with a role, is kept."""
    made: set[int] = set()
    written: set[int] = set()
    late: dict[int, set[int]] = {}
    for kernel in kernels:
        members = kernel.ops
        outputs = {t.storage for op in members for t in written_tensors(op)}
        lone_anchor = len(members) == 1 and kind_of(members[0].packet) not in FUSED_KINDS
        # a cost with no tensors listed writes each output once in full (counters.cost.Cost)
        implicit = not kernel.cost.writes and kernel.cost.bytes_written > 0
        if lone_anchor or implicit:
            written.update(outputs)
            continue
        written.update(t.storage for t, _ in kernel.cost.writes)
        made.update(outputs)
        read = {t.storage for op in members for t in read_tensors(op)}
        extra = {t.storage for t, _ in kernel.cost.reads} - read
        if extra:
            late.setdefault(max(op.index for op in members), set()).update(extra)
    unwritten = frozenset(made - written - set(roles))
    return Residency(unwritten, {index: frozenset(s) for index, s in late.items()})

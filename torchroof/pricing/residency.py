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
from dataclasses import replace

from torchroof.counters import kind_of
from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.kernels.fp8_saves import fp8_divisor
from torchroof.kernels.fusion import FUSED_KINDS, Kernel
from torchroof.kernels.regather import Regather
from torchroof.records.tensors import TensorMeta
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


def regathered_residency(residency: Residency | None, regathers: Sequence[Regather]) -> Residency:
    """``residency`` (None: eager kernels, which keep every output) where each gathered
    sequence-parallel input lives again from its backward re-gather and its shard is kept
    until then (:mod:`torchroof.kernels.regather`)."""
    base = residency or Residency()
    late = {index: set(storages) for index, storages in base.late_reads.items()}
    refilled: dict[int, set[int]] = {}
    for r in regathers:
        late.setdefault(r.first_use, set()).add(r.shard)
        refilled.setdefault(r.first_use, set()).add(r.gathered)
    return replace(
        base,
        late_reads={index: frozenset(s) for index, s in late.items()},
        refilled={index: frozenset(s) for index, s in refilled.items()},
    )


def fp8_narrowed_residency(residency: Residency | None, divisors: Mapping[int, int]) -> Residency:
    """``residency`` (None: eager kernels) where the storages of ``divisors`` (storage -> how
    many times fp8 divides its bytes, :func:`fp8_divisors`) are held at fp8's size from
    their last forward use, and re-gathered at it (:mod:`torchroof.kernels.fp8_saves`)."""
    return replace(residency or Residency(), narrowed=dict(divisors))


def fp8_divisors(
    narrowed: Mapping[int, TensorMeta], regathers: Sequence[Regather]
) -> dict[int, int]:
    """Storage -> fp8's divisor of its bytes, for the inputs Transformer Engine saves in fp8
    and, where such an input is a re-gathered sequence-parallel one, its shard too (what is
    saved) besides the gathered storage (what the backward gathers again, in fp8)."""
    divisors = {storage: fp8_divisor(tensor) for storage, tensor in narrowed.items()}
    for r in regathers:
        if r.gathered in divisors:
            divisors[r.shard] = divisors[r.gathered]
    return divisors

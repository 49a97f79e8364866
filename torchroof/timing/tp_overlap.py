"""Tensor-parallel communication beside its GEMMs: which collective runs in chunks with which
kernel, when a runtime overlaps them.

Under sequence parallel, Transformer Engine's userbuffers (Megatron-LM ``--tp-comm-overlap``,
on in Megatron-Bridge's performance recipes wherever tensor parallel is) split the all-gather
before a column-parallel GEMM and the reduce-scatter after a row-parallel one into chunks and
run each chunk's transfer beside the GEMM on the chunk before it. The pair then takes about
the longer of the two, not their sum (:func:`torchroof.timing.streams.schedule`: the GEMM
starts with its all-gather and ends no sooner than it; the reduce-scatter starts with its GEMM
and ends no sooner than it). What the chunking costs (smaller GEMMs, one chunk not hidden) is
not counted: the pair is a floor.

The pairs taken: an all-gather over the tensor-parallel group (``tp`` consecutive ranks, the
mesh's innermost dimension) and the first compute kernel after it that reads its result,
when that kernel is a GEMM; a reduce-scatter over it and the last compute kernel before it
that wrote its input, when that kernel is a GEMM. A collective whose neighbour is not a GEMM
(a ``cat`` that puts a batch's tokens in place) runs as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from torchroof.counters import kind_of
from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.kernels.fusion import Kernel
from torchroof.kernels.regather import ALL_GATHER, tensor_parallel_group
from torchroof.timing.streams import COMPUTE, stream_of

REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


@dataclass(frozen=True)
class Beside:
    """How one kernel of a pipelined pair runs: from the start (not the end) of the kernel
    ``after`` on the other stream, not waiting for the end of the pair's kernels ``skip``
    (every other wait kept), and ending no sooner than the kernel ``until`` (None: no later
    than it would)."""

    after: int
    until: int | None = None
    skip: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Pipelined:
    """A step's pipelined pairs: ``pairs`` (collective <-> GEMM, both ways) and what each
    kernel of them, and each layout copy between them, runs beside (:class:`Beside`)."""

    pairs: dict[int, int] = field(default_factory=dict)
    beside: dict[int, Beside] = field(default_factory=dict)


def _gemm(kernel: Kernel) -> bool:
    return kernel.cost.unit != "network" and kind_of(kernel.lead.packet) == "matmul"


def _compute(kernel: Kernel) -> bool:
    return stream_of(kernel) == COMPUTE


LAYOUT_PACKETS = frozenset({"aten.cat", "aten.clone", "aten.copy_", "aten.add", "aten.add_"})
"""Ops of a copy torch's graph runs between a collective and its GEMM where Megatron's
sequence-first one runs none: funcol's ``cat`` of a gather's chunks (or of a scatter's), and
the sum of q, k and v's (gate and up's) input gradients, which Megatron's fused QKV (FC1)
GEMM makes at once."""


def _layout(kernel: Kernel) -> bool:
    """A kernel of layout copies only (:data:`LAYOUT_PACKETS`; views launch nothing)."""
    return _compute(kernel) and all(
        op.packet in LAYOUT_PACKETS or kind_of(op.packet) in ("view", "metadata")
        for op in kernel.ops
    )


def pipelined_pairs(kernels: Sequence[Kernel], tp: int) -> Pipelined:
    """The pairs this module's docstring names. Between a collective and its GEMM there may
    be one layout copy torch's graph has and Megatron's sequence-first one does not
    (:data:`LAYOUT_PACKETS`): it runs beside the collective too. A GEMM or a copy is in one
    pair at most (the first collective that reaches it)."""
    found = Pipelined()
    used: set[int] = set()  # every kernel of a pair, the copies between included
    for i, kernel in enumerate(kernels):
        if kernel.cost.unit != "network" or len(kernel.ops) != 1:
            continue
        op = kernel.ops[0]
        if op.name not in (ALL_GATHER, REDUCE_SCATTER) or not tensor_parallel_group(op, tp):
            continue
        if op.name == ALL_GATHER:
            chain = _readers(kernels, i, {t.storage for t in written_tensors(op)})
        else:
            chain = _writers(kernels, i, {t.storage for t in read_tensors(op)})
        if not chain or used & set(chain):
            continue
        used.update(chain)
        gemm = chain[-1]
        found.pairs[i], found.pairs[gemm] = gemm, i
        if op.name == ALL_GATHER:  # the copy and the GEMM from the gather's start
            for j in chain:
                found.beside[j] = Beside(i, i if j == gemm else None, frozenset({i}))
        else:  # the reduce-scatter from its GEMM's start, ending after its pair's last
            found.beside[i] = Beside(gemm, max(chain), frozenset(chain))
    return found


def _readers(kernels: Sequence[Kernel], i: int, made: set[int]) -> list[int]:
    """The first compute kernel after ``i`` reading ``made`` when it is a GEMM, else that
    kernel and the first GEMM after it reading what it writes; [] when neither."""
    first = _first(kernels, range(i + 1, len(kernels)), made, _reads)
    if first is None or _gemm(kernels[first]):
        return [] if first is None else [first]
    if not _layout(kernels[first]):
        return []
    written = {t.storage for op in kernels[first].ops for t in written_tensors(op)}
    then = _first(kernels, range(first + 1, len(kernels)), written, _reads)
    return [first, then] if then is not None and _gemm(kernels[then]) else []


def _writers(kernels: Sequence[Kernel], i: int, fed: set[int]) -> list[int]:
    """The last compute kernel before ``i`` writing ``fed`` when it is a GEMM, else that
    kernel and the last GEMM before it writing what it reads; [] when neither (nearest
    first)."""
    last = _first(kernels, range(i - 1, -1, -1), fed, _writes)
    if last is None or _gemm(kernels[last]):
        return [] if last is None else [last]
    if not _layout(kernels[last]):
        return []
    read = {t.storage for op in kernels[last].ops for t in read_tensors(op)}
    # the last writer before the collective, not only before the copy: a fused copy can be
    # issued ahead of the last GEMM it sums
    earlier = (j for j in range(i - 1, -1, -1) if j != last)
    then = _first(kernels, earlier, read, _writes)
    return [last, then] if then is not None and _gemm(kernels[then]) else []


def _first(
    kernels: Sequence[Kernel],
    order: Iterable[int],
    storages: set[int],
    touches: Callable[[Kernel, set[int]], bool],
) -> int | None:
    return next((j for j in order if _compute(kernels[j]) and touches(kernels[j], storages)), None)


def _reads(kernel: Kernel, storages: set[int]) -> bool:
    return any(t.storage in storages for op in kernel.ops for t in read_tensors(op))


def _writes(kernel: Kernel, storages: set[int]) -> bool:
    return any(t.storage in storages for op in kernel.ops for t in written_tensors(op))


def pipelined_line(pairs: dict[int, int], kernels: Sequence[Kernel]) -> str:
    """The estimate's statement of the pairs run side by side (one line)."""
    collectives = [i for i in pairs if kernels[i].cost.unit == "network"]
    gathers = sum(kernels[i].ops[0].name == ALL_GATHER for i in collectives)
    return (
        f"tensor-parallel communication beside its GEMMs: {gathers} all-gathers and "
        f"{len(collectives) - gathers} reduce-scatters run in chunks beside the GEMM that "
        "reads or writes them (Transformer Engine's userbuffers); each pair takes the longer "
        "of the two"
    )

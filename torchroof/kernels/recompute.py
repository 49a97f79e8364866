"""Save versus recompute under a compiler: which saved tensors a fused backward rebuilds.

torch.compile's min-cut partitioner saves for backward the tensors that are expensive to
rebuild (matmul outputs, reductions, inputs) and recomputes cheap pointwise work inside the
backward kernels that need it, so a saved ``silu(gate)`` or an fp32 upcast of a bf16
activation is never written to HBM (it bans recomputing reductions, so a norm's row
statistics are saved). Eager autograd instead saves every tensor its backward formulas
name. A kernel boundary is a memory boundary (docs/concepts/fusion.md); a tensor the backward can
rebuild from what it already reads need not cross it.

This module answers, for a trace, which tensors are *recomputable* and from what *sources*
(the saved tensors a kernel would read instead): forward tensors a fused backward kernel
rebuilds, and any pointwise tensor a consumer kernel inlines (a column reduction inlines
its producer's loop body, so the product it sums is never written). Softmax and log-softmax rebuild
from their input and two fp32 row statistics (max and log-sum-exp), which is how Inductor
splits them; the statistics are written by the forward kernel in place of the full output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torchroof.counters import Cost, OpKind, kind_of
from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta

ROW_STATISTICS = 2  # max and log-sum-exp, fp32, one each per row
# torch._inductor.config: _realize_opcount_threshold_default, realize_reads_threshold
REALIZE_OPCOUNT_THRESHOLD = 30
REALIZE_READS_THRESHOLD = 4

# Kinds (counters/registry.py OP_KINDS) whose output a consumer kernel can rebuild: cheap
# elementwise work from its inputs; a softmax from its input and row statistics; a norm
# over the last dimension from x, w, b and the mean / rstd it writes.
_REBUILT_FROM_INPUTS: frozenset[OpKind] = frozenset({"pointwise", "cast"})


@dataclass(frozen=True)
class Recomputable:
    """A tensor a consumer kernel can rebuild instead of reading it."""

    sources: tuple[TensorMeta, ...]  # what is read instead
    cheap: bool = True  # the rebuild reads no more bulk bytes than the tensor itself
    flops_per_element: float = 0.0  # W of the rebuilt chain per element of the tensor

    def large(self) -> bool:
        """Would Inductor realize this buffer rather than inline it into a second user?
        (``TensorBox.should_realize_on_reuse``: more than 30 ops in its loop body or more
        than 4 buffers read; FLOPs per element stand in for its op count.)"""
        return (
            self.flops_per_element > REALIZE_OPCOUNT_THRESHOLD
            or len(self.sources) > REALIZE_READS_THRESHOLD
        )


def statistics_producer(t: TensorMeta) -> int | None:
    """The op index of the softmax whose row statistics ``t`` is, or None."""
    return -t.storage - 1 if t.storage < 0 else None


def _row_statistics(op: OpRecord, index: int) -> TensorMeta:
    """Two fp32 values per row of a softmax's output, as a storage of its own (a negative
    id that names the op: ``-(index + 1)``)."""
    out = op.outputs[0]
    dim = op.arg("dim", -1) % max(len(out.shape), 1)
    rows = tuple(s for d, s in enumerate(out.shape) if d != dim) + (ROW_STATISTICS,)
    stride, running = [], 1
    for size in reversed(rows):
        stride.append(running)
        running *= size
    return TensorMeta(rows, tuple(reversed(stride)), "float32", -(index + 1))


def recomputable_tensors(
    ops: Sequence[OpRecord], costs: Sequence[Cost], roles: Mapping[int, str]
) -> dict[int, Recomputable]:
    """storage -> how to rebuild it, for every output of a pointwise op (through chains of
    cheap pointwise ops), a softmax or a norm; tensors with a role (weights, KV cache) and
    outputs of matmuls, gathers and reductions are sources, never rebuilt. ``cheap`` when
    the rebuild reads no more bulk bytes than the tensor itself: what the partitioner
    recomputes in backward rather than saving (a consumer kernel that inlines its pointwise
    producer, as a column reduction does, rebuilds whatever it costs)."""
    found: dict[int, Recomputable] = {}
    for i, (op, cost) in enumerate(zip(ops, costs, strict=True)):
        if not (cost.flops or cost.bytes):
            continue
        kind = kind_of(op.packet)
        outputs = written_tensors(op)
        inputs = read_tensors(op)
        statistics_out: list[TensorMeta] = []
        if kind == "norm":  # y rebuilt from x, w, b and mean / rstd
            outputs, statistics_out = outputs[:1], outputs[1:]
        recomputable = (
            cost.counted
            and (kind in _REBUILT_FROM_INPUTS or kind == "softmax" or statistics_out)
            and len(outputs) == 1
            and outputs[0].storage not in roles
            and all(t.storage != outputs[0].storage for t in inputs)  # not in place
        )
        if not recomputable:
            for t in outputs:
                found.pop(t.storage, None)
            continue
        sources: dict[tuple, TensorMeta] = {}
        chain = cost.flops / max(outputs[0].numel, 1)
        for t in [*inputs, *statistics_out]:
            rebuilt = found.get(t.storage)
            if rebuilt and rebuilt.cheap:
                chain += rebuilt.flops_per_element
            for s in rebuilt.sources if rebuilt and rebuilt.cheap else (t,):
                sources.setdefault((s.storage, s.shape, s.stride, s.offset), s)
        if kind == "softmax":
            statistics = _row_statistics(op, i)
            sources[(statistics.storage,)] = statistics
        cheap = _bulk_bytes(sources.values(), outputs[0]) <= outputs[0].nbytes
        found[outputs[0].storage] = Recomputable(tuple(sources.values()), cheap, chain)
    return found


def _bulk_bytes(sources: Iterable[TensorMeta], rebuilt: TensorMeta) -> int:
    """Bytes a rebuild reads from sources as large as the tensor it rebuilds (per-row
    statistics and broadcast weights are small beside it). A residual stream, whose sources
    are every earlier block's output, is saved, never rebuilt."""
    return sum(s.nbytes for s in sources if s.unique_numel * BULK_RATIO > rebuilt.unique_numel)


BULK_RATIO = 8  # a source under 1/8 of the rebuilt tensor's elements is not bulk

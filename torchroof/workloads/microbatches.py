"""The micro-batches of a training step traced once each kind: the first two and a third
run, the rest copies of the second.

Under gradient accumulation with mixed precision (gradients synchronised every micro-batch,
as torchtitan's trainer leaves it; no ZeRO-1/2 holding parameters whole between them),
every micro-batch runs the same program: forward, loss, backward, its gradients added into
the fp32 ones the optimizer reads, the parameters' gradients dropped. Only the first
differs: it meets and labels what the later ones reuse (the weights; FSDP2's unsharded
parameters, allocated the first time each is gathered). So the first three run on meta;
the third is held to the second, op for op (names, arguments, phases, modules, tensor
layouts, and each storage either the same one as the second's or one each met first, met in
the same places), and only then is each later micro-batch recorded as the second's ops with
fresh storages for those it met first (:func:`torchroof.capture.replay.append_copies`): the
trace a run of every micro-batch records, without running them. Where the third differs,
every micro-batch runs, and the step's note says why. What the check cannot see: a tensor
made before the step that no op touches until the second micro-batch, read by every other
micro-batch in turn with another such (a pool of two buffers): the copies would read fresh
storages where the step reads the pool's. No training step here does that; its weights and
optimizer state are met before the second micro-batch begins. ``full_trace`` runs every
micro-batch, except where it was set only to run every layer of a step whose copied layer
could not be copied (:func:`layers_run_whole`).

Under ZeRO-1 and ZeRO-2 (DeepSpeed's stages 1 and 2, Megatron's distributed optimizer:
parameters whole on every data rank) the parameters are gathered in the first micro-batch
and kept until the last one's backward frees them, so the last differs too: the middle
ones run alike (:func:`alike_middle_microbatches`). The first three run, the third is held
to the second, the fourth to the one before the last are copies of the second, and the
last runs; it is held to read and write no storage a middle one made (a copy's storage
would stand for it), which ZeRO's last micro-batch does not.

A search prices a layout from copies of its model with 2 and then 3 alike decoder layers
(:mod:`torchroof.planning.shallow`): inside :func:`held_once`, where the 2-layer copy's
third micro-batch matched its second, the 3-layer copy runs only its first two (and the
last, under ZeRO) and copies the second: one more of the same layers adds the same ops
to each micro-batch. The tests hold a 3-layer step so copied to the one that runs every
micro-batch, op for op.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torchroof.capture.mode import Capture
from torchroof.capture.replay import append_copies
from torchroof.config.errors import WorkloadError
from torchroof.records.assumptions import Assumption
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace

if TYPE_CHECKING:
    from torchroof.config import Workload

TRACED = 3
"""Micro-batches run before the rest are copies: the first (what later ones reuse is met
there), the second (the one copied) and the third (held to the second; not run where a
step before it was trusted for it, :func:`held_once`)."""

_LAYERS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchroof_full_trace_for_layers_only", default=False
)


@dataclass
class HeldOnce:
    """The workload of the step traced inside :func:`held_once` whose third micro-batch
    was held to its second and found alike (None before one is)."""

    matched: Workload | None = None

    def trusts(self, workload: Workload) -> bool:
        """Whether a step of ``workload`` may copy its micro-batches without a third: one
        of the same workload matched (a copy of the same model at another depth)."""
        return self.matched == workload


_HELD: contextvars.ContextVar[HeldOnce | None] = contextvars.ContextVar(
    "torchroof_microbatches_held_once", default=None
)


@contextlib.contextmanager
def held_once() -> Iterator[HeldOnce]:
    """Inside, once one step's third micro-batch matched its second, each later step of
    the same workload that copies micro-batches copies them from its second without
    running a third (a step whose
    micro-batches each run anyway, three of them or four under ZeRO, still holds its third
    to its second, for the next step's sake); a step counts once all its micro-batches
    ran. For the copies of one model with 2 and then 3 of the same decoder layers
    (:mod:`torchroof.planning.shallow`): one more of the same layers adds the same ops to
    each micro-batch. The deeper copy may copy layers in other places than the shallower
    one (a layer is copied from the one before it, across micro-batches too), which holds
    as long as a copied layer is the layer run, op for op, as the tests of copied layers
    hold it."""
    held = HeldOnce()
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


@contextlib.contextmanager
def layers_run_whole() -> Iterator[None]:
    """Inside, a step traced with ``full_trace`` still copies its micro-batches: the flag
    was set to run every layer (a copied layer's backward could not be copied), not to
    run every micro-batch."""
    token = _LAYERS_ONLY.set(True)
    try:
        yield
    finally:
        _LAYERS_ONLY.reset(token)


def alike_microbatches(workload: Workload) -> bool:
    """Whether every micro-batch after the first of ``workload``'s step runs the same
    program: mixed precision (each micro-batch's gradients join the fp32 ones and the
    parameters' are dropped: nothing accumulates on them), gradients synchronised every
    micro-batch, and no ZeRO-1/2 (which keeps parameters gathered from the first
    micro-batch to the last)."""
    return _accumulated_alike(workload) and workload.zero not in (1, 2)


def alike_middle_microbatches(workload: Workload) -> bool:
    """Whether every micro-batch but the first and the last of ``workload``'s step runs the
    same program: :func:`alike_microbatches` but under ZeRO-1/2, whose last micro-batch
    frees the parameters gathered in the first."""
    return _accumulated_alike(workload) and workload.zero in (1, 2)


def _accumulated_alike(workload: Workload) -> bool:
    """A training step in mixed precision whose gradients are synchronised every
    micro-batch: each micro-batch leaves the same state for the next."""
    return workload.trains and workload.precision == "mixed" and not workload.defer_gradient_sync


@dataclass(frozen=True)
class _Span:
    """What one micro-batch recorded: ops ``start`` to ``end``, the storages it met first
    (:func:`_made`), its op-budget count and the bytes it added to each role."""

    start: int
    end: int
    own: frozenset[int]
    op_count: int
    role_bytes: Counter[str]


def _made(ops: Sequence[OpRecord], first_storage: int) -> frozenset[int]:
    """The storages of ``ops`` met no earlier than id ``first_storage``: the micro-batch's
    own (its activations, the tensors transformers makes each forward), which a copy
    replaces with fresh ones."""
    return frozenset(
        t.storage for op in ops for t in (*op.inputs, *op.outputs) if t.storage >= first_storage
    )


def run_microbatches(capture: Capture, workload: Workload, run: Callable[[int], None]) -> str:
    """Every micro-batch of ``workload`` in order, micro-batch ``k`` by ``run(k)``; from
    the fourth on, copies of the second where the step allows it
    (:func:`alike_microbatches`; :func:`alike_middle_microbatches` to the one before the
    last, which runs) and the third matched the second, or from the third on where a step
    of the same workload matched before it (:func:`held_once`). Returns the line the
    step's facts keep ("" where each ran and none was asked to be copied)."""
    total = workload.microbatches
    every = workload.full_trace and not _LAYERS_ONLY.get()
    last = alike_middle_microbatches(workload)  # the last runs: not a copy
    held = _HELD.get()
    trusted = held is not None and held.trusts(workload)
    traced = TRACED - 1 if trusted else TRACED
    ran = traced + 1 if last else traced
    alike = alike_microbatches(workload) or last
    if every or total <= ran or not alike:
        spans: list[_Span] = []
        if held is not None and not trusted and alike and not every and total == ran:
            # each runs, the third (and the last) still held for the next step's sake
            spans = [_recorded(capture, run, micro) for micro in range(total)]
        for micro in range(len(spans), total):
            run(micro)
        if spans and held is not None:  # set once the step's micro-batches all ran
            middle = spans[1:TRACED]
            alike_last = not last or not _touches_middle(capture.trace, spans[-1], middle)
            if alike_last and not _difference(capture.trace, spans[1], spans[2]):
                held.matched = workload
        return ""
    spans = [_recorded(capture, run, micro) for micro in range(traced)]
    if not trusted:
        why = _difference(capture.trace, spans[1], spans[2])
        if why:
            for micro in range(TRACED, total):
                run(micro)
            return f"{total} micro-batches, each traced: the third differs from the second ({why})"
    copies = total - ran
    for _ in range(copies):
        _copy(capture, spans[1])
    note = f"{total} micro-batches: {traced} traced, {copies} copied"
    if last:
        _check_last(capture.trace, _recorded(capture, run, total - 1), spans[1:])
        note = f"{total} micro-batches: {traced} and the last traced, {copies} copied"
    if held is not None:  # set once the step's micro-batches all ran
        held.matched = workload
    return note


def _check_last(trace: Trace, last: _Span, middle_spans: Sequence[_Span]) -> None:
    """A WorkloadError where the last micro-batch reads or writes a storage a middle one
    traced (the second, and the third where it ran) made: in the step it would be the one
    before the last's, which a copy stands for."""
    touching = _touches_middle(trace, last, middle_spans)
    if touching:
        raise WorkloadError(
            f"the last micro-batch's {touching} touches a tensor a middle micro-batch "
            "made, so the middle ones cannot be copied: trace with full_trace=True"
        )


def _touches_middle(trace: Trace, last: _Span, middle_spans: Sequence[_Span]) -> str:
    """The first op of the last micro-batch that reads or writes a storage one of
    ``middle_spans`` made ("" where none does)."""
    middle = frozenset[int]().union(*(span.own for span in middle_spans))
    for op in trace.ops[last.start : last.end]:
        if any(t.storage in middle for t in (*op.inputs, *op.outputs)):
            return op.name
    return ""


def _recorded(capture: Capture, run: Callable[[int], None], micro: int) -> _Span:
    trace, storage = capture.trace, capture.storage
    start, first, ops_before = len(trace.ops), storage.next_id, capture.op_count
    before = Counter(trace.role_bytes)
    run(micro)
    added = Counter(trace.role_bytes)
    added.subtract(before)
    own = _made(trace.ops[start:], first)
    return _Span(start, len(trace.ops), own, capture.op_count - ops_before, added)


def _difference(trace: Trace, second: _Span, third: _Span) -> str:
    """Why the third micro-batch is not the second's ops on storages of its own ("" when
    it is): the first op or storage that differs, or the roles, bytes or assumptions."""
    if third.end - third.start != second.end - second.start:
        return f"{third.end - third.start:,} ops, not {second.end - second.start:,}"
    if +third.role_bytes != +second.role_bytes:
        return "it holds other bytes"
    mapping: dict[int, int] = {}
    for i in range(second.end - second.start):
        was, now = trace.ops[second.start + i], trace.ops[third.start + i]
        why = _op_difference(was, now, second, third, mapping)
        if why:
            return f"op {i} of the micro-batch, {now.name}: {why}"
    if len(set(mapping.values())) != len(mapping):
        return "two of its storages are one in the second"
    for old, new in mapping.items():
        if trace.roles.get(old) != trace.roles.get(new):
            return "a storage holds another role"
        if trace.parameters.get(old) != trace.parameters.get(new):
            return "a storage is another parameter"
    if _assumptions(trace, second) != _assumptions(trace, third):
        return "capture assumed other answers"
    return ""


def _op_difference(
    was: OpRecord, now: OpRecord, second: _Span, third: _Span, mapping: dict[int, int]
) -> str:
    """How ``now`` (the third's) differs from ``was`` (the second's) as a copy would
    record it ("" when alike), its storages' correspondence added to ``mapping``."""
    if (now.name, now.phase, now.module, now.synthetic) != (
        was.name,
        was.phase,
        was.module,
        was.synthetic,
    ):
        return "another op, phase or module"
    if now.args != was.args or len(now.inputs) != len(was.inputs):
        return "other arguments"
    if len(now.outputs) != len(was.outputs):
        return "other outputs"
    for x, y in zip((*now.inputs, *now.outputs), (*was.inputs, *was.outputs), strict=True):
        if (x.shape, x.stride, x.dtype, x.offset) != (y.shape, y.stride, y.dtype, y.offset):
            return "a tensor of another layout"
        if y.storage not in second.own:  # held from before: the same one
            if x.storage != y.storage:
                return "it reads another storage from before"
        elif x.storage not in third.own or mapping.setdefault(y.storage, x.storage) != (x.storage):
            return "a storage met in other places"
    return ""


def _assumptions(trace: Trace, span: _Span) -> list[Assumption]:
    """What capture assumed in ``span``, each counted from the span's first op."""
    return [
        replace(a, op_index=a.op_index - span.start)
        for a in trace.assumptions
        if span.start <= a.op_index < span.end
    ]


def _copy(capture: Capture, span: _Span) -> None:
    """The ops of ``span`` recorded again, each storage it made given a fresh one (with
    its role and parameter name), the bytes it added to each role added again."""
    trace = capture.trace
    ops = trace.ops[span.start : span.end]
    mapping = {sid: capture.storage.fresh_id() for sid in sorted(span.own)}
    append_copies(capture, ops, _assumptions(trace, span), mapping, "", "", span.op_count)
    for old, new in mapping.items():
        if old in trace.roles:
            trace.roles[new] = trace.roles[old]
        if old in trace.parameters:
            trace.parameters[new] = trace.parameters[old]
    for role, size in span.role_bytes.items():
        if size:
            trace.role_bytes[role] = trace.role_bytes.get(role, 0) + size

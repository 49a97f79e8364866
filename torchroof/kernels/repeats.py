"""Kernels of repeated layers built once.

An inference step whose decoder layers were copied from a traced representative
(:mod:`torchroof.capture.replay`, :class:`~torchroof.records.trace.CopiedSpan`) holds a run
of alike periods (one layer, or one round of an interleave such as Gemma-3's five
sliding-window layers and one global one). Fusion crosses a layer's boundary (a residual
add joins the next layer's norm), so each period's kernels are the same but for the
storages and module paths of their ops. This stage groups two short versions of the step,
with two and with three periods of the run (and everything before and after it), and
checks that the three-period version's kernels are exactly the two-period version's with
its first period's kernels repeated once more: every kernel's member ops, W, Q, the
tensors it reads and writes, its flags, and the role of every storage it moves. Only then
are the whole step's kernels made from the short version with that period repeated once
per period; any difference, or a run too short to gain from it, and the whole step is
grouped op by op (:func:`torchroof.kernels.fusion.build_kernels`), as ``full_trace=True``
always is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from torchroof.config import PricingOptions
from torchroof.counters import Cost
from torchroof.kernels.fusion import Coverage, Kernel, build_kernels
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, remapped
from torchroof.records.trace import CopiedSpan

MIN_PERIODS = 5
"""Fewest periods a run needs before its kernels are built once: the two short versions
hold five periods between them, so a shorter run is grouped whole."""


@dataclass(frozen=True)
class RepeatedRun:
    """``periods`` alike periods of ``length`` ops each, the first starting at op ``start``."""

    start: int
    length: int
    periods: int

    @property
    def end(self) -> int:
        return self.start + self.length * self.periods

    def period(self, t: int) -> range:
        return range(self.start + t * self.length, self.start + (t + 1) * self.length)


def repeated_run(ops: Sequence[OpRecord], copies: Sequence[CopiedSpan]) -> RepeatedRun | None:
    """The longest run of back-to-back copied spans whose sources repeat with the shortest
    period (one span: a stack of alike layers; several: an interleave), of at least
    :data:`MIN_PERIODS` periods; None when there is none."""
    spans = sorted(copies, key=lambda span: span.first)
    best: RepeatedRun | None = None
    i = 0
    while i < len(spans):
        j = i
        while j + 1 < len(spans) and spans[j + 1].first == spans[j].first + spans[j].count:
            j += 1
        run = _periodic(spans[i : j + 1])
        if run is not None and run.end <= len(ops):
            if best is None or run.length * run.periods > best.length * best.periods:
                best = run
        i = j + 1
    return best


def _periodic(chain: Sequence[CopiedSpan]) -> RepeatedRun | None:
    n = len(chain)
    for u in range(1, n // MIN_PERIODS + 1):
        if all(
            (chain[t].source, chain[t].count) == (chain[t + u].source, chain[t + u].count)
            for t in range(n - u)
        ):
            return RepeatedRun(chain[0].first, sum(s.count for s in chain[:u]), n // u)
    return None


def repeated_kernels(
    ops: Sequence[OpRecord],
    copies: Sequence[CopiedSpan],
    options: PricingOptions,
    roles: Mapping[int, str],
) -> tuple[list[Kernel], Coverage] | None:
    """The kernels :func:`~torchroof.kernels.fusion.build_kernels` makes of ``ops``, built
    on two short versions of the step and checked alike (the module docstring); None where
    the step has no run to build once or the check fails (then build the whole step)."""
    built = repeated_kernel_copies(ops, copies, options, roles)
    return (built.kernels, built.coverage) if built is not None else None


@dataclass(frozen=True)
class RepeatedKernels:
    """A step's kernels built once per period, and for each kernel the index of the one
    it is a copy of (its own index where it is not a copy): copies are timed alike."""

    kernels: list[Kernel]
    coverage: Coverage
    sources: tuple[int, ...]


def repeated_kernel_copies(
    ops: Sequence[OpRecord],
    copies: Sequence[CopiedSpan],
    options: PricingOptions,
    roles: Mapping[int, str],
) -> RepeatedKernels | None:
    """:func:`repeated_kernels`, with which kernel each one copies."""
    if any(op.phase != "forward" for op in ops):
        return None  # a backward reads its forward's saved tensors across every layer
    run = repeated_run(ops, copies)
    touched = _periods_alike(ops, run) if run is not None else None
    if run is None or touched is None:
        return None
    two_periods, three_periods = (_short_step(ops, run, k, touched) for k in (2, 3))
    if two_periods is None or three_periods is None:
        return None
    two, cover_two = build_kernels(two_periods, options, roles)
    three, cover_three = build_kernels(three_periods, options, roles)
    extended = _extended(two, run, 2, 3, two_periods, three_periods, roles)
    if extended is None or [k for k, _ in extended] != three:
        return None
    every = _extended(two, run, 2, run.periods, two_periods, ops, roles)
    if every is None:
        return None
    per_period = Counter(cover_three.uncounted)
    per_period.subtract(cover_two.uncounted)
    uncounted = Counter(cover_two.uncounted)
    for name, n in per_period.items():
        uncounted[name] += n * (run.periods - 2)
    coverage = Coverage(len(ops), {k: n for k, n in uncounted.items() if n})
    first: dict[int, int] = {}  # a kernel of the short step -> its first copy's place
    sources = tuple(first.setdefault(source, i) for i, (_, source) in enumerate(every))
    return RepeatedKernels([k for k, _ in every], coverage, sources)


def _tensors(op: OpRecord) -> tuple[TensorMeta, ...]:
    return (*op.inputs, *op.outputs)


def _periods_alike(ops: Sequence[OpRecord], run: RepeatedRun) -> set[int] | None:
    """The storages the run touches, if every period is the first's ops (names, arguments,
    phases, tensor layouts) and relates to the period before it as the second relates to
    the first: each storage it touches is one the period before touched (at the same first
    place), one of its own, the same one from before the run, or one never seen, and none
    is one only an earlier period touched or first touched (a storage made two periods
    back and read by each period since); None otherwise."""
    first = [ops[i] for i in run.period(0)]
    before_run: set[int] = {t.storage for op in ops[: run.start] for t in _tensors(op)}
    touched: set[int] = set()  # by the periods before the previous one, then by all
    previous = _first_places(ops, run.period(0))
    # storage -> the period that first touched it (one from before the run: none)
    born = {sid: 0 for sid in previous if sid not in before_run}
    expected: list[object] | None = None
    for t in range(1, run.periods):
        # a tensor's place: 2p for the previous period's first place p, 2p + 1 for this
        # period's own, -1 for a new storage, (sid,) for one from before the run
        labels: list[object] = []
        own: dict[int, int] = {}
        for i, template in zip(run.period(t), first, strict=True):
            op = ops[i]
            if op.index != i or op.name != template.name or op.phase != template.phase:
                return None
            if op.args != template.args or len(op.inputs) != len(template.inputs):
                return None
            if len(op.outputs) != len(template.outputs):
                return None
            for x, y in zip(_tensors(op), _tensors(template), strict=True):
                if (x.shape, x.stride, x.dtype, x.offset) != (y.shape, y.stride, y.dtype, y.offset):
                    return None
                sid = x.storage
                if sid in own:
                    labels.append(2 * own[sid] + 1)
                elif sid in previous and born.get(sid, t - 1) == t - 1:
                    labels.append(2 * previous[sid])
                    own[sid] = len(labels) - 1
                elif sid in before_run:
                    labels.append((sid,))
                    own[sid] = len(labels) - 1
                elif sid in touched or sid in previous:
                    return None  # reaches back past the period before it
                else:
                    labels.append(-1)
                    own[sid] = len(labels) - 1
                    born[sid] = t
        if expected is None:
            expected = labels
        elif labels != expected:
            return None
        touched.update(previous)
        previous = own
    touched.update(previous)
    return touched


def _first_places(ops: Sequence[OpRecord], span: range) -> dict[int, int]:
    """Each storage the span's ops touch -> where it is first touched (counting tensors)."""
    places: dict[int, int] = {}
    for position, sid in enumerate(t.storage for i in span for t in _tensors(ops[i])):
        places.setdefault(sid, position)
    return places


def _short_step(
    ops: Sequence[OpRecord], run: RepeatedRun, k: int, touched: set[int]
) -> list[OpRecord] | None:
    """The step with only the run's first ``k`` periods: the ops after the run read the
    ``k``-th period's storages where they read the last period's (by position), renumbered
    to follow it; None when they read anything else a dropped period touched."""
    kept_end = run.start + k * run.length
    last = [ops[i] for i in run.period(run.periods - 1)]
    stand_in = [ops[i] for i in run.period(k - 1)]
    mapping: dict[int, int] = {}
    for a, b in zip(last, stand_in, strict=True):
        for x, y in zip(_tensors(a), _tensors(b), strict=True):
            if mapping.setdefault(x.storage, y.storage) != y.storage:
                return None
    kept = {t.storage for op in ops[:kept_end] for t in _tensors(op)}
    shift = run.end - kept_end
    short = list(ops[:kept_end])
    for op in ops[run.end :]:
        for t in _tensors(op):
            if t.storage in touched and t.storage not in kept and t.storage not in mapping:
                return None
        short.append(
            OpRecord(
                op.index - shift,
                op.name,
                remapped(op.inputs, mapping),
                remapped(op.outputs, mapping),
                op.args,
                op.module,
                op.phase,
                op.synthetic,
            )
        )
    return short


def _shifts(kernel: Kernel, run: RepeatedRun, extra: int) -> Iterator[int]:
    """How far each copy of ``kernel`` moves in a step with ``extra`` ops more: kernels
    that start before the first period stay, those that start in it are repeated once per
    added period, the rest follow the run's end."""
    first = kernel.ops[0].index
    if first < run.start:
        yield 0
    elif first < run.start + run.length:
        yield from range(0, extra + run.length, run.length)
    else:
        yield extra


def _extended(
    kernels: Sequence[Kernel] | None,
    run: RepeatedRun,
    k: int,
    periods: int,
    source: Sequence[OpRecord],
    target: Sequence[OpRecord],
    roles: Mapping[int, str],
) -> list[tuple[Kernel, int]] | None:
    """``kernels`` of the ``k``-period step ``source`` as the ``periods``-period step
    ``target`` has them, each with the index of the kernel of ``kernels`` it was moved
    from, if nothing but their position differs: members moved by whole periods, their
    tensors' storages followed by position (a role kept); None when a member is not an op
    of the step or a storage cannot be followed."""
    if kernels is None:
        return None
    extra = (periods - k) * run.length
    out: list[tuple[Kernel, int]] = []
    for n, kernel in enumerate(kernels):
        if any(op.index >= len(source) or source[op.index] is not op for op in kernel.ops):
            return None  # an op the grouping made (a split column reduction)
        for shift in _shifts(kernel, run, extra):
            moved = _moved(kernel, shift, target, roles)
            if moved is None:
                return None
            out.append((moved, n))
    out.sort(key=lambda pair: pair[0].ops[0].index)
    return out


def _moved(
    kernel: Kernel, shift: int, target: Sequence[OpRecord], roles: Mapping[int, str]
) -> Kernel | None:
    members = tuple(target[op.index + shift] for op in kernel.ops)
    if all(a is b for a, b in zip(kernel.ops, members, strict=True)):
        return kernel
    mapping: dict[int, int] = {}
    for a, b in zip(kernel.ops, members, strict=True):
        if a.name != b.name or (len(a.inputs), len(a.outputs)) != (len(b.inputs), len(b.outputs)):
            return None
        for x, y in zip(_tensors(a), _tensors(b), strict=True):
            if mapping.setdefault(x.storage, y.storage) != y.storage:
                return None
            if roles.get(x.storage) != roles.get(y.storage):
                return None
    cost = kernel.cost
    reads = _followed(cost.reads, mapping)
    writes = _followed(cost.writes, mapping)
    if reads is None or writes is None:
        return None
    moved = Cost(
        cost.flops,
        cost.bytes_read,
        cost.bytes_written,
        cost.unit,
        cost.dtype,
        cost.counted,
        reads=reads,
        writes=writes,
    )
    return Kernel(members, moved, kernel.flags)


def _followed(
    moved: tuple[tuple[TensorMeta, int], ...], mapping: Mapping[int, int]
) -> tuple[tuple[TensorMeta, int], ...] | None:
    out = []
    for t, n in moved:
        sid = mapping.get(t.storage)
        if sid is None:
            return None
        out.append((TensorMeta(t.shape, t.stride, t.dtype, sid, t.offset), n))
    return tuple(out)

"""A trace recorded once with its sizes as symbols, and the concrete trace it is at any point.

:class:`SymbolicTrace` holds a step traced with ``batch``, ``seq`` or ``context`` as symbols
(:mod:`torchroof.capture.symbolic`): its ops' sizes are :class:`~torchroof.records.dims.Dim`
s, and ``decisions`` are every comparison the model, torch and the capture took on them.
:meth:`SymbolicTrace.at` gives the trace at other numbers by putting them into the
polynomials, when every decision comes out as it was taken there (:meth:`holds`); such a
point runs the same program, so the trace is the one tracing it afresh records, op for op.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torchroof.records.dims import Dim, DimFloat, follow, has_dims
from torchroof.records.expressions import Decision, compile_check, compile_values, evaluate
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta
from torchroof.records.trace import Trace


@dataclass
class SymbolicTrace:
    """A trace whose sizes follow ``axes`` (each symbol and the number it was traced at)."""

    trace: Trace
    axes: dict[str, int]
    decisions: tuple[Decision, ...]
    # (a second point, its trace traced afresh): where the symbolic trace was checked
    checked: tuple[dict[str, int], Trace] | None = field(default=None, repr=False, compare=False)
    _check: Any = field(default=None, repr=False, compare=False)
    _views: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check = compile_check(self.decisions, self.axes)
        self._views = _ViewsApart(self.trace, self.axes)

    def holds(self, numbers: Mapping[str, int]) -> bool:
        """Does every decision come out at ``numbers`` (one per axis) as it was taken?"""
        return bool(self._check(**{name: numbers[name] for name in self.axes}))

    def views_apart(self, numbers: Mapping[str, int]) -> bool:
        """Do the views of each storage that differ in the trace differ at ``numbers``
        too? Work done on the sized trace keys tensors by their layout (a tensor read
        twice is read once): two views apart there must not be one view at the point."""
        return self._views.holds({name: numbers[name] for name in self.axes})

    def failed(self, numbers: Mapping[str, int]) -> list[Decision]:
        """The decisions that come out otherwise at ``numbers`` (for the message)."""
        return [d for d in self.decisions if not d.at(numbers)]

    def anchored(self, numbers: Mapping[str, int]) -> SymbolicTrace:
        """The same symbolic trace with every size's traced value that of ``numbers``
        (where it :meth:`holds`): what is decided on it afterwards is decided there."""
        moved = _mapped(self.trace, Values(numbers, anchored=True))
        named = {name: numbers[name] for name in self.axes}
        return SymbolicTrace(moved, named, self.decisions, self.checked)

    def at(self, numbers: Mapping[str, int]) -> Trace:
        """The trace at ``numbers`` (which must hold: :meth:`holds`); its facts are the
        traced ones with their sizes evaluated (the caller sets what the workload says)."""
        return _mapped(self.trace, Values(numbers))


def _mapped(trace: Trace, values: Values) -> Trace:
    """``trace`` with every size through ``values`` (numbers, or sizes anchored there)."""
    facts = replace(
        trace.facts,
        kv_cache_tokens=values.of(trace.facts.kv_cache_tokens),
        tokens=values.of(trace.facts.tokens),
    )
    return Trace(
        ops=[op_at(op, values) for op in trace.ops],
        assumptions=list(trace.assumptions),
        parameters=dict(trace.parameters),
        roles=dict(trace.roles),
        role_bytes={k: values.of(v) for k, v in trace.role_bytes.items()},
        facts=facts,
        copies=list(trace.copies),
    )


NEARBY_STEPS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
"""How far from a point :func:`nearby` looks for another, on every axis at once and on each
alone, up then down."""


def nearby(numbers: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Points near ``numbers`` (every number at least 1), nearest first: where a symbolic
    trace or plan is checked against working a second point out afresh."""
    names = list(numbers)
    for step in (*NEARBY_STEPS, *(-s for s in NEARBY_STEPS)):
        moves = [names] + ([[name] for name in names] if len(names) > 1 else [])
        for moved in moves:
            point = {n: numbers[n] + (step if n in moved else 0) for n in names}
            if min(point.values()) >= 1:
                yield point


class _ViewsApart:
    """The trace's storages viewed in several layouts, at least one of them sized, each
    kind of group once (a copied layer's storages repeat its representative's): a point
    keeps them apart when no two of a group's layouts become one."""

    def __init__(self, trace: Trace, axes: Mapping[str, int]) -> None:
        by_storage: dict[int, dict[tuple[Any, ...], None]] = {}
        for op in trace.ops:
            for t in (*op.inputs, *op.outputs):
                by_storage.setdefault(t.storage, {})[(t.shape, t.stride, t.offset)] = None
        groups: dict[tuple[Any, ...], None] = {}
        for layouts in by_storage.values():
            if len(layouts) > 1 and any(has_dims(layout) for layout in layouts):
                groups[tuple(_exprs(layout) for layout in layouts)] = None
        exprs: list[Any] = []
        self._groups: list[list[tuple[int, int]]] = []
        for group in groups:
            spans = []
            for layout in group:
                flat = _flat(layout)
                spans.append((len(exprs), len(exprs) + len(flat)))
                exprs.extend(flat)
            self._groups.append(spans)
        self._values = compile_values(exprs, axes) if self._groups else None

    def holds(self, numbers: Mapping[str, int]) -> bool:
        if self._values is None:
            return True
        try:
            values = self._values(**numbers)
        except (ZeroDivisionError, OverflowError, ValueError):
            return False  # a layout that cannot be made at these numbers
        return all(len({values[a:b] for a, b in spans}) == len(spans) for spans in self._groups)


def _exprs(value: Any) -> Any:
    """A layout with each size as its expression (hashable, equal where the sizes are)."""
    if isinstance(value, (Dim, DimFloat)):
        return value.expr
    if isinstance(value, tuple):
        return tuple(_exprs(v) for v in value)
    return value


def _flat(value: Any) -> list[Any]:
    if isinstance(value, tuple):
        return [x for v in value for x in _flat(v)]
    return [value]


class Values:
    """Sizes at one point: each expression's number worked out once; ``anchored``, each
    size stays a Dim of its expression with this point's number as its traced value."""

    def __init__(self, numbers: Mapping[str, int], anchored: bool = False) -> None:
        self.numbers = dict(numbers)
        self._known: dict[Any, Any] = {}
        self._anchored = anchored

    def _at(self, size: Dim | DimFloat) -> Any:
        value = evaluate(size.expr, self.numbers, self._known)
        return follow(value, size.expr) if self._anchored else value

    def sizes(self, sizes: tuple[Any, ...]) -> tuple[Any, ...]:
        """A flat tuple of sizes at this point."""
        return tuple(self._at(x) if isinstance(x, (Dim, DimFloat)) else x for x in sizes)

    def of(self, value: Any) -> Any:
        """``value`` with every Dim in it (nested in tuples, lists and dicts) replaced by
        its number at this point."""
        if isinstance(value, (Dim, DimFloat)):
            return self._at(value)
        if isinstance(value, tuple):
            return tuple(self.of(v) for v in value)
        if isinstance(value, list):
            return [self.of(v) for v in value]
        if isinstance(value, dict):
            return {k: self.of(v) for k, v in value.items()}
        return value


def tensor_at(t: TensorMeta, values: Values) -> TensorMeta:
    """A tensor's layout at the point (the same TensorMeta when it holds no size)."""
    shape, stride, offset = t.shape, t.stride, t.offset
    sized_shape, sized_stride = _sized(shape), _sized(stride)
    if not (sized_shape or sized_stride or isinstance(offset, Dim)):
        return t
    return TensorMeta(
        values.sizes(shape) if sized_shape else shape,
        values.sizes(stride) if sized_stride else stride,
        t.dtype,
        t.storage,
        values.of(offset),
    )


def _sized(sizes: Sequence[int]) -> bool:
    return any(isinstance(s, Dim) for s in sizes)


def op_at(op: OpRecord, values: Values) -> OpRecord:
    """An op at the point: its tensors' layouts and its arguments evaluated."""
    args = op.args
    return OpRecord(
        op.index,
        op.name,
        tuple(tensor_at(t, values) for t in op.inputs),
        tuple(tensor_at(t, values) for t in op.outputs),
        {k: values.of(v) for k, v in args.items()} if has_dims(args) else dict(args),
        op.module,
        op.phase,
        op.synthetic,
    )

"""A step's kernels planned once for every batch and length, and a point's figures from them.

Grouping a symbolic trace's ops (:class:`~torchroof.records.symbolic_trace.SymbolicTrace`:
sizes as :mod:`~torchroof.records.dims` expressions) gives kernels whose W, Q and tensors are
expressions, and the decisions the grouping took on sizes (a split reduction's threshold,
siblings of equal size, a cost that is zero). A point where the trace's decisions and the
grouping's all come out the same, and whose views of a storage stay apart, has exactly those
kernels at its numbers: :class:`SymbolicPlan` gives its figures by evaluating them, with a
repeated layer's kernels timed once (they are alike: :mod:`torchroof.kernels.repeats`). The
activations' transient peak is the largest of the live-byte sums at every change, each a
polynomial, all evaluated at the point (the point decides which is largest, not the trace).

A plan is checked once when it is made: at a second point where its decisions hold, its
kernels evaluated must equal grouping that point's trace afresh; any difference and the plan
is not used (a size that left the expressions unseen). Pricing each point from its own trace
(:func:`torchroof.pricing.price.price_trace`) is what remains, and gives the same numbers.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from torchroof.accuracy.expected import correction
from torchroof.collector import paused_gc
from torchroof.config import PricingOptions
from torchroof.config.routing import BALANCED, routing_kind
from torchroof.counters import Cost
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.kernels.fusion import Kernel, SpillFlag
from torchroof.pricing.planned_streams import PlannedStreams
from torchroof.pricing.price import (
    KernelPlan,
    add_counts,
    check_step,
    group_kernels,
    plan_kernels,
    time_kernels,
)
from torchroof.pricing.runtime import reference_peak, timing_of
from torchroof.records.dims import Dim, DimFloat, has_dims
from torchroof.records.expressions import (
    Decision,
    Poly,
    compile_check,
    compile_values,
    deciding,
)
from torchroof.records.facts import StepFacts
from torchroof.records.ops import OpRecord
from torchroof.records.symbolic_trace import SymbolicTrace, Values, nearby, op_at, tensor_at
from torchroof.records.tensors import TensorMeta, clear_layout_caches
from torchroof.report.compare import point_metrics
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.report.memory import TransientPeak, footprint, live_bytes
from torchroof.timing.runtime import StepRuntime


class NotPlanned(Exception):
    """The symbolic trace's kernels cannot be planned once for every size (why, in a line)."""


@dataclass
class SymbolicPlan:
    """A symbolic trace's kernels under one kernel policy, with what a point must keep."""

    symbolic: SymbolicTrace
    plan: KernelPlan
    decisions: tuple[Decision, ...]  # the grouping's and the trace's
    classes: tuple[int, ...]  # the kernels timed at a point (one per repeated kernel)
    order: tuple[int, ...]  # per kernel, its place in ``classes``
    role_bytes: dict[str, Any]
    lives: _LiveBytes

    def __post_init__(self) -> None:
        self._check = compile_check(self.decisions, self.symbolic.axes)
        self._counts = [0] * len(self.classes)
        for place in self.order:
            self._counts[place] += 1
        # the symbols each timed kernel follows: one that follows the batch alone is the
        # same kernel at every context, timed once per batch
        self._follows = [_symbols(self.plan.kernels[i]) for i in self.classes]
        self._timings: dict[tuple[int, int, PricingOptions, StepRuntime], Any] = {}
        self._makers: dict[int, KernelMaker] = {}
        # each timed kernel made at the numbers it follows, shared by every timing of them
        self._made: dict[tuple[Any, ...], Kernel] = {}
        # a step with collectives is laid on its streams (the same tasks at every point)
        communicates = any(k.cost.unit == "network" for k in self.plan.kernels)
        self._streams = PlannedStreams(self.plan.kernels, self.order) if communicates else None

    def holds(self, numbers: Mapping[str, int]) -> bool:
        """Does the plan hold at ``numbers``: every decision as it was taken, each storage's
        views apart?"""
        named = {name: numbers[name] for name in self.symbolic.axes}
        return bool(self._check(**named)) and self.symbolic.views_apart(named)

    def kernels_at(self, numbers: Mapping[str, int]) -> list[Kernel]:
        """Every kernel at ``numbers`` (which must hold)."""
        values = Values(numbers)
        return [kernel_at(k, values) for k in self.plan.kernels]

    def metrics(
        self,
        numbers: Mapping[str, int],
        facts: StepFacts,
        spec: HardwareSpec,
        cluster: ClusterSpec | None,
        pricing: PricingOptions,
    ) -> dict[str, Any]:
        """:func:`~torchroof.report.compare.point_metrics` of the estimate at ``numbers``
        (which must hold; ``facts`` are that step's), each repeated kernel timed once."""
        return point_metrics(self.repeated(numbers, facts, spec, cluster, pricing))

    def repeated(
        self,
        numbers: Mapping[str, int],
        facts: StepFacts,
        spec: HardwareSpec,
        cluster: ClusterSpec | None,
        pricing: PricingOptions,
    ) -> CountedKernels:
        """The step at ``numbers`` (which must hold; ``facts`` are that step's) as its
        distinct kernels, each timed once, with how many times each runs."""
        check_step(facts.workload, spec, cluster, pricing)
        if routing_kind(pricing.routing) != BALANCED:
            raise NotPlanned("MoE routing other than balanced is priced from the point's trace")
        if pricing.routing_imbalance != 1.0:
            raise NotPlanned("a routing imbalance is priced from the point's trace")
        if cluster is None and self._streams is not None:
            # the point's own estimate says how many collectives need a cluster
            raise NotPlanned("a step with collectives on no cluster is priced whole")
        runtime = timing_of(pricing, facts.workload)
        workload = facts.workload
        overlapped = runtime.tp_comm_overlap and pricing.overlap_communication
        if overlapped and workload is not None and workload.sequence_parallel:
            # (price.tp_pairs): pairs laid side by side are found in the step's own kernels
            raise NotPlanned("a step whose collectives run beside their GEMMs is priced whole")
        timed = self._timed_classes(numbers, spec, cluster, pricing, runtime)
        step_time_s: float | None = None
        copies_exposed: tuple[float, ...] = ()
        if self._streams is not None:
            step_time_s, timed, copies_exposed = self._streams.lay(
                timed, pricing.overlap_communication
            )
        tensor_flops: dict[str, int] = defaultdict(int)
        traffic: dict[str, int] = defaultdict(int)
        for count, k in zip(self._counts, timed, strict=True):
            if k.unit == "tensor":
                tensor_flops[k.dtype] += count * k.flops
            for role, size in k.traffic.items():
                traffic[role] += count * size
        reference_dtype, reference_flops = reference_peak(tensor_flops, spec, pricing, runtime)
        times = [k.time_s for k in timed]
        batch = facts.workload.batch if facts.workload else 1
        values = Values(numbers)
        memory = footprint(
            self.symbolic.trace,
            spec.hbm_capacity_bytes.value,
            batch,
            self.plan.roles,
            {role: values.of(size) for role, size in self.role_bytes.items()},
            peak=self.lives.peak(numbers),
            backward_saved=0,  # serving steps only (torchroof.symbolic.AXES): no backward
        )
        return CountedKernels(
            hardware=spec.name,
            hardware_display=spec.display_name,
            hbm_bytes_per_s=spec.hbm_bytes_per_s.value,
            reference_peak_flops_per_s=reference_flops,
            reference_dtype=reference_dtype,
            kernels=timed,
            op_count=len(self.symbolic.trace.ops),
            uncounted={},
            options=pricing,
            facts=facts,
            memory=memory,
            cluster=cluster.name if cluster is not None else None,
            # the kernels' times added one by one in launch order, as Estimate.time_s adds
            # them (report.analysis.added)
            step_time_s=step_time_s
            if step_time_s is not None
            else functools.reduce(operator.add, [times[place] for place in self.order], 0.0),
            counts=tuple(self._counts),
            order=tuple(self.order),
            copies_exposed_s=copies_exposed,
            totals=dict(traffic),
            host_overhead_s=runtime.host_overhead_s,
        ).calibrated(correction(pricing.mode, facts.workload))

    def maker(self, n: int) -> KernelMaker:
        """How the ``n``-th timed kernel is made at a point (made once, when first needed)."""
        maker = self._makers.get(n)
        if maker is None:
            maker = self._makers[n] = KernelMaker(
                self.plan.kernels[self.classes[n]], self.symbolic.axes
            )
        return maker

    def _timed_classes(
        self,
        numbers: Mapping[str, int],
        spec: HardwareSpec,
        cluster: ClusterSpec | None,
        pricing: PricingOptions,
        runtime: StepRuntime,
    ) -> list[KernelEstimate]:
        """Each timed kernel at ``numbers``, from the ones timed at earlier points where
        the numbers it follows were the same, under the ``runtime`` of that point's step."""
        key = (id(spec), id(cluster), pricing, runtime)
        held = self._timings.get(key)
        if held is None:  # the spec and cluster are held too: their ids stay theirs
            held = self._timings[key] = (spec, cluster, {})
        known: dict[tuple[Any, ...], KernelEstimate] = held[2]
        if len(known) > MAX_TIMED_KERNELS:
            known.clear()  # timed again from here: none is dropped while a point needs it
        keys = [
            (n, *(numbers[name] for name in follows)) for n, follows in enumerate(self._follows)
        ]
        missing = [n for n, k in enumerate(keys) if k not in known]
        if missing:
            if len(self._made) > MAX_MADE_KERNELS:
                self._made.clear()
            kernels = [self._kernel(n, keys[n], numbers) for n in missing]
            timed, _, _, _ = time_kernels(kernels, self.plan.roles, spec, cluster, pricing, runtime)
            for n, estimate in zip(missing, timed, strict=True):
                known[keys[n]] = estimate
        return [known[k] for k in keys]

    def _kernel(self, n: int, key: tuple[Any, ...], numbers: Mapping[str, int]) -> Kernel:
        """The ``n``-th timed kernel at ``numbers`` (``key``: it and the numbers it follows),
        made once for every timing that needs it (a step's graphed and eager launches)."""
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self.maker(n)(numbers)
        return made


MAX_TIMED_KERNELS = 200_000
"""Timed kernels a plan keeps per accelerator and timing (a kernel that follows the batch
alone is timed once per batch): past it, they are timed again."""

MAX_MADE_KERNELS = 20_000
"""Made kernels a plan keeps for every timing of them (a step's graphed and eager launches
at one batch, which a serving simulation may ask for far apart): a made kernel holds its
ops and tensors, far more than its timing, so fewer are kept; past it, they are made
again."""


@dataclass
class CountedKernels(Estimate):
    """A step's figures from its distinct kernels, each repeated ``counts`` times (a
    repeated layer's kernels are alike): its totals count every copy, its step time is
    given (added in launch order). :func:`point_metrics` reads it, and what reads each
    kind of kernel's time (``kernels`` with ``counts``); not a whole estimate."""

    counts: tuple[int, ...] = ()
    totals: dict[str, int] | None = None
    order: tuple[int, ...] = ()  # the distinct kernel each launch is, in launch order
    copies_exposed_s: tuple[float, ...] = ()  # each launch's exposed communication time

    @property
    def flops(self) -> int:
        return sum(count * k.flops for count, k in zip(self.counts, self.kernels, strict=True))

    @property
    def bytes(self) -> int:
        return sum(count * k.bytes for count, k in zip(self.counts, self.kernels, strict=True))

    def traffic(self) -> dict[str, int]:
        return dict(self.totals or {})

    def calibrated(self, factor: float) -> CountedKernels:
        """As :meth:`Estimate.calibrated`, each launch's exposed communication time too."""
        scaled = super().calibrated(factor)
        assert isinstance(scaled, CountedKernels)
        return replace(scaled, copies_exposed_s=tuple(t * factor for t in self.copies_exposed_s))


def _symbols(kernel: Kernel) -> tuple[str, ...]:
    """The symbols a planned kernel's sizes follow."""
    found: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, (Dim, DimFloat)):
            found.update(value.expr.symbols)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for op in kernel.ops:
        for t in (*op.inputs, *op.outputs):
            visit((t.shape, t.stride, t.offset))
        visit(op.args)
    cost = kernel.cost
    visit((cost.flops, cost.bytes_read, cost.bytes_written))
    visit(tuple((t.shape, t.stride, t.offset, n) for t, n in (*cost.reads, *cost.writes)))
    visit(tuple(f.live_row_bytes for f in kernel.flags))
    return tuple(sorted(found))


@paused_gc()
def plan_symbolic(symbolic: SymbolicTrace, pricing: PricingOptions) -> SymbolicPlan:
    """Group ``symbolic``'s ops once under ``pricing``'s kernel policy (:class:`NotPlanned`
    when the step is not one a plan can serve, or the check at a second point fails)."""
    trace = symbolic.trace
    clear_layout_caches()  # each comparison on a size is made, and written down, here
    with deciding() as log:
        plan = group_kernels(trace, pricing)
        lives = live_bytes(trace, plan.roles, plan.residency)
        role_bytes = add_counts(trace.role_bytes, plan.step.role_bytes)
    sources = plan.sources or tuple(range(len(plan.kernels)))
    classes = tuple(sorted(set(sources)))
    place = {kernel: n for n, kernel in enumerate(classes)}
    planned = SymbolicPlan(
        symbolic,
        plan,
        (*symbolic.decisions, *log),
        classes,
        tuple(place[s] for s in sources),
        role_bytes,
        _LiveBytes(lives, symbolic.axes),
    )
    _check_second_point(planned, pricing)
    return planned


def _check_second_point(planned: SymbolicPlan, pricing: PricingOptions) -> None:
    """The plan's kernels and peak at a second point where it holds, against planning that
    point's trace afresh (:class:`NotPlanned` on any difference, or no such point)."""
    checked = planned.symbolic.checked  # the trace's own second point, traced afresh
    if checked is not None and planned.holds(checked[0]):
        numbers, trace = checked
    else:
        found = next((p for p in nearby(planned.symbolic.axes) if planned.holds(p)), None)
        if found is None:
            raise NotPlanned("no second point near the traced one keeps the plan's decisions")
        numbers, trace = found, planned.symbolic.at(found)
    fresh = plan_kernels(trace, pricing)
    every = planned.kernels_at(numbers)
    if every != fresh.kernels:
        raise NotPlanned(f"the kernels at {numbers} differ from grouping that trace afresh")
    # the timed kernels as the points make them (their generated makers), held to the same
    made = [planned.maker(n)(numbers) for n in range(len(planned.classes))]
    if made != [every[i] for i in planned.classes]:
        raise NotPlanned(f"the kernels made at {numbers} differ from the plan's")
    if planned.lives.peak(numbers) != fresh.peak:
        raise NotPlanned(f"the transient peak at {numbers} differs from that trace's own")


def kernel_at(kernel: Kernel, values: Values) -> Kernel:
    """A planned kernel at one point: its ops, W, Q and the tensors its bytes come from."""
    cost = kernel.cost
    at = Cost(
        values.of(cost.flops),
        values.of(cost.bytes_read),
        values.of(cost.bytes_written),
        cost.unit,
        cost.dtype,
        cost.counted,
        tuple((tensor_at(t, values), values.of(n)) for t, n in cost.reads),
        tuple((tensor_at(t, values), values.of(n)) for t, n in cost.writes),
    )
    flags = tuple(
        SpillFlag(live, f.budget_bytes)
        for f in kernel.flags
        if (live := values.of(f.live_row_bytes)) > f.budget_bytes  # decided at the point
    )
    return Kernel(tuple(op_at(op, values) for op in kernel.ops), at, flags)


class KernelMaker:
    """One planned kernel made at any point by one generated function (what
    :func:`kernel_at` makes, without walking its ops at every point): its sizes'
    expressions evaluated by compiled code (:func:`~torchroof.records.expressions.
    compile_values`), its ops, tensors and cost built from those numbers, and what holds no
    size shared with the plan (a tensor without a symbolic size, an op's name)."""

    def __init__(self, kernel: Kernel, axes: Iterable[str]) -> None:
        self._held: list[Any] = []  # objects the generated code refers to
        self._exprs: list[Any] = []
        self._slots: dict[int, int] = {}  # id(expression) -> its place in the numbers
        body = self._kernel(kernel)
        self._values = compile_values(self._exprs, axes)
        namespace = {
            "Kernel": Kernel,
            "Cost": Cost,
            "OpRecord": OpRecord,
            "TensorMeta": TensorMeta,
            "SpillFlag": SpillFlag,
            "H": self._held,
        }
        source = f"def make(v):\n    return {body}\n"
        exec(compile(source, "<torchroof.pricing.symbolic_plan>", "exec"), namespace)  # noqa: S102
        self._make = namespace["make"]

    def __call__(self, numbers: Mapping[str, int]) -> Kernel:
        return self._make(self._values(**numbers))

    def _object(self, value: Any) -> str:
        self._held.append(value)
        return f"H[{len(self._held) - 1}]"

    def _size(self, value: Any) -> str:
        if isinstance(value, (Dim, DimFloat)):
            slot = self._slots.get(id(value.expr))
            if slot is None:
                slot = self._slots[id(value.expr)] = len(self._exprs)
                self._exprs.append(value.expr)
            return f"v[{slot}]"
        if type(value) is int or type(value) is bool:
            return repr(value)
        return self._object(value)

    def _value(self, value: Any) -> str:
        """An argument: sizes from the numbers, lists and tuples rebuilt, the rest held."""
        if isinstance(value, (list, tuple)) and has_dims(value):
            items = ", ".join(self._value(v) for v in value)
            return f"[{items}]" if isinstance(value, list) else f"({items},)"
        if isinstance(value, dict) and has_dims(value):
            items = ", ".join(f"{self._object(k)}: {self._value(v)}" for k, v in value.items())
            return f"{{{items}}}"
        if isinstance(value, (Dim, DimFloat)):
            return self._size(value)
        return (
            self._object(value)
            if has_dims(value) or not isinstance(value, (int, bool))
            else repr(value)
        )

    def _tensor(self, t: TensorMeta) -> str:
        if not has_dims((t.shape, t.stride, t.offset)):
            return self._object(t)
        shape = "".join(f"{self._size(x)}, " for x in t.shape)
        stride = "".join(f"{self._size(x)}, " for x in t.stride)
        dtype = self._object(t.dtype)
        return f"TensorMeta(({shape}), ({stride}), {dtype}, {t.storage}, {self._size(t.offset)})"

    def _op(self, op: OpRecord) -> str:
        inputs = "".join(f"{self._tensor(t)}, " for t in op.inputs)
        outputs = "".join(f"{self._tensor(t)}, " for t in op.outputs)
        if has_dims(op.args):
            items = ", ".join(f"{k!r}: {self._value(v)}" for k, v in op.args.items())
            args = f"{{{items}}}"
        else:
            args = f"dict({self._object(op.args)})"
        name, module, phase = (self._object(x) for x in (op.name, op.module, op.phase))
        return (
            f"OpRecord({op.index}, {name}, ({inputs}), ({outputs}), {args}, {module}, {phase}, "
            f"{op.synthetic!r})"
        )

    def _kernel(self, kernel: Kernel) -> str:
        cost = kernel.cost
        reads = "".join(f"({self._tensor(t)}, {self._size(n)}), " for t, n in cost.reads)
        writes = "".join(f"({self._tensor(t)}, {self._size(n)}), " for t, n in cost.writes)
        made = (
            f"Cost({self._size(cost.flops)}, {self._size(cost.bytes_read)}, "
            f"{self._size(cost.bytes_written)}, {self._object(cost.unit)}, "
            f"{self._object(cost.dtype)}, {cost.counted!r}, ({reads}), ({writes}))"
        )
        flags = []
        for flag in kernel.flags:  # decided at the point, as kernel_at decides it
            live = self._size(flag.live_row_bytes)
            flags.append(
                f"*((SpillFlag({live}, {flag.budget_bytes}),) "
                f"if {live} > {flag.budget_bytes} else ())"
            )
        ops = "".join(f"{self._op(op)}, " for op in kernel.ops)
        return f"Kernel(({ops}), {made}, ({''.join(f + ', ' for f in flags)}))"


class _LiveBytes:
    """The transient bytes alive after every change (in all, and FSDP's layer buffers) as
    integer polynomials: at a point, two matrix products and the first largest total
    (:func:`~torchroof.report.memory.first_peak`); an expression past a polynomial is
    evaluated one by one instead."""

    def __init__(self, lives: list[TransientPeak], axes: Mapping[str, int]) -> None:
        self._axes = list(axes)
        totals = [_poly(live.total_bytes) for live in lives]
        buffers = [_poly(live.layer_buffers_bytes) for live in lives]
        self._count = len(lives)
        self._each: Any = None
        if None in totals or None in buffers:
            exprs = [getattr(x, "expr", x) for live in lives for x in _fields(live)]
            self._each = compile_values(exprs, axes)
            return
        polys = [p for p in (*totals, *buffers) if p is not None]
        self._monomials = sorted({m for p in polys for m, _ in p.terms})
        self._totals = self._matrix([p for p in totals if p is not None])
        self._buffers = self._matrix([p for p in buffers if p is not None])

    def _matrix(self, polys: list[Poly]) -> _Exact:
        column = {m: j for j, m in enumerate(self._monomials)}
        out = np.zeros((len(polys), len(self._monomials)), dtype=object)
        for i, p in enumerate(polys):
            for m, c in p.terms:
                out[i, column[m]] = c
        return _Exact(out)

    def peak(self, numbers: Mapping[str, int]) -> TransientPeak:
        """The first largest live total at ``numbers`` (zero where none is above zero)."""
        if not self._count:
            return TransientPeak(0, 0)
        named = {name: numbers[name] for name in self._axes}
        if self._each is not None:
            flat = self._each(**named)
            totals, buffers = list(flat[0::2]), list(flat[1::2])
            best = max(range(len(totals)), key=lambda i: (totals[i], -i))
        else:
            vector = [_monomial(m, named) for m in self._monomials]
            totals, buffers = self._totals @ vector, self._buffers @ vector
            best = int(np.argmax(totals))  # the first of the largest, as first_peak keeps
        total = int(totals[best])
        return TransientPeak(total, int(buffers[best])) if total > 0 else TransientPeak(0, 0)


class _Exact:
    """An integer matrix times integer vectors, exactly: in int64 where no sum can
    overflow it, else in Python integers."""

    def __init__(self, matrix: np.ndarray) -> None:
        self._object = matrix
        self._largest = max((abs(int(c)) for c in matrix.flat), default=0) * max(matrix.shape[1], 1)
        self._int64 = matrix.astype(np.int64) if self._largest < 2**62 else None

    def __matmul__(self, vector: list[int]) -> Any:
        biggest = max((abs(v) for v in vector), default=0)
        if self._int64 is not None and biggest * self._largest < 2**62:
            return self._int64 @ np.array(vector, dtype=np.int64)
        return self._object @ np.array(vector, dtype=object)


def _fields(live: TransientPeak) -> tuple[Any, Any]:
    return (live.total_bytes, live.layer_buffers_bytes)


def _poly(value: Any) -> Poly | None:
    if isinstance(value, Dim):
        return value.expr if isinstance(value.expr, Poly) else None
    if isinstance(value, int):
        return Poly.constant(int(value))
    return None


def _monomial(mono: tuple[tuple[str, int], ...], numbers: Mapping[str, int]) -> int:
    out = 1
    for name, power in mono:
        out *= numbers[name] ** power
    return out

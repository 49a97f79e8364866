"""A model prepared once and priced many times: :func:`prepare` returns a
:class:`PreparedModel` whose :meth:`~PreparedModel.price` gives an :class:`Estimate` for
any hardware, timing mode or pricing option, and any batch, length or plan, tracing only
the steps it has not traced yet, and whose :meth:`~PreparedModel.metrics` gives a point's
figures (step time, tokens/s, MFU, traffic, memory and fit) without making its estimate.

A trace is kept per distinct step (the :class:`~torchroof.config.Workload` it records:
batch, sequence, context, the parallel plan, the quant recipe, the optimizer ...), so
prices that differ only in how the step is priced (the accelerator or cluster, ``mode``,
``fusion``, efficiencies) share it and cost only the pricing. Each trace copies the
repeated decoder layers of an inference step from one traced representative of each
kind (:mod:`torchroof.capture.replay`), unless ``full_trace=True``.

An inference step (on one GPU, or across tensor-parallel GPUs: not pipelined or
context-parallel) priced at a second batch or length is traced once more with
its sizes as symbols (:mod:`torchroof.symbolic`); every later point that keeps that
trace's decisions has its trace by putting its numbers into it, op for op the trace a
fresh trace records, and :meth:`~PreparedModel.metrics` prices such a point from kernels
planned once for every size (:mod:`torchroof.pricing.symbolic_plan`). A point that does
not keep them (a batch of 1 broadcasts differently) gets a symbolic trace of its own or is
traced afresh; :attr:`PreparedModel.notes` says which and why.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchroof.api import (
    PipelineTrace,
    Trace,
    check_quant_hardware,
    config_of,
    estimate_trace,
    resolve_seq,
    trace_module,
    trace_workload,
    traced_workload,
)
from torchroof.capture.symbolic import NotSymbolic
from torchroof.config import PricingOptions, Workload, split_knobs
from torchroof.config.errors import OptionError, first_line
from torchroof.counters import registry_version
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.price import TracePlans
from torchroof.pricing.runtime import check_runtime_regime, with_knobs, workload_defaults
from torchroof.pricing.symbolic_plan import (
    CountedKernels,
    NotPlanned,
    SymbolicPlan,
    plan_symbolic,
)
from torchroof.progress import reporting
from torchroof.records.symbolic_trace import SymbolicTrace
from torchroof.report.compare import point_metrics
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.report.memory import MemoryFootprint
from torchroof.symbolic import (
    family_key,
    point_facts,
    symbolic_axes,
    symbolic_point,
    trace_symbolic,
)

MAX_SYMBOLIC_TRACES = 3
"""Symbolic traces kept per step with its sizes left out (a batch of 1 and of more broadcast
differently: two); a point that keeps none of them past it is traced afresh."""

MAX_SYMBOLIC_PLANS = 8
"""Kernel plans kept per symbolic trace and kernel policy (each holds where its decisions
do); a point that keeps none of them past it is priced from its own trace."""

DEFAULT_MAX_TRACES = 16
"""Traces a prepared model keeps (the least recently priced is dropped past it): a 70B
training trace holds about 18,000 ops, some 100 MB; 16 of them some 1.6 GB. Each keeps
up to :data:`~torchroof.pricing.price.MAX_PLANS_PER_TRACE` sets of kernels beside it,
each much smaller than the trace (its kernels refer to the trace's own ops)."""


@dataclass(frozen=True)
class KernelTimes:
    """A step's time (``time_s``, as its estimate's), its memory footprint, and its distinct
    kernels, each timed once, beside how many times each runs (``counts``)."""

    time_s: float
    kernels: tuple[KernelEstimate, ...]
    counts: tuple[int, ...]
    memory: MemoryFootprint | None


@dataclass(frozen=True)
class CacheInfo:
    """How a prepared model's traces were reused."""

    traced: int  # steps traced (each distinct workload once, unless dropped and re-traced)
    reused: int  # prices that found their step already traced
    held: int  # traces kept now
    plans: int = 0  # kernel plans kept (one per trace and kernel policy it was priced with)
    symbolic: int = 0  # steps traced with their sizes as symbols
    substituted: int = 0  # traces made from a symbolic trace (no tracing)
    planned: int = 0  # points whose figures came from kernels planned for every size


class PreparedModel:
    """One model and the steps of it traced so far; :meth:`price` prices any of them.

    Build it with :func:`prepare`. ``workload`` is the step every :meth:`price` starts
    from; each call's workload keywords replace its fields for that call only.
    """

    def __init__(
        self,
        model: Any,
        workload: Workload,
        *,
        given: tuple[str | None, Workload | None, dict[str, Any]] | None = None,
        inputs: Sequence[Any] | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        max_traces: int = DEFAULT_MAX_TRACES,
        progress: bool = False,
    ) -> None:
        if isinstance(max_traces, bool) or not isinstance(max_traces, int) or max_traces < 1:
            raise OptionError(f"max_traces must be a positive integer, got {max_traces!r}")
        self.model = model
        self.workload = workload
        self.progress = progress
        # what prepare() was given (regime, workload, its knobs): each price's workload is
        # made from these and its own knobs as estimate() makes it (context follows seq)
        self._given = given or (None, workload, {})
        self._inputs = inputs
        self._loss_fn = loss_fn
        self._max_traces = max_traces
        # each step's trace, and its kernels per kernel policy (pricing a trace again times
        # them only), dropped together
        self._traces: OrderedDict[tuple[Workload, bool], tuple[Trace | PipelineTrace, TracePlans]]
        self._traces = OrderedDict()
        self._traced = self._reused = 0
        # symbolic traces per step with its sizes left out, or why it has none; the kernel
        # plans of each per kernel policy, or why it has none
        self._families: dict[tuple[Any, ...], list[SymbolicTrace] | str] = {}
        self._seen: set[tuple[Any, ...]] = set()
        self._plans: dict[tuple[Any, ...], list[SymbolicPlan] | str] = {}
        self._symbolic = self._substituted = self._planned_points = 0
        self._config: Any = None
        # what was traced or priced the long way: why -> the points it held for
        self._notes: dict[str, dict[str, None]] = {}

    def __repr__(self) -> str:
        label = self.model if isinstance(self.model, (str, Path)) else type(self.model).__name__
        info = self.cache_info()
        return f"PreparedModel({label}, {self.workload.regime}, {info.held} traces held)"

    def cache_info(self) -> CacheInfo:
        plans = sum(len(held) for _, held in self._traces.values())
        return CacheInfo(
            self._traced,
            self._reused,
            len(self._traces),
            plans,
            self._symbolic,
            self._substituted,
            self._planned_points,
        )

    def for_regime(self, regime: str) -> PreparedModel:
        """The same model, with the same workload keywords but its sizes (batch, seq and
        context are each price's), prepared for ``regime`` (this one where it is its
        regime); it traces its own steps."""
        if regime == self.workload.regime:
            return self
        _, workload, given = self._given
        sizes = ("regime", "batch", "seq", "context")
        kept = {k: v for k, v in given.items() if k not in sizes}
        return prepare(
            self.model,
            regime,
            workload=workload,
            inputs=self._inputs,
            loss_fn=self._loss_fn,
            max_traces=self._max_traces,
            progress=self.progress,
            **kept,
        )

    def workload_for(self, **knobs: Any) -> Workload:
        """The workload :meth:`price` traces for these workload keywords (checked)."""
        return self._step(knobs)[0]

    def _step(
        self, knobs: dict[str, Any], pricing: PricingOptions | None = None
    ) -> tuple[Workload, bool]:
        """(the workload, whether a module is cast) as estimate() makes them from what
        prepare() was given and ``knobs``, with the defaults of ``pricing``'s runtime."""
        regime, workload, given = self._given
        asked = knobs.get("regime")
        if asked is not None and asked != self.workload.regime:
            raise OptionError(
                f"this model is prepared for {self.workload.regime} steps, not {asked}: "
                f"price {asked} from for_regime({asked!r}) or a model prepared for it"
            )
        merged = {**given, **knobs}
        if pricing is not None:
            merged = workload_defaults(pricing, merged, workload, regime)
        return traced_workload(regime, workload, merged, priced_by="price()")

    def trace(self, **knobs: Any) -> Trace | PipelineTrace:
        """The trace of the step these workload keywords give (traced on first use): the
        one held, whose kernels later prices reuse; do not change it."""
        return self._held(self._step(knobs))[0]

    def _held(self, step: tuple[Workload, bool]) -> tuple[Trace | PipelineTrace, TracePlans]:
        """The step's trace and its kernel plans, traced on first use."""
        found = self._traces.get(step)
        if found is not None:
            self._traces.move_to_end(step)
            self._reused += 1
            return found
        with reporting(self.progress):
            traced: Trace | PipelineTrace | None = self._from_symbolic(step)
            if traced is None:
                traced = self._trace(*step)
                self._traced += 1
        held = self._traces[step] = (traced, TracePlans())
        if len(self._traces) > self._max_traces:
            self._traces.popitem(last=False)
        return held

    def price(
        self,
        hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
        *,
        pricing: PricingOptions | None = None,
        **knobs: Any,
    ) -> Estimate:
        """The estimate of the step ``knobs`` give (fields of :class:`Workload`: batch,
        seq, context, tp, quant, ...; the prepared workload's where left out) on
        ``hardware``, priced with ``pricing`` or its fields as keywords (``mode``,
        ``fusion``, ``compute_efficiency``, ...). Equal to :func:`torchroof.estimate` of
        the same model and knobs; only a step not priced before is traced."""
        workload_knobs, pricing_knobs = split_knobs(knobs)
        spec, cluster = resolve_hardware(hardware)  # a bad name fails before any tracing
        options = with_knobs(pricing, pricing_knobs)
        step = self._step(workload_knobs, options)
        check_runtime_regime(options, step[0].regime)  # before anything is traced
        check_quant_hardware(step[0].quant, spec)
        trace, plans = self._held(step)
        with reporting(self.progress):
            return estimate_trace(trace, cluster or spec, options, plans=plans)

    def metrics(
        self,
        hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
        *,
        pricing: PricingOptions | None = None,
        **knobs: Any,
    ) -> dict[str, Any]:
        """:func:`~torchroof.report.compare.point_metrics` of :meth:`price` with the same
        arguments (step time, tokens/s, GPUs, MFU, traffic by role, memory, fit), equal to
        it; an inference step (not pipelined) is priced from kernels planned once for every
        size where its point keeps their decisions, without making its estimate."""
        return self.figures(hardware, pricing=pricing, **knobs)[0]

    def figures(
        self,
        hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
        *,
        pricing: PricingOptions | None = None,
        **knobs: Any,
    ) -> tuple[dict[str, Any], Estimate | None]:
        """(:meth:`metrics`, the estimate they were read from, or None where they were
        priced from kernels planned for every size and no estimate was made)."""
        counted = self._counted(hardware, pricing, knobs)
        if isinstance(counted, CountedKernels):
            return point_metrics(counted), None
        return point_metrics(counted), counted

    def kernel_times(
        self,
        hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
        *,
        pricing: PricingOptions | None = None,
        **knobs: Any,
    ) -> KernelTimes:
        """The step :meth:`price` prices, as its step time, its memory footprint and its
        distinct kernels each timed once with how many times each runs; from kernels
        planned once for every size where the point keeps their decisions (no estimate is
        made), else from its estimate (every kernel once)."""
        counted = self._counted(hardware, pricing, knobs)
        counts = (
            counted.counts if isinstance(counted, CountedKernels) else (1,) * len(counted.kernels)
        )
        return KernelTimes(counted.time_s, tuple(counted.kernels), tuple(counts), counted.memory)

    def _counted(
        self,
        hardware: str | Path | HardwareSpec | ClusterSpec,
        pricing: PricingOptions | None,
        knobs: dict[str, Any],
    ) -> Estimate:
        """The point's :class:`~torchroof.pricing.symbolic_plan.CountedKernels` where it is
        priced from kernels planned for every size, else its whole estimate."""
        workload_knobs, pricing_knobs = split_knobs(knobs)
        spec, cluster = resolve_hardware(hardware)
        options = with_knobs(pricing, pricing_knobs)
        step = self._step(workload_knobs, options)
        check_runtime_regime(options, step[0].regime)  # before anything is traced
        check_quant_hardware(step[0].quant, spec)
        with reporting(self.progress):
            planned = self._planned(step, spec, cluster, options)
        if planned is not None:
            self._planned_points += 1
            return planned
        return self.price(hardware, pricing=options, **workload_knobs)

    # -- symbolic traces and plans ---------------------------------------------------------
    def _model_config(self) -> Any:
        if self._config is None:
            self._config = config_of(self.model)
        return self._config

    @property
    def notes(self) -> list[str]:
        """What was traced or priced the long way, and why: a line per reason, with the
        first point it held for and how many it held for."""
        out = []
        for why, points in self._notes.items():
            first = next(iter(points))
            where = first if len(points) == 1 else f"{len(points)} points (the first {first})"
            out.append(f"{where}: {why}")
        return out

    def _note(self, point: str, why: str) -> None:
        self._notes.setdefault(why, {})[point] = None

    def _family(
        self, step: tuple[Workload, bool], eager: bool, new: bool = True
    ) -> SymbolicTrace | None:
        """A symbolic trace whose decisions the step keeps: one held, or (where ``new``)
        one traced at this step (from its step's second point on, or at once when
        ``eager``); None where the step is not one (training, a pipeline, context parallel,
        a plain module) or cannot be."""
        workload, cast = step
        if self._inputs is not None or self._loss_fn is not None:
            return None
        axes = symbolic_axes(workload)
        if isinstance(axes, str):
            return None
        key = (family_key(workload), cast)
        held = self._families.setdefault(key, [])
        resolved, _ = resolve_seq(self.model, workload, self._model_config())
        numbers = {name: getattr(resolved, name) for name in axes}
        if isinstance(held, str):
            self._note(_point(numbers), f"traced at each size ({held})")
            return None
        for symbolic in held:
            if symbolic.holds(numbers):
                return symbolic
        if not new:
            return None
        if not eager and key not in self._seen:
            self._seen.add(key)  # a step's first point is traced as it is
            return None
        point = _point(numbers)
        if len(held) >= MAX_SYMBOLIC_TRACES:
            self._note(
                point, f"not made from symbols (none of the {len(held)} symbolic traces holds)"
            )
            return None
        try:
            symbolic = trace_symbolic(self.model, workload, cast)
        except NotSymbolic as why:
            if not held:
                self._families[key] = str(why)
            self._note(point, f"traced at each size ({why})")
            return None
        self._symbolic += 1
        held.append(symbolic)
        return symbolic

    def _from_symbolic(self, step: tuple[Workload, bool]) -> Trace | None:
        """The step's trace from a symbolic trace, where one holds at it."""
        symbolic = self._family(step, eager=False)
        if symbolic is None:
            return None
        trace = symbolic_point(symbolic, self.model, step[0], self._model_config())
        if trace is not None:
            self._substituted += 1
        return trace

    def _planned(
        self,
        step: tuple[Workload, bool],
        spec: HardwareSpec,
        cluster: ClusterSpec | None,
        pricing: PricingOptions,
    ) -> CountedKernels | None:
        """The point's kernels from kernels planned for every size; None where there is
        no symbolic trace or plan for it, or where the point's own trace is held (then it
        is priced from its own trace where no symbolic trace held holds there: a step
        prepared at a batch of 1, whose symbolic trace would hold there alone, is not
        traced again)."""
        symbolic = self._family(step, eager=True, new=step not in self._traces)
        if symbolic is None:
            return None
        facts = point_facts(symbolic, self.model, step[0], self._model_config())
        if facts is None or facts.workload is None:
            return None
        numbers = {name: getattr(facts.workload, name) for name in symbolic.axes}
        plan = self._plan(symbolic, pricing, numbers)
        if plan is None:
            return None
        try:
            return plan.repeated(numbers, facts, spec, cluster, pricing)
        except NotPlanned as why:
            self._note(_point(numbers), f"priced from its own trace ({why})")
            return None

    def _plan(
        self, symbolic: SymbolicTrace, pricing: PricingOptions, numbers: dict[str, int]
    ) -> SymbolicPlan | None:
        """A kernel plan of ``symbolic`` under ``pricing``'s kernel policy that holds at
        ``numbers``: one held, or one planned with the sizes at these numbers."""
        key = (id(symbolic), registry_version(), *pricing.kernel_policy())
        held = self._plans.setdefault(key, [])
        point = _point(numbers)
        if isinstance(held, str):
            self._note(point, f"priced from its own trace ({held})")
            return None
        for plan in held:
            if plan.holds(numbers):
                return plan
        if len(held) >= MAX_SYMBOLIC_PLANS:
            self._note(point, f"priced from its own trace (none of the {len(held)} plans holds)")
            return None
        if not symbolic.views_apart(numbers):  # no plan holds where two views become one
            self._note(point, "priced from its own trace (two views of a tensor coincide)")
            return None
        at = symbolic if symbolic.axes == numbers else symbolic.anchored(numbers)
        try:
            plan = plan_symbolic(at, pricing)
        except NotPlanned as why:
            if not held:
                self._plans[key] = str(why)
            self._note(point, f"priced from its own trace ({why})")
            return None
        except Exception as error:  # noqa: BLE001 - the point's own trace says it in a line
            self._note(point, f"priced from its own trace ({first_line(error)})")
            return None
        held.append(plan)
        if not plan.holds(numbers):  # planned at these numbers: it holds here
            self._note(point, "priced from its own trace (the plan made here does not hold)")
            return None
        return plan

    def _trace(self, workload: Workload, cast: bool) -> Trace | PipelineTrace:
        if self._inputs is not None or self._loss_fn is not None:
            return trace_module(
                self.model, self._inputs, workload=workload, loss_fn=self._loss_fn, cast_module=cast
            )
        return trace_workload(self.model, workload, cast_module=cast)


def _point(numbers: dict[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in numbers.items())


def prepare(
    model: Any = DEFAULT_MODEL,
    regime: str | None = None,
    *,
    workload: Workload | None = None,
    inputs: Sequence[Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    max_traces: int = DEFAULT_MAX_TRACES,
    progress: bool = False,
    **knobs: Any,
) -> PreparedModel:
    """``model`` (as :func:`torchroof.estimate` takes it) ready to price many times:

    >>> prepared = torchroof.prepare("llama-3-70b", "decode", context=4096)  # doctest: +SKIP
    >>> prepared.price("h100-sxm", batch=8).time_s                             # doctest: +SKIP
    >>> prepared.price("b200", batch=8, mode="realistic").time_s               # doctest: +SKIP

    ``knobs`` are fields of :class:`torchroof.config.Workload` (the step every price
    starts from); pricing options go to :meth:`PreparedModel.price`. Nothing is traced
    until the first price. ``max_traces`` bounds the traces kept (the least recently
    priced is dropped); ``progress=True`` shows each stage on stderr.
    """
    base, _ = traced_workload(regime, workload, knobs, priced_by="PreparedModel.price()")
    workload_knobs = dict(knobs)
    return PreparedModel(
        model,
        base,
        given=(regime, workload, workload_knobs),
        inputs=inputs,
        loss_fn=loss_fn,
        max_traces=max_traces,
        progress=progress,
    )

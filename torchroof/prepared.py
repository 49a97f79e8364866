"""A model prepared once and priced many times: :func:`prepare` returns a
:class:`PreparedModel` whose :meth:`~PreparedModel.price` gives an :class:`Estimate` for
any hardware, timing mode or pricing option, and any batch, length or plan, tracing only
the steps it has not traced yet.

A trace is kept per distinct step (the :class:`~torchroof.config.Workload` it records:
batch, sequence, context, the parallel plan, the quant recipe, the optimizer ...), so
prices that differ only in how the step is priced (the accelerator or cluster, ``mode``,
``fusion``, efficiencies) share it and cost only the pricing. Each trace copies the
repeated decoder layers of an inference step from one traced representative of each
kind (:mod:`torchroof.capture.replay`), unless ``full_trace=True``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from torchroof.api import (
    PipelineTrace,
    Trace,
    check_quant_hardware,
    estimate_trace,
    trace_module,
    trace_workload,
    traced_workload,
)
from torchroof.config import PricingOptions, Workload, split_knobs
from torchroof.config.errors import OptionError
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.price import TracePlans
from torchroof.progress import reporting
from torchroof.report.estimate import Estimate

DEFAULT_MAX_TRACES = 16
"""Traces a prepared model keeps (the least recently priced is dropped past it): a 70B
training trace holds about 18,000 ops, some 100 MB; 16 of them some 1.6 GB. Each keeps
up to :data:`~torchroof.pricing.price.MAX_PLANS_PER_TRACE` sets of kernels beside it,
each much smaller than the trace (its kernels refer to the trace's own ops)."""


@dataclass(frozen=True)
class CacheInfo:
    """How a prepared model's traces were reused."""

    traced: int  # steps traced (each distinct workload once, unless dropped and re-traced)
    reused: int  # prices that found their step already traced
    held: int  # traces kept now
    plans: int = 0  # kernel plans kept (one per trace and kernel policy it was priced with)


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

    def __repr__(self) -> str:
        label = self.model if isinstance(self.model, (str, Path)) else type(self.model).__name__
        info = self.cache_info()
        return f"PreparedModel({label}, {self.workload.regime}, {info.held} traces held)"

    def cache_info(self) -> CacheInfo:
        plans = sum(len(held) for _, held in self._traces.values())
        return CacheInfo(self._traced, self._reused, len(self._traces), plans)

    def workload_for(self, **knobs: Any) -> Workload:
        """The workload :meth:`price` traces for these workload keywords (checked)."""
        return self._step(knobs)[0]

    def _step(self, knobs: dict[str, Any]) -> tuple[Workload, bool]:
        """(the workload, whether a module is cast) as estimate() makes them from what
        prepare() was given and ``knobs``."""
        regime, workload, given = self._given
        return traced_workload(regime, workload, {**given, **knobs}, priced_by="price()")

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
        step = self._step(workload_knobs)
        check_quant_hardware(step[0].quant, spec)
        options = replace(pricing or PricingOptions(), **pricing_knobs)
        trace, plans = self._held(step)
        with reporting(self.progress):
            return estimate_trace(trace, cluster or spec, options, plans=plans)

    def _trace(self, workload: Workload, cast: bool) -> Trace | PipelineTrace:
        if self._inputs is not None or self._loss_fn is not None:
            return trace_module(
                self.model, self._inputs, workload=workload, loss_fn=self._loss_fn, cast_module=cast
            )
        return trace_workload(self.model, workload, cast_module=cast)


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

"""Steps traced once with their sizes as symbols, and the trace of any point from them.

:func:`trace_symbolic` traces an inference step with its batch and length (``seq`` for
prefill, ``context`` for decode) as PyTorch symbolic integers
(:mod:`torchroof.capture.symbolic`), and checks the result once at a second point against
tracing that point afresh. :func:`symbolic_point` gives any point's trace from it, by putting
the point's numbers into the recorded sizes, when every decision the model, torch and the
capture took on the sizes comes out the same there: the trace a fresh trace of that point
records, op for op, without running the model again.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torchroof.api import Trace as PricedTrace
from torchroof.api import build_step_model, resolve_seq, run_step, step_checks, step_facts
from torchroof.capture.symbolic import NotSymbolic, SymbolicSizes
from torchroof.collector import paused_gc
from torchroof.config import Workload
from torchroof.config.errors import first_line
from torchroof.records.facts import StepFacts
from torchroof.records.symbolic_trace import SymbolicTrace, Values, nearby
from torchroof.records.trace import Trace
from torchroof.workloads import regime

AXES: dict[str, tuple[str, ...]] = {"prefill": ("batch", "seq"), "decode": ("batch", "context")}
"""The sizes each regime traces as symbols: its batch and the length it reads."""

MAX_SECOND_POINTS = 24
"""Points near the traced one (:func:`~torchroof.records.symbolic_trace.nearby`) tried for
the check: the first where every decision holds, and the model takes, is traced afresh."""

# a ShapeEnv symbol's name (s0, u3) in text a step wrote: a note that named a symbolic size
_SYMBOL_IN_TEXT = re.compile(r"\b[su]\d+\b")
_SOURCE_LOCATION = re.compile(r"^(\w+: )?\S+\.(cpp|h):\d+: ")


def symbolic_axes(workload: Workload) -> tuple[str, ...] | str:
    """The sizes of ``workload`` a symbolic trace would follow, or why it is traced at each
    size instead (a line)."""
    axes = AXES.get(workload.regime)
    if axes is None:
        return f"a {workload.regime} step is traced at each size"
    if workload.pp > 1:
        return "a step across pipeline stages is traced at each size"
    if workload.cp > 1:
        return "a step across context-parallel ranks is traced at each size"
    if workload.ep > 1:  # its expert mesh and token routing decide on the sizes
        return "a step across expert-parallel ranks is traced at each size"
    if workload.full_trace:
        return "full_trace=True traces every point as it is"
    return axes


def family_key(workload: Workload) -> tuple[Any, ...]:
    """What a symbolic trace of ``workload`` is shared by: every field but its sizes (the
    batch, and the lengths, which an inference step reads one of)."""
    return tuple(
        value for name, value in vars(workload).items() if name not in ("batch", "seq", "context")
    )


def numbers_of(symbolic: SymbolicTrace, workload: Workload) -> dict[str, int]:
    """The point ``workload`` is, in ``symbolic``'s axes."""
    return {name: getattr(workload, name) for name in symbolic.axes}


@paused_gc()
def trace_symbolic(model: Any, workload: Workload, cast_module: bool = False) -> SymbolicTrace:
    """Trace ``workload``'s step with its sizes as symbols (their numbers those of
    ``workload``); :class:`NotSymbolic` says why not (a size torch or the model fixed, a
    path that cannot run on symbols, a second point that traces otherwise)."""
    axes = symbolic_axes(workload)
    if isinstance(axes, str):
        raise NotSymbolic(axes)
    workload, note = resolve_seq(model, workload)
    module, label, beyond = build_step_model(model, workload, cast_module)
    sizes = SymbolicSizes({name: getattr(workload, name) for name in axes})
    try:
        with sizes.active():
            sizes.adopt(module)
            trace = run_step(module, workload)
        decisions = (*sizes.guards(), *sizes.decisions)
    except NotSymbolic:
        raise
    except Exception as error:  # noqa: BLE001 - any failure on symbols: traced at each size
        raise NotSymbolic(f"the step does not trace on symbolic sizes: {_reason(error)}") from error
    step_facts(trace, label, note, beyond)
    _check_text(trace)
    symbolic = SymbolicTrace(trace, dict(sizes.hints), decisions)
    if not symbolic.holds(numbers_of(symbolic, workload)):
        raise NotSymbolic("the traced point does not keep its own decisions")
    _check_second_point(symbolic, model, workload, cast_module)
    return symbolic


def _reason(error: BaseException) -> str:
    """The innermost cause's first line, without the C++ source location torch puts first."""
    while error.__cause__ is not None:
        error = error.__cause__
    return _SOURCE_LOCATION.sub("", first_line(error))


def _check_text(trace: Trace) -> None:
    """Text the step wrote that names a symbolic size would be wrong at every point."""
    texts = [a.what for a in trace.assumptions]
    texts += [v for v in vars(trace.facts).values() if isinstance(v, str)]
    if any(_SYMBOL_IN_TEXT.search(text) for text in texts):
        raise NotSymbolic("a note of the step names a size as a symbol")


def _check_second_point(
    symbolic: SymbolicTrace, model: Any, workload: Workload, cast_module: bool
) -> None:
    """The trace at a second point where every decision holds, against tracing that point
    afresh: any difference and the symbolic trace is refused."""
    from torchroof.api import trace_workload

    for tried, moved in enumerate(nearby(symbolic.axes)):
        if tried >= MAX_SECOND_POINTS:
            break
        if not symbolic.holds(moved):
            continue
        sizes: dict[str, Any] = dict(moved)
        other = replace(workload, **sizes)
        try:
            fresh = trace_workload(model, other, cast_module)
        except Exception:  # noqa: BLE001 - a point the model refuses: try the next
            continue
        made = symbolic_point(symbolic, model, other)
        if made is None or made != fresh or made.facts != fresh.facts:
            raise NotSymbolic(f"the trace at {moved} differs from tracing it afresh")
        symbolic.checked = (moved, fresh)  # a plan of it is checked there too
        return
    raise NotSymbolic("no second point near the traced one keeps its decisions")


def point_facts(
    symbolic: SymbolicTrace, model: Any, workload: Workload, config: Any = None
) -> StepFacts | None:
    """The facts a fresh trace of ``workload``'s point records (its Workload, tokens, cache
    positions, the model's name and notes); None where ``symbolic``'s decisions do not hold
    there. Raises what a fresh trace raises for the point (a length past the model's
    maximum positions, a plan the model cannot take). ``config`` is the model's config,
    when already loaded."""
    workload, note = resolve_seq(model, workload, config)
    label, _, beyond = step_checks(model, workload, config)
    numbers = numbers_of(symbolic, workload)
    if not symbolic.holds(numbers):
        return None
    facts = replace(
        symbolic.trace.facts,
        positions="",  # the traced point's note: this point's is set below, if any
        workload=workload,
        tokens=regime(workload.regime).tokens(workload),
        kv_cache_tokens=Values(numbers).of(symbolic.trace.facts.kv_cache_tokens),
    )
    named = Trace(facts=facts)
    step_facts(named, label, note, beyond)
    return named.facts


@paused_gc()
def symbolic_point(
    symbolic: SymbolicTrace, model: Any, workload: Workload, config: Any = None
) -> PricedTrace | None:
    """The trace of ``workload``'s point from ``symbolic`` (None where its decisions do not
    hold there): the same as :func:`torchroof.api.trace_workload` of it, op for op."""
    facts = point_facts(symbolic, model, workload, config)
    if facts is None:
        return None
    assert facts.workload is not None  # point_facts sets it
    trace = symbolic.at(numbers_of(symbolic, facts.workload))
    trace.facts = facts
    return PricedTrace.of(trace)

"""Kernels planned once for every size (torchroof/pricing/symbolic_plan.py): at any point
where the plan holds, a point's figures equal the figures of a fresh estimate of it, to
the last bit; its kernels equal grouping that point's trace afresh; the transient peak is
that trace's own; and a plan that would be wrong somewhere is not used."""

from dataclasses import replace

import pytest
from conftest import small_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchroof.api import estimate_trace
from torchroof.config import PricingOptions, Workload
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.price import plan_kernels
from torchroof.pricing.symbolic_plan import NotPlanned, plan_symbolic
from torchroof.records.dims import dim
from torchroof.records.expressions import Poly
from torchroof.records.ops import OpRecord
from torchroof.records.symbolic_trace import SymbolicTrace
from torchroof.records.tensors import TensorMeta
from torchroof.records.trace import Trace
from torchroof.report.compare import point_metrics
from torchroof.report.memory import transient_peak
from torchroof.symbolic import symbolic_point, trace_symbolic

CONFIG = small_llama(8)
DECODE = Workload(regime="decode", batch=3, context=32)
PREFILL = Workload(regime="prefill", batch=3, seq=32)
LENGTH = {"decode": "context", "prefill": "seq"}


@pytest.fixture(scope="module")
def traces():
    return {w.regime: trace_symbolic(CONFIG, w) for w in (DECODE, PREFILL)}


@pytest.fixture(scope="module")
def plans(traces):
    return {regime: plan_symbolic(t, PricingOptions()) for regime, t in traces.items()}


def _figures(traces, plans, regime, batch, length, hardware, pricing):
    """(the plan's figures, a fresh estimate's) at a point, or None where the plan does
    not hold there."""
    workload = replace(DECODE if regime == "decode" else PREFILL, batch=batch)
    workload = replace(workload, **{LENGTH[regime]: length})
    trace = symbolic_point(traces[regime], CONFIG, workload)
    numbers = {"batch": batch, LENGTH[regime]: length}
    if trace is None or not plans[regime].holds(numbers):
        return None
    spec, cluster = resolve_hardware(hardware)
    planned = plans[regime].metrics(numbers, trace.facts, spec, cluster, pricing)
    return planned, point_metrics(estimate_trace(trace, hardware, pricing=pricing))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.sampled_from(["decode", "prefill"]),
    st.integers(2, 48),
    st.integers(2, 2000),
    st.sampled_from(["h100-sxm", "a100-sxm", "l4", "dgx-h100"]),
    st.sampled_from(["roofline", "realistic"]),
)
def test_a_point_s_figures_equal_a_fresh_estimate_s(traces, plans, regime, batch, length, hw, mode):
    found = _figures(traces, plans, regime, batch, length, hw, PricingOptions(mode=mode))
    if found is not None:
        planned, fresh = found
        assert planned == fresh  # step time, tokens/s, MFU, traffic, memory, fit: every bit


def test_the_plan_holds_over_the_whole_decode_grid(traces, plans):
    """One plan serves every batch from 2 to 40 and every context from 256 to 6400: the
    on-chip spill flag is decided per point, not by the plan."""
    plan = plans["decode"]
    assert all(
        plan.holds({"batch": b, "context": c}) for b in range(2, 41) for c in range(256, 6401, 256)
    )
    assert sum(1 for _ in plan.order) == len(plan.plan.kernels)
    assert len(plan.classes) < len(plan.plan.kernels)  # the copies' kernels timed once


@pytest.mark.parametrize("regime, batch, length", [("decode", 9, 1500), ("prefill", 4, 77)])
def test_kernels_and_peak_equal_the_point_s_own(traces, plans, regime, batch, length):
    workload = replace(DECODE if regime == "decode" else PREFILL, batch=batch)
    workload = replace(workload, **{LENGTH[regime]: length})
    trace = symbolic_point(traces[regime], CONFIG, workload)
    numbers = {"batch": batch, LENGTH[regime]: length}
    fresh = plan_kernels(trace, PricingOptions())
    assert plans[regime].kernels_at(numbers) == fresh.kernels
    # the fused kernels' peak: what they write out (eager keeps more: each op's output)
    fused = transient_peak(trace, fresh.roles, fresh.residency)
    assert plans[regime].lives.peak(numbers) == fresh.peak == fused
    assert fused.total_bytes < transient_peak(trace).total_bytes


def test_a_plan_held_to_a_second_point_refuses_what_differs(traces, monkeypatch):
    """The check made once per plan: its kernels at a point near the traced one against
    grouping that point's trace afresh."""
    import torchroof.pricing.symbolic_plan as symbolic_plan

    def off(trace, pricing):
        plan = original(trace, pricing)
        return replace(plan, kernels=plan.kernels[1:])

    original = symbolic_plan.plan_kernels
    monkeypatch.setattr(symbolic_plan, "plan_kernels", off)
    with pytest.raises(NotPlanned, match="differ from grouping that trace afresh"):
        plan_symbolic(traces["decode"], PricingOptions())


def test_views_of_a_storage_that_differ_must_stay_apart():
    """Work on the sized trace keys a tensor by its layout: a view [b, 4] and a view [8, 4]
    of one storage are two keys there, one at b = 8, where the plan would count twice what
    a fresh plan counts once."""
    b = dim(3, Poly.symbol("batch"))
    views = (TensorMeta((b, 4), (4, 1), "float32", 7), TensorMeta((8, 4), (4, 1), "float32", 7))
    op = OpRecord(0, "aten.add.Tensor", views, (), {}, "", "forward")
    symbolic = SymbolicTrace(Trace(ops=[op]), {"batch": 3}, ())
    assert symbolic.views_apart({"batch": 3}) and symbolic.views_apart({"batch": 9})
    assert not symbolic.views_apart({"batch": 8})


def test_a_kernel_made_by_its_generated_function_is_the_kernel_evaluated(traces, plans):
    """The per-point path makes each timed kernel by one generated function
    (symbolic_plan.KernelMaker); it must be what evaluating the planned kernel gives."""
    from torchroof.pricing.symbolic_plan import KernelMaker, kernel_at
    from torchroof.records.symbolic_trace import Values

    for regime, plan in plans.items():
        numbers = {"batch": 7, LENGTH[regime]: 333}
        for i in plan.classes:
            kernel = plan.plan.kernels[i]
            made = KernelMaker(kernel, plan.symbolic.axes)(numbers)
            assert made == kernel_at(kernel, Values(numbers))
            assert made.ops == kernel_at(kernel, Values(numbers)).ops


def test_a_plan_anchored_at_another_point_prices_it_as_fresh(traces):
    """A point that keeps the trace's decisions but not a plan's gets a plan of its own,
    with the sizes' traced values moved to the point (SymbolicTrace.anchored): the same
    expressions, decided there."""
    symbolic = traces["decode"]
    numbers = {"batch": 9, "context": 1500}
    moved = symbolic.anchored(numbers)
    assert moved.axes == numbers and moved.at({"batch": 4, "context": 77}) == symbolic.at(
        {"batch": 4, "context": 77}
    )
    plan = plan_symbolic(moved, PricingOptions())
    found = _figures(traces, {"decode": plan}, "decode", 9, 1500, "h100-sxm", PricingOptions())
    assert found is not None and found[0] == found[1]


def test_one_plan_holds_past_every_projection_s_weight(traces, plans):
    """A sibling kernel's domain (its largest tensor) is worked out only for the kernels a
    sibling is weighed against: the larger of a projection's weight and its activation is
    not a decision of the plan. Here the k and v weights hold 64 x 128 = 8,192 elements,
    a decode's hidden states 128 per sequence, so a plan that compared them stopped at a
    batch of 64 (q 16,384: 128; the MLP's 352 x 128: 352); it holds up to 1,000, past
    which the embedding's lookups outnumber its 1,000 rows (its rule reads each row at
    most once)."""
    plan = plans["decode"]
    assert all(plan.holds({"batch": b, "context": 256}) for b in (63, 64, 128, 352, 1000))
    assert not plan.holds({"batch": 1001, "context": 256})
    found = _figures(traces, plans, "decode", 400, 256, "h100-sxm", PricingOptions())
    assert found is not None and found[0] == found[1]


def test_a_point_s_kernels_are_made_once_for_every_timing(traces, plans):
    """A step's graphed and eager launches time the same kernels: each timed kernel is
    made once at a point and timed under both."""
    plan = plan_symbolic(traces["decode"], PricingOptions())
    numbers = {"batch": 5, "context": 200}
    workload = replace(DECODE, batch=5, context=200)
    facts = symbolic_point(traces["decode"], CONFIG, workload).facts
    spec, cluster = resolve_hardware("h100-sxm")
    for graphs in (True, False):
        pricing = PricingOptions(mode="realistic", runtime="vllm", cuda_graphs=graphs)
        plan.repeated(numbers, facts, spec, cluster, pricing)
        assert len(plan._made) == len(plan.classes)

"""Kernels of repeated layers built once (torchroof/kernels/repeats.py) are the kernels of
the whole step grouped op by op: the checked-in results of examples/repeated_kernels_check.py
on the zoo's 29 architectures (prefill and decode, three kernel policies), three of them
rerun live, estimates of copied steps against steps that ran every layer, and the checks
that make a step be grouped whole."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import small_llama
from hypothesis import given, settings
from hypothesis import strategies as st

import torchroof
from torchroof.config import PricingOptions
from torchroof.kernels.fusion import build_kernels
from torchroof.kernels.repeats import (
    MIN_PERIODS,
    RepeatedRun,
    _periods_alike,
    repeated_kernels,
    repeated_run,
)
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, TensorRef
from torchroof.records.trace import CopiedSpan
from torchroof.workloads import run_workload

RESULTS = json.loads((Path(__file__).parent / "data" / "repeated_kernels.json").read_text())
ROWS = {(r["architecture"], r["regime"]): r for r in RESULTS}
POLICIES = ("fused", "eager", "epilogue")
# No run of five alike periods: two layers only (bloom), layers of several kinds whose
# copies do not follow each other back to back (jamba, recurrent_gemma), layers not
# copied (zamba2, minimax), an encoder-decoder's two short stacks (t5).
NO_RUN = {"bloom", "jamba", "recurrent_gemma", "zamba2", "minimax", "t5"}


def test_the_checked_in_results_cover_every_step_and_agree():
    assert len(RESULTS) == 29 * 2
    assert [k for k, r in ROWS.items() if r["differences"]] == []
    assert {a for (a, _), r in ROWS.items() if r["periods"] == 0} == NO_RUN
    # Llama-3-8B's default config: 32 layers, two traced, 30 copies of 79 ops each
    assert (ROWS[("llama", "prefill")]["periods"], ROWS[("llama", "prefill")]["length"]) == (30, 79)
    # a linear-attention model whose grouping splits column reductions is grouped whole
    # under fusion (its kernels hold ops the grouping made), built once when eager
    assert ROWS[("qwen3_next", "decode")]["built_once"] == ["eager"]
    built_whole = {k for k, r in ROWS.items() if r["periods"] and r["built_once"] != list(POLICIES)}
    assert built_whole == {("qwen3_next", "prefill"), ("qwen3_next", "decode")}


@pytest.mark.parametrize(
    "architecture, regime", [("llama", "decode"), ("gemma2", "prefill"), ("deepseek_v3", "decode")]
)
def test_a_rerun_matches_the_checked_in_result(architecture, regime):
    """A stack of alike layers, an interleave (a period of two layers: sliding window and
    global) and latent attention with routed experts after dense first layers."""
    from torchroof.validation.zoo import repeated_kernels_check

    check = repeated_kernels_check(architecture, regime)
    row = ROWS[(architecture, regime)]
    assert check.differences == []
    assert (check.periods, check.length, check.kernels) == (
        row["periods"],
        row["length"],
        row["kernels"],
    )
    assert check.built_once == row["built_once"] == list(POLICIES)


def eight_layers():
    from torchroof.models.sources import build_model

    return build_model(small_llama(8), torch.bfloat16)


def traced(regime="decode", full=False, **knobs):
    workload = torchroof.Workload(regime, full_trace=full, **knobs)
    return torchroof.Trace.of(run_workload(eight_layers(), workload))


def policy_and_roles(trace, **options):
    return PricingOptions(**options).kernels_only(), dict(trace.roles)


def test_eight_layers_build_six_copies_once():
    """Layers 0 and 1 run, layers 2-7 are copies: six periods of one layer each."""
    trace = traced(batch=2, context=64)
    run = repeated_run(trace.ops, trace.copies)
    assert run is not None and run.periods == 6
    assert trace.ops[run.start].module.startswith("model.layers.2")
    assert trace.ops[run.end - 1].module == "model.layers.7"  # its residual add
    policy, roles = policy_and_roles(trace)
    assert repeated_kernels(trace.ops, trace.copies, policy, roles) == build_kernels(
        trace.ops, policy, roles
    )


def same(a, b) -> bool:
    """Every field of two estimates but the line that says how the layers were traced."""
    data = [e.to_dict() for e in (a, b)]
    for d in data:
        d["metadata"].pop("repeated_layers", None)
        d["metadata"].get("workload", {}).pop("full_trace", None)
    return json.dumps(data[0], sort_keys=True) == json.dumps(data[1], sort_keys=True)


@settings(max_examples=6, deadline=None)
@given(
    regime=st.sampled_from(["prefill", "decode"]),
    batch=st.integers(1, 8),
    length=st.integers(1, 300),
    mode=st.sampled_from(["roofline", "realistic"]),
)
def test_an_estimate_equals_the_step_that_ran_every_layer(regime, batch, length, mode):
    knobs = dict(batch=batch, context=length) if regime == "decode" else dict(seq=length)
    copied, full = traced(regime, False, **knobs), traced(regime, True, **knobs)
    assert repeated_run(copied.ops, copied.copies) is not None and not full.copies
    assert same(copied.estimate("h100-sxm", mode=mode), full.estimate("h100-sxm", mode=mode))


def test_ops_no_rule_counts_are_counted_in_every_layer(monkeypatch):
    """Without a rule for rsqrt, every RMSNorm's is uncounted: two per layer and the final
    norm, 2 x 8 + 1 = 17, as grouping every op counts them."""
    from torchroof.counters import registry as registry_module

    rules = dict(registry_module._REGISTRY)
    rules.pop("aten.rsqrt")
    monkeypatch.setattr(registry_module, "_REGISTRY", rules)
    trace = traced(batch=1, context=32)
    policy, roles = policy_and_roles(trace)
    once = repeated_kernels(trace.ops, trace.copies, policy, roles)
    assert once is not None
    assert once[1].uncounted == {"aten.rsqrt.default": 17}
    assert once == build_kernels(trace.ops, policy, roles)


def with_op(trace, index, op):
    ops = list(trace.ops)
    ops[index] = op
    return ops


def test_a_copy_that_differs_is_grouped_whole():
    """Period 4 reads a storage of its own where the others read their predecessor's, or
    one of its ops has another shape: the periods are not alike, so no kernel is copied."""
    trace = traced(batch=1, context=32)
    run = repeated_run(trace.ops, trace.copies)
    policy, roles = policy_and_roles(trace)
    i = run.period(4)[10]
    op = trace.ops[i]
    stray = TensorMeta(op.inputs[0].shape, op.inputs[0].stride, op.inputs[0].dtype, 10**9)
    rewired = dataclasses.replace(op, inputs=(stray, *op.inputs[1:]))
    assert repeated_kernels(with_op(trace, i, rewired), trace.copies, policy, roles) is None
    t = op.outputs[0]
    wider = TensorMeta((*t.shape[:-1], t.shape[-1] + 1), t.stride, t.dtype, t.storage, t.offset)
    reshaped = dataclasses.replace(op, outputs=(wider, *op.outputs[1:]))
    assert repeated_kernels(with_op(trace, i, reshaped), trace.copies, policy, roles) is None


def test_a_step_reading_a_dropped_period_after_the_run_is_grouped_whole():
    """The final norm reads a tensor that only period 3 made: the short versions of the
    step could not hold it, so the step is grouped whole."""
    trace = traced(batch=1, context=32)
    run = repeated_run(trace.ops, trace.copies)
    policy, roles = policy_and_roles(trace)
    made = trace.ops[run.period(3)[5]].outputs[0]
    after = trace.ops[run.end]
    rewired = dataclasses.replace(after, inputs=(made, *after.inputs[1:]))
    assert repeated_kernels(with_op(trace, run.end, rewired), trace.copies, policy, roles) is None


def test_a_training_step_is_grouped_whole():
    trace = traced("train", batch=1, seq=32)
    policy, roles = policy_and_roles(trace)
    assert repeated_kernels(trace.ops, trace.copies, policy, roles) is None


def spans(first, sources, count=10, gap_after=None):
    out, at = [], first
    for n, source in enumerate(sources):
        out.append(CopiedSpan(at, count, source))
        at += count + (5 if n == gap_after else 0)
    return out


OPS: list[OpRecord] = [None] * 10_000  # type: ignore[list-item]  # only the length is read


def test_a_run_is_the_longest_chain_of_back_to_back_copies_at_its_shortest_period():
    assert repeated_run(OPS, spans(100, [0] * 12)) == RepeatedRun(100, 10, 12)
    # an interleave of two kinds: a period of two layers, 20 ops
    assert repeated_run(OPS, spans(100, [0, 50] * 6)) == RepeatedRun(100, 20, 6)
    # a gap after the sixth copy: two chains, of six and eight copies; the longer wins
    assert repeated_run(OPS, spans(100, [0] * 14, gap_after=5)) == RepeatedRun(165, 10, 8)
    # an odd copy at the end is not part of the run
    assert repeated_run(OPS, spans(100, [0, 50] * 6 + [0])) == RepeatedRun(100, 20, 6)
    assert repeated_run(OPS, spans(100, [0] * (MIN_PERIODS - 1))) is None
    # a run reaching past the ops is refused (spans of another trace)
    assert repeated_run(OPS[:150], spans(100, [0] * 12)) is None


def test_a_period_reaching_two_periods_back_is_grouped_whole():
    """x[t + 2] = x[t] + x[t + 1]: each period reads what the period before it made and what
    the one before that made. Each period relates to the one before it as the second does
    to the first, so labelling each storage by where the period before touched it passes;
    a storage first touched two periods back refuses the periods as alike."""

    def t(sid):
        return TensorMeta((4,), (1,), "float32", 100 + sid)

    def add(index, a, b, out):
        args = {"self": TensorRef(0), "other": TensorRef(1)}
        return OpRecord(index, "aten.add.Tensor", (t(a), t(b)), (t(out),), args, "m", "forward")

    ops = [add(0, 90, 91, 0), add(1, 90, 91, 1)]  # x0 and x1, before the run
    ops += [add(2 + k, k, k + 1, k + 2) for k in range(8)]  # eight periods of one op
    copies = [CopiedSpan(2 + k, 1, 2) for k in range(1, 8)]
    assert repeated_run(ops, copies) == RepeatedRun(3, 1, 7)  # the copies: periods 1 to 7
    assert _periods_alike(ops, RepeatedRun(3, 1, 7)) is None
    policy = PricingOptions().kernels_only()
    assert repeated_kernels(ops, copies, policy, {}) is None

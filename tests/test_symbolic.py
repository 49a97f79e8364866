"""A step traced once with its sizes as symbols (torchroof/symbolic.py,
torchroof/capture/symbolic.py, torchroof/records/symbolic_trace.py): the trace of any point
that keeps its decisions is the trace a fresh trace of that point records, op for op and
fact for fact; a point that does not is refused, and a step that cannot be traced on
symbols says why in one line."""

from dataclasses import replace

import pytest
from conftest import small_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchroof.api import trace_workload
from torchroof.capture.storage import unit_strides
from torchroof.capture.symbolic import NotSymbolic
from torchroof.config import Workload
from torchroof.records.dims import Dim
from torchroof.records.expressions import Poly
from torchroof.symbolic import family_key, symbolic_axes, symbolic_point, trace_symbolic

# eight layers: two traced, six copies (torchroof/capture/replay.py), as a big model's are
CONFIG = small_llama(8)
DECODE = Workload(regime="decode", batch=3, context=32)
PREFILL = Workload(regime="prefill", batch=3, seq=32)


@pytest.fixture(scope="module")
def decode():
    return trace_symbolic(CONFIG, DECODE)


@pytest.fixture(scope="module")
def prefill():
    return trace_symbolic(CONFIG, PREFILL)


def test_sizes_are_recorded_as_the_polynomials_they_follow(decode):
    trace = decode.trace
    assert decode.axes == {"batch": 3, "context": 32}
    # the static cache's K of a layer: [batch, 2 KV heads, context + 1 slots, 32]
    kv = next(t for op in trace.ops for t in op.inputs if trace.roles.get(t.storage) == "kv_cache")
    assert kv.shape[1:] == (2, 33, 32) and isinstance(kv.shape[0], Dim)
    assert kv.shape[0].expr is Poly.symbol("batch")
    assert kv.shape[2].expr is Poly.symbol("context") + Poly.constant(1)
    # the cache holds 8 layers x (K + V) x b x 2 x (c + 1) x 32 x 2 bytes = 2048·b·(c + 1)
    kv_bytes = trace.role_bytes["kv_cache"]
    assert kv_bytes == 8 * 2 * 3 * 2 * 33 * 32 * 2
    assert kv_bytes.expr.at({"batch": 5, "context": 99}) == 8 * 2 * 5 * 2 * 100 * 32 * 2
    assert "6 copied" in trace.facts.repeated_layers


@pytest.mark.parametrize("batch, length", [(3, 32), (2, 17), (16, 1000), (7, 2)])
def test_a_point_is_the_trace_a_fresh_trace_records(decode, prefill, batch, length):
    for symbolic, workload, name in ((decode, DECODE, "context"), (prefill, PREFILL, "seq")):
        point = replace(workload, batch=batch, **{name: length})
        made = symbolic_point(symbolic, CONFIG, point)
        fresh = trace_workload(CONFIG, point)
        assert made is not None
        assert made == fresh  # every op: name, tensors, arguments, module, phase; storages
        assert made.facts == fresh.facts and made.role_bytes == fresh.role_bytes
        assert [(c.first, c.count) for c in made.copies] == [
            (c.first, c.count) for c in fresh.copies
        ]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(2, 64), st.integers(1, 3000))
def test_any_decode_point_is_a_fresh_trace(decode, batch, context):
    point = replace(DECODE, batch=batch, context=context)
    made = symbolic_point(decode, CONFIG, point)
    assert made == trace_workload(CONFIG, point) and made.facts.tokens == batch


def test_a_batch_of_one_does_not_keep_the_decisions(decode, prefill):
    """A batch of 1 broadcasts where a batch of 2 or more does not (torch's meta kernels
    decide it on the size), and so does a prefill of one token: the symbolic trace refuses
    the point."""
    numbers = {"batch": 1, "context": 32}
    assert not decode.holds(numbers)
    assert "not (-1 + 1*batch == 0)" in {str(d) for d in decode.failed(numbers)}
    assert symbolic_point(decode, CONFIG, replace(DECODE, batch=1)) is None
    assert "not (-1 + 1*seq == 0)" in {str(d) for d in prefill.failed({"batch": 3, "seq": 1})}


def test_a_point_is_refused_as_a_fresh_trace_refuses_it(decode):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        symbolic_point(decode, CONFIG, replace(DECODE, context=5000))


def test_which_steps_are_traced_on_symbols():
    assert symbolic_axes(DECODE) == ("batch", "context")
    assert symbolic_axes(PREFILL) == ("batch", "seq")
    assert "train" in symbolic_axes(Workload(regime="train"))
    assert symbolic_axes(replace(DECODE, tp=2)) == ("batch", "context")  # test_symbolic_parallel
    assert "pipeline stages" in symbolic_axes(replace(DECODE, pp=2))
    assert "full_trace" in symbolic_axes(replace(DECODE, full_trace=True))
    with pytest.raises(NotSymbolic, match="train step is traced at each size"):
        trace_symbolic(CONFIG, Workload(regime="train"))
    # one symbolic trace serves every batch and length of a step, not another cache
    assert family_key(DECODE) == family_key(replace(DECODE, batch=9, context=4, seq=4))
    assert family_key(DECODE) != family_key(replace(DECODE, cache="dynamic"))


def test_a_second_point_that_traces_otherwise_refuses_the_symbolic_trace(monkeypatch):
    """The check made once per symbolic trace: a point near the traced one, traced afresh,
    must equal the trace made from the symbols."""
    import torchroof.symbolic as symbolic

    def off(symbolic_trace, model, workload, config=None):
        made = original(symbolic_trace, model, workload, config)
        made.ops = made.ops[:-1]
        return made

    original = symbolic.symbolic_point
    monkeypatch.setattr(symbolic, "symbolic_point", off)
    with pytest.raises(NotSymbolic, match=r"the trace at \{'batch': 4, 'context': 33\} differs"):
        trace_symbolic(CONFIG, DECODE)


def test_a_step_that_cannot_run_on_symbols_says_why_in_a_line(capfd):
    """Bloom's ALiBi bias meets a meta kernel that wants concrete sizes: traced at each size,
    with the reason, and nothing of torch's on stderr."""
    from transformers import BloomConfig

    bloom = BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256)
    with pytest.raises(NotSymbolic, match="does not trace on symbolic sizes") as caught:
        trace_symbolic(bloom, PREFILL)
    assert "\n" not in str(caught.value)
    assert "failed while attempting" not in capfd.readouterr().err


def test_a_size_one_dimension_has_one_stride():
    """torch's C++ and symbolic kernels give a size-1 dimension different strides for the
    same tensor; the trace records one: packed against the dimension inside it."""
    assert unit_strides((8, 4, 1, 32), (128, 32, 128, 1)) == (128, 32, 32, 1)
    assert unit_strides((8, 4, 1, 32), (128, 32, 32, 1)) == (128, 32, 32, 1)
    assert unit_strides((2, 1), (1, 7)) == (1, 1)
    assert unit_strides((4, 5), (5, 1)) == (4, 5)[:0] + (5, 1)

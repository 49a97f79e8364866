"""Sizes as symbols (torchroof/records/dims.py, expressions.py): a Dim is its traced int,
follows its expression through arithmetic, writes every comparison down, and evaluates at
other numbers exactly as the same Python code would run there."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchroof.records.dims import Dim, DimFloat, dim, follow, has_dims, isqrt, log2, value_of
from torchroof.records.expressions import (
    Decision,
    Node,
    Poly,
    compile_check,
    compile_values,
    deciding,
    evaluate,
)

B, C = Poly.symbol("batch"), Poly.symbol("context")


def sizes(batch: int = 8, context: int = 100) -> tuple[int, int]:
    return dim(batch, B), dim(context, C)


def test_polynomials_are_interned_and_canonical():
    assert B * C + B is C * B + B  # one object for one polynomial
    two_b = B * Poly.constant(2)
    assert (two_b - B - B).is_constant and (two_b - B - B).constant_term == 0
    # (b + 1)(b - 1) = b² - 1; at b = 7: 48
    assert ((B + Poly.constant(1)) * (B - Poly.constant(1))).at({"batch": 7}) == 48
    # 8192·b·c / c = 8192·b; 3·b / 2 leaves a remainder at odd b: not a polynomial
    assert (B * C * Poly.constant(8192)).divided(C) is B * Poly.constant(8192)
    assert (B * Poly.constant(3)).divided(Poly.constant(2)) is None


def test_a_dim_is_its_traced_int_and_follows_its_polynomial():
    b, c = sizes()
    numel = math.prod((b, 8, c, 128))  # a KV cache [b, 8, c, 128]
    assert numel == 8 * 8 * 100 * 128  # 819,200 at the traced point
    assert isinstance(numel, Dim) and numel.expr is B * C * Poly.constant(1024)
    assert numel.expr.at({"batch": 3, "context": 10}) == 3 * 8 * 10 * 128
    # an exact floor division stays a polynomial: rows = numel // (c · 128) = 8·b
    assert (numel // (c * 128)).expr is B * Poly.constant(8)
    # a remainder that no point can leave (1024·b·c % 64) is zero, a plain 0
    assert type(numel % 64) is int and numel % 64 == 0


def test_comparisons_answer_at_the_traced_point_and_are_written_down():
    b, c = sizes()
    with deciding() as log:
        assert b * 8192 > 8192  # 65,536 > 8,192
        assert not c < 64
        assert max(b, 16) == 16
        assert b * c == c * b  # one expression: no decision
        assert (b * 0 + 5) > 4  # a number: no decision
    found = {str(d) for d in log}
    assert found == {"-8192 + 8192*batch > 0", "not (64 + -1*context > 0)", "16 + -1*batch > 0"}
    check = compile_check(list(log), ["batch", "context"])
    assert check(batch=8, context=100) and check(batch=2, context=64)
    assert not check(batch=1, context=100)  # 8192·1 > 8192 is false there
    assert not check(batch=8, context=63)
    assert not check(batch=16, context=100)  # max(16, 16) is 16 either way, but b < 16 is not


def test_float_work_on_sizes_is_repeated_bit_for_bit():
    """A causal attention's kept fraction and the FLOPs rounded from it (counters/attention.py:
    round(W · (n(n + 1)/2) / n²)): evaluated at other numbers, the same float operations in
    the same order as running the code there."""
    b, c = sizes()

    def causal_flops(batch, context):
        flops = 4 * batch * 32 * context * context * 128
        kept = context * (context + 1) // 2
        return round(flops * (kept / (context * context)))

    traced = causal_flops(b, c)
    assert isinstance(traced, Dim) and traced == causal_flops(8, 100)
    values = compile_values([traced.expr], ["batch", "context"])
    for batch, context in [(1, 1), (3, 7), (17, 4093), (64, 131071)]:
        expected = causal_flops(batch, context)
        assert values(batch=batch, context=context) == (expected,)
        assert evaluate(traced.expr, {"batch": batch, "context": context}) == expected
    ratio = b / c
    assert isinstance(ratio, DimFloat) and ratio == 0.08
    assert isinstance(ratio.expr, Node) and ratio.expr.op == "truediv"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10_000), st.integers(1, 100_000))
def test_any_point_evaluates_as_the_code_runs_there(batch, context):
    b, c = sizes()

    def work(x, y):
        rows = x * y
        blocks = math.ceil(rows / 128)
        share = (y - 1) / (x * y)
        return blocks * 3 + rows // 7 + round(share * 1e6) + (x * 4096) % 1000

    traced = work(b, c)
    assert evaluate(traced.expr, {"batch": batch, "context": context}) == work(batch, context)


def test_leaving_the_expressions_fixes_the_traced_value_and_says_so():
    b, c = sizes()
    with deciding() as log:
        assert f"{b:,}" == "8"  # text
        assert int(b) == 8
        assert float(c // 50) == 2.0
    assert {str(d) for d in log} == {"-8 + 1*batch == 0", "floordiv(1*context, 50) == 2"}


def test_what_python_reads_past_the_methods_is_not_seen():
    """range() and a list index read an int subclass's value without asking it (CPython's
    index protocol takes any int as it is): code over sizes takes int() first (as
    kernels/column_reductions.py does), and a plan is held to a second point afresh
    (pricing/symbolic_plan.py) for what is missed."""
    _, c = sizes()
    with deciding() as log:
        assert len(range(c)) == 100
        assert [1, 2, 3][c // 50] == 3
    assert len(log) == 0


def test_math_on_sizes_through_the_helpers_follows():
    # math.log2 reads an int's value directly: the helpers keep the expression
    b, c = sizes(8, 100)
    assert isinstance(log2(c), DimFloat) and log2(c) == math.log2(100)
    assert math.ceil(log2(c)).expr.op == "ceil"
    assert evaluate(math.ceil(log2(c)).expr, {"context": 5000}) == 13  # ceil(12.29)
    assert isqrt(c * c) == 100 and evaluate(isqrt(c * c).expr, {"context": 7}) == 7


def test_dict_keys_are_equal_only_when_their_expressions_are():
    b, c = sizes(8, 8)  # equal here, different expressions
    assert len({(b, 4): 1, (c, 4): 2}) == 2
    assert len({(b, 4): 1, (dim(8, B), 4): 2}) == 1


def test_helpers_and_refusals():
    b, c = sizes()
    assert value_of(b) == 8 and type(value_of(b)) is int
    assert has_dims({"x": [1, (2, c)]}) and not has_dims({"x": [1, (2, 3)]})
    assert follow(5, Poly.constant(5)) == 5 and type(follow(5, Poly.constant(5))) is int
    # a check that divides by zero at a point does not hold there (a size of 0)
    decision = Decision(Node("floordiv", (Poly.constant(100), B)), ">", 1, True)
    check = compile_check([decision], ["batch"])
    assert check(batch=50) and not check(batch=0)
    with pytest.raises(TypeError):
        _ = b + "x"

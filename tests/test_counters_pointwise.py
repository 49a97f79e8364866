"""Elementwise, cast, view and data-movement rules (elementwise intensity:
docs/concepts/compulsory-bytes.md; views cost nothing)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchroof.counters import cost_of

import torchroof


def _ops(fn, *tensors):
    with torchroof.trace() as t:
        fn(*tensors)
    return t.ops


def _only(fn, *tensors):
    ops = [op for op in _ops(fn, *tensors) if cost_of(op).bytes]
    assert len(ops) == 1, [op.name for op in ops]
    return ops[0], cost_of(ops[0])


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_residual_add_bf16_is_six_bytes_per_element():
    n = 8 * 8192
    _, cost = _only(torch.add, _meta(8, 8192), _meta(8, 8192))
    assert cost.flops == n  # 1 FLOP / element
    assert cost.bytes == 6 * n  # two bf16 reads + one bf16 write = 3·s = 6 bytes / element
    assert cost.intensity == pytest.approx(1 / 6)  # residual add in bf16: I = 0.17
    assert round(cost.intensity, 2) == 0.17
    assert cost.unit == "vector"


def test_broadcast_input_is_read_once():
    # x[4096, 1024] + bias[1024] broadcast over rows: reads x once and bias once.
    op, cost = _only(torch.add, _meta(4096, 1024), _meta(1024))
    assert cost.bytes_read == 2 * (4096 * 1024 + 1024)
    assert cost.bytes_written == 2 * 4096 * 1024


def test_expanded_input_reads_its_unique_elements():
    row = _meta(1, 1024).expand(4096, 1024)  # stride 0 on dim 0
    _, cost = _only(torch.mul, row, _meta(4096, 1024))
    assert cost.bytes_read == 2 * (1024 + 4096 * 1024)


def test_same_tensor_twice_is_read_once():
    a = _meta(1000)
    _, cost = _only(torch.add, a, a)  # tinygrad's a + a: one read, one write
    assert cost.bytes == 2 * 1000 + 2 * 1000


def test_in_place_op_reads_and_writes_self():
    a, b = _meta(1000), _meta(1000)
    _, cost = _only(lambda x, y: x.add_(y), a, b)
    assert cost.bytes_read == 2 * 2000  # self and other
    assert cost.bytes_written == 2 * 1000  # self


def test_cast_moves_bytes_with_zero_flops():
    # bf16 -> fp32 cast, 0 FLOP, 6 bytes / element
    _, cost = _only(lambda x: x.float(), _meta(1024))
    assert cost.flops == 0
    assert cost.bytes == 6 * 1024


def test_views_cost_nothing_and_copies_cost_their_bytes():
    x = _meta(64, 32)

    def chain(x):
        y = x.view(32, 64).transpose(0, 1).unsqueeze(0)[:, :16].expand(4, 16, 32)
        return y.contiguous()

    ops = _ops(chain, x)
    costs = {op.name: cost_of(op) for op in ops}
    for name in (
        "aten.view.default",
        "aten.transpose.int",
        "aten.unsqueeze.default",
        "aten.slice.Tensor",
        "aten.expand.default",
    ):
        assert costs[name].bytes == 0 and costs[name].flops == 0, name
    # contiguous() of the [4, 16, 32] expanded view: reads its 16·32 unique elements,
    # writes all 4·16·32 of the copy
    clone = costs["aten.clone.default"]
    assert clone.bytes_read == 2 * 16 * 32
    assert clone.bytes_written == 2 * 4 * 16 * 32


def test_rmsnorm_pieces_and_silu_flops():
    _, silu = _only(torch.nn.functional.silu, _meta(100))
    # silu = x·sigmoid(x) = x / (1 + exp(-x)): neg, exp, add, div, mul = 5 FLOPs/element
    # (with the gate product, 6: SwiGLU "~6")
    assert silu.flops == 5 * 100 == 500
    assert silu.unit == "vector"
    _, rsqrt = _only(torch.rsqrt, _meta(100, dtype=torch.float32))
    assert rsqrt.unit == "sfu" and rsqrt.flops == 100
    _, square = _only(lambda x: x.pow(2), _meta(100))
    assert square.flops == 100 and square.unit == "vector"  # x² is one multiply
    _, gelu = _only(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), _meta(100))
    assert gelu.flops == 12 * 100  # GELU (tanh) ~12 FLOP / element


def test_reduction_reads_input_writes_output():
    _, cost = _only(lambda x: x.float().mean(-1, keepdim=True), _meta(64, 128, dtype=torch.float32))
    assert cost.flops == 64 * 128
    assert cost.bytes_read == 4 * 64 * 128 and cost.bytes_written == 4 * 64


def test_softmax_and_backward():
    x = torch.empty(32, 1000, device="meta", requires_grad=True)
    with torchroof.trace() as t:
        torch.softmax(x, -1).sum().backward()
    soft = next(op for op in t.ops if op.name == "aten._softmax.default")
    back = next(op for op in t.ops if op.name == "aten._softmax_backward_data.default")
    assert cost_of(soft).flops == 5 * 32 * 1000
    assert cost_of(soft).bytes == 4 * 2 * 32 * 1000
    assert cost_of(back).flops == 4 * 32 * 1000
    assert back.phase == "backward"


def test_embedding_reads_only_the_gathered_rows():
    weight = _meta(128256, 4096)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    _, cost = _only(torch.nn.functional.embedding, ids, weight)
    # 16 rows of 4096 bf16 read (not the 1 GB table) + 16 int64 indices; 16 rows written
    assert cost.bytes_read == 16 * 4096 * 2 + 16 * 8
    assert cost.bytes_written == 16 * 4096 * 2


def test_cat_reads_inputs_and_writes_output():
    _, cost = _only(lambda a, b: torch.cat([a, b], -1), _meta(8, 100), _meta(8, 28))
    assert cost.bytes_read == 2 * 8 * 128 and cost.bytes_written == 2 * 8 * 128


def test_index_put_accumulate_reads_and_writes_scattered_rows():
    target = _meta(1000, 64)
    index = torch.zeros(10, dtype=torch.long, device="meta")
    values = _meta(10, 64)
    _, cost = _only(lambda t, i, v: t.index_put_((i,), v, accumulate=True), target, index, values)
    # reads values (10·64 bf16) + indices (10 int64) + the 10 touched rows; writes 10 rows
    assert cost.bytes_read == 2 * 640 + 8 * 10 + 2 * 640
    assert cost.bytes_written == 2 * 640


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 64),
    cols=st.integers(1, 64),
    broadcast=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
)
def test_binary_pointwise_bytes_property(rows, cols, broadcast, dtype):
    """For any shape: W = n, Q = s·(n + unique(other) + n)."""
    a = _meta(rows, cols, dtype=dtype)
    b = _meta(cols, dtype=dtype) if broadcast else _meta(rows, cols, dtype=dtype)
    _, cost = _only(torch.mul, a, b)
    s, n = dtype.itemsize, rows * cols
    other = cols if broadcast else n
    assert cost.flops == n
    assert cost.bytes_read == s * (n + other)
    assert cost.bytes_written == s * n

"""Reductions, scans, softmax and selection (topk, sort).

Each is one pass over its input: read the input once, write the (smaller) output once.
FLOPs are per *input* element (softmax ~6 per element, online, one pass: Milakov &
Gimelshein 2018).
"""

from __future__ import annotations

import math

from torchroof.counters.cost import Cost
from torchroof.counters.registry import register, register_per_element
from torchroof.counters.tensors import compute_dtype, io_bytes, tensor_arg

from torchroof.records.dims import log2
from torchroof.records.ops import OpRecord

# FLOPs per input element for one-pass reductions and scans, per kind (counters/registry.py
# OP_KINDS). Sum and mean: over leading dimensions a column reduction.
SUM_FLOPS: dict[str, int] = {
    "sum": 1,  # one add
    "mean": 1,  # add; the final divide is per output element (negligible)
}
# Reductions along rows, fused with their producers and consumers.
ROW_REDUCTION_FLOPS: dict[str, int] = {
    "nansum": 2,  # test, add
    "prod": 1,
    "amax": 1,  # one compare
    "amin": 1,
    "max": 1,
    "min": 1,
    "aminmax": 2,
    "argmax": 1,
    "argmin": 1,
    "any": 1,
    "all": 1,
    "_is_all_true": 1,  # torch.all on a bool tensor, as data-dependent checks call it
    "_is_any_true": 1,
    "count_nonzero": 1,
    "var": 3,  # Welford: subtract, multiply, add
    "std": 3,
    "var_mean": 3,
    "std_mean": 3,
    "norm": 2,  # square, add (p = 2); the sqrt is per output element
    "linalg_vector_norm": 2,
    "logsumexp": 4,  # max, subtract, exp, add
}
# Scans, histograms and list reductions: kernels of their own.
# NB: not modelled as fusing (a scan carries state along its dim; histc and bincount
# scatter-add into bins).
OWN_KERNEL_REDUCTION_FLOPS: dict[str, int] = {
    "cumsum": 1,
    "cumprod": 1,
    "logcumsumexp": 4,
    "_cummax_helper": 1,
    "_cummin_helper": 1,
    "histc": 1,  # one bin increment per element (MoE routing counts tokens per expert)
    "bincount": 1,
    "_foreach_norm": 2,
    "_foreach_max": 1,
}
REDUCTION_FLOPS: dict[str, int] = {
    **SUM_FLOPS,
    **ROW_REDUCTION_FLOPS,
    **OWN_KERNEL_REDUCTION_FLOPS,
}

# Softmax family, per element (softmax ~6, online one pass):
SOFTMAX_FLOPS: dict[str, int] = {
    "_softmax": 5,  # max, subtract, exp, sum, divide
    "_safe_softmax": 6,  # + the select that zeroes fully masked rows
    "_log_softmax": 5,  # max, subtract, exp, sum, subtract log-sum
}
# Their backward: a row reduction with its pointwise work.
SOFTMAX_BACKWARD_FLOPS: dict[str, int] = {
    "_softmax_backward_data": 4,  # g·y, row sum, subtract, multiply
    "_log_softmax_backward_data": 4,  # exp(y), row sum of g, multiply, subtract
}


def _processed_numel(op: OpRecord) -> int:
    """Input elements a reduction passes over (``Tensor[] self`` for ``_foreach_norm``)."""
    processed = op.tensors("self") or list(op.inputs[:1])
    return sum(t.numel for t in processed)


_ONE_PASS = "one pass"
_SOFTMAX = "softmax, one online pass"
register_per_element(SUM_FLOPS, kind="sum", elements=_processed_numel, what=_ONE_PASS)
register_per_element(
    ROW_REDUCTION_FLOPS, kind="reduction", elements=_processed_numel, what=_ONE_PASS
)
register_per_element(
    OWN_KERNEL_REDUCTION_FLOPS, kind="opaque", elements=_processed_numel, what=_ONE_PASS
)
register_per_element(SOFTMAX_FLOPS, kind="softmax", elements=_processed_numel, what=_SOFTMAX)
register_per_element(
    SOFTMAX_BACKWARD_FLOPS, kind="reduction", elements=_processed_numel, what=_SOFTMAX
)


def _dim_size(op: OpRecord) -> int:
    x = tensor_arg(op, "self")
    if not x.shape:
        return 1
    return x.shape[op.arg("dim", -1)]


@register("aten.sort", "aten.argsort", kind="opaque")
def sort(op: OpRecord) -> Cost:
    """Sort along a dim: n·log2(L) compare-exchanges for L elements per row.

    NB: a comparison counts as one FLOP, as in the reductions above.
    """
    read, written = io_bytes(op)
    length = _dim_size(op)
    flops = tensor_arg(op, "self").numel * max(1, math.ceil(log2(max(length, 2))))
    return Cost(flops, read, written, "vector", compute_dtype(op.inputs))


@register("aten.topk", kind="opaque")
def topk(op: OpRecord) -> Cost:
    """Top-k along a dim: each element is compared into a k-heap, n·log2(k) compares."""
    read, written = io_bytes(op)
    k = int(op.arg("k"))
    flops = tensor_arg(op, "self").numel * max(1, math.ceil(log2(max(k, 2))))
    return Cost(flops, read, written, "vector", compute_dtype(op.inputs))


@register(
    "torchroof.column_reduction",
    "torchroof.column_partial",
    "torchroof.column_final",
    kind="column_reduction",
)
def column_reduction(op: OpRecord) -> Cost:
    """A column reduction as Inductor splits it (torchroof/kernels/column_reductions.py): reads its
    inputs once, writes its outputs (fp32 partials, or the reduced columns); W is the
    reduction's own, carried in ``flops``."""
    read, written = io_bytes(op)
    return Cost(int(op.arg("flops", 0)), read, written, "vector", compute_dtype(op.inputs))

"""Elementwise ops, casts and their ``_foreach_`` list forms.

Elementwise intensity (docs/concepts/compulsory-bytes.md): I = f / [s·(r + w)] with f FLOPs
per element; r and w are the tensors read and written. Bytes here are the unique bytes of
every tensor read and written, so a broadcast input is read once.
"""

from __future__ import annotations

from torchroof.counters.cost import Cost, Unit
from torchroof.counters.registry import aten_packets, register, register_per_element
from torchroof.counters.tensors import (
    compute_dtype,
    io_bytes,
    read_tensors,
    unique_bytes,
    written_tensors,
)

from torchroof.records.ops import OpRecord

VECTOR: Unit = "vector"
SFU: Unit = "sfu"

# FLOPs per output element, and the unit that executes them.
# One FLOP per add, multiply, compare or select; a transcendental (exp, log, tanh, erf,
# rsqrt, sin, ...) counts one FLOP and, alone in its op, runs on the SFU (the special function
# units, CUDA C++ Programming Guide, "Arithmetic Instructions"). Composite activations count
# every step. NB: these counts are implementation-dependent by 30-50%; that never moves an
# op across the ridge.
POINTWISE_FLOPS: dict[str, tuple[int, Unit]] = {
    # arithmetic
    "add": (1, VECTOR),  # residual add, 1 FLOP / element
    "sub": (1, VECTOR),
    "rsub": (1, VECTOR),
    "mul": (1, VECTOR),
    "div": (1, VECTOR),
    "true_divide": (1, VECTOR),
    "floor_divide": (2, VECTOR),  # divide, floor
    "remainder": (3, VECTOR),  # divide, floor, multiply-subtract
    "fmod": (3, VECTOR),
    "neg": (1, VECTOR),
    "abs": (1, VECTOR),
    "sign": (1, VECTOR),
    "sgn": (1, VECTOR),
    "square": (1, VECTOR),
    "reciprocal": (1, SFU),
    "lerp": (3, VECTOR),  # a + w·(b - a): sub, mul, add
    "addcmul": (3, VECTOR),  # a + v·b·c
    "addcdiv": (3, VECTOR),  # a + v·b/c
    "xlogy": (2, SFU),
    "copysign": (1, VECTOR),
    "hypot": (3, SFU),
    "nan_to_num": (3, VECTOR),
    # comparisons, selects, logic: one operation each
    "eq": (1, VECTOR),
    "ne": (1, VECTOR),
    "lt": (1, VECTOR),
    "le": (1, VECTOR),
    "gt": (1, VECTOR),
    "ge": (1, VECTOR),
    "maximum": (1, VECTOR),
    "minimum": (1, VECTOR),
    "fmax": (1, VECTOR),
    "fmin": (1, VECTOR),
    "clamp": (2, VECTOR),
    "clamp_min": (1, VECTOR),
    "clamp_max": (1, VECTOR),
    "where": (1, VECTOR),
    "masked_fill": (1, VECTOR),
    "logical_and": (1, VECTOR),
    "logical_or": (1, VECTOR),
    "logical_xor": (1, VECTOR),
    "logical_not": (1, VECTOR),
    "bitwise_and": (1, VECTOR),
    "bitwise_or": (1, VECTOR),
    "bitwise_xor": (1, VECTOR),
    "bitwise_not": (1, VECTOR),
    "bitwise_left_shift": (1, VECTOR),
    "bitwise_right_shift": (1, VECTOR),
    "__and__": (1, VECTOR),
    "__or__": (1, VECTOR),
    "__xor__": (1, VECTOR),
    "isnan": (1, VECTOR),
    "isinf": (1, VECTOR),
    "isfinite": (1, VECTOR),
    "isneginf": (1, VECTOR),
    "isposinf": (1, VECTOR),
    "signbit": (1, VECTOR),
    "floor": (1, VECTOR),
    "ceil": (1, VECTOR),
    "round": (1, VECTOR),
    "trunc": (1, VECTOR),
    "frac": (2, VECTOR),
    "heaviside": (1, VECTOR),
    # transcendentals
    "exp": (1, SFU),
    "exp2": (1, SFU),
    "expm1": (1, SFU),
    "log": (1, SFU),
    "log2": (1, SFU),
    "log10": (1, SFU),
    "log1p": (1, SFU),
    "sqrt": (1, SFU),
    "rsqrt": (1, SFU),
    "sin": (1, SFU),
    "cos": (1, SFU),
    "tan": (1, SFU),
    "asin": (1, SFU),
    "acos": (1, SFU),
    "atan": (1, SFU),
    "atan2": (1, SFU),
    "sinh": (1, SFU),
    "cosh": (1, SFU),
    "tanh": (1, SFU),
    "asinh": (1, SFU),
    "acosh": (1, SFU),
    "atanh": (1, SFU),
    "erf": (1, SFU),
    "erfc": (1, SFU),
    "erfinv": (1, SFU),
    "lgamma": (1, SFU),
    "digamma": (1, SFU),
    "sigmoid": (4, VECTOR),  # 1 / (1 + exp(-x)): neg, exp, add, reciprocal
    "logit": (3, VECTOR),
    # activations
    "relu": (1, VECTOR),
    "relu6": (2, VECTOR),
    "leaky_relu": (2, VECTOR),
    "elu": (4, VECTOR),
    "celu": (4, VECTOR),
    "selu": (5, VECTOR),
    "hardtanh": (2, VECTOR),
    "hardsigmoid": (3, VECTOR),
    "hardswish": (4, VECTOR),
    "silu": (5, VECTOR),  # x·sigmoid(x); with the gate product, SwiGLU ~6
    "mish": (7, VECTOR),  # x·tanh(softplus(x))
    "softplus": (4, VECTOR),  # log(1 + exp(x)) with a threshold compare
    "log_sigmoid_forward": (5, VECTOR),
    "log_sigmoid": (5, VECTOR),  # as recorded undecomposed (context parallel's LSE merge)
    "prelu": (2, VECTOR),
    "_prelu_kernel": (2, VECTOR),
    # activation backward: the derivative times the incoming gradient
    "threshold_backward": (1, VECTOR),
    "sigmoid_backward": (3, VECTOR),  # g·y·(1 - y)
    "tanh_backward": (3, VECTOR),  # g·(1 - y²)
    "silu_backward": (8, VECTOR),  # recompute sigmoid (4), g·s·(1 + x·(1 - s)) (4)
    "hardtanh_backward": (2, VECTOR),
    "hardsigmoid_backward": (2, VECTOR),
    "hardswish_backward": (4, VECTOR),
    "leaky_relu_backward": (2, VECTOR),
    "elu_backward": (3, VECTOR),
    "softplus_backward": (5, VECTOR),
    "mish_backward": (12, VECTOR),
    "log_sigmoid_backward": (5, VECTOR),
    "_prelu_kernel_backward": (3, VECTOR),
    "logit_backward": (3, VECTOR),
}

# GELU depends on its ``approximate`` argument: erf form x·½·(1 + erf(x/√2)) is ~5 steps;
# the tanh form is ~12. The backward roughly doubles each.
GELU_FLOPS = {"none": 5, "tanh": 12}
GELU_BACKWARD_FLOPS = {"none": 10, "tanh": 20}

# pow: x² is one multiply; any other exponent is exp(y·log(x)) on the SFU.
POW_SQUARE_FLOPS = 1
POW_GENERAL_FLOPS = 3


def _packets(base: str) -> list[str]:
    """``aten.base`` and its in-place ``aten.base_``, where this torch has them."""
    return aten_packets(base, f"{base}_")


def _written_numel(op: OpRecord) -> int:
    out = written_tensors(op)
    return out[0].unique_numel if out else 0


def _all_written_numel(op: OpRecord) -> int:
    return sum(t.unique_numel for t in written_tensors(op))


register_per_element(
    POINTWISE_FLOPS, kind="pointwise", elements=_written_numel, what="POINTWISE_FLOPS"
)


def _pointwise_cost(op: OpRecord, flops_per_element: int, unit: Unit) -> Cost:
    read, written = io_bytes(op)
    dtype = compute_dtype(read_tensors(op))
    return Cost(flops_per_element * _written_numel(op), read, written, unit, dtype)


@register(*_packets("gelu"), kind="pointwise")
def gelu(op: OpRecord) -> Cost:
    """GELU, erf or tanh form (tanh approximation ~12 FLOP/element)."""
    return _pointwise_cost(op, GELU_FLOPS[op.arg("approximate", "none")], VECTOR)


@register("aten.gelu_backward", kind="pointwise")
def gelu_backward(op: OpRecord) -> Cost:
    """GELU derivative times the gradient (the forward's count, doubled for the derivative)."""
    return _pointwise_cost(op, GELU_BACKWARD_FLOPS[op.arg("approximate", "none")], VECTOR)


@register(*_packets("pow"), kind="pointwise")
def pow_(op: OpRecord) -> Cost:
    """x**2 is one multiply; other exponents are exp(y·log x) on the SFU."""
    exponent = op.arg("exponent")
    if exponent == 2:
        return _pointwise_cost(op, POW_SQUARE_FLOPS, VECTOR)
    return _pointwise_cost(op, POW_GENERAL_FLOPS, SFU)


# Whole-tensor copies (the ``*_copy`` forms of views appear in functionalized graphs);
# ``_to_copy``, a conversion of each element, is registered beside them as a cast.
_COPY_OPS = [
    "clone",
    "copy",
    "_copy_from",
    "lift_fresh_copy",
    "alias_copy",
    "view_copy",
    "detach_copy",
    "t_copy",
    "permute_copy",
    "transpose_copy",
    "expand_copy",
    "slice_copy",
    "select_copy",
    "unsqueeze_copy",
    "squeeze_copy",
    "_unsafe_view_copy",
]


@register("aten._to_copy", kind="cast")
@register(*aten_packets(*_COPY_OPS), kind="copy")
def copy(op: OpRecord) -> Cost:
    """Casts and copies: 0 FLOPs, read once and written once (a bf16 -> fp32 cast moves 6
    bytes per element for no arithmetic)."""
    read, written = io_bytes(op)
    return Cost(0, read, written, "none", compute_dtype(op.inputs))


@register("aten.copy_", "aten._copy_from_and_resize", kind="copy")
def copy_(op: OpRecord) -> Cost:
    """In-place copy: reads the source, writes the destination; the old contents are not read."""
    src = op.tensor("src") or op.tensor("other")
    dst = written_tensors(op)
    reads = ((src, src.nbytes),) if src else ()
    dtype = dst[0].dtype if dst else ""
    return Cost(0, sum(n for _, n in reads), unique_bytes(dst), "none", dtype, reads=reads)


# _foreach_X over a list: every tensor read and written once (the per-element counts above).
_FOREACH_TABLE = {**POINTWISE_FLOPS, "pow": (POW_GENERAL_FLOPS, SFU), "copy": (0, "none")}
register_per_element(
    _FOREACH_TABLE,
    kind="foreach",
    elements=_all_written_numel,
    what="POINTWISE_FLOPS, per tensor",
    prefix="_foreach_",
)


@register("aten._foreach_zero_", kind="foreach")
@register("aten.zero_", "aten.fill", "aten.fill_", kind="pointwise")
def fill(op: OpRecord) -> Cost:
    """Write-only fills: the destination's bytes, no reads beyond a scalar."""
    written = written_tensors(op)
    read = unique_bytes(t for t in op.inputs if t.numel == 1 and t not in written)
    return Cost(0, read, unique_bytes(written), "none", written[0].dtype if written else "")

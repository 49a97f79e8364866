"""Data movement: views, creation, concatenation, padding, indexing, embedding, dropout.

Views cost nothing; copies cost their bytes. Gathers read the gathered
elements (not the whole source) and scatters write the scattered ones (compulsory Q).
"""

from __future__ import annotations

import torch
from torchroof.counters.cost import ZERO, Cost
from torchroof.counters.registry import aten_packets, register
from torchroof.counters.tensors import (
    compute_dtype,
    distinct,
    io_bytes,
    tensor_arg,
    unique_bytes,
    written_tensors,
)

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta

VIEW_OPS = (
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "reshape",
    "expand",
    "expand_as",
    "t",
    "transpose",
    "permute",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "as_strided",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "narrow",
    "view_as",
    "view_as_real",
    "view_as_complex",
    "unfold",
    "diagonal",
    "lift_fresh",
    "movedim",
    "real",
    "imag",
    "_conj",
    "conj",
    "_neg_view",
    "unflatten",
    "flatten",
    "tensor_split",
    "swapaxes",
    "_nested_view_from_buffer",
    "numpy_T",
    "mT",
    "mH",
    "adjoint",
    "_indices",
    "_values",
)

# Ops that only touch metadata, allocate without writing, or ask the runtime a question.
METADATA_OPS = (
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_fused_sdp_choice",
    "_assert_async",
    "_assert_scalar",
    "_functional_assert_async",
    "_assert_tensor_metadata",
    "_has_compatible_shallow_copy_type",
    "set_",
    "resize_",
    "resize_as_",
    "record_stream",
    "_resize_output_",
    "_print",
    "is_nonzero",
    "_local_scalar_dense",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "_make_dep_token",
)


@register(*aten_packets(*VIEW_OPS), kind="view")
def view(op: OpRecord) -> Cost:
    """Views alias their input: no kernel, no bytes."""
    return ZERO


_PROFILER_OPS = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")


@register(
    *aten_packets(*METADATA_OPS),
    *[f"profiler.{n}" for n in _PROFILER_OPS if hasattr(torch.ops.profiler, n)],
    "prim.device",  # tensor.device under a fake tensor mode (FSDP2 asks it of every grad)
    kind="metadata",
)
def metadata(op: OpRecord) -> Cost:
    """Allocation, metadata queries and profiler markers (``torch.optim`` wraps each step
    in ``record_function``) launch no kernel and move no tensor bytes.

    NB: ``_local_scalar_dense`` (``.item()``) is a device-to-host sync on a GPU; its latency
    is not a roofline quantity and is left to the launch-overhead option.
    """
    return ZERO


CREATION_OPS = (
    "zeros",
    "ones",
    "full",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "scalar_tensor",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "normal",
    "normal_",
    "uniform",
    "uniform_",
    "bernoulli",
    "bernoulli_",
    "exponential_",
    "random_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "multinomial",
    "_efficientzerotensor",
    "_to_dense",
)
"""Tensors made from nothing or from a distribution: a kernel writes them, reads nothing."""


@register(*aten_packets(*CREATION_OPS), kind="creation")
def creation(op: OpRecord) -> Cost:
    """Tensors made from nothing (or from a distribution): their bytes written once."""
    written = written_tensors(op)
    read = unique_bytes(t for t in op.inputs if t.numel == 1 and t not in written)
    return Cost(0, read, unique_bytes(written), "none", written[0].dtype if written else "")


@register(
    *aten_packets("cat", "repeat", "flip", "roll", "constant_pad_nd", "tril", "triu"),
    kind="rearrange",
)
@register(*aten_packets("_unsafe_index", "index", "index_select", "gather"), kind="gather")
@register(
    *aten_packets("slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter"),
    kind="scatter",
)
# NB: kernels of their own; stack, take and the other pads are not modelled as fusing.
@register(
    *aten_packets(
        "stack",
        "repeat_interleave",
        "rot90",
        "reflection_pad1d",
        "reflection_pad2d",
        "reflection_pad3d",
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
        "take",
        "masked_select",
        "nonzero",
        "nonzero_static",
        "unique_dim",
        "_unique2",
        "unique_consecutive",
        "pixel_shuffle",
        "pixel_unshuffle",
        "im2col",
        "col2im",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "polar",
        "complex",
    ),
    kind="opaque",
)
def movement(op: OpRecord) -> Cost:
    """Copies, concatenation, padding and gathers: 0 FLOPs, inputs read, outputs written.

    A gather (``index``, ``index_select``, ``gather``) reads no more of its source than it
    returns, so the source is charged at most the output's size (compulsory Q).
    """
    source = op.tensor("self")
    if op.packet in _GATHERS and source is not None:
        gathered = min(source.nbytes, unique_bytes(op.outputs[:1]))
        others = distinct(t for t in op.inputs if t is not source)
        reads = ((source, gathered), *((t, t.nbytes) for t in others))
        read = sum(n for _, n in reads)
        return Cost(0, read, unique_bytes(op.outputs), "none", source.dtype, reads=reads)
    read, written = io_bytes(op)
    return Cost(0, read, written, "none", compute_dtype(op.inputs))


_GATHERS = {"aten.index", "aten._unsafe_index", "aten.index_select", "aten.gather", "aten.take"}


@register(
    *aten_packets(
        "index_put",
        "index_put_",
        "_index_put_impl_",
        "_unsafe_index_put",
        "index_copy",
        "index_copy_",
        "index_add",
        "index_add_",
        "index_fill",
        "index_fill_",
        "scatter",
        "scatter_",
        "scatter_add",
        "scatter_add_",
        "scatter_reduce",
        "scatter_reduce_",
        "masked_scatter",
        "masked_scatter_",
        "put",
        "put_",
        "index_reduce",
        "index_reduce_",
    ),
    kind="scatter",
)
def scatter(op: OpRecord) -> Cost:
    """Scatters write the scattered elements; an accumulating scatter also reads them.

    The out-of-place form copies ``self`` first (read + write of the whole tensor).
    """
    target = tensor_arg(op, "self")
    values = op.tensor("values") or op.tensor("src") or op.tensor("source")
    touched = values.numel * target.itemsize if values is not None else target.nbytes
    accumulate = bool(op.arg("accumulate", False)) or "add" in op.packet or "reduce" in op.packet
    reads = [(t, t.nbytes) for t in distinct(t for t in op.inputs if t is not target)]
    if accumulate:
        reads.append((target, touched))
    written = touched
    flops = values.numel if (accumulate and values is not None) else 0
    if not op.packet.endswith("_"):
        reads.append((target, target.nbytes))  # functional form: copy self, then scatter
        written = target.nbytes
    read = sum(n for _, n in reads)
    return Cost(
        flops, read, written, "vector" if flops else "none", target.dtype, reads=tuple(reads)
    )


@register(*aten_packets("slice_backward", "select_backward"), kind="rearrange")
@register(*aten_packets("index_select_backward"), kind="scatter")
# NB: kernels of their own (not modelled as fusing).
@register(
    *aten_packets("diagonal_backward", "unfold_backward", "as_strided_backward"), kind="opaque"
)
def view_backward(op: OpRecord) -> Cost:
    """The gradient of a view: a zero-filled tensor of the input's size with the incoming
    gradient copied into the viewed part (one full write, one read of the gradient)."""
    read, written = io_bytes(op)
    return Cost(0, read, written, "none", compute_dtype(op.inputs))


@register("aten.embedding", kind="opaque")  # NB: a row gather, not modelled as fusing
def embedding(op: OpRecord) -> Cost:
    """Row gather: reads the indices and at most one weight row per index, writes the rows."""
    weight, indices = tensor_arg(op, "weight"), tensor_arg(op, "indices")
    rows = min(indices.numel, weight.shape[0])
    row_bytes = weight.nbytes // max(weight.shape[0], 1)
    reads = ((weight, rows * row_bytes), (indices, indices.nbytes))
    read = rows * row_bytes + indices.nbytes
    return Cost(0, read, unique_bytes(op.outputs), "none", weight.dtype, reads=reads)


@register(
    *aten_packets("embedding_dense_backward", "embedding_backward", "_embedding_bag_backward"),
    kind="scatter",
)
def embedding_backward(op: OpRecord) -> Cost:
    """Gradient of a row gather: zero the [V, d] gradient, scatter-add each incoming row."""
    grad = op.tensor("grad_output") or op.tensor("grad")
    read, written = io_bytes(op)
    return Cost(grad.numel if grad else 0, read, written, "vector", grad.dtype if grad else "")


@register("aten.native_dropout", kind="dropout")
def dropout(op: OpRecord) -> Cost:
    """Dropout draws a mask and scales: ~2 FLOP/element; writes y and the bool mask."""
    x: TensorMeta = tensor_arg(op, "input")
    read, written = io_bytes(op)
    return Cost(2 * x.numel, read, written, "vector", x.dtype)


@register("aten.native_dropout_backward", kind="dropout")
def dropout_backward(op: OpRecord) -> Cost:
    """g · mask · scale: one multiply per element, reads g and the mask."""
    grad = tensor_arg(op, "grad_output")
    read, written = io_bytes(op)
    return Cost(grad.numel, read, written, "vector", grad.dtype)

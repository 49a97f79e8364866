"""Matmul-class ops: they run on tensor cores at the dtype's peak (the unit follows the op).

W = 2MNK, Q_compulsory = s(MK + KN + MN) (NVIDIA, Matrix Multiplication Background User's
Guide; docs/concepts/compulsory-bytes.md).

Kinds (counters/registry.py OP_KINDS): the dense GEMMs (mm, addmm, bmm, baddbmm) are
``matmul``, which may take an epilogue and lead a fused group; the other tensor-core calls
(int8 / fp8 / grouped GEMMs, GEMV, dot, convolution, triangular solve) are ``opaque``.
NB: their epilogues are not modelled, so they stay kernels of their own.
"""

from __future__ import annotations

import math

from torch.utils.flop_counter import conv_backward_flop, conv_flop_count
from torchroof.counters.cost import Cost
from torchroof.counters.registry import register
from torchroof.counters.tensors import compute_dtype, io_bytes, tensor_arg

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta


def _tensor_cost(op: OpRecord, flops: int, *operands: str) -> Cost:
    read, written = io_bytes(op)
    dtype = compute_dtype(t for name in operands if (t := op.tensor(name)) is not None)
    return Cost(flops, read, written, "tensor", dtype)


@register("aten.mm", kind="matmul")
@register("aten._int_mm", kind="opaque")
def mm(op: OpRecord) -> Cost:
    """C[M,N] = A[M,K] @ B[K,N]: W = 2MNK (NVIDIA, Matrix Multiplication Background)."""
    m, k = tensor_arg(op, "self").shape
    n = tensor_arg(op, "mat2").shape[1]
    return _tensor_cost(op, 2 * m * n * k, "self", "mat2")


@register("aten.addmm", "aten._addmm_activation", kind="matmul")
def addmm(op: OpRecord) -> Cost:
    """bias + A @ B: 2MNK for the product, MN for the bias epilogue."""
    m, k = tensor_arg(op, "mat1").shape
    n = tensor_arg(op, "mat2").shape[1]
    return _tensor_cost(op, 2 * m * n * k + m * n, "mat1", "mat2")


@register("aten._scaled_mm", kind="opaque")
def scaled_mm(op: OpRecord) -> Cost:
    """fp8 GEMM with per-tensor scales: W = 2MNK on the fp8 tensor cores (the fp8 peak)."""
    m, k = tensor_arg(op, "self").shape
    n = tensor_arg(op, "mat2").shape[1]
    return _tensor_cost(op, 2 * m * n * k, "self", "mat2")


@register("aten.bmm", kind="matmul")
def bmm(op: OpRecord) -> Cost:
    """Batched A[B,M,K] @ B[B,K,N]: W = 2·B·M·N·K (2MNK per batch)."""
    b, m, k = tensor_arg(op, "self").shape
    n = tensor_arg(op, "mat2").shape[2]
    return _tensor_cost(op, 2 * b * m * n * k, "self", "mat2")


@register("aten.baddbmm", kind="matmul")
def baddbmm(op: OpRecord) -> Cost:
    """bias + batched product: 2·B·M·N·K + B·M·N."""
    b, m, k = tensor_arg(op, "batch1").shape
    n = tensor_arg(op, "batch2").shape[2]
    return _tensor_cost(op, 2 * b * m * n * k + b * m * n, "batch1", "batch2")


@register("aten.addbmm", kind="opaque")
def addbmm(op: OpRecord) -> Cost:
    """bias + sum over the batch of products: 2·B·M·N·K + M·N."""
    b, m, k = tensor_arg(op, "batch1").shape
    n = tensor_arg(op, "batch2").shape[2]
    return _tensor_cost(op, 2 * b * m * n * k + m * n, "batch1", "batch2")


@register("aten.mv", kind="opaque")
def mv(op: OpRecord) -> Cost:
    """GEMV A[M,K] @ x[K]: W = 2MK, I -> 2/s (decode is a GEMV: Pope et al. 2022)."""
    m, k = tensor_arg(op, "self").shape
    return _tensor_cost(op, 2 * m * k, "self", "vec")


@register("aten.addmv", kind="opaque")
def addmv(op: OpRecord) -> Cost:
    """bias + GEMV: 2MK + M (decode is a GEMV: Pope et al. 2022)."""
    m, k = tensor_arg(op, "mat").shape
    return _tensor_cost(op, 2 * m * k + m, "mat", "vec")


@register("aten.dot", "aten.vdot", kind="opaque")
def dot(op: OpRecord) -> Cost:
    """Inner product of two K-vectors: 2K (an FMA counts 2 FLOPs)."""
    return _tensor_cost(op, 2 * tensor_arg(op, "self").numel, "self", "tensor")


@register("aten.addr", kind="opaque")
def addr(op: OpRecord) -> Cost:
    """bias + outer product: M·N multiplies and M·N adds."""
    n_out = tensor_arg(op, "vec1").numel * tensor_arg(op, "vec2").numel
    return _tensor_cost(op, 2 * n_out, "vec1", "vec2")


def reached_bytes(experts: TensorMeta, rows: int) -> int:
    """Bytes of the experts ``rows`` routed rows reach in a tensor holding one slice per
    expert along dim 0: min(E, rows) of the E slices under balanced routing."""
    count = experts.shape[0]
    return experts.nbytes * min(count, rows) // count


@register("aten._grouped_mm", kind="opaque")
def grouped_mm(op: OpRecord) -> Cost:
    """Grouped GEMM (MoE experts): 2·M_total·N·K summed over groups.

    NB: with ``offs`` the rows are split among groups at run time, which meta cannot know.
    Balanced routing is assumed: M routed rows touch min(G, M) of the G expert matrices, so
    a decode step with fewer routed tokens than experts reads only that many experts.
    """
    a, b = tensor_arg(op, "self"), tensor_arg(op, "mat2")
    out = op.outputs[0].shape
    k = a.shape[-1]
    if len(a.shape) == 2 and len(b.shape) == 2:
        # 2D x 2D with offs (the weight-gradient form): groups split K, so the total
        # contraction is K once for each of the N_out x M_out outputs of one group.
        flops = 2 * out[-2] * out[-1] * k
    else:
        flops = 2 * math.prod(out) * k
    read, written = io_bytes(op)
    dtype = compute_dtype([a, b])
    if len(a.shape) == 2 and len(b.shape) == 3 and op.tensor("offs") is not None:
        touched = reached_bytes(b, a.shape[0])
        others = [t for t in op.inputs if t is not b]
        reads = ((b, touched), *((t, t.nbytes) for t in others))
        read = sum(n for _, n in reads)
        return Cost(flops, read, written, "tensor", dtype, reads=reads)
    return Cost(flops, read, written, "tensor", dtype)


@register("aten.convolution", "aten._convolution", kind="opaque")
def convolution(op: OpRecord) -> Cost:
    """Convolution: 2 FLOPs per MAC, counted by ``torch.utils.flop_counter.conv_flop_count``."""
    x, w = tensor_arg(op, "input"), tensor_arg(op, "weight")
    transposed = bool(op.arg("transposed", False))
    flops = conv_flop_count(list(x.shape), list(w.shape), list(op.outputs[0].shape), transposed)
    if op.tensor("bias") is not None:
        flops += op.outputs[0].numel
    return _tensor_cost(op, flops, "input", "weight")


@register("aten.convolution_backward", kind="opaque")
def convolution_backward(op: OpRecord) -> Cost:
    """Input and weight gradients per ``output_mask``, counted by torch's own formula."""
    grad, x, w = tensor_arg(op, "grad_output"), tensor_arg(op, "input"), tensor_arg(op, "weight")
    mask = list(op.arg("output_mask", [True, True, True]))
    transposed = bool(op.arg("transposed", False))
    # Each output of the op is present only where the mask asks for it.
    shapes = [list(x.shape), list(w.shape), None]
    # register_flop_formula's wrapper takes out_val and passes it on as out_shape; its typing
    # keeps the undecorated signature, which names out_shape
    flops = conv_backward_flop(  # type: ignore[call-arg]
        list(grad.shape),
        list(x.shape),
        list(w.shape),
        None,
        None,
        None,
        None,
        transposed,
        None,
        None,
        mask,
        out_val=shapes,
    )
    if mask[2]:
        flops += grad.numel  # bias gradient: a sum over everything but channels
    return _tensor_cost(op, flops, "grad_output", "weight")


@register("aten.linalg_solve_triangular", "aten.triangular_solve", kind="opaque")
def triangular_solve(op: OpRecord) -> Cost:
    """X = A⁻¹B for a triangular A [.., n, n] and right-hand sides B: n² FLOPs per
    right-hand-side column (half of a dense product's 2n², FMA = 2); blocked TRSM runs on the
    tensor cores. Gated delta-rule attention (Qwen3-Next) solves one per chunk."""
    if op.packet == "aten.triangular_solve":  # (self = B, A)
        a, b, operand = tensor_arg(op, "A"), tensor_arg(op, "self"), "A"
    else:  # linalg_solve_triangular(self = A, B)
        a, b, operand = tensor_arg(op, "self"), tensor_arg(op, "B"), "self"
    n = a.shape[-1]
    columns = b.numel // n  # every right-hand side, over the batch
    return _tensor_cost(op, n * n * columns, operand)

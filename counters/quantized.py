"""Packed low-bit GEMMs and NVFP4's activation quantiser (torchroof/quant/packed_weights.py).

W = 2MNK and Q_compulsory reads every operand once (docs/concepts/compulsory-bytes.md);
a packed operand is read at its stored width (its ``nbytes``: half a byte per 4-bit code,
plus its scales), so Q shrinks while W does not. A narrower datatype raises the peak the
GEMM reaches only where its tensor cores take that datatype (the vendor datasheets list a
tensor peak per datatype).

Kinds (counters/registry.py OP_KINDS): the GEMMs are library kernels (tinygemm, Marlin,
CUTLASS) and ``opaque``, like ``_scaled_mm``. NB: their epilogues are not modelled, and the
weight-only GEMMs' dequantisation (a multiply-add per weight, in registers) is not counted in
W: it rides on the GEMM's memory-bound time at decode, as the mixed-input kernels intend.

``quantize_nvfp4`` is a ``reduction``: one amax per 16-element block of a row, then the
scaled, rounded values; a row-local kernel, which Inductor-style fusion joins to its
producer (the norm or activation before the GEMM, as TensorRT-LLM fuses the quantisation
into the preceding RMSNorm) so the bf16 activation need not reach HBM. Not ``pointwise``:
its output is saved, never rebuilt by a compiled backward, and it reduces.
NB: each packed GEMM quantises its own input; q, k and v projections of one normed input
quantise it three times unless sibling fusion merges them (TensorRT-LLM quantises once).
"""

from __future__ import annotations

import math

from torchroof.counters.cost import Cost
from torchroof.counters.matmul import reached_bytes
from torchroof.counters.registry import register
from torchroof.counters.tensors import io_bytes, tensor_arg

from torchroof.records.ops import OpRecord

FP4_DTYPE = "float4_e2m1fn_x2"  # hardware/spec.py maps it to the "fp4" tensor peak

# quantize_nvfp4, per element: abs and compare for the block amax, multiply by the
# reciprocal block scale; the conversions to e2m1 and e4m3 are casts (0 FLOPs, as
# ``_to_copy``) and the reciprocal is per block of 16 (not counted).
NVFP4_QUANTIZE_FLOPS = 3


def _packed_gemm(op: OpRecord, x_name: str, weight_name: str, x_k_per_element: int) -> int:
    """W = 2MNK for ``x [.., K]`` (K = last dim · ``x_k_per_element``) times a packed
    ``uint8 [N, K/2]`` weight."""
    x, weight = tensor_arg(op, x_name), tensor_arg(op, weight_name)
    k = x.shape[-1] * x_k_per_element
    m = math.prod(x.shape[:-1])
    n = weight.shape[0]
    return 2 * m * n * k


@register("torchroof.int4_weight_mm", "torchroof.mxfp4_weight_mm", kind="opaque")
def packed_weight_mm(op: OpRecord) -> Cost:
    """Weight-only int4 / MXFP4 GEMM: W = 2MNK on the tensor cores of x's dtype; Q reads
    x, the packed weight and its scales (by nbytes), any bias, and writes the output (the
    weight narrows, the peak does not)."""
    read, written = io_bytes(op)
    flops = _packed_gemm(op, "x", "packed", 1)
    return Cost(flops, read, written, "tensor", tensor_arg(op, "x").dtype)


@register("torchroof.nvfp4_mm", kind="opaque")
def nvfp4_mm(op: OpRecord) -> Cost:
    """NVFP4 GEMM: W = 2MNK at the fp4 tensor peak; Q reads both packed operands, their e4m3
    scales and alpha, any bias, and writes the bf16 output (compulsory bytes at the narrower
    datatype's peak)."""
    read, written = io_bytes(op)
    flops = _packed_gemm(op, "xq", "wq", 2)  # xq holds two e2m1 codes per byte
    return Cost(flops, read, written, "tensor", FP4_DTYPE)


@register("torchroof.quantize_nvfp4", kind="reduction")
def quantize_nvfp4(op: OpRecord) -> Cost:
    """NVFP4 activation quantisation: 3 FLOPs per element on the vector units; reads x once,
    writes the packed codes and the e4m3 scales (compulsory bytes, at the stored widths)."""
    read, written = io_bytes(op)
    x = tensor_arg(op, "x")
    return Cost(NVFP4_QUANTIZE_FLOPS * x.numel, read, written, "vector", x.dtype)


@register("torchroof.packed_grouped_mm", kind="opaque")
def packed_grouped_mm(op: OpRecord) -> Cost:
    """Quantised MoE experts' grouped GEMM, x [S, K] against E experts' codes [E, N, ..]:
    W = 2·S·N·K (2MNK over the routed rows); Q reads x, and the codes and scales
    of the min(E, S) experts the S routed rows reach under balanced routing (as
    ``_grouped_mm``), and writes the output. The peak is the recorded ``gemm_dtype``'s
    (the datasheet's peak for it): fp8 / fp4 tensor cores for W8A8 and NVFP4, the
    activations' dtype for weight-only formats."""
    x, codes, scales = tensor_arg(op, "x"), tensor_arg(op, "codes"), tensor_arg(op, "scales")
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = codes.shape[1]
    reads = (
        (x, x.nbytes),
        (codes, reached_bytes(codes, rows)),
        (scales, reached_bytes(scales, rows)),
        *((t, t.nbytes) for t in op.inputs if t not in (x, codes, scales)),
    )
    out = op.outputs[0]
    dtype = str(op.arg("gemm_dtype") or x.dtype)  # recorded by torchroof/quant/packed_experts.py
    return Cost(
        2 * rows * n * k,
        sum(b for _, b in reads),
        out.nbytes,
        "tensor",
        dtype,
        reads=reads,
        writes=((out, out.nbytes),),
    )

"""Packed low-bit linear layers that torchao cannot run here: int4 weight-only
(tinygemm's layout), MXFP4 weight-only and NVFP4 weights with NVFP4 activations.

Each recipe replaces an ``nn.Linear`` by a module holding the packed weight and calling an
op registered in the ``torchroof`` namespace, so a trace records the one kernel a GPU
launches (``torchroof.int4_weight_mm.default``), priced by torchroof/counters/quantized.py.
On meta the ops only infer shapes; on a real device they run a reference kernel
(dequantise, then a matmul), which fixes what each layout means.

Layouts (N = out_features, K = in_features; 4-bit codes packed two per byte, the element of
even index in the low nibble, as torchao's ``pack_uint4``):

- ``int4-weight``: unsigned codes q in [0, 15] ``uint8 [N, K/2]``; a bf16 scale and zero per
  group of 128 along K, ``scale_and_zero bf16 [K/128, N, 2]``; w = (q - 8) · scale + zero
  (torchao's tinygemm convention, ``ZeroPointDomain.FLOAT``).
- ``mxfp4-weight``: OCP MX: e2m1 codes ``uint8 [N, K/2]``, one e8m0 scale (a power of two,
  one byte: 2^(byte - 127)) per 32 along K, ``uint8 [N, K/32]``.
- ``nvfp4``: e2m1 weight codes ``uint8 [N, K/2]``, one ``float8_e4m3fn`` scale per 16 along K
  ``[N, K/16]`` and an fp32 per-tensor scale; activations quantised per 16 with e4m3 scales
  and no dynamic tensor scale (torchao's single-level ``nvfp4_quantize``; TensorRT-LLM's
  calibrated static scale costs nothing per step), so the GEMM's alpha is the weight's
  tensor scale. NB: torchao's NVFP4 config defaults to a dynamic per-tensor activation
  scale, a whole-tensor amax before each quantisation: a second pass over the activation
  (about +26% bytes on a Llama-3-8B 4096-token prefill), not modelled.

Quantised parameters are ``nn.Parameter`` with ``requires_grad=False``, as torchao holds its
quantised weights, so capture labels their storages weights. Cast a model before packing
it: ``Module.to(dtype)`` also casts the float8 and fp32 scales (the ops refuse them then).
"""

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

OptTensor = Tensor | None

PackedQuant = Literal["int4-weight", "mxfp4-weight", "nvfp4"]
PACKED_QUANTS: tuple[PackedQuant, ...] = ("int4-weight", "mxfp4-weight", "nvfp4")

INT4_GROUP = 128  # tinygemm's group along K (torchao Int4WeightOnlyConfig's default)
MXFP4_BLOCK = 32  # OCP MX block
NVFP4_BLOCK = 16  # NVFP4 block

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_EPS = 2.0**-9  # smallest positive e4m3 (subnormal)
E8M0_BIAS = 127
# e2m1 value of each 4-bit code: bit 3 is the sign, bits 0-2 index the magnitude
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FilterFn = Callable[[nn.Module, str], bool]


# -- codes and packing (reference numerics, any device) --------------------------------------


def _e2m1_table(device: torch.device) -> torch.Tensor:
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``uint8 [.., K]`` -> ``uint8 [.., K/2]``, even index in the low nibble."""
    return codes[..., ::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [.., K/2]`` -> codes ``uint8 [.., K]`` (inverse of :func:`pack_nibbles`)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes -> their fp32 values."""
    return _e2m1_table(codes.device)[codes.long()]


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> the nearest e2m1 codes (±6 saturates)."""
    magnitudes = _e2m1_table(values.device)[:8]
    index = (values.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - magnitudes).abs().argmin(-1)
    return (index | ((values < 0).long() << 3)).to(torch.uint8)


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """[.., K] -> fp32 [.., K/block, block]."""
    return t.float().reshape(*t.shape[:-1], t.shape[-1] // block, block)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (codes packed ``uint8 [N, K/2]``, ``bf16 [K/128, N, 2]``):
    asymmetric per group, scale = (max - min)/15, zero = min + 8·scale (torchao's
    ``choose_qparams_affine`` for tinygemm)."""
    groups = _blocks(weight, INT4_GROUP)  # [N, K/128, 128]
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny)
    zero = low + 8 * scale
    codes = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
    packed = pack_nibbles(codes.to(torch.uint8).flatten(-2))
    scale_and_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)
    return packed, scale_and_zero.contiguous()


def dequantize_int4(packed: torch.Tensor, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: fp32 ``[N, K]``, w = (q - 8)·scale + zero."""
    codes = _blocks(unpack_nibbles(packed), INT4_GROUP)  # [N, K/128, 128]
    scale, zero = scale_and_zero.float().transpose(0, 1).unbind(-1)  # [N, K/128] each
    return ((codes - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (e2m1 packed ``uint8 [N, K/2]``, e8m0 ``uint8 [N, K/32]``): the
    block's shared exponent is floor(log2 amax) - 2, e2m1's largest exponent (OCP MX 1.0
    §6.3)."""
    blocks = _blocks(weight, MXFP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_encode(blocks / torch.exp2(exponent).unsqueeze(-1))
    return pack_nibbles(codes.flatten(-2)), (exponent + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: fp32 ``[N, K]``."""
    values = _blocks(e2m1_decode(unpack_nibbles(packed)), MXFP4_BLOCK)
    return (values * torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)).flatten(-2)


def _quantize_nvfp4_blocks(
    t: torch.Tensor, tensor_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(t, NVFP4_BLOCK)
    block_scale = blocks.abs().amax(-1) / E2M1_MAX / tensor_scale
    scales = block_scale.clamp(E4M3_EPS, E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = (scales.float() * tensor_scale).unsqueeze(-1)
    return pack_nibbles(e2m1_encode(blocks / divisor).flatten(-2)), scales


def quantize_nvfp4_weight(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (e2m1 packed ``uint8 [N, K/2]``, e4m3 ``[N, K/16]``, fp32 tensor
    scale ``[]``): the tensor scale amax/(448·6) lets the e4m3 block scales span the weight's
    range (torchao's two-level ``nvfp4_quantize``)."""
    tensor_scale = (weight.float().abs().amax() / (E4M3_MAX * E2M1_MAX)).clamp(
        min=torch.finfo(torch.float32).tiny
    )
    packed, scales = _quantize_nvfp4_blocks(weight, tensor_scale)
    return packed, scales, tensor_scale


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[.., K]`` from NVFP4 codes and e4m3 block scales (times any tensor scale)."""
    values = _blocks(e2m1_decode(unpack_nibbles(packed)), NVFP4_BLOCK)
    return (values * scales.float().unsqueeze(-1)).flatten(-2)


# -- the ops a trace records -------------------------------------------------------------------


def _check(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise ValueError(f"torchroof.{op}: {message}")


def _check_weight(
    op: str, x_k: int, packed: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int]:
    """(N, K) of a packed ``uint8 [N, K/2]`` weight that an input of K = ``x_k`` multiplies."""
    _check(packed.dtype == torch.uint8, op, f"packed weight must be uint8, got {packed.dtype}")
    _check(packed.dim() == 2, op, f"packed weight must be [N, K/2], got {list(packed.shape)}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    _check(x_k == k, op, f"x has K = {x_k}, the packed weight {list(packed.shape)} has K = {k}")
    if bias is not None:
        _check(bias.shape == (n,), op, f"bias must be [{n}], got {tuple(bias.shape)}")
    return n, k


def _check_scales(
    op: str, name: str, scales: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    _check(
        tuple(scales.shape) == shape and scales.dtype == dtype,
        op,
        f"{name} must be {str(dtype).removeprefix('torch.')} {list(shape)}, got "
        f"{str(scales.dtype).removeprefix('torch.')} {list(scales.shape)}",
    )


def _reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    out = x.float() @ weight.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


@torch.library.custom_op(
    "torchroof::int4_weight_mm",
    mutates_args=(),
    schema="(Tensor x, Tensor packed, Tensor scale_and_zero, int group_size, Tensor? bias=None)"
    " -> Tensor",
)
def int4_weight_mm(
    x: Tensor, packed: Tensor, scale_and_zero: Tensor, group_size: int, bias: OptTensor = None
) -> Tensor:
    """x [.., K] @ W.T for tinygemm's int4 weight ``uint8 [N, K/2]`` with a bf16 scale and
    zero per ``group_size`` along K ``[K/group, N, 2]``; out in x's dtype [.., N]."""
    _int4_weight_mm_out_features(x, packed, scale_and_zero, group_size, bias)
    weight = dequantize_int4(packed, scale_and_zero)
    return _reference_linear(x, weight, bias, x.dtype)


def _int4_weight_mm_out_features(
    x: Tensor, packed: Tensor, scale_and_zero: Tensor, group_size: int, bias: OptTensor
) -> int:
    op = "int4_weight_mm"
    _check(x.dim() >= 1, op, "x must have a last dimension K")
    n, k = _check_weight(op, x.shape[-1], packed, bias)
    _check(group_size == INT4_GROUP, op, f"group_size must be {INT4_GROUP}, got {group_size}")
    _check(k % group_size == 0, op, f"K = {k} is not a multiple of group_size {group_size}")
    _check_scales(op, "scale_and_zero", scale_and_zero, (k // group_size, n, 2), torch.bfloat16)
    return n


@int4_weight_mm.register_fake
def _(
    x: Tensor, packed: Tensor, scale_and_zero: Tensor, group_size: int, bias: OptTensor = None
) -> Tensor:
    n = _int4_weight_mm_out_features(x, packed, scale_and_zero, group_size, bias)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op(
    "torchroof::mxfp4_weight_mm",
    mutates_args=(),
    schema="(Tensor x, Tensor packed, Tensor scales, Tensor? bias=None) -> Tensor",
)
def mxfp4_weight_mm(x: Tensor, packed: Tensor, scales: Tensor, bias: OptTensor = None) -> Tensor:
    """x [.., K] @ W.T for an MXFP4 weight ``uint8 [N, K/2]`` with e8m0 scales
    ``uint8 [N, K/32]``, computed in x's dtype; out [.., N]."""
    _mxfp4_weight_mm_out_features(x, packed, scales, bias)
    return _reference_linear(x, dequantize_mxfp4(packed, scales), bias, x.dtype)


def _mxfp4_weight_mm_out_features(
    x: Tensor, packed: Tensor, scales: Tensor, bias: OptTensor
) -> int:
    op = "mxfp4_weight_mm"
    _check(x.dim() >= 1, op, "x must have a last dimension K")
    n, k = _check_weight(op, x.shape[-1], packed, bias)
    _check(k % MXFP4_BLOCK == 0, op, f"K = {k} is not a multiple of the block {MXFP4_BLOCK}")
    _check_scales(op, "scales", scales, (n, k // MXFP4_BLOCK), torch.uint8)
    return n


@mxfp4_weight_mm.register_fake
def _(x: Tensor, packed: Tensor, scales: Tensor, bias: OptTensor = None) -> Tensor:
    n = _mxfp4_weight_mm_out_features(x, packed, scales, bias)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op(
    "torchroof::quantize_nvfp4", mutates_args=(), schema="(Tensor x) -> (Tensor, Tensor)"
)
def quantize_nvfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [.., K] -> (e2m1 packed ``uint8 [.., K/2]``, e4m3 ``[.., K/16]``): one amax per 16,
    scale = amax/6 (single level: no tensor scale, torchao's ``nvfp4_quantize``)."""
    _check_quantize_nvfp4(x)
    return _quantize_nvfp4_blocks(x, 1.0)


def _check_quantize_nvfp4(x: Tensor) -> int:
    """K of an input the quantiser takes."""
    op = "quantize_nvfp4"
    _check(x.is_floating_point(), op, f"x must be floating point, got {x.dtype}")
    k = x.shape[-1] if x.dim() else 0
    _check(k > 0 and k % NVFP4_BLOCK == 0, op, f"x's last dimension {k} is not a multiple of 16")
    return k


@quantize_nvfp4.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    k = _check_quantize_nvfp4(x)
    lead = tuple(x.shape[:-1])
    packed = x.new_empty((*lead, k // 2), dtype=torch.uint8)
    scales = x.new_empty((*lead, k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn)
    return packed, scales


@torch.library.custom_op(
    "torchroof::nvfp4_mm",
    mutates_args=(),
    schema="(Tensor xq, Tensor xs, Tensor wq, Tensor ws, Tensor alpha, Tensor? bias=None)"
    " -> Tensor",
)
def nvfp4_mm(
    xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, alpha: Tensor, bias: OptTensor = None
) -> Tensor:
    """NVFP4 GEMM on fp4 tensor cores: alpha · (xq·xs) @ (wq·ws).T [.., N] in bf16."""
    _nvfp4_mm_out_features(xq, xs, wq, ws, alpha, bias)
    x = dequantize_nvfp4(xq, xs)
    weight = dequantize_nvfp4(wq, ws) * alpha.float()
    return _reference_linear(x, weight, bias, torch.bfloat16)


def _nvfp4_mm_out_features(
    xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, alpha: Tensor, bias: OptTensor
) -> int:
    op = "nvfp4_mm"
    _check(xq.dtype == torch.uint8, op, f"xq must be packed uint8, got {xq.dtype}")
    _check(xq.dim() >= 1, op, "xq must have a last dimension K/2")
    n, k = _check_weight(op, 2 * xq.shape[-1], wq, bias)
    _check(k % NVFP4_BLOCK == 0, op, f"K = {k} is not a multiple of the block {NVFP4_BLOCK}")
    blocks = k // NVFP4_BLOCK
    _check_scales(op, "xs", xs, (*xq.shape[:-1], blocks), torch.float8_e4m3fn)
    _check_scales(op, "ws", ws, (n, blocks), torch.float8_e4m3fn)
    _check_scales(op, "alpha", alpha, (), torch.float32)
    return n


@nvfp4_mm.register_fake
def _(
    xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, alpha: Tensor, bias: OptTensor = None
) -> Tensor:
    n = _nvfp4_mm_out_features(xq, xs, wq, ws, alpha, bias)
    return xq.new_empty((*xq.shape[:-1], n), dtype=torch.bfloat16)


# -- the modules -------------------------------------------------------------------------------


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class PackedLinear(nn.Module):
    """A linear layer whose weight is stored packed; subclasses pack and multiply."""

    block = 1  # K must be a multiple of this

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = linear.bias
        self.bias = None if bias is None else _frozen(bias.detach())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


class Int4WeightLinear(PackedLinear):
    """int4 weight-only, tinygemm's layout: ``packed_weight uint8 [N, K/2]``,
    ``scale_and_zero bf16 [K/128, N, 2]``."""

    block = INT4_GROUP

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach()
        n, k = weight.shape
        if weight.is_meta:
            packed = weight.new_empty((n, k // 2), dtype=torch.uint8)
            scale_and_zero = weight.new_empty((k // INT4_GROUP, n, 2), dtype=torch.bfloat16)
        else:
            packed, scale_and_zero = quantize_int4(weight)
        self.packed_weight = _frozen(packed)
        self.scale_and_zero = _frozen(scale_and_zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_weight_mm(x, self.packed_weight, self.scale_and_zero, INT4_GROUP, self.bias)


class MXFP4WeightLinear(PackedLinear):
    """MXFP4 weight-only: ``packed_weight uint8 [N, K/2]`` (e2m1), ``weight_scale uint8
    [N, K/32]`` (e8m0); computes in x's dtype."""

    block = MXFP4_BLOCK

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach()
        n, k = weight.shape
        if weight.is_meta:
            packed = weight.new_empty((n, k // 2), dtype=torch.uint8)
            scales = weight.new_empty((n, k // MXFP4_BLOCK), dtype=torch.uint8)
        else:
            packed, scales = quantize_mxfp4(weight)
        self.packed_weight = _frozen(packed)
        self.weight_scale = _frozen(scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp4_weight_mm(x, self.packed_weight, self.weight_scale, self.bias)


class NVFP4Linear(PackedLinear):
    """NVFP4 weights and activations: ``packed_weight uint8 [N, K/2]`` (e2m1),
    ``weight_scale float8_e4m3fn [N, K/16]``, ``weight_tensor_scale fp32 []``; each call
    quantises x (:func:`quantize_nvfp4`) and runs :func:`nvfp4_mm`. The output is bf16, cast
    to x's dtype if that differs."""

    block = NVFP4_BLOCK

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach()
        n, k = weight.shape
        if weight.is_meta:
            packed = weight.new_empty((n, k // 2), dtype=torch.uint8)
            scales = weight.new_empty((n, k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn)
            tensor_scale = weight.new_empty((), dtype=torch.float32)
        else:
            packed, scales, tensor_scale = quantize_nvfp4_weight(weight)
        self.packed_weight = _frozen(packed)
        self.weight_scale = _frozen(scales)
        self.weight_tensor_scale = _frozen(tensor_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_nvfp4(x)
        out = nvfp4_mm(
            xq, xs, self.packed_weight, self.weight_scale, self.weight_tensor_scale, self.bias
        )
        return out if out.dtype == x.dtype else out.to(x.dtype)


PACKED_LINEARS: dict[PackedQuant, type[PackedLinear]] = {
    "int4-weight": Int4WeightLinear,
    "mxfp4-weight": MXFP4WeightLinear,
    "nvfp4": NVFP4Linear,
}


def apply_packed_weights(model: nn.Module, quant: str, filter_fn: FilterFn | None = None) -> int:
    """Replace, in place, each ``nn.Linear`` of ``model`` that ``filter_fn(module, fqn)``
    accepts (all when None, as torchao's ``quantize_``) by the packed layer of ``quant``;
    returns how many were replaced. On meta nothing is computed (the packed tensors are
    empty); on a real device the weights are quantised by the reference numerics above."""
    if quant not in PACKED_LINEARS:
        raise ValueError(f"unknown packed quant {quant!r}; expected one of {PACKED_QUANTS}")
    packed_type = PACKED_LINEARS[quant]
    targets = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear) and (filter_fn is None or filter_fn(module, fqn))
    ]
    for fqn, linear in targets:
        if linear.in_features % packed_type.block:
            raise ValueError(
                f"{quant}: {fqn} has in_features {linear.in_features}, not a multiple of "
                f"{packed_type.block} (the {quant} block along K); leave it out with filter_fn"
            )
        if not fqn:
            raise ValueError(f"{quant}: the model itself is a Linear; wrap it in a module")
    for fqn, linear in targets:
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, packed_type(linear))
    return len(targets)

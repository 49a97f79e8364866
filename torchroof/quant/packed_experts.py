"""Quantised MoE experts: transformers' 3-D expert weights stored narrow and multiplied by one
grouped GEMM that reads them at their stored width.

transformers' experts (``grouped_mm_experts_forward``) hold ``gate_up_proj`` / ``up_proj`` and
``down_proj`` as ``[E, out, in]`` parameters and call ``grouped_mm(x, w.transpose(-2, -1),
offs)``. Here each is replaced by a :class:`PackedExpertWeight`: a wrapper tensor that looks
like the bf16 weight (its shape, its dtype, so ``x.to(w.dtype)`` changes nothing) but holds
the codes and scales of the recipe, and turns the grouped GEMM into one registered op,
``torchroof::packed_grouped_mm``, priced by ``counters/quantized.py``: W = 2·S·N·K (2MNK
over the routed rows), the codes and scales of the experts the routed rows reach
read once (balanced routing, as for ``_grouped_mm``).

Formats (the codes ``[E, N, K·bits/8]`` and their scales):

- ``int8-weight``: int8 codes, one fp32 scale per output channel ``[E, N]``;
- ``fp8-weight``, ``fp8``, ``fp8-rowwise``: e4m3 codes, fp32 per channel. ``fp8`` and
  ``fp8-rowwise`` are W8A8: the GEMM runs on fp8 tensor cores. NB: the activations'
  quantisation (an amax and a cast per routed row, fused into the dispatch by DeepSeek-V3 /
  SGLang) is not priced and x is read at its traced width: a net understatement of up to
  ~15% of the expert GEMMs' time at prefill (NVFP4 experts likewise);
- ``int4-weight``: two codes per byte, bf16 scale and zero per 128 along K ``[E, K/128, N, 2]``;
- ``mxfp4-weight``: two e2m1 codes per byte, one e8m0 scale per 32 ``[E, N, K/32]`` (gpt-oss);
- ``nvfp4``: two e2m1 codes per byte, one e4m3 scale per 16 ``[E, N, K/16]``, fp4 tensor cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# format: (codes dtype, codes per byte, scale shape from (E, N, K), scale dtype, GEMM dtype)
# GEMM dtype "" computes in the activation's dtype (weight-only).
_FORMATS: dict[str, tuple[torch.dtype, int, Callable[[int, int, int], tuple], Any, str]] = {
    "int8-weight": (torch.int8, 1, lambda e, n, k: (e, n), torch.float32, ""),
    "fp8-weight": (torch.float8_e4m3fn, 1, lambda e, n, k: (e, n), torch.float32, ""),
    "fp8": (torch.float8_e4m3fn, 1, lambda e, n, k: (e, n), torch.float32, "float8_e4m3fn"),
    "fp8-rowwise": (
        torch.float8_e4m3fn,
        1,
        lambda e, n, k: (e, n),
        torch.float32,
        "float8_e4m3fn",
    ),
    "int4-weight": (torch.uint8, 2, lambda e, n, k: (e, k // 128, n, 2), torch.bfloat16, ""),
    "mxfp4-weight": (torch.uint8, 2, lambda e, n, k: (e, n, k // 32), torch.uint8, ""),
    "nvfp4": (
        torch.uint8,
        2,
        lambda e, n, k: (e, n, k // 16),
        torch.float8_e4m3fn,
        "float4_e2m1fn_x2",
    ),
}
# K must divide into the format's scale groups
_BLOCKS = {"int4-weight": 128, "mxfp4-weight": 32, "nvfp4": 16}
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def gemm_dtype(fmt: str, activation_dtype: str) -> str:
    """The dtype whose tensor-core peak the grouped GEMM of ``fmt`` reaches."""
    return _FORMATS[fmt][4] or activation_dtype


@torch.library.custom_op("torchroof::packed_grouped_mm", mutates_args=())
def packed_grouped_mm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offs: torch.Tensor,
    fmt: str,
    gemm_dtype: str,
) -> torch.Tensor:
    """``x [S, K] @ expert weights -> [S, N]``, the rows of each expert split by ``offs``;
    the weights are ``codes [E, N, ...]`` and ``scales`` in ``fmt``; the GEMM runs on the
    tensor cores of ``gemm_dtype`` (:func:`gemm_dtype`). Defined for meta only: torchroof
    prices it, no device runs it here."""
    raise NotImplementedError("torchroof::packed_grouped_mm is priced on meta, not run")


@packed_grouped_mm.register_fake
def _(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offs: torch.Tensor,
    fmt: str,
    gemm_dtype: str,
) -> torch.Tensor:
    if fmt not in _FORMATS:
        raise ValueError(f"packed_grouped_mm: unknown format {fmt!r}")
    k = codes.shape[2] * _FORMATS[fmt][1]
    if x.dim() != 2 or x.shape[-1] != k:
        raise ValueError(
            f"packed_grouped_mm: x {tuple(x.shape)} does not match the experts' K = {k}"
        )
    return x.new_empty(x.shape[0], codes.shape[1])


class PackedExpertWeight(torch.Tensor):
    """A 3-D expert weight ``[E, out, in]`` (or its transpose) held as ``codes`` and
    ``scales`` in ``fmt``; looks like the bf16 weight it replaces. ``transposed``: the view
    is ``[E, in, out]`` (after ``transpose(-2, -1)``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str

    @staticmethod
    def __new__(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        fmt: str,
        shape: torch.Size,
        dtype: torch.dtype,
    ) -> PackedExpertWeight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        fmt: str,
        shape: torch.Size,
        dtype: torch.dtype,
    ) -> None:
        self.codes, self.scales, self.fmt = codes, scales, fmt

    # the same keyword as Tensor.__repr__; mypy still reports the untyped original as
    # incompatible with any override
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"PackedExpertWeight({self.fmt}, shape={tuple(self.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        return ["codes", "scales"], (self.fmt, self.shape, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Any:
        fmt, shape, dtype = meta
        return PackedExpertWeight(inner["codes"], inner["scales"], fmt, shape, dtype)

    def _with_shape(self, shape: torch.Size) -> PackedExpertWeight:
        return PackedExpertWeight(self.codes, self.scales, self.fmt, shape, self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _GROUPED_MMS:
            x, weight = args[0], args[1]
            offs = kwargs.pop("offs", args[2] if len(args) > 2 else None)
            extra = [k for k, v in kwargs.items() if v is not None]
            if len(args) > 3 or extra:
                raise NotImplementedError(
                    f"grouped_mm with {extra or 'more arguments'} on packed experts"
                )
            if tuple(weight.shape[1:]) != (x.shape[-1], weight.codes.shape[1]):
                raise ValueError(
                    f"grouped_mm of x {tuple(x.shape)} with packed experts viewed as "
                    f"{tuple(weight.shape)}: expected [E, {x.shape[-1]}, "
                    f"{weight.codes.shape[1]}] (in, out)"
                )
            dtype = gemm_dtype(weight.fmt, str(x.dtype).removeprefix("torch."))
            return packed_grouped_mm(x, weight.codes, weight.scales, offs, weight.fmt, dtype)
        if func in (torch.Tensor.transpose, torch.transpose):
            weight = args[0]
            shape = list(weight.shape)
            dim0, dim1 = (d % len(shape) for d in args[1:3])
            shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
            return weight._with_shape(torch.Size(shape))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # torch types Tensor.__torch_dispatch__ as its disabled implementation bound as a method
    # (no ``func`` parameter), not as the classmethod every subclass defines
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]._with_shape(args[0].shape)
        if func is torch.ops.aten.clone.default:  # deepcopy (meta_copy of a packed model)
            weight = args[0]
            codes, scales = weight.codes.clone(), weight.scales.clone()
            return PackedExpertWeight(codes, scales, weight.fmt, weight.shape, weight.dtype)
        raise NotImplementedError(
            f"{func} on a packed expert weight: only transformers' grouped-GEMM experts "
            "(experts_implementation='grouped_mm') read it"
        )


_GROUPED_MMS = tuple(
    f
    for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
    if f is not None
)


def _pack(weight: torch.Tensor, fmt: str, transposed: bool) -> PackedExpertWeight:
    """Meta codes and scales of ``fmt`` for a ``[E, out, in]`` weight (``[E, in, out]`` when
    ``transposed``)."""
    codes_dtype, per_byte, scale_shape, scale_dtype, _ = _FORMATS[fmt]
    e, n, k = (weight.shape[0], weight.shape[2], weight.shape[1]) if transposed else weight.shape
    codes = torch.empty(e, n, k // per_byte, dtype=codes_dtype, device="meta")
    scales = torch.empty(scale_shape(e, n, k), dtype=scale_dtype, device="meta")
    return PackedExpertWeight(codes, scales, fmt, weight.shape, weight.dtype)


def _in_features(weight: torch.Tensor, transposed: bool) -> int:
    return weight.shape[1] if transposed else weight.shape[2]


def pack_experts(model: nn.Module, fmt: str) -> tuple[int, tuple[str, ...]]:
    """Replace, in place, the 3-D expert weights of every grouped-GEMM experts module of
    ``model`` (on meta) by packed ones in ``fmt``; returns (weights packed, names of those
    whose K does not divide into the format's groups, left wide)."""
    packed, skipped = 0, []
    block = _BLOCKS.get(fmt, 16)
    for path, module in model.named_modules():
        if not hasattr(module, "num_experts"):
            continue
        transposed = bool(getattr(module, "is_transposed", False))
        for name in EXPERT_WEIGHTS:
            weight = module._parameters.get(name)
            if weight is None or weight.dim() != 3 or isinstance(weight, PackedExpertWeight):
                continue
            if _in_features(weight, transposed) % block:
                skipped.append(f"{path}.{name}")
                continue
            module._parameters[name] = nn.Parameter(
                _pack(weight, fmt, transposed), requires_grad=False
            )
            packed += 1
    return packed, tuple(skipped)


def _expert_weights(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(module path, name, weight) of every 3-D parameter of a module with ``num_experts``."""
    return [
        (path, name, weight)
        for path, module in model.named_modules()
        if hasattr(module, "num_experts")
        for name, weight in module._parameters.items()
        if weight is not None and weight.dim() == 3
    ]


def has_experts(model: nn.Module) -> bool:
    """Does ``model`` hold 3-D expert weights (a module with ``num_experts``)?"""
    return bool(_expert_weights(model))


def other_expert_weights(model: nn.Module) -> list[str]:
    """3-D expert weights that are not packed: not named as transformers' grouped-GEMM
    experts name them (JetMoE's ``weight``), left in the model's dtype."""
    return [
        f"{path}.{name}"
        for path, name, weight in _expert_weights(model)
        if not isinstance(weight, PackedExpertWeight) and name not in EXPERT_WEIGHTS
    ]


def experts_implementation(model: nn.Module) -> str:
    """The experts implementation transformers runs (``grouped_mm`` reads packed weights)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_experts_implementation", "") or "")

"""Tensors as a trace records them: shape, layout, storage identity and what a storage holds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, Literal

Role = Literal["weights", "gradients", "optimizer_state", "kv_cache"]
ROLES: tuple[Role, ...] = ("weights", "gradients", "optimizer_state", "kv_cache")
"""What a storage holds; every storage without a role holds activations."""


@cache
def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype named without the ``torch.`` prefix."""
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch_dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, layout and storage identity of one tensor an op touched."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    storage: int  # storage id, unique within one trace
    offset: int = 0  # storage offset in elements

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def unique_numel(self) -> int:
        """Distinct elements addressed: a broadcast (stride-0) dimension is read once."""
        return _unique_numel(self.shape, self.stride)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Compulsory bytes to read or write this tensor once (unique elements only)."""
        return _unique_numel(self.shape, self.stride) * dtype_itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        return [list(self.shape), list(self.stride), self.dtype, self.storage, self.offset]

    @classmethod
    def from_json(cls, data: list[Any]) -> TensorMeta:
        shape, stride, dtype, storage, offset = data
        return cls(tuple(shape), tuple(stride), dtype, storage, offset)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor argument inside ``OpRecord.args``: an index into ``OpRecord.inputs``."""

    index: int


def remapped(tensors: tuple[TensorMeta, ...], mapping: dict[int, int]) -> tuple[TensorMeta, ...]:
    """``tensors`` with their storages through ``mapping`` (a storage not in it kept)."""
    return tuple(
        TensorMeta(t.shape, t.stride, t.dtype, mapping.get(t.storage, t.storage), t.offset)
        for t in tensors
    )


def storage_extent_bytes(t: TensorMeta) -> int:
    """Bytes of storage a tensor view reaches: (offset + last element + 1) · itemsize."""
    return _extent_elements(t.shape, t.stride, t.offset) * dtype_itemsize(t.dtype)


# A trace repeats a few layouts thousands of times (every copy of a layer has its
# representative's shapes): each is worked out once. Bounded, so a long search over many
# shapes does not grow without end.
_LAYOUTS = 1 << 16


def clear_layout_caches() -> None:
    """Forget every layout worked out so far: work whose decisions on symbolic sizes are
    written down (:func:`torchroof.records.expressions.deciding`) must make them itself,
    not find a result a cache kept from earlier work on the same sizes."""
    for cached in (_numel, _unique_numel, _extent_elements):
        cached.cache_clear()


@lru_cache(maxsize=_LAYOUTS)
def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@lru_cache(maxsize=_LAYOUTS)
def _unique_numel(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    count = 1
    for size, step in zip(shape, stride, strict=True):
        if size == 0:
            return 0
        if step:
            count *= size
    return count


@lru_cache(maxsize=_LAYOUTS)
def _extent_elements(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements of storage a view reaches: offset + its last element + 1 (0 when empty)."""
    if math.prod(shape) == 0:
        return 0
    return offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) + 1

"""Tensors as a trace records them: shape, layout, storage identity and what a storage holds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
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
        return math.prod(self.shape)

    @property
    def unique_numel(self) -> int:
        """Distinct elements addressed: a broadcast (stride-0) dimension is read once."""
        count = 1
        for size, step in zip(self.shape, self.stride, strict=True):
            if size == 0:
                return 0
            if step:
                count *= size
        return count

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Compulsory bytes to read or write this tensor once (unique elements only)."""
        return self.unique_numel * self.itemsize

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


def storage_extent_bytes(t: TensorMeta) -> int:
    """Bytes of storage a tensor view reaches: (offset + last element + 1) · itemsize."""
    if t.numel == 0:
        return 0
    last = sum((size - 1) * step for size, step in zip(t.shape, t.stride, strict=True))
    return (t.offset + last + 1) * t.itemsize

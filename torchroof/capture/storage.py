"""Storage identity during a capture: one id per storage, and the TensorMeta of a tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TensorWithFlatten, is_traceable_wrapper_subclass_type

from torchroof.capture.symbolic import active_sizes, sized
from torchroof.records.tensors import TensorMeta


class StorageIds:
    """Numbers the storages a capture meets 0, 1, 2, ... in the order it meets them, and
    describes tensors as :class:`TensorMeta` with those ids."""

    def __init__(self) -> None:
        self._storages: dict[int, tuple[int, StorageWeakRef]] = {}
        self._next_storage = 0

    def storage_id(self, tensor: torch.Tensor) -> int:
        sizes = active_sizes()
        real = sizes.real_of(tensor) if sizes is not None else None
        if real is not None:  # a fake copy of a meta weight or buffer: the weight's storage
            tensor = real
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return self.fresh_id()
        key = storage._cdata
        entry = self._storages.get(key)
        if entry is None:
            # Holding a weak reference keeps the StorageImpl's address from being reused
            # for another storage while the trace runs, so the key stays unique.
            entry = (self.fresh_id(), StorageWeakRef(storage))
            self._storages[key] = entry
        return entry[0]

    def alias(self, tensor: torch.Tensor, base: torch.Tensor) -> None:
        """Record ``tensor``'s storage under ``base``'s id: a re-wrap that hands the same
        bytes on as a new tensor (``_wrap_tensor_autograd`` gives a collective's result to
        autograd) must not look like a buffer nobody wrote, or fusion and the schedule lose
        the dependency on the collective."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = storage._cdata
        if key not in self._storages:
            self._storages[key] = (self.storage_id(base), StorageWeakRef(storage))

    @property
    def next_id(self) -> int:
        """The id the next storage met will get: every id below it is taken."""
        return self._next_storage

    def bind(self, tensor: torch.Tensor, sid: int) -> None:
        """Record ``tensor``'s storage under ``sid`` (a replayed layer's output, made
        without running the op the ops recorded for it say wrote it)."""
        storage = tensor.untyped_storage()
        self._storages[storage._cdata] = (sid, StorageWeakRef(storage))

    def fresh_id(self) -> int:
        self._next_storage += 1
        return self._next_storage - 1

    def clear(self) -> None:
        """Release the weak references that pin storage addresses (the capture is over)."""
        self._storages.clear()

    def tensor_meta(self, tensor: torch.Tensor) -> TensorMeta:
        try:
            stride = tuple(tensor.stride())
            offset = tensor.storage_offset()
        except (RuntimeError, NotImplementedError):
            stride, offset = contiguous_stride(tuple(tensor.shape)), 0
        shape = tuple(sized(s) for s in tensor.shape)
        return TensorMeta(
            shape,
            unit_strides(shape, tuple(sized(s) for s in stride)),
            str(tensor.dtype).removeprefix("torch."),
            self.storage_id(tensor),
            sized(offset),
        )

    def synthetic_meta(self, shape: Iterable[int], dtype: torch.dtype) -> TensorMeta:
        """A tensor the modelled kernel would produce but the captured run did not."""
        shape = tuple(sized(s) for s in shape)
        dtype_name = str(dtype).removeprefix("torch.")
        return TensorMeta(shape, contiguous_stride(shape), dtype_name, self.fresh_id())


def unit_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """``stride`` with each size-1 dimension's stride set to what it would be packed
    against the dimension inside it (``(B, 4, 1, 32)`` strides ``(128, 32, *, 1)`` -> 32).
    A size-1 dimension is never stepped along, so its stride is arbitrary: torch's C++
    kernels and its symbolic-shape kernels (a capture with symbolic sizes) choose it
    differently for the same tensor, and a trace records one choice for both."""
    if 1 not in shape:
        return stride
    out = list(stride)
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] == 1:
            out[d] = out[d + 1] * shape[d + 1] if d + 1 < len(shape) else 1
    return tuple(out)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's result (one tensor, or a nested list or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard (tensor parallel's
    column or row block, FSDP2's flat-padded shard), any other tensor itself. Unwrapped
    without dispatching an op (DTensor's ``to_local`` is an autograd function)."""
    if not torch.distributed.is_available():
        return tensor
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor


def held_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors ``tensor`` holds on this rank: a DTensor's local shard, the inner
    tensors of a wrapper subclass (torchao's quantised weights: fp8 or int8 data and their
    scales; an 8-bit optimizer state's codes and scales), recursively; a plain tensor
    itself. Their storages are what the traced ops read, and their bytes what memory holds."""
    tensor = local_shard(tensor)
    if not is_traceable_wrapper_subclass_type(type(tensor)):
        return [tensor]
    names, _ = cast(TensorWithFlatten, tensor).__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)
    return [held for t in inner if isinstance(t, torch.Tensor) for held in held_tensors(t)]

"""A fake tensor mode that takes eager PyTorch's paths: views with eager's strides, and
functional collectives whose results are handed on as eager hands them on.

Under ``FakeTensorMode`` ``aten.view`` and ``aten._unsafe_view`` are computed by
``torch._refs._reshape_view_helper`` (``torch/_subclasses/fake_impls.py``), not by the C++
kernel every real (and meta) tensor runs, ``at::detail::computeStride``
(``aten/src/ATen/TensorUtils.cpp``). The two agree on every stride but that of a dimension of
size 1, which no element is ever reached through, but which ``matmul`` reads: its fold of a
3-d input into one ``mm`` asks that each leading stride equal the next stride times the
next size (``should_fold`` in ``aten/src/ATen/native/LinearAlgebra.cpp``). A row-parallel
layer's input ``(batch, 1, d)`` made by ``reshape`` of attention's output has strides
``(d, d, 1)`` in eager (``mm``) and ``(d, d/2, 1)`` under the fake mode (``expand`` and
``bmm``): a symbolic capture would record other kernels than the step runs. Here each such
view is given eager's strides, so the fake step takes eager's path.

A functional collective (``torch.distributed._functional_collectives``: DTensor's
redistributions) hands its result on through ``_maybe_wrap_tensor``: in eager as
``_c10d_functional._wrap_tensor_autograd`` (an ``AsyncCollectiveTensor``, waited for at
its first use), but ``wait_tensor`` at once when it believes it is being compiled, which it
takes any fake tensor mode to mean. A symbolic capture compiles nothing:
:func:`eager_collective_results` makes it record what eager records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

_RESHAPING_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default})


def eager_view_strides(
    shape: Sequence[Any], stride: Sequence[Any], new_shape: Sequence[Any]
) -> tuple[Any, ...] | None:
    """The strides eager PyTorch gives a view of a tensor of ``shape`` and ``stride`` as
    ``new_shape`` (``at::detail::computeStride``), or None where it cannot view it so.
    Sizes may be symbolic: each comparison on them is then a guard the ShapeEnv writes
    down, as for any other decision torch takes on them."""
    if not shape:
        return (1,) * len(new_shape)
    numel = 1
    for size in shape:
        numel = numel * size
    if isinstance(numel, int) and numel == 0:  # eager's rule for an empty tensor
        if list(shape) == list(new_shape):
            return tuple(stride)
        empty: list[Any] = [1] * len(new_shape)
        for view_d in range(len(new_shape) - 2, -1, -1):
            empty[view_d] = max(new_shape[view_d + 1], 1) * empty[view_d + 1]
        return tuple(empty)
    if numel == 0:
        return None  # a symbolic empty size: left to the fake mode
    new_stride: list[Any] = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = stride[-1]
    tensor_numel: Any = 1
    view_numel: Any = 1
    for tensor_d in range(len(shape) - 1, -1, -1):
        tensor_numel = tensor_numel * shape[tensor_d]
        # the end of a chunk of dimensions contiguous with one another
        if tensor_d == 0 or (
            shape[tensor_d - 1] != 1 and stride[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base_stride
                view_numel = view_numel * new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = stride[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    return tuple(new_stride) if view_d == -1 else None


class EagerViewsFakeMode(FakeTensorMode):
    """``FakeTensorMode`` with eager's strides on ``view`` and ``_unsafe_view``."""

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().dispatch(func, types, args, kwargs)
        if func not in _RESHAPING_VIEWS or not isinstance(out, FakeTensor):
            return out
        base = args[0]
        strides = eager_view_strides(base.shape, base.stride(), out.shape)
        if strides is None or all(
            statically_known_true(a == b) for a, b in zip(strides, out.stride(), strict=True)
        ):
            return out
        offset = out.storage_offset()
        return super().dispatch(
            aten.as_strided.default, types, (base, tuple(out.shape), strides, offset), {}
        )


@contextlib.contextmanager
def eager_collective_results() -> Iterator[None]:
    """Inside: a functional collective's result is handed on as eager hands it on
    (``_wrap_tensor_autograd``) under a fake tensor mode too, unless something is really
    compiling or tracing the step (dynamo, a proxy mode)."""
    if not torch.distributed.is_available():
        yield
        return
    import torch.distributed._functional_collectives as functional

    real = functional._maybe_wrap_tensor

    def maybe_wrap(tensor: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or functional.get_proxy_mode() is not None:
            return real(tensor)
        wrap = getattr(functional, "_wrap_tensor_autograd", None)  # newer torch
        return wrap(tensor) if wrap is not None else functional.AsyncCollectiveTensor(tensor)

    functional._maybe_wrap_tensor = maybe_wrap  # type: ignore[assignment]
    try:
        yield
    finally:
        functional._maybe_wrap_tensor = real

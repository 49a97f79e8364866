"""Data-dependent ops on meta, answered under balanced routing.

``nonzero``, boolean-mask indexing and ``Tensor.tolist()`` have no data-independent meta
kernel: the size of what they return depends on values meta does not have. Routing code
(MoE expert loops, language adapters) builds those values in a few recognisable ways, so
capture keeps the *mean value* of the tensors they come from:

* ``one_hot(i, E)`` is, on meta, ``i.unsqueeze(-1) == arange(E)``: mean 1/E;
* ``zeros(...).scatter(d, idx, 1)``: mean ``idx.numel() / numel``, and so for
  ``zeros(...).scatter_add_(d, idx, ones_like(idx))`` (transformers' expert-parallel
  dispatch counts the rows it sends each expert this way);
* ``stack`` / ``cat`` of tensors whose means are known: their element-weighted mean (a
  ``stack`` keeps each row's own, so the sizes sent and those received each sum right);
* an ``all_to_all_single`` of a count tensor (c10d or functional) keeps its mean: balanced
  routing is symmetric, so every rank receives from each peer what it sends to it;
* ``sum`` over dims multiplies the mean by the elements reduced (tokens per expert);
* ``x > 0`` / ``x != 0`` of a count: the fraction of experts hit, min(1, mean count);
* an index ``nonzero`` returned, compared with one value (``expert_idx == num_experts``,
  the padding class transformers' expert loops skip): False, so every hit expert runs;
* views, casts, copies, integer indexing (``mask[e]``) and waiting for a collective's
  result keep it.

A tensor of unknown provenance counts as all nonzero (the same choice as ``.item()``
answering True: no padding, every sequence in the one language). The answers are balanced
routing: each of the E experts gets tokens·top_k/E rows (rounded up, so small batches hit
tokens·top_k experts of one row each), and ``tolist()`` of per-expert counts sums to
tokens·top_k exactly, as the ``split`` that follows requires; read one element at a time
(a FakeTensor's ``tolist`` unbinds and calls ``.item()``), a count answers the same split.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten


def _all_to_all_ops() -> tuple[Any, frozenset[Any]]:
    """``c10d.alltoall_base_`` (in place: output, input, ...) and the functional
    ``all_to_all_single`` packets (input, ... -> output), where this torch has them."""
    in_place = getattr(getattr(torch.ops, "c10d", None), "alltoall_base_", None)
    functional = [
        getattr(getattr(torch.ops, namespace, None), "all_to_all_single", None)
        for namespace in ("_c10d_functional", "_c10d_functional_autograd")
    ]
    return (
        in_place.default if in_place is not None else None,
        frozenset(op.default for op in functional if op is not None),
    )


def _rewrap_ops() -> frozenset[Any]:
    """``wait_tensor`` / ``_wrap_tensor_autograd``: a collective's result handed on as is."""
    namespace = getattr(torch.ops, "_c10d_functional", None)
    ops = (getattr(namespace, name, None) for name in ("wait_tensor", "_wrap_tensor_autograd"))
    return frozenset(op.default for op in ops if op is not None)


if torch.distributed.is_available():  # defines the _c10d_functional packets
    import torch.distributed._functional_collectives  # noqa: F401
_ALL_TO_ALL_IN_PLACE, _ALL_TO_ALL = _all_to_all_ops()


_KEEP = {
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.permute.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.select.int,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.transpose.int,
    aten.t.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.flatten.using_ints,
} | _rewrap_ops()
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_SCATTER_VALUE = {aten.scatter.value, aten.scatter_.value}
_SCATTER_ADD = {aten.scatter_add.default, aten.scatter_add_.default}
_ONES = {aten.ones.default, aten.ones_like.default, aten.new_ones.default}
_JOIN = {aten.stack.default, aten.cat.default}
_SUM = {aten.sum.dim_IntList, aten.sum.default}
_ANY_HIT = {aten.gt.Scalar, aten.ne.Scalar}
_EQUAL = {aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor}
_INDEX = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}


def is_data_dependent(func: Any, args: tuple[Any, ...]) -> bool:
    """``nonzero``, or indexing with a boolean mask (which runs a nonzero inside)."""
    if func is aten.nonzero.default:
        return True
    return func in _INDEX and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    )


def _numel(t: torch.Tensor) -> int:
    return max(int(t.numel()), 1)


_MASK_DTYPES = (torch.bool, torch.uint8)


class Means:
    """Mean value per meta tensor, where routing code made it knowable."""

    def __init__(self) -> None:
        self._mean = WeakTensorKeyDictionary()
        self._arange = WeakTensorKeyDictionary()  # tensor -> length of the arange it views
        self._index = WeakTensorKeyDictionary()  # positions returned by nonzero
        self._ones = WeakTensorKeyDictionary()  # ones / ones_like: what scatter_add counts
        self._rows = WeakTensorKeyDictionary()  # stack of known means -> each row's mean

    def mean(self, tensor: torch.Tensor) -> float | None:
        return self._mean.get(tensor)

    def mark_index(self, tensor: torch.Tensor) -> None:
        self._index[tensor] = True

    def item(self, tensor: torch.Tensor, neutral: Any) -> Any:
        """``.item()`` of a boolean whose mean is known (an expert index compared with the
        padding class: False), or of one count whose mean is known (an element of a count
        tensor, as a FakeTensor's ``tolist`` reads them one by one), else the neutral
        answer."""
        mean = self.mean(tensor)
        if mean is None or tensor.numel() != 1:
            return neutral
        if tensor.dtype == torch.bool:
            return mean >= 0.5
        if _is_count(tensor):
            return round(mean)
        return neutral

    def observe(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is _ALL_TO_ALL_IN_PLACE and first is not None:
            # balanced routing is symmetric: the counts received are those sent
            sent = self._mean.get(args[1])
            if sent is None:
                self._mean.pop(first, None)
            else:
                self._mean[first] = sent
            return
        if isinstance(out, (tuple, list)):  # unbind: iterating over nonzero's rows
            if first is not None and first in self._index:
                for piece in out:
                    if isinstance(piece, torch.Tensor):
                        self._index[piece] = True
            if func is aten.unbind.int and first is not None and first in self._mean:
                self._unbind_counts(first, out, args[1] if len(args) > 1 else 0)
            return
        if not isinstance(out, torch.Tensor):
            return
        if first is not None and first in self._index:
            if func in _KEEP:
                self._index[out] = True
            elif func in _EQUAL:
                # one expert index equals one given value (the padding class, expert E)
                # for 1 of E indices: taken as never, so every hit expert runs
                self._mean[out] = 0.0 if func in (aten.eq.Scalar, aten.eq.Tensor) else 1.0
                return
        if func in _ARANGE:
            self._arange[out] = out.shape[0]  # a SymInt stays one until a router reads it
        elif func in _ONES:
            self._ones[out] = True
        elif func in _ALL_TO_ALL and first is not None and first in self._mean:
            self._mean[out] = self._mean[first]
        elif func in _JOIN and args[0] and all(t in self._mean for t in args[0]):
            total = sum(self._mean[t] * t.numel() for t in args[0])
            self._mean[out] = total / _numel(out)
            if func is aten.stack.default and (args[1] if len(args) > 1 else 0) == 0:
                # rows keep their own totals (the sizes sent and received each sum right)
                self._rows[out] = [self._mean[t] for t in args[0]]
        elif func in _ZEROS:
            self._mean[out] = 0.0
        elif (func in _KEEP or func is aten.index.Tensor) and first is not None:
            # (indexing with integer indices picks rows: their mean is the whole's mean)
            if first in self._mean:
                self._mean[out] = self._mean[first]
            if first in self._arange:
                self._arange[out] = self._arange[first]
            if first in self._ones:
                self._ones[out] = True
        elif func is aten.eq.Tensor and len(args) == 2:
            for a, b in (args, args[::-1]):
                if isinstance(b, torch.Tensor) and b in self._arange and a not in self._arange:
                    self._mean[out] = 1.0 / max(self._arange[b], 1)  # one_hot
        elif func in _SCATTER_VALUE and first is not None and first in self._mean:
            index, value = args[2], args[3]
            added = float(value) * index.numel() / _numel(first)
            self._mean[out] = min(self._mean[first] + added, float(value))
        elif func in _SCATTER_ADD and first is not None and first in self._mean:
            index, source = args[2], args[3]
            added = self._mean.get(source, 1.0 if source in self._ones else None)
            if added is not None:
                self._mean[out] = self._mean[first] + added * index.numel() / _numel(first)
        elif func in _SUM and first is not None and first in self._mean:
            self._mean[out] = self._mean[first] * _numel(first) / _numel(out)
        elif func in _ANY_HIT and first is not None and first in self._mean and args[1] == 0:
            self._mean[out] = min(1.0, self._mean[first])

    def _unbind_counts(self, whole: torch.Tensor, pieces: Any, dim: int) -> None:
        """The rows of a count tensor (``unbind(0)``, a FakeTensor's ``tolist``) get the
        balanced split :meth:`tolist` answers, row by row, so that read one by one they
        sum to the same total; along another dimension each piece keeps the whole's mean."""
        mean = self._mean[whole]
        if dim % max(whole.dim(), 1) or not _is_count(whole):
            for piece in pieces:
                self._mean[piece] = mean
            return
        flat = self._balanced_values(whole)
        step = len(flat) // max(len(pieces), 1)
        for i, piece in enumerate(pieces):
            self._mean[piece] = sum(flat[i * step : (i + 1) * step]) / max(step, 1)

    def _balanced_values(self, tensor: torch.Tensor) -> list[int]:
        """The flat values of a count tensor under balanced routing: its total split evenly,
        row by row when it stacks rows of known means."""
        rows = self._rows.get(tensor)
        if rows is None or not rows:
            return _balanced(round(self._mean[tensor] * tensor.numel()), int(tensor.numel()))
        size = int(tensor.numel()) // len(rows)
        return [value for row in rows for value in _balanced(round(row * size), size)]

    # -- answers ------------------------------------------------------------------------------
    def nonzero_rows(self, mask: torch.Tensor) -> Any:
        """Rows ``nonzero(mask)`` returns: ceil(numel · mean), all when the mean is unknown
        (the mask's size as it is: a symbolic size stays one)."""
        mean = self.mean(mask)
        if mean is None:
            return mask.numel()
        return min(int(mask.numel()), math.ceil(mask.numel() * mean - 1e-9))

    def tolist(self, tensor: torch.Tensor, neutral: Any) -> tuple[Any, str, bool]:
        """Nested list for ``tensor.tolist()``: a count tensor split evenly so that it sums
        to its total (tokens·top_k for per-expert counts); otherwise ``neutral`` everywhere.
        The flag says which (True: a routing answer)."""
        shape = tuple(tensor.shape)
        n = int(tensor.numel())
        mean = self.mean(tensor)
        if mean is not None and _is_count(tensor):
            flat: list[Any] = self._balanced_values(tensor)
            how = f"balanced: {sum(flat)} split over {n}"
        else:
            flat = [neutral] * n
            how = f"{neutral!r} everywhere"
        return _nest(flat, shape), how, mean is not None

    def bool_indices(self, indices: list[Any]) -> tuple[list[Any], int | None]:
        """Boolean masks in an index list replaced by the long indices ``nonzero`` gives."""
        out: list[Any] = []
        rows = None
        for index in indices:
            if isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES:
                rows = self.nonzero_rows(index)
                out.extend(
                    torch.empty(rows, dtype=torch.long, device=index.device)
                    for _ in range(max(index.dim(), 1))
                )
            else:
                out.append(index)
        return out, rows


def _is_count(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point and tensor.dtype != torch.bool


def _balanced(total: int, n: int) -> list[int]:
    """``total`` split over ``n`` as evenly as integers allow, the larger shares first."""
    base, extra = divmod(total, max(n, 1))
    return [base + 1] * extra + [base] * (n - extra)


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def answer(
    means: Means, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, str, bool]:
    """Run a data-dependent op on meta with the balanced answer; (output, what was assumed,
    whether the answer is a routing one). A mask whose mean routing code made knowable (a
    one-hot of expert indices) is answered balanced: routing. Any other mask (a vocabulary
    shard's out-of-range tokens, a padding mask) selects every row, the upper bound."""
    if func is aten.nonzero.default:
        mask = args[0]
        rows = means.nonzero_rows(mask)
        out = torch.empty((rows, mask.dim()), dtype=torch.long, device=mask.device)
        means.mark_index(out)
        return out, _mask_note("nonzero of", mask, rows, means), means.mean(mask) is not None
    masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES]
    indices, selected = means.bool_indices(list(args[1]))
    out = func(args[0], indices, *args[2:], **kwargs)
    routed = any(means.mean(m) is not None for m in masks)
    if not routed:  # every row: said without its number, the same at every size
        return out, "boolean mask indexing answered every row selected", routed
    return out, f"boolean mask indexing answered {selected} selected rows", routed


def _mask_note(what: str, mask: torch.Tensor, rows: Any, means: Means) -> str:
    """What ``nonzero`` of ``mask`` was answered: its rows where routing made them known,
    else every row, said without sizes (a symbolic capture's note is the same at every
    size: :func:`torchroof.symbolic.trace_symbolic`)."""
    if means.mean(mask) is None:
        return f"{what} a {mask.dim()}-d mask answered every row"
    return f"{what} {tuple(mask.shape)} answered {rows} of {mask.numel()} rows"

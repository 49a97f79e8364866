"""Answers for what meta cannot compute (.item(), tolist(), nonzero), noted as assumptions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchroof.capture import routing
from torchroof.records.assumptions import Assumption, AssumptionKind
from torchroof.records.ops import OpRecord, Phase
from torchroof.records.trace import Trace

Record = Callable[[Any, tuple[Any, ...], dict[str, Any], Any, Any], OpRecord]


def neutral_scalar(dtype: torch.dtype) -> bool | int | float:
    """The value ``Tensor.item()`` answers on meta.

    NB: True / 1 / 1.0 is the choice that keeps the common callers on their fast, dense
    path: HF's "is the mask all ones" checks say yes (no padding), and ``torch.optim``'s
    step counter is 1 (bias corrections stay finite).
    """
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return 1.0
    return 1


def needs_item_answer(tensor: Any) -> bool:
    """True for a tensor without data (meta, or a FakeTensor): its values must be answered."""
    if not isinstance(tensor, torch.Tensor):
        return False
    if tensor.is_meta:
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class MetaAnswers:
    """Answers data-dependent calls on tensors without data and notes each answer in
    ``Trace.assumptions``: ``.item()`` a neutral value (or a balanced-routing count),
    ``nonzero`` / boolean masks and ``tolist()`` balanced routing (``means``).
    ``count()`` is told of each ``.item()`` / ``tolist()`` answer (the op budget);
    ``record(func, args, kwargs, out, context)`` records an op."""

    def __init__(
        self,
        trace: Trace,
        count: Callable[[], None],
        record: Record,
        context: Callable[[], tuple[Phase, str, Any]],
    ) -> None:
        self._trace = trace
        self._count = count
        self._record = record
        self._context = context
        self.means = routing.Means()  # balanced-routing answers for nonzero / tolist

    def item_unrecorded(self, tensor: torch.Tensor) -> Any:
        """``.item()`` inside unrecorded work: answered and counted, not noted."""
        self._count()
        return self.means.item(tensor, neutral_scalar(tensor.dtype))

    def item(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``aten._local_scalar_dense`` (``.item()``): answered, recorded and noted."""
        self._count()
        tensor = args[0]
        value = self.means.item(tensor, neutral_scalar(tensor.dtype))
        op = self._record(func, args, kwargs, None, None)
        self._trace.assumptions.append(
            Assumption(op.index, op.module, f"Tensor.item() on {tensor.dtype} answered {value!r}")
        )
        return value

    def data_dependent(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        """nonzero / boolean-mask indexing on meta: the balanced-routing answer
        (torchroof.capture.routing), recorded as an assumption (when ``context`` is given:
        not in unrecorded work)."""
        out, what, routed = routing.answer(self.means, func, args, kwargs)
        if context is not None:
            op = self._record(func, args, kwargs, out, context)
            kind: AssumptionKind = "routing" if routed else "selection"
            self._trace.assumptions.append(Assumption(op.index, op.module, what, kind))
        return out

    def tolist(self, tensor: torch.Tensor, suppressed: bool) -> Any:
        """``Tensor.tolist()``: the balanced-routing answer, noted unless ``suppressed``."""
        self._count()
        value, how, routed = self.means.tolist(tensor, neutral_scalar(tensor.dtype))
        if not suppressed:
            phase, module, _ = self._context()
            self._trace.assumptions.append(
                Assumption(
                    len(self._trace.ops),
                    module,
                    f"Tensor.tolist() on {tensor.dtype} {how}",
                    "routing" if routed else "scalar",
                )
            )
        return value

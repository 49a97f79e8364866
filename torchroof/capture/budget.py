"""The op budget of a capture: aten ops and meta ``.item()`` answers, counted and bounded."""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from torchroof.config.limits import (  # why: see there
    DEFAULT_MAX_ITEM_ANSWERS,
    DEFAULT_MAX_OPS,
    ITEM_ANSWERS_PER_TRACE_FACTOR,
)

_WINDOW = 1000  # ops kept to name the loop body when the budget trips
_LIMITS: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "torchroof_op_budget", default=(DEFAULT_MAX_OPS, DEFAULT_MAX_ITEM_ANSWERS)
)
_ITEM_REMEDY = (
    "raise max_item_answers if this many is real: "
    "torchroof.trace(max_item_answers=...), or "
    "torchroof.op_budget(max_item_answers=...)"
)


class OpBudgetExceeded(RuntimeError):
    """Capture saw more aten ops than its budget (``max_ops``), or more meta ``.item()``
    answers in one module call than ``max_item_answers``: almost always a data-dependent
    Python loop that never ends on meta. ``ops``, ``module`` and ``frequent`` (the most
    frequent ops of the last window, with their counts) say where it was."""

    def __init__(
        self, message: str, *, ops: int, module: str, frequent: list[tuple[str, int]]
    ) -> None:
        super().__init__(message)
        self.ops = ops
        self.module = module
        self.frequent = frequent


@contextlib.contextmanager
def op_budget(max_ops: int | None = None, max_item_answers: int | None = None) -> Iterator[None]:
    """The budget of every :class:`Capture` made inside without its own (``None`` keeps
    the current one): how a caller that does not make the captures itself (the workloads)
    raises or lowers it."""
    token = _LIMITS.set(budget_limits(max_ops, max_item_answers))
    try:
        yield
    finally:
        _LIMITS.reset(token)


def budget_limits(max_ops: int | None, max_item_answers: int | None) -> tuple[int, int]:
    """(max_ops, max_item_answers): each as given, checked, or the current budget's."""
    current_ops, current_items = _LIMITS.get()
    return (
        _check_budget("max_ops", current_ops if max_ops is None else max_ops),
        _check_budget(
            "max_item_answers", current_items if max_item_answers is None else max_item_answers
        ),
    )


def _check_budget(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class OpBudget:
    """Counts every aten op and every meta ``.item()`` answer of one capture, and raises
    :class:`OpBudgetExceeded` naming where (``locate``: (where, module path)) and the most
    frequent ops of the last window when a limit is passed."""

    def __init__(
        self, max_ops: int, max_item_answers: int, locate: Callable[[], tuple[str, str]]
    ) -> None:
        self.max_ops = max_ops
        self.max_item_answers = max_item_answers
        self.op_count = 0  # every aten op seen, recorded or not
        self._items_here = 0  # .item() answers since the module stack last changed
        self._items_total = 0  # .item() answers in the whole trace (outside optimizer steps)
        self._window: collections.deque[Any] = collections.deque(maxlen=_WINDOW)
        self._locate = locate

    def new_module_call(self) -> None:
        """A module entered or left, or an optimizer step begun or ended: the per-call
        count of ``.item()`` answers starts again."""
        self._items_here = 0

    def count_op(self, func: Any) -> None:
        """Count one aten op against ``max_ops`` (every op, recorded or not)."""
        self.op_count += 1
        self._window.append(func)
        if self.op_count > self.max_ops:
            self._over_budget(
                f"{self.max_ops:,} aten ops traced (max_ops={self.max_ops:,})",
                "raise max_ops if the step really is this long: torchroof.trace(max_ops=...), "
                "or torchroof.op_budget(max_ops=...) around estimate() / trace_model()",
            )

    def count_ops(self, count: int) -> None:
        """Count ``count`` ops a replayed layer stands for (its representative ran them)."""
        self.op_count += count
        if self.op_count > self.max_ops:
            self.count_op("a replayed layer")

    def count_item_answer(self, in_optimizer: bool) -> None:
        """Count one ``.item()`` / ``tolist()`` answered on meta; too many in one module
        call, with no module entered or left in between, is a loop on those answers.
        Answers inside a torch.optim step (one per parameter) do not count."""
        if in_optimizer:
            return
        self._items_here += 1
        self._items_total += 1
        if self._items_total > self.max_item_answers * ITEM_ANSWERS_PER_TRACE_FACTOR:
            # a loop whose body calls a submodule resets the per-call count every
            # iteration: the whole trace's answers bound it too
            self._over_budget(
                f"{self.max_item_answers * ITEM_ANSWERS_PER_TRACE_FACTOR:,} Tensor.item() "
                f"answers in this trace (max_item_answers={self.max_item_answers:,} per "
                f"module call, {ITEM_ANSWERS_PER_TRACE_FACTOR}x that per trace; "
                f"{self.op_count:,} aten ops so far)",
                _ITEM_REMEDY,
            )
        if self._items_here > self.max_item_answers:
            self._over_budget(
                f"{self.max_item_answers:,} Tensor.item() answers in one module call, no "
                f"module entered or left in between (max_item_answers="
                f"{self.max_item_answers:,}; {self.op_count:,} aten ops so far)",
                _ITEM_REMEDY,
            )

    def _over_budget(self, what: str, remedy: str) -> None:
        where, module = self._locate()
        names = collections.Counter(str(f) for f in self._window)
        frequent = names.most_common(6)
        listed = ", ".join(f"{name} x{count}" for name, count in frequent)
        message = (
            f"op budget exceeded: {what}, stopped in {where}. Most likely a data-dependent "
            "Python loop that never ends on meta.\n"
            f"  most frequent ops of the last {len(self._window):,}: {listed}\n"
            "  on meta, Tensor.item() / bool(tensor) / tolist() answer neutral values "
            "(True, 1, 1.0), so a loop such as `while x.abs().max() > tol:` never sees its "
            "condition change: run the loop a fixed number of times while tracing\n"
            f"  {remedy}"
        )
        raise OpBudgetExceeded(message, ops=self.op_count, module=module, frequent=frequent)

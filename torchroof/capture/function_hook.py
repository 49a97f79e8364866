"""The torch-function mode a capture runs: SDPA replaced, tolist answered, backward marked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from torchroof.capture.answers import needs_item_answer
from torchroof.capture.sdpa import widened_kv

if TYPE_CHECKING:
    from torchroof.capture.mode import Capture

_BACKWARD_ENTRY_POINTS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


class FunctionHook(TorchFunctionMode):
    """Sees torch-level calls: replaces SDPA, marks explicit backward calls.

    NB: autograd runs every backward node under the thread-local state it saved when
    backward was called, and that call came through ``__torch_function__`` below, which
    torch runs with this mode popped off the stack. So backward nodes run without it, and
    so would a checkpointed forward re-run inside backward: its SDPA would go down meta's
    math path (bmm + an S×S softmax). The module stack therefore pushes the mode back
    (:meth:`reactivate`) for a module entered during backward, until it exits.
    """

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def reactivate(self) -> bool:
        """Push this mode back on the stack if it is not there; True when pushed."""
        if any(mode is self for mode in _get_current_function_mode_stack()):
            return False
        self.__enter__()
        return True

    def deactivate(self) -> None:
        """Undo :meth:`reactivate` (pops only this mode, if it is the innermost)."""
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is self:
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        capture = self.capture
        if func is F.scaled_dot_product_attention and capture.flash_attention:
            if not capture.suppressed:
                return capture.sdpa.run(func, args, kwargs)
            # unrecorded (a context run before the step) over a quantised cache
            wide_args, wide_kwargs = widened_kv(args, kwargs)
            return func(*wide_args, **wide_kwargs)
        if func is torch.Tensor.tolist and args and needs_item_answer(args[0]):
            return capture.answers.tolist(args[0], capture.suppressed)
        if func in _BACKWARD_ENTRY_POINTS:
            return capture.run_as_backward(func, args, kwargs)
        return func(*args, **kwargs)

"""The phase of a step an op runs in (forward, backward, recompute, optimizer) and its module."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchroof.capture.module_stack import ModuleStack
from torchroof.records.ops import Phase


class Phases:
    """Tells the phase and module of the op about to run: autograd's current node (backward,
    or a checkpointed forward re-run inside it), a caller's :meth:`phase` label, a
    ``torch.optim`` step (its pre/post hooks), else the forward of the innermost module.
    ``on_change()`` is told when an optimizer step begins or ends."""

    def __init__(self, stack: ModuleStack, on_change: Callable[[], None]) -> None:
        self._stack = stack
        self._on_change = on_change
        self._phase_override: list[tuple[Phase, str]] = []
        self.optimizer_depth = 0

    def enter_optimizer(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer step pre-hook; refuses a fused optimizer over meta parameters."""
        defaults = getattr(optimizer, "defaults", {}) or {}
        if defaults.get("fused") and any(
            p.is_meta for group in optimizer.param_groups for p in group["params"]
        ):
            from torchroof.config.errors import WorkloadError

            raise WorkloadError(
                f"torch.optim.{type(optimizer).__name__}(fused=True) cannot step meta "
                "parameters (the fused kernel needs a real device); create it with "
                "fused=False: torchroof prices the step as the one fused kernel a "
                "fused optimizer launches either way"
            )
        self.optimizer_depth += 1
        self._on_change()

    def exit_optimizer(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer step post-hook."""
        self.optimizer_depth -= 1
        self._on_change()

    @contextlib.contextmanager
    def phase(self, phase: Phase, module: str = "") -> Iterator[None]:
        """Label what runs inside as ``phase`` work of ``module``."""
        self._phase_override.append((phase, module))
        try:
            yield
        finally:
            self._phase_override.pop()

    def context(self) -> tuple[Phase, str, Any]:
        """(phase, module path, autograd node or None) for the op about to be recorded."""
        node = torch._C._current_autograd_node()
        if node is not None:
            if self._stack.recompute_depth:  # a checkpointed forward re-run inside backward
                return "recompute", self._stack.innermost(), node
            return "backward", self._stack.module_of_node(node), node
        if self._phase_override:
            phase, module = self._phase_override[-1]
            return phase, module, None
        if self.optimizer_depth:
            return "optimizer", "", None
        return "forward", (self._stack.innermost() if self._stack else ""), None

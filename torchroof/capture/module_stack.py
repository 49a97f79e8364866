"""The module stack of a capture: which module each op ran in, in forward and in backward.

Global forward pre/post hooks keep the module stack. Every change of the stack is logged
against autograd's sequence counter, so an autograd node created while module M was
innermost has a sequence number inside M's interval; in backward the node being executed
(``torch._C._current_autograd_node()``) is mapped back to M by bisection. No graph walk, no
per-tensor hooks.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

_ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1  # AccumulateGrad nodes carry UINT64_MAX


class ModuleStack:
    """Module paths and the stack of modules running, with autograd's sequence numbers
    logged at each change so backward nodes map back to the module that made them.

    ``on_parameter(path, name, param)`` is told of each parameter when its module is first
    named; ``on_change()`` of every push and pop; a module entered during backward (a
    checkpointed forward re-run) calls ``reactivate()`` (True when it did something), and
    ``deactivate()`` when it exits."""

    def __init__(
        self,
        on_parameter: Callable[[str, str, torch.nn.Parameter], None],
        on_change: Callable[[], None],
        reactivate: Callable[[], bool],
        deactivate: Callable[[], None],
    ) -> None:
        self._on_parameter = on_parameter
        self._on_change = on_change
        self._reactivate = reactivate
        self._deactivate = deactivate
        self._module_types: dict[str, str] = {}  # module path -> class name
        self._stack: list[str] = []
        self._entered_in_backward: list[bool] = []  # per stack entry: a recompute?
        self._reactivated: list[bool] = []  # per stack entry: pushed the function mode back?
        self.recompute_depth = 0
        self._seq_starts: list[int] = []  # sequence nr at each change of the module stack
        self._seq_modules: list[str] = []  # innermost module from that change on
        self._module_names: dict[int, str] = {}
        self._param_owner: dict[int, str] = {}  # id(param) -> module path
        # modules first met running, outside any root, and their children -> the name each
        # takes after its caller's path
        self._unrooted: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self._stack)

    def innermost(self) -> str:
        """The innermost module running (raises IndexError when none is)."""
        return self._stack[-1]

    def enter(self, module: torch.nn.Module, _inputs: Any) -> None:
        """The forward pre-hook: ``module`` starts running."""
        name = self._module_names.get(id(module))
        if name is None or id(module) in self._unrooted:
            # a module no model owns (an activation shared by every layer, made outside
            # any __init__), and its children, are named after the module calling them, at
            # each call
            suffix = self._unrooted.get(id(module), type(module).__name__)
            prefix = f"{self._stack[-1]}.{suffix}" if self._stack else ""
            if name is None and not self._stack:  # the model itself: named once
                name = self.register_root(module, prefix)
            elif name is None:
                owned = {id(m) for _, m in module.named_modules() if id(m) in self._module_names}
                name = self.register_root(module, prefix)
                self._unrooted[id(module)] = suffix
                for child_name, child in module.named_modules():
                    if child_name and id(child) not in owned:
                        self._unrooted.setdefault(id(child), child_name.rsplit(".", 1)[-1])
            elif prefix:
                name = prefix
                self._module_types.setdefault(name, type(module).__name__)
        in_backward = torch._C._current_autograd_node() is not None
        self._stack.append(name)
        self._entered_in_backward.append(in_backward)
        self._reactivated.append(in_backward and self._reactivate())
        self.recompute_depth += in_backward
        self._log_stack_change()

    def exit(self, _module: torch.nn.Module, _inputs: Any, _outputs: Any) -> None:
        """The forward hook (always called): the innermost module has returned."""
        if self._stack:
            self._stack.pop()
            self.recompute_depth -= self._entered_in_backward.pop()
            if self._reactivated.pop():
                self._deactivate()
        self._log_stack_change()

    def name_of(self, module: torch.nn.Module) -> str | None:
        """The path ``module`` was named (None for one not met yet)."""
        return self._module_names.get(id(module))

    def register_root(self, root: torch.nn.Module, prefix: str) -> str:
        """Name ``root``'s modules ``prefix.<path>`` (a module already named keeps its first
        name); ``root``'s name."""
        for name, module in root.named_modules(remove_duplicate=False):
            path = f"{prefix}.{name}".strip(".") if prefix else name
            self._module_names.setdefault(id(module), path)
            self._module_types.setdefault(path, type(module).__name__)
            for pname, param in module.named_parameters(recurse=False):
                self._param_owner.setdefault(id(param), path)
                self._on_parameter(path, pname, param)
        return self._module_names[id(root)]

    def _log_stack_change(self) -> None:
        self._on_change()
        seq = torch._C._autograd._get_sequence_nr()
        top = self._stack[-1] if self._stack else ""
        if self._seq_starts and self._seq_starts[-1] == seq:
            self._seq_modules[-1] = top  # no node was created in between
        else:
            self._seq_starts.append(seq)
            self._seq_modules.append(top)

    def module_of_node(self, node: Any) -> str:
        """The module an autograd node was created in ("" for none)."""
        seq = node._sequence_nr()
        if seq == _ACCUMULATE_GRAD_SEQUENCE_NR:
            variable = getattr(node, "variable", None)
            return self._param_owner.get(id(variable), "")
        at = bisect.bisect_right(self._seq_starts, seq) - 1
        return self._seq_modules[at] if at >= 0 else ""

    def describe(self, path: str) -> str:
        """``module 'model.layers.3.mlp' (LlamaMLP)``; the root model by its class."""
        kind = self._module_types.get(path)
        if path:
            return f"module {path!r}" + (f" ({kind})" if kind else "")
        if kind and self._stack:
            return f"the root module ({kind})"
        return "no module (top-level code)"

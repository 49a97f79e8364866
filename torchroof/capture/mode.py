"""Capture: record every aten op of a model step, with module path and phase.

A ``TorchDispatchMode`` (:mod:`torchroof.capture.dispatch`) sees each aten op after autograd
and composite decompositions; a ``TorchFunctionMode`` (:mod:`torchroof.capture.function_hook`)
sees ``F.scaled_dot_product_attention`` before meta would decompose it into the math path,
and records the fused kernel a GPU would launch instead (on the meta device the math path is
what runs). The mode composes narrow collaborators, each in its own module: the module stack,
the phases, storage identity, the op writer, the SDPA substitution, the answers meta cannot
compute and the op budget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchroof.capture.answers import MetaAnswers
from torchroof.capture.budget import OpBudget, budget_limits
from torchroof.capture.dispatch import OpRecorder
from torchroof.capture.function_hook import FunctionHook
from torchroof.capture.module_stack import ModuleStack
from torchroof.capture.phases import Phases
from torchroof.capture.recording import OpWriter
from torchroof.capture.sdpa import SdpaSubstitution
from torchroof.capture.storage import StorageIds, held_tensors
from torchroof.capture.symbolic import sized
from torchroof.records.ops import OpRecord, Phase
from torchroof.records.tensors import Role, TensorMeta
from torchroof.records.trace import Trace


class Capture:
    """Context manager behind :func:`torchroof.trace`; ``__enter__`` returns the Trace.

    Works with meta tensors (primary), FakeTensors and real CPU tensors. On meta,
    ``Tensor.item()`` is answered with a neutral value and the answer is recorded in
    ``Trace.assumptions``.
    """

    def __init__(
        self,
        *,
        flash_attention: bool = True,
        max_ops: int | None = None,
        max_item_answers: int | None = None,
        trace_type: type[Trace] = Trace,
    ) -> None:
        self.trace = trace_type()
        self.flash_attention = flash_attention
        self.budget = OpBudget(*budget_limits(max_ops, max_item_answers), self._budget_location)
        self.storage = StorageIds()
        self._function = FunctionHook(self)
        self.modules = ModuleStack(
            on_parameter=self._label_parameter,
            on_change=self.budget.new_module_call,
            reactivate=self._function.reactivate,
            deactivate=self._function.deactivate,
        )
        self.phases = Phases(self.modules, on_change=self.budget.new_module_call)
        self.writer = OpWriter(self.trace, self.storage)
        self.sdpa = SdpaSubstitution(self.trace, self.storage, self.context, self.unrecorded)
        self.answers = MetaAnswers(self.trace, self._count_item_answer, self.record, self.context)
        self._suppress = 0
        self._dispatch = OpRecorder(self)
        self._handles: list[Any] = []

    @property
    def op_count(self) -> int:
        """Every aten op seen so far, recorded or not."""
        return self.budget.op_count

    @property
    def max_ops(self) -> int:
        return self.budget.max_ops

    @property
    def max_item_answers(self) -> int:
        return self.budget.max_item_answers

    @property
    def suppressed(self) -> bool:
        """True inside :meth:`unrecorded`."""
        return bool(self._suppress)

    # -- context management -------------------------------------------------------------
    def __enter__(self) -> Trace:
        nn_hooks = torch.nn.modules.module
        self._handles = [
            nn_hooks.register_module_forward_pre_hook(self.modules.enter),
            nn_hooks.register_module_forward_hook(self.modules.exit, always_call=True),
            register_optimizer_step_pre_hook(self.phases.enter_optimizer),
            register_optimizer_step_post_hook(self.phases.exit_optimizer),
        ]
        self._function.__enter__()
        self._dispatch.__enter__()
        return self.trace

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.storage.clear()
        self.writer.end_progress(failed=exc[0] is not None)

    # -- what callers tell the capture --------------------------------------------------
    def name_modules(self, root: torch.nn.Module, prefix: str) -> str:
        """Name ``root``'s modules ``prefix.<path>`` in the trace (before it runs): a step
        that runs two models (a draft and a target) keeps their layers apart this way.
        A module already named keeps its first name."""
        return self.modules.register_root(root, prefix)

    def mark(self, tensors: Iterable[torch.Tensor], role: Role, count_bytes: bool = True) -> None:
        """Label the storages of ``tensors`` (weights, gradients, optimizer state, KV cache);
        the first label a storage gets is kept, and (with ``count_bytes``) its bytes are
        added to ``role_bytes``, the memory the role holds. A sharded tensor (DTensor) is
        labelled by its local shard: the storage this rank's ops read and the bytes this
        rank holds (per-rank memory)."""
        for tensor in (held for given in tensors for held in held_tensors(given)):
            sid = self.storage.storage_id(tensor)
            if sid in self.trace.roles:
                continue
            self.trace.roles[sid] = role
            size = sized(tensor.untyped_storage().nbytes()) if count_bytes else 0
            self.trace.role_bytes[role] = self.trace.role_bytes.get(role, 0) + size

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Run tensor work that is not part of the step (setting up state) without
        recording it."""
        self._suppress += 1
        try:
            yield
        finally:
            self._suppress -= 1

    def phase(self, phase: Phase, module: str = "") -> contextlib.AbstractContextManager[None]:
        """Record what runs inside as ``phase`` work under the label ``module``: for what a
        training loop does around autograd and ``torch.optim`` (detected on their own)."""
        return self.phases.phase(phase, module)

    def context(self) -> tuple[Phase, str, Any]:
        """(phase, module path, autograd node or None) for the op about to be recorded."""
        return self.phases.context()

    def run_as_backward(self, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        with self.phase("backward"):
            return func(*args, **kwargs)

    # -- recording ----------------------------------------------------------------------
    def record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        context: tuple[Phase, str, Any] | None = None,
    ) -> OpRecord:
        """Record one aten call (in ``context``, else the current one)."""
        phase, module, _node = context or self.context()
        return self.writer.record(func, args, kwargs, out, phase, module)

    def record_synthetic(
        self,
        name: str,
        tensors: dict[str, torch.Tensor | list[torch.Tensor]],
        scalars: dict[str, Any],
        phase: Phase,
        module: str = "",
        outputs: tuple[TensorMeta, ...] = (),
    ) -> OpRecord:
        """Record the kernel a GPU would launch where the traced run took another path
        (e.g. a fused optimizer step where meta runs the foreach one)."""
        return self.writer.record_synthetic(name, tensors, scalars, phase, module, outputs)

    def tensor_meta(self, tensor: torch.Tensor) -> TensorMeta:
        return self.storage.tensor_meta(tensor)

    def alias_storage(self, tensor: torch.Tensor, base: torch.Tensor) -> None:
        """Record ``tensor``'s storage under ``base``'s id (see ``StorageIds.alias``)."""
        self.storage.alias(tensor, base)

    # -- the collaborators' callbacks ---------------------------------------------------
    def _label_parameter(self, path: str, name: str, param: torch.nn.Parameter) -> None:
        for held in held_tensors(param):
            self.trace.parameters.setdefault(
                self.storage.storage_id(held), f"{path}.{name}".strip(".")
            )
        self.mark([param], "weights")

    def _count_item_answer(self) -> None:
        self.budget.count_item_answer(in_optimizer=bool(self.phases.optimizer_depth))

    def _budget_location(self) -> tuple[str, str]:
        """(where, module) the op budget tripped, for its message."""
        try:
            phase, module, _ = self.context()
        except Exception:  # noqa: BLE001 - naming the module must not hide the real error
            phase, module = "forward", self.modules.innermost() if self.modules else ""
        if phase == "optimizer" and not module:
            where = "the optimizer step"
        else:
            where = self.modules.describe(module)
            where += f" during {phase}" if phase != "forward" else ""
        return where, module

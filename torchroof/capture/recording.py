"""Turning one aten call into an OpRecord: argument names, tensor references, progress."""

from __future__ import annotations

from typing import Any

import torch

from torchroof import progress
from torchroof.capture.storage import StorageIds, tensors_in
from torchroof.capture.symbolic import sized
from torchroof.records.ops import OpRecord, Phase
from torchroof.records.tensors import TensorMeta, TensorRef
from torchroof.records.trace import Trace

# what the progress line says while ops of each phase are recorded (a recompute of a
# checkpointed layer is part of the backward pass: it runs inside it, layer by layer)
_PHASE_PROGRESS = {
    "forward": "tracing the forward pass",
    "backward": "tracing the backward pass",
    "recompute": "tracing the backward pass",
    "optimizer": "tracing the optimizer step",
}


class OpWriter:
    """Appends OpRecords to a trace: schema argument names (cached per overload), tensors
    as TensorMetas with :class:`TensorRef` in the arguments, and the progress line."""

    def __init__(self, trace: Trace, storage: StorageIds) -> None:
        self._trace = trace
        self._storage = storage
        self._arg_names: dict[Any, tuple[str, ...]] = {}
        self._op_names: dict[Any, str] = {}
        self._progress = progress.current()
        self._shown_phase = ""  # the stage the progress reporter was last told about

    def arg_names(self, func: Any) -> tuple[str, ...]:
        """Schema argument names of an aten overload (cached: schemas do not change)."""
        names = self._arg_names.get(func)
        if names is None:
            names = tuple(a.name for a in func._schema.arguments)
            self._arg_names[func] = names
        return names

    def record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        phase: Phase,
        module: str,
    ) -> OpRecord:
        """Record one aten call with its result ``out``."""
        name = self._op_names.get(func)
        if name is None:
            name = str(func)
            self._op_names[func] = name
        inputs: list[TensorMeta] = []
        named: dict[str, Any] = {}
        arg_names = self.arg_names(func)
        for position, value in enumerate(args):
            key = arg_names[position] if position < len(arg_names) else f"arg{position}"
            named[key] = self.convert(value, inputs)
        for key, value in kwargs.items():
            named[key] = self.convert(value, inputs)
        outputs = tuple(self._storage.tensor_meta(t) for t in tensors_in(out))
        op = OpRecord(len(self._trace.ops), name, tuple(inputs), outputs, named, module, phase)
        self._trace.ops.append(op)
        self.note_progress(phase)
        return op

    def record_synthetic(
        self,
        name: str,
        tensors: dict[str, torch.Tensor | list[torch.Tensor]],
        scalars: dict[str, Any],
        phase: Phase,
        module: str = "",
        outputs: tuple[TensorMeta, ...] = (),
    ) -> OpRecord:
        """Record a kernel the traced run did not launch (see ``Capture.record_synthetic``)."""
        inputs: list[TensorMeta] = []
        args: dict[str, Any] = {k: self.convert(v, inputs) for k, v in tensors.items()}
        args.update(scalars)
        op = OpRecord(len(self._trace.ops), name, tuple(inputs), outputs, args, module, phase, True)
        self._trace.ops.append(op)
        self.note_progress(phase)
        return op

    def convert(self, value: Any, inputs: list[TensorMeta]) -> Any:
        """An argument as plain data; a tensor is appended to ``inputs`` and referenced."""
        if isinstance(value, torch.Tensor):
            inputs.append(self._storage.tensor_meta(value))
            return TensorRef(len(inputs) - 1)
        if isinstance(value, (list, tuple)):
            return [self.convert(v, inputs) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.SymInt):
            return sized(value)  # a Dim in a symbolic capture
        if isinstance(value, torch.SymFloat):
            return float(value)  # decided: the ShapeEnv guards its value
        if isinstance(value, torch.SymBool):
            return bool(value)
        return str(value).removeprefix("torch.")  # dtype, device, layout, memory_format

    def note_progress(self, phase: str) -> None:
        """One more op of ``phase`` recorded: a new progress stage when the phase changed."""
        shown = _PHASE_PROGRESS.get(phase, f"tracing the {phase} phase")
        if shown != self._shown_phase:
            self._shown_phase = shown
            self._progress.begin(shown, unit="ops")
        self._progress.advance()

    def end_progress(self, failed: bool) -> None:
        """The capture is over: end the progress stage, if one was begun."""
        if self._shown_phase:
            self._progress.end(failed=failed)
            self._shown_phase = ""

"""Capture: record every aten op of a model step, with module path and phase.

A ``TorchDispatchMode`` sees each aten op after autograd and composite decompositions; a
``TorchFunctionMode`` sees ``F.scaled_dot_product_attention`` before meta would decompose it
into the math path, and records the fused kernel a GPU would launch instead (DESIGN.md,
"What the meta device does differently").

Module attribution. Global forward pre/post hooks keep the module stack. Every change of
the stack is logged against autograd's sequence counter, so an autograd node created while
module M was innermost has a sequence number inside M's interval; in backward the node being
executed (``torch._C._current_autograd_node()``) is mapped back to M by bisection. No graph
walk, no per-tensor hooks.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from torchroof import progress
from torchroof.capture import routing
from torchroof.config.limits import (  # why: see there
    DEFAULT_MAX_ITEM_ANSWERS,
    DEFAULT_MAX_OPS,
    ITEM_ANSWERS_PER_TRACE_FACTOR,
)
from torchroof.records.trace import Assumption, OpRecord, Phase, Role, TensorMeta, TensorRef, Trace

aten = torch.ops.aten

# what the progress line says while ops of each phase are recorded (a recompute of a
# checkpointed layer is part of the backward pass: it runs inside it, layer by layer)
_PHASE_PROGRESS = {
    "forward": "tracing the forward pass",
    "backward": "tracing the backward pass",
    "recompute": "tracing the backward pass",
    "optimizer": "tracing the optimizer step",
}

_LOCAL_SCALAR_DENSE = aten._local_scalar_dense.default
_CLONE = aten.clone.default
if torch.distributed.is_available():  # defines _c10d_functional._wrap_tensor_autograd
    import torch.distributed._functional_collectives  # noqa: F401
# ops that hand their input's bytes on as a new tensor (a new storage to the dispatcher:
# under a FakeTensorMode, wait_tensor's result is a new fake tensor)
_REWRAPS = frozenset(
    op.default
    for name in ("_wrap_tensor_autograd", "wait_tensor")
    if (op := getattr(torch.ops._c10d_functional, name, None)) is not None
)
_BACKWARD_ENTRY_POINTS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
_ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1  # AccumulateGrad nodes carry UINT64_MAX

_WINDOW = 1000  # ops kept to name the loop body when the budget trips
_LIMITS: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "torchroof_op_budget", default=(DEFAULT_MAX_OPS, DEFAULT_MAX_ITEM_ANSWERS)
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
    current_ops, current_items = _LIMITS.get()
    limits = (
        _check_budget("max_ops", current_ops if max_ops is None else max_ops),
        _check_budget(
            "max_item_answers", current_items if max_item_answers is None else max_item_answers
        ),
    )
    token = _LIMITS.set(limits)
    try:
        yield
    finally:
        _LIMITS.reset(token)


def _check_budget(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _neutral_scalar(dtype: torch.dtype) -> bool | int | float:
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


@dataclass
class _SdpaGroup:
    """Autograd sequence interval of one SDPA call, so its backward can be replaced too."""

    first_seq: int
    end_seq: int
    forward: OpRecord
    # the same call re-run by activation checkpointing before its backward: the backward
    # reads the recomputed q, k, v, o and log-sum-exp (the forward's were not kept)
    recomputed: OpRecord | None = None
    backward_done: bool = False


class _ArgNames:
    """Schema argument names per aten overload (cached: schemas do not change)."""

    def __init__(self) -> None:
        self._cache: dict[Any, tuple[str, ...]] = {}

    def __call__(self, func: Any) -> tuple[str, ...]:
        names = self._cache.get(func)
        if names is None:
            names = tuple(a.name for a in func._schema.arguments)
            self._cache[func] = names
        return names


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
        default_ops, default_items = _LIMITS.get()
        self.max_ops = _check_budget("max_ops", default_ops if max_ops is None else max_ops)
        self.max_item_answers = _check_budget(
            "max_item_answers", default_items if max_item_answers is None else max_item_answers
        )
        self.op_count = 0  # every aten op seen, recorded or not
        self._items_here = 0  # .item() answers since the module stack last changed
        self._items_total = 0  # .item() answers in the whole trace (outside optimizer steps)
        self._window: collections.deque[Any] = collections.deque(maxlen=_WINDOW)
        self._module_types: dict[str, str] = {}  # module path -> class name
        self._suppress = 0
        self._phase_override: list[tuple[Phase, str]] = []
        self._optimizer_depth = 0
        self._stack: list[str] = []
        self._entered_in_backward: list[bool] = []  # per stack entry: a recompute?
        self._reactivated: list[bool] = []  # per stack entry: pushed the function mode back?
        self._recompute_depth = 0
        self._seq_starts: list[int] = []  # sequence nr at each change of the module stack
        self._seq_modules: list[str] = []  # innermost module from that change on
        self._module_names: dict[int, str] = {}
        self._param_owner: dict[int, str] = {}  # id(param) -> module path
        self._storages: dict[int, tuple[int, StorageWeakRef]] = {}
        self._next_storage = 0
        self._sdpa_groups: list[_SdpaGroup] = []
        # storages the skipped math-path SDPA backward made (dq, dk, dv among them)
        self.flash_gradients: set[int] = set()
        self._sdpa_group_starts: list[int] = []
        self._arg_names = _ArgNames()
        self._op_names: dict[Any, str] = {}
        self._dispatch = _Recorder(self)
        self._function = _FunctionHook(self)
        self.means = routing.Means()  # balanced-routing answers for nonzero / tolist
        self._handles: list[Any] = []
        self._progress = progress.current()
        self._shown_phase = ""  # the stage the progress reporter was last told about

    # -- context management -------------------------------------------------------------
    def __enter__(self) -> Trace:
        nn_hooks = torch.nn.modules.module
        self._handles = [
            nn_hooks.register_module_forward_pre_hook(self._enter_module),
            nn_hooks.register_module_forward_hook(self._exit_module, always_call=True),
            register_optimizer_step_pre_hook(self._enter_optimizer),
            register_optimizer_step_post_hook(self._exit_optimizer),
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
        self._storages.clear()  # releases the weak references that pin storage addresses
        if self._shown_phase:
            self._progress.end(failed=exc[0] is not None)
            self._shown_phase = ""

    # -- module tracking ----------------------------------------------------------------
    def _enter_module(self, module: torch.nn.Module, _inputs: Any) -> None:
        name = self._module_names.get(id(module))
        if name is None:
            prefix = f"{self._stack[-1]}.{type(module).__name__}" if self._stack else ""
            name = self._register_root(module, prefix)
        in_backward = torch._C._current_autograd_node() is not None
        self._stack.append(name)
        self._entered_in_backward.append(in_backward)
        self._reactivated.append(in_backward and self._function.reactivate())
        self._recompute_depth += in_backward
        self._log_stack_change()

    def _exit_module(self, _module: torch.nn.Module, _inputs: Any, _outputs: Any) -> None:
        if self._stack:
            self._stack.pop()
            self._recompute_depth -= self._entered_in_backward.pop()
            if self._reactivated.pop():
                self._function.deactivate()
        self._log_stack_change()

    def name_modules(self, root: torch.nn.Module, prefix: str) -> str:
        """Name ``root``'s modules ``prefix.<path>`` in the trace (before it runs): a step
        that runs two models (a draft and a target) keeps their layers apart this way.
        A module already named keeps its first name."""
        return self._register_root(root, prefix)

    def _register_root(self, root: torch.nn.Module, prefix: str) -> str:
        for name, module in root.named_modules(remove_duplicate=False):
            path = f"{prefix}.{name}".strip(".") if prefix else name
            self._module_names.setdefault(id(module), path)
            self._module_types.setdefault(path, type(module).__name__)
            for pname, param in module.named_parameters(recurse=False):
                self._param_owner.setdefault(id(param), path)
                for held in held_tensors(param):
                    self.trace.parameters.setdefault(
                        self._storage_id(held), f"{path}.{pname}".strip(".")
                    )
                self.mark([param], "weights")
        return self._module_names[id(root)]

    def _log_stack_change(self) -> None:
        self._items_here = 0
        seq = torch._C._autograd._get_sequence_nr()
        top = self._stack[-1] if self._stack else ""
        if self._seq_starts and self._seq_starts[-1] == seq:
            self._seq_modules[-1] = top  # no node was created in between
        else:
            self._seq_starts.append(seq)
            self._seq_modules.append(top)

    def _module_of_node(self, node: Any) -> str:
        seq = node._sequence_nr()
        if seq == _ACCUMULATE_GRAD_SEQUENCE_NR:
            variable = getattr(node, "variable", None)
            return self._param_owner.get(id(variable), "")
        at = bisect.bisect_right(self._seq_starts, seq) - 1
        return self._seq_modules[at] if at >= 0 else ""

    # -- optimizer and backward phases --------------------------------------------------
    def _enter_optimizer(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
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
        self._optimizer_depth += 1
        self._items_here = 0

    def _exit_optimizer(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._optimizer_depth -= 1
        self._items_here = 0

    # -- the op budget ------------------------------------------------------------------
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

    def count_item_answer(self) -> None:
        """Count one ``.item()`` / ``tolist()`` answered on meta; too many in one module
        call, with no module entered or left in between, is a loop on those answers.
        Answers inside a torch.optim step (one per parameter) do not count."""
        if self._optimizer_depth:
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
                "raise max_item_answers if this many is real: "
                "torchroof.trace(max_item_answers=...), or "
                "torchroof.capture.mode.op_budget(max_item_answers=...)",
            )
        if self._items_here > self.max_item_answers:
            self._over_budget(
                f"{self.max_item_answers:,} Tensor.item() answers in one module call, no "
                f"module entered or left in between (max_item_answers="
                f"{self.max_item_answers:,}; {self.op_count:,} aten ops so far)",
                "raise max_item_answers if this many is real: "
                "torchroof.trace(max_item_answers=...), or "
                "torchroof.capture.mode.op_budget(max_item_answers=...)",
            )

    def _over_budget(self, what: str, remedy: str) -> None:
        try:
            phase, module, _ = self.context()
        except Exception:  # noqa: BLE001 - naming the module must not hide the real error
            phase, module = "forward", self._stack[-1] if self._stack else ""
        if phase == "optimizer" and not module:
            where = "the optimizer step"
        else:
            where = self.describe_module(module)
            where += f" during {phase}" if phase != "forward" else ""
        names = collections.Counter(self._op_names.get(f) or str(f) for f in self._window)
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

    def describe_module(self, path: str) -> str:
        """``module 'model.layers.3.mlp' (LlamaMLP)``; the root model by its class."""
        kind = self._module_types.get(path)
        if path:
            return f"module {path!r}" + (f" ({kind})" if kind else "")
        if kind and self._stack:
            return f"the root module ({kind})"
        return "no module (top-level code)"

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Run tensor work that is not part of the step (setting up state) without
        recording it."""
        self._suppress += 1
        try:
            yield
        finally:
            self._suppress -= 1

    @contextlib.contextmanager
    def phase(self, phase: Phase, module: str = "") -> Iterator[None]:
        """Record what runs inside as ``phase`` work under the label ``module``: for what a
        training loop does around autograd and ``torch.optim`` (detected on their own)."""
        self._phase_override.append((phase, module))
        try:
            yield
        finally:
            self._phase_override.pop()

    def context(self) -> tuple[Phase, str, Any]:
        """(phase, module path, autograd node or None) for the op about to be recorded."""
        node = torch._C._current_autograd_node()
        if node is not None:
            if self._recompute_depth:  # a checkpointed forward re-run inside backward
                return "recompute", self._stack[-1], node
            return "backward", self._module_of_node(node), node
        if self._phase_override:
            phase, module = self._phase_override[-1]
            return phase, module, None
        if self._optimizer_depth:
            return "optimizer", "", None
        return "forward", (self._stack[-1] if self._stack else ""), None

    def run_as_backward(self, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        with self.phase("backward"):
            return func(*args, **kwargs)

    # -- tensors ------------------------------------------------------------------------
    def _storage_id(self, tensor: torch.Tensor) -> int:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return self._fresh_storage_id()
        key = storage._cdata
        entry = self._storages.get(key)
        if entry is None:
            # Holding a weak reference keeps the StorageImpl's address from being reused
            # for another storage while the trace runs, so the key stays unique.
            entry = (self._fresh_storage_id(), StorageWeakRef(storage))
            self._storages[key] = entry
        return entry[0]

    def alias_storage(self, tensor: torch.Tensor, base: torch.Tensor) -> None:
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
            self._storages[key] = (self._storage_id(base), StorageWeakRef(storage))

    def _fresh_storage_id(self) -> int:
        self._next_storage += 1
        return self._next_storage - 1

    def tensor_meta(self, tensor: torch.Tensor) -> TensorMeta:
        try:
            stride = tuple(tensor.stride())
            offset = tensor.storage_offset()
        except (RuntimeError, NotImplementedError):
            stride, offset = _contiguous_stride(tuple(tensor.shape)), 0
        return TensorMeta(
            tuple(int(s) for s in tensor.shape),
            tuple(int(s) for s in stride),
            str(tensor.dtype).removeprefix("torch."),
            self._storage_id(tensor),
            int(offset),
        )

    def mark(self, tensors: Iterable[torch.Tensor], role: Role, count_bytes: bool = True) -> None:
        """Label the storages of ``tensors`` (weights, gradients, optimizer state, KV cache);
        the first label a storage gets is kept, and (with ``count_bytes``) its bytes are
        added to ``role_bytes``, the memory the role holds. A sharded tensor (DTensor) is
        labelled by its local shard: the storage this rank's ops read and the bytes this
        rank holds (issue 13 item 5: per-rank memory)."""
        for tensor in (held for given in tensors for held in held_tensors(given)):
            sid = self._storage_id(tensor)
            if sid in self.trace.roles:
                continue
            self.trace.roles[sid] = role
            size = tensor.untyped_storage().nbytes() if count_bytes else 0
            self.trace.role_bytes[role] = self.trace.role_bytes.get(role, 0) + size

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
        inputs: list[TensorMeta] = []
        args: dict[str, Any] = {k: self._convert(v, inputs) for k, v in tensors.items()}
        args.update(scalars)
        op = OpRecord(len(self.trace.ops), name, tuple(inputs), outputs, args, module, phase, True)
        self.trace.ops.append(op)
        self._note_progress(phase)
        return op

    def _note_progress(self, phase: str) -> None:
        """One more op of ``phase`` recorded: a new progress stage when the phase changed."""
        shown = _PHASE_PROGRESS.get(phase, f"tracing the {phase} phase")
        if shown != self._shown_phase:
            self._shown_phase = shown
            self._progress.begin(shown, unit="ops")
        self._progress.advance()

    def synthetic_meta(self, shape: Iterable[int], dtype: torch.dtype) -> TensorMeta:
        """A tensor the modelled kernel would produce but the captured run did not."""
        shape = tuple(int(s) for s in shape)
        dtype_name = str(dtype).removeprefix("torch.")
        return TensorMeta(shape, _contiguous_stride(shape), dtype_name, self._fresh_storage_id())

    # -- recording ----------------------------------------------------------------------
    def record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        context: tuple[Phase, str, Any] | None = None,
    ) -> OpRecord:
        name = self._op_names.get(func)
        if name is None:
            name = str(func)
            self._op_names[func] = name
        inputs: list[TensorMeta] = []
        named: dict[str, Any] = {}
        arg_names = self._arg_names(func)
        for position, value in enumerate(args):
            key = arg_names[position] if position < len(arg_names) else f"arg{position}"
            named[key] = self._convert(value, inputs)
        for key, value in kwargs.items():
            named[key] = self._convert(value, inputs)
        outputs = tuple(self.tensor_meta(t) for t in _tensors_in(out))
        phase, module, _node = context or self.context()
        op = OpRecord(len(self.trace.ops), name, tuple(inputs), outputs, named, module, phase)
        self.trace.ops.append(op)
        self._note_progress(phase)
        return op

    def _convert(self, value: Any, inputs: list[TensorMeta]) -> Any:
        if isinstance(value, torch.Tensor):
            inputs.append(self.tensor_meta(value))
            return TensorRef(len(inputs) - 1)
        if isinstance(value, (list, tuple)):
            return [self._convert(v, inputs) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return value.node.hint if hasattr(value.node, "hint") else str(value)
        return str(value).removeprefix("torch.")  # dtype, device, layout, memory_format

    def answer_item(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.count_item_answer()
        tensor = args[0]
        value = self.means.item(tensor, _neutral_scalar(tensor.dtype))
        op = self.record(func, args, kwargs, None)
        self.trace.assumptions.append(
            Assumption(op.index, op.module, f"Tensor.item() on {tensor.dtype} answered {value!r}")
        )
        return value

    def answer_data_dependent(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        """nonzero / boolean-mask indexing on meta: the balanced-routing answer
        (torchroof.capture.routing), recorded as an assumption."""
        out, what, routed = routing.answer(self.means, func, args, kwargs)
        if context is not None:
            op = self.record(func, args, kwargs, out, context)
            kind = "routing" if routed else "selection"
            self.trace.assumptions.append(Assumption(op.index, op.module, what, kind))
        return out

    def answer_tolist(self, tensor: torch.Tensor) -> Any:
        self.count_item_answer()
        value, how, routed = self.means.tolist(tensor, _neutral_scalar(tensor.dtype))
        if not self._suppress:
            phase, module, _ = self.context()
            self.trace.assumptions.append(
                Assumption(
                    len(self.trace.ops),
                    module,
                    f"Tensor.tolist() on {tensor.dtype} {how}",
                    "routing" if routed else "scalar",
                )
            )
        return value

    # -- scaled dot-product attention ---------------------------------------------------
    def sdpa(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """Run SDPA (unrecorded) and record the fused kernel a GPU would launch instead.

        seed 000 "FlashAttention is an IO algorithm": S and P stay on chip, so the record is
        ``_scaled_dot_product_flash_attention`` (or ``_efficient_`` when a mask is given),
        with K/V at their own ``h_kv`` heads: no ``repeat_kv`` copies. K/V read from a
        quantised cache (fp8, int8) are recorded at their stored width: the kernel reads them
        at 1 B per element and dequantises in registers (vLLM's and TensorRT-LLM's fp8 KV).
        """
        params = dict(zip(_SDPA_ARGS, args, strict=False))
        params.update(kwargs)
        query, key, value = params["query"], params["key"], params["value"]
        mask = params.get("attn_mask")
        context = self.context()
        first_seq = torch._C._autograd._get_sequence_nr()
        with self.unrecorded():
            wide_args, wide_kwargs = _widened_kv(args, kwargs)
            out = func(*wide_args, **wide_kwargs)
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                # The flash kernel writes o as (B, L, H, d) in memory, so the caller's
                # ``o.transpose(1, 2).contiguous()`` is free on a GPU; give o that layout.
                out = out.transpose(1, 2).contiguous().transpose(1, 2)
        end_seq = torch._C._autograd._get_sequence_nr()

        batch_heads_q = tuple(query.shape[:-1])
        logsumexp = self.synthetic_meta(batch_heads_q, torch.float32)
        common = {
            "dropout_p": float(params.get("dropout_p", 0.0)),
            "is_causal": bool(params.get("is_causal", False)),
            "scale": params.get("scale"),
        }
        tensors = [query, key, value] + ([mask] if mask is not None else [])
        inputs = [self.tensor_meta(t) for t in tensors]
        refs = {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2)}
        if mask is None:
            name = "aten._scaled_dot_product_flash_attention.default"
        else:
            name = "aten._scaled_dot_product_efficient_attention.default"
            refs["attn_bias"] = TensorRef(3)
        phase, module, _ = context
        forward = OpRecord(
            len(self.trace.ops),
            name,
            tuple(inputs),
            (self.tensor_meta(out), logsumexp),
            {**refs, **common},
            module,
            phase,
            synthetic=True,
        )
        self.trace.ops.append(forward)
        if phase == "recompute":
            self._attach_recompute(forward)
        if end_seq > first_seq and isinstance(out, torch.Tensor) and out.requires_grad:
            group = _SdpaGroup(first_seq, end_seq, forward)
            self._sdpa_group_starts.append(first_seq)
            self._sdpa_groups.append(group)
            out.register_hook(lambda grad, group=group: self._sdpa_backward(group, grad))
        return out

    def _attach_recompute(self, recomputed: OpRecord) -> None:
        """Pair a recomputed SDPA call with the forward call it repeats: the latest one of
        the same module whose backward has not run (checkpointing recomputes a block just
        before its backward, in the forward's order)."""
        for group in reversed(self._sdpa_groups):
            forward = group.forward
            if forward.module == recomputed.module and forward.phase == "forward":
                if not group.backward_done and group.recomputed is None:
                    group.recomputed = recomputed
                    return

    def sdpa_group_of(self, node: Any) -> _SdpaGroup | None:
        seq = node._sequence_nr()
        at = bisect.bisect_right(self._sdpa_group_starts, seq) - 1
        if at >= 0 and seq < self._sdpa_groups[at].end_seq:
            return self._sdpa_groups[at]
        return None

    def _sdpa_backward(self, group: _SdpaGroup, grad: torch.Tensor) -> None:
        group.backward_done = True
        forward = group.recomputed or group.forward
        query, key, value = forward.inputs[:3]
        out, logsumexp = forward.outputs
        grad_meta = self.tensor_meta(grad)
        dq, dk, dv = (
            self.synthetic_meta(t.shape, getattr(torch, t.dtype)) for t in forward.inputs[:3]
        )
        inputs = (grad_meta, query, key, value, out, logsumexp)
        args: dict[str, Any] = {
            "grad_out": TensorRef(0),
            "query": TensorRef(1),
            "key": TensorRef(2),
            "value": TensorRef(3),
            "out": TensorRef(4),
            "logsumexp": TensorRef(5),
            "dropout_p": forward.args["dropout_p"],
            "is_causal": forward.args["is_causal"],
            "scale": forward.args["scale"],
        }
        if "attn_bias" in forward.args:
            name = "aten._scaled_dot_product_efficient_attention_backward.default"
            inputs = inputs + (forward.inputs[3],)
            args["attn_bias"] = TensorRef(6)
        else:
            name = "aten._scaled_dot_product_flash_attention_backward.default"
        self.trace.ops.append(
            OpRecord(
                len(self.trace.ops),
                name,
                inputs,
                (dq, dk, dv),
                args,
                forward.module,
                "backward",
                synthetic=True,
            )
        )


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _widened_kv(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """SDPA's arguments with K/V stored narrower than the query (a quantised cache) cast to
    the query's dtype: torch's SDPA wants one dtype, the kernel being modelled dequantises
    in registers. Unchanged otherwise."""
    positional, named = list(args), dict(kwargs)
    dtype = (positional[0] if positional else named["query"]).dtype
    for position, name in ((1, "key"), (2, "value")):
        if name in named and named[name].dtype != dtype:
            named[name] = named[name].to(dtype)
        elif position < len(positional) and positional[position].dtype != dtype:
            positional[position] = positional[position].to(dtype)
    return tuple(positional), named


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _needs_item_answer(tensor: Any) -> bool:
    if not isinstance(tensor, torch.Tensor):
        return False
    if tensor.is_meta:
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class _Recorder(TorchDispatchMode):
    """Records each aten op; answers ``.item()`` on meta; hides SDPA's decomposition."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if _wraps_local_tensors(types):
            _shape_inference_unrecorded()
            return NotImplemented  # the subclass unwraps; its local ops come back here
        kwargs = kwargs or {}
        capture = self.capture
        capture.count_op(func)
        if func is _LOCAL_SCALAR_DENSE and _needs_item_answer(args[0]):
            if capture._suppress:
                capture.count_item_answer()
                return capture.means.item(args[0], _neutral_scalar(args[0].dtype))
            return capture.answer_item(func, args, kwargs)
        data_dependent = _needs_item_answer(args[0]) and routing.is_data_dependent(func, args)
        if capture._suppress:
            if data_dependent:
                return capture.answer_data_dependent(func, args, kwargs, None)
            out = func(*args, **kwargs)
            capture.means.observe(func, args, out)
            return out
        context = capture.context()
        phase, _module, node = context
        if (
            node is not None
            and phase == "backward"  # a recompute is forward work, whichever node asked for it
            and capture._sdpa_groups
            and capture.sdpa_group_of(node)
        ):
            out = func(*args, **kwargs)  # replaced by the synthetic flash backward
            capture.flash_gradients.update(capture._storage_id(t) for t in _tensors_in(out))
            return out
        if data_dependent:
            return capture.answer_data_dependent(func, args, kwargs, context)
        out = func(*args, **kwargs)
        capture.means.observe(func, args, out)
        if func in _REWRAPS and isinstance(out, torch.Tensor):
            capture.alias_storage(out, args[0])
        if func is _CLONE and capture._storage_id(args[0]) in capture.flash_gradients:
            # The flash backward writes dq, dk, dv in the layout of q, k, v (as its forward
            # writes o): the copy back to the projection's layout is free on a GPU.
            return out
        op = capture.record(func, args, kwargs, out, context)
        if op.name.startswith(_COLLECTIVE_NAMESPACES):
            op.args.update(_collective_group(args, kwargs, capture._arg_names(func)))
        return out


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
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)
    return [held for t in inner if isinstance(t, torch.Tensor) for held in held_tensors(t)]


def _wraps_local_tensors(types: Iterable[type]) -> bool:
    """True when a tensor subclass that wraps local tensors takes part (DTensor, the
    AsyncCollectiveTensor of functional collectives, torchao's fp8 tensors): the recorder
    steps aside so the subclass runs its per-rank ops, which it records at local shapes
    (DESIGN.md, "Parallel programs on one CPU")."""
    return any(is_traceable_wrapper_subclass_type(t) for t in types)


def _shape_inference_unrecorded() -> None:
    """Make DTensor's shape inference run unrecorded (installed once, on the first DTensor
    op a capture sees). For each op it has not cached, DTensor runs the op on fake tensors
    at global shapes to learn the output's shape (``ShardingPropagator.
    _propagate_tensor_meta_non_cached``, under a fake mode of its own): no rank's work, and
    recorded only the first time a process meets that op. NB: a patch of a private torch
    method; it is a pass-through when no capture is on the dispatch mode stack."""
    if not torch.distributed.is_available():
        return  # no DTensor in this torch
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    if getattr(original, "torchroof_unrecorded", False):
        return

    def propagate(self: Any, op_schema: Any) -> Any:
        with contextlib.ExitStack() as unrecorded:
            for mode in _get_current_dispatch_mode_stack():
                if isinstance(mode, _Recorder):
                    unrecorded.enter_context(mode.capture.unrecorded())
            return original(self, op_schema)

    propagate.torchroof_unrecorded = True  # type: ignore[attr-defined]
    propagate.__wrapped__ = original  # type: ignore[attr-defined]
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]


_COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "_c10d_functional_autograd.")


def _collective_group(
    args: tuple[Any, ...], kwargs: dict[str, Any], arg_names: tuple[str, ...]
) -> dict[str, Any]:
    """The process group of a c10d / _c10d_functional op as plain data: ``group_name``,
    ``group_size`` and ``group_ranks`` (global ranks), with the ProcessGroup and ReduceOp
    objects of ``c10d`` ops replaced by the group's name and the op's name (``"sum"``).
    Empty for ops without a group (``wait_tensor``)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    values = dict(zip(arg_names, args, strict=False))
    values.update(kwargs)
    plain: dict[str, Any] = {}
    group = None
    for key, value in values.items():
        if isinstance(value, torch.ScriptObject):
            kind = value._type().qualified_name()
            if kind.endswith(".ProcessGroup"):
                group = dist.ProcessGroup.unbox(value)
                plain[key] = group.group_name
            elif kind.endswith(".ReduceOp"):
                plain[key] = dist.ReduceOp.RedOpType(value.op()).name.lower()
        elif isinstance(value, dist.ProcessGroup):
            group = value
            plain[key] = group.group_name
        elif key == "group_name" and isinstance(value, str):
            group = _resolve_process_group(value)
    if group is not None:
        plain["group_name"] = group.group_name
        plain["group_size"] = group.size()
        plain["group_ranks"] = list(dist.get_process_group_ranks(group))
    return plain


class _FunctionHook(TorchFunctionMode):
    """Sees torch-level calls: replaces SDPA, marks explicit backward calls.

    NB: autograd runs every backward node under the thread-local state it saved when
    backward was called, and that call came through ``__torch_function__`` below, which
    torch runs with this mode popped off the stack. So backward nodes run without it, and
    so would a checkpointed forward re-run inside backward: its SDPA would go down meta's
    math path (bmm + an S×S softmax). ``Capture._enter_module`` therefore pushes the mode
    back (:meth:`reactivate`) for a module entered during backward, until it exits.
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
        if func is F.scaled_dot_product_attention and self.capture.flash_attention:
            if not self.capture._suppress:
                return self.capture.sdpa(func, args, kwargs)
            # unrecorded (a context run before the step) over a quantised cache
            wide_args, wide_kwargs = _widened_kv(args, kwargs)
            return func(*wide_args, **wide_kwargs)
        if func is torch.Tensor.tolist and args and _needs_item_answer(args[0]):
            return self.capture.answer_tolist(args[0])
        if func in _BACKWARD_ENTRY_POINTS:
            return self.capture.run_as_backward(func, args, kwargs)
        return func(*args, **kwargs)

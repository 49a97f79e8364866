"""The dispatch mode a capture runs: sees each aten op after autograd and decompositions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from torchroof.capture import routing
from torchroof.capture.answers import needs_item_answer
from torchroof.capture.storage import tensors_in
from torchroof.capture.symbolic import active_sizes

if TYPE_CHECKING:
    from torchroof.capture.mode import Capture

aten = torch.ops.aten

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
# what a FakeTensor (symbolic sizes, FSDP2's fake parameters) dispatches where a meta
# tensor answers from its own metadata: never a kernel, never recorded
_FAKE_QUERIES = frozenset({torch.ops.prim.device.default})
_COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "_c10d_functional_autograd.")


class OpRecorder(TorchDispatchMode):
    """Records each aten op; answers ``.item()`` on meta; hides SDPA's decomposition."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if _wraps_local_tensors(types):
            _shape_inference_unrecorded()
            return NotImplemented  # the subclass unwraps; its local ops come back here
        kwargs = kwargs or {}
        if func in _FAKE_QUERIES or (
            active_sizes() is not None and _not_on_meta(func, args, kwargs)
        ):  # a fake tensor's device query is no work, and meta never dispatches it
            return func(*args, **kwargs)
        capture = self.capture
        answers = capture.answers
        capture.budget.count_op(func)
        if func is _LOCAL_SCALAR_DENSE and needs_item_answer(args[0]):
            if capture.suppressed:
                return answers.item_unrecorded(args[0])
            return answers.item(func, args, kwargs)
        data_dependent = needs_item_answer(args[0]) and routing.is_data_dependent(func, args)
        if capture.suppressed:
            if data_dependent:
                return answers.data_dependent(func, args, kwargs, None)
            out = func(*args, **kwargs)
            answers.means.observe(func, args, out)
            return out
        context = capture.context()
        phase, _module, node = context
        sdpa = capture.sdpa
        # a recompute is forward work, whichever node asked for it
        if node is not None and phase == "backward" and sdpa and sdpa.group_of(node):
            out = func(*args, **kwargs)  # replaced by the synthetic flash backward
            sdpa.flash_gradients.update(capture.storage.storage_id(t) for t in tensors_in(out))
            return out
        if data_dependent:
            return answers.data_dependent(func, args, kwargs, context)
        out = func(*args, **kwargs)
        answers.means.observe(func, args, out)
        if func in _REWRAPS and isinstance(out, torch.Tensor):
            capture.storage.alias(out, args[0])
        if func is _CLONE and capture.storage.storage_id(args[0]) in sdpa.flash_gradients:
            # The flash backward writes dq, dk, dv in the layout of q, k, v (as its forward
            # writes o): the copy back to the projection's layout is free on a GPU.
            return out
        op = capture.record(func, args, kwargs, out, context)
        if op.name.startswith(_COLLECTIVE_NAMESPACES):
            op.args.update(_collective_group(args, kwargs, capture.writer.arg_names(func)))
        return out


_SLICE = aten.slice.Tensor
_WHOLE = 2**62  # a slice's end past any size: Python's ``x[:]`` when the size is a symbol


def _not_on_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An op a capture with symbolic sizes sees that the same step on meta never
    dispatches: a fake tensor asking for its device, and the whole-dimension slice of
    Python indexing (``x[:, None]``), which torch skips when it knows the size (it cuts the
    slice's end to the size and returns the tensor itself: ``applySlice``)."""
    if func in _FAKE_QUERIES:
        return True
    if func is not _SLICE:
        return False
    values = [*args[1:], *kwargs.values()]
    start = values[1] if len(values) > 1 else 0
    end = values[2] if len(values) > 2 else None
    step = values[3] if len(values) > 3 else 1
    return start in (0, None) and step == 1 and (end is None or _known_int(end) >= _WHOLE)


def _known_int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _wraps_local_tensors(types: Iterable[type]) -> bool:
    """True when a tensor subclass that wraps local tensors takes part (DTensor, the
    AsyncCollectiveTensor of functional collectives, torchao's fp8 tensors): the recorder
    steps aside so the subclass runs its per-rank ops, which it records at local shapes
    (the parallel program on a fake process group)."""
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
                if isinstance(mode, OpRecorder):
                    unrecorded.enter_context(mode.capture.unrecorded())
            return original(self, op_schema)

    propagate.torchroof_unrecorded = True  # type: ignore[attr-defined]
    propagate.__wrapped__ = original  # type: ignore[attr-defined]
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]


def _collective_group(
    args: tuple[Any, ...], kwargs: dict[str, Any], arg_names: tuple[str, ...]
) -> dict[str, Any]:
    """The process group of a c10d / _c10d_functional op as plain data: ``group_name``,
    ``group_size`` and ``group_ranks`` (global ranks), with the ProcessGroup and ReduceOp
    objects of ``c10d`` ops replaced by the group's name and the op's name (``"sum"``).
    Empty for ops without a group (``wait_tensor``)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

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
                # a boxed ReduceOp: torch's ScriptObject stub lists none of its methods
                op = value.op()  # type: ignore[attr-defined]
                plain[key] = dist.ReduceOp.RedOpType(op).name.lower()
        elif isinstance(value, dist.ProcessGroup):
            group = value
            plain[key] = group.group_name
        elif key == "group_name" and isinstance(value, str):
            group = _resolve_process_group(GroupName(value))
    if group is not None:
        plain["group_name"] = group.group_name
        plain["group_size"] = group.size()
        plain["group_ranks"] = list(dist.get_process_group_ranks(group))
    return plain

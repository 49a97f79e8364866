"""Repeated layers of a training step traced once (:mod:`torchroof.capture.replay` for the
forward-only case).

With gradients on, a copied layer needs a backward pass too, and autograd runs the layers'
backward passes last layer first. So the first layer of each kind runs for real, whose
forward ops the others copy, and the last of that kind, whose backward (and, with activation
checkpointing, recompute) ops the others copy; a pre-hook on the autograd node that made
its outputs and a hook on its inputs' gradients mark where its backward begins and ends. A
copied layer is one autograd node (:class:`_CopiedLayer`): its forward records the first
layer's ops under its own names and makes its outputs; its backward records the last
layer's backward ops, its storages mapped (gradients of the outputs to the gradients it is
given, activations to the ones its forward made, weights to its own), hands autograd
gradients for its inputs and sets its weights' gradients, made at the last layer's shapes.
The second layer of each kind runs too, held to the first
(:mod:`torchroof.capture.replay_check`). Where the last layer's backward turns out not to
be copyable, the step is traced again running every layer (:class:`ReplayFallback`).

Under FSDP2 a layer's parameters are fake tensors and its all-gathers, prefetches and
reduce-scatters are done by hooks on the layer and on its outputs' gradients, which run
around a copy as around the layer: the last layer's backward is recorded from when its
own autograd node starts, after those hooks, and a copy makes its tensors fake like theirs.
Under tensor parallelism a weight is a DTensor: its ops are recorded on its local shard,
and a copy sets its gradient as a DTensor of the weight's mesh and placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from torchroof.capture.layer_calls import COMPOSABLE_STATE, Route, reachable, structure_key
from torchroof.capture.replay import (
    CallTemplate,
    LayerCall,
    LayerCounts,
    append_copies,
    replay_call,
)
from torchroof.capture.replay_check import verified
from torchroof.capture.storage import local_shard
from torchroof.capture.symbolic import is_fake, tensors_made_aside
from torchroof.records.assumptions import Assumption

if TYPE_CHECKING:
    from torchroof.capture.mode import Capture

# shape, stride, offset, bytes, dtype, device
View = tuple[tuple[int, ...], tuple[int, ...], int, int, str, str]


class ReplayFallback(RuntimeError):
    """A copied layer's backward could not be copied: the step must run every layer."""


@dataclass
class _Backward:
    """The last layer of a kind's backward pass, as its copies replay it."""

    path: str
    correspondence: dict[int, int]  # its forward's storages -> the first layer's
    forward_external: dict[int, Route]  # what its forward read, by how it was reached
    forward_internal: set[int]
    outputs: int  # its outputs that take gradients
    inputs: list[int]  # the argument leaves that take gradients
    first_op: int = -1
    first_sid: int = -1
    first_assumption: int = 0
    op_count: int = 0
    grad_outputs: list[int | None] = field(default_factory=list)
    reach: dict[int, Route] = field(default_factory=dict)  # weights as its backward read them
    ops: list[Any] = field(default_factory=list)
    assumptions: list[Any] = field(default_factory=list)
    grad_inputs: dict[int, tuple[int, View]] = field(default_factory=dict)  # leaf -> grad
    param_grads: dict[str, tuple[int, View]] = field(default_factory=dict)
    # a DTensor weight's gradient: its mesh, placements (Partial where the step reduces it
    # later), shape and stride
    grad_specs: dict[str, tuple[Any, Any, Any, Any]] = field(default_factory=dict)
    refusal: str = ""
    done: bool = False


def _view(t: torch.Tensor, capture: Capture) -> tuple[int, View]:
    """(storage, view) of ``t``, a DTensor by its local shard (what its ops read)."""
    t = local_shard(t)
    dtype = str(t.dtype).removeprefix("torch.")
    nbytes = t.untyped_storage().nbytes()
    return capture.storage.storage_id(t), (
        tuple(t.shape),
        tuple(t.stride()),
        int(t.storage_offset()),
        nbytes,
        dtype,
        str(t.device),
    )


class TrainingReplay:
    """The :class:`~torchroof.capture.replay.TrainingCopies` of one stack of layers."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self._last: dict[tuple[Any, ...], int] = {}
        for position, layer in enumerate(layers):
            self._last[structure_key(layer)] = position
        self._forward: dict[tuple[Any, ...], CallTemplate] = {}
        self._backward: dict[tuple[Any, ...], _Backward] = {}
        self._checked: set[tuple[Any, ...]] = set()

    def call(
        self, call: LayerCall, key: tuple[Any, ...], shape: tuple[Any, ...], counts: LayerCounts
    ) -> Any:
        capture = call.capture
        if (
            capture.context()[0] == "recompute"
            or capture.suppressed
            or not _plain(call)
            or _aliased_inputs(call)
        ):  # a checkpointed layer's re-run is its backward's business
            return call.run()
        first = self._forward.get(key)
        if first is None:
            counts.kinds += 1
            counts.traced += 1
            out, first = call.record()
            first.refusal = first.refusal or _outputs_refusal(first) or _made_inside(call, out)
            if first.refusal:
                counts.not_replayed.append(first.refusal)
            self._forward[key] = first
            return out
        last = self._last[shape]
        if (
            first.refusal
            or call.position > last
            or any(path not in call.reach for path in first.external.values())
        ):
            counts.traced += 1
            return call.run()
        if call.position == last:
            counts.traced += 1
            return self._record_backward(call, key, first)
        if key not in self._checked:  # the second of its kind runs too, held to the first
            self._checked.add(key)
            counts.traced += 1
            out, second = call.record()
            first.refusal = second.refusal or verified(first, second)
            if first.refusal:
                counts.not_replayed.append(first.refusal)
            return out
        counts.replayed += 1
        return _copy(self, call, key, first)

    def backward_of(self, key: tuple[Any, ...]) -> _Backward:
        found = self._backward.get(key)
        if found is None or not found.done:
            raise ReplayFallback("the last layer of a kind ran with other inputs")
        if found.refusal:
            raise ReplayFallback(found.refusal)
        return found

    def _record_backward(self, call: LayerCall, key: tuple[Any, ...], first: CallTemplate) -> Any:
        """Run the last layer of its kind for real, and hook its backward's ends."""
        capture = call.capture
        out, own = call.record()
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tensors if t.requires_grad]
        inputs = [
            i for i, t in enumerate(call.leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        record = _Backward(
            capture.modules.innermost(),
            _correspondence(own, first),
            dict(own.external),
            set(own.internal),
            len(outputs),
            inputs,
        )
        if own.refusal or not outputs or not inputs or len(outputs) != len(tensors):
            record.refusal = own.refusal or "a layer output or input takes no gradient"
        elif len({t.grad_fn for t in outputs}) != 1 or outputs[0].grad_fn is None:
            # where its backward begins is no one node's start
            record.refusal = "a layer's outputs come from several autograd nodes"
        self._backward[key] = record
        if record.refusal or not record.correspondence and own.ops:
            record.refusal = record.refusal or "the last layer of a kind ran other ops"
            record.done = True
            return out
        layer, position = call.layer, call.position

        def begin(grads: Any) -> None:
            record.first_op, record.first_sid = len(capture.trace.ops), capture.storage.next_id
            record.first_assumption = len(capture.trace.assumptions)
            record.op_count = capture.budget.op_count
            record.grad_outputs = [
                capture.storage.storage_id(g) if g is not None else None for g in grads
            ]
            record.reach = {
                capture.storage.storage_id(t): path
                for path, t in reachable(layer, position, []).items()
            }

        def end(grads: Any) -> None:
            _close(record, capture, layer, grads)

        _when_node_runs(outputs, begin)
        held = [call.leaves[i] for i in inputs]
        torch.autograd.graph.register_multi_grad_hook(held, end, mode="all")
        return out


def _when_node_runs(outputs: list[torch.Tensor], begin: Any) -> None:
    """Call ``begin`` with the gradients of ``outputs`` when the one autograd node that
    made them all is about to run: after the hooks on the outputs themselves (FSDP2's
    pre-backward, which gathers this layer's weights and prefetches the next layer's: work
    its hooks do around a copy too), which a hook on the tensors would precede (tensor
    hooks run before the node's pre-hooks: PyTorch docs, "Backward Hooks execution")."""
    node = outputs[0].grad_fn
    assert node is not None  # outputs that take gradients, of one node (checked before)
    # their positions, not the tensors: the node holds its hooks, so a hook holding its
    # outputs is a cycle through C++ that Python's collector does not see (the model and
    # the capture stayed in memory after every trace with copied layers)
    positions = [t.output_nr for t in outputs]

    def run(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        begin([grad_outputs[n] for n in positions])

    node.register_prehook(run)


def _aliased_inputs(call: LayerCall) -> bool:
    """Two arguments that take gradients on one storage (``layer(x, residual=x)``): their
    gradients are one sum, which a copy's hooks would see twice."""
    held = [
        t.untyped_storage()._cdata
        for t in call.leaves
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    return len(set(held)) != len(held)


def _plain(call: LayerCall) -> bool:
    """Plain or fake tensors only (FSDP2's unsharded parameters are fake; weights may be
    tensor parallel's DTensors; no quantised weight), no gradient yet held (a second
    micro-batch accumulates into it), and no hook on a weight's gradient (a copy sets its
    gradient without running one: transformers' all-reduce of a replicated norm's)."""
    params = list(call.layer.parameters())
    tensors = [t for t in call.leaves if isinstance(t, torch.Tensor)]
    return all(
        (_plain_tensor(p) or _plain_tensor(local_shard(p)))
        and p.grad is None
        and not getattr(p, "_post_accumulate_grad_hooks", None)
        and not getattr(p, "_backward_hooks", None)
        for p in params
    ) and all(_plain_tensor(t) for t in tensors)


def _plain_tensor(t: torch.Tensor) -> bool:
    return type(t) in (torch.nn.Parameter, torch.Tensor) or is_fake(t)


def _outputs_refusal(first: CallTemplate) -> str:
    """A copy hands autograd outputs it made: every tensor output must be one."""
    handed = [
        leaf
        for leaf in first.outputs
        if leaf[0] == "path" or (leaf[0] == "same" and isinstance(leaf[1], torch.Tensor))
    ]
    return "a layer returned a tensor it did not make" if handed else ""


def _made_inside(call: LayerCall, out: Any) -> str:
    """FSDP2's pre-backward hook on a layer's outputs runs as part of the autograd node
    that made them, and its ops are labelled with that node's module; a copy's outputs are
    made by its own node, in the layer. So under FSDP2 a layer whose outputs a submodule
    made (BERT's output LayerNorm) is not copied."""
    if not any(attr.startswith(COMPOSABLE_STATE) for attr in vars(call.layer)):
        return ""
    modules = call.capture.modules
    path = modules.name_of(call.layer)
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            if modules.module_of_node(t.grad_fn) != path:
                return "a layer's output was made inside a submodule, where FSDP hooks it"
    return ""


def _correspondence(own: CallTemplate, first: CallTemplate) -> dict[int, int]:
    """The last layer's forward storages -> the first layer's, op by op ({} when the two
    ran other ops)."""
    if len(own.ops) != len(first.ops):
        return {}
    found: dict[int, int] = {}
    for a, b in zip(own.ops, first.ops, strict=True):
        if a.name != b.name or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs):
            return {}
        for x, y in zip((*a.inputs, *a.outputs), (*b.inputs, *b.outputs), strict=True):
            if found.setdefault(x.storage, y.storage) != y.storage or x.shape != y.shape:
                return {}
    return found


def _close(record: _Backward, capture: Capture, layer: torch.nn.Module, grads: Any) -> None:
    """The last layer's backward is over: keep its ops and how each storage is reached."""
    trace = capture.trace
    record.done = True
    if record.first_op < 0:  # its outputs took no gradient, yet its inputs did
        record.refusal = "the last layer of a kind had no gradient for its outputs"
        return
    record.ops = list(trace.ops[record.first_op :])
    record.assumptions = [
        Assumption(a.op_index - record.first_op, a.module, a.what, a.kind)
        for a in trace.assumptions[record.first_assumption :]
    ]
    record.op_count = capture.budget.op_count - record.op_count
    for leaf, grad in zip(record.inputs, grads, strict=True):
        if grad is not None:
            record.grad_inputs[leaf] = _view(grad, capture)
    for name, param in layer.named_parameters():
        if param.grad is not None:
            record.param_grads[name] = _view(param.grad, capture)
            if local_shard(param.grad) is not param.grad:
                dtensor: Any = param.grad
                mesh, placements = dtensor.device_mesh, dtensor.placements
                record.grad_specs[name] = (mesh, placements, dtensor.shape, dtensor.stride())
    made = {sid for sid, _ in (*record.grad_inputs.values(), *record.param_grads.values())}
    if any(sid < record.first_sid for sid in made):
        record.refusal = "a layer's gradients are not ones its backward made"


def _copy(
    replay: TrainingReplay, call: LayerCall, key: tuple[Any, ...], first: CallTemplate
) -> Any:
    """The layer as one autograd node whose forward and backward are copies."""
    job = _Job(replay, call, key, first)
    made = _CopiedLayer.apply(job, *(call.leaves[i] for i in job.inputs))
    made = made if isinstance(made, tuple) else (made,)
    return job.rebuild(list(made))


class _Job:
    """One copied layer call: what its forward made, for its backward."""

    def __init__(
        self, replay: TrainingReplay, call: LayerCall, key: tuple[Any, ...], first: CallTemplate
    ) -> None:
        self.replay, self.call, self.key, self.first = replay, call, key, first
        self.inputs = [
            i for i, t in enumerate(call.leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        self.params = [(n, p) for n, p in call.layer.named_parameters() if p.requires_grad]
        self.mapping: dict[int, int] = {}
        self.out: Any = None

    def forward(self) -> tuple[torch.Tensor, ...]:
        call = self.call
        copied = replay_call(
            call.capture, self.first, call.layer, call.position, call.reach, call.leaves
        )
        assert copied is not None  # every path it reads was checked before
        self.out, self.mapping = copied
        return tuple(t for t in pytree.tree_leaves(self.out) if isinstance(t, torch.Tensor))

    def rebuild(self, made: list[torch.Tensor]) -> Any:
        leaves, spec = pytree.tree_flatten(self.out)
        it = iter(made)
        return pytree.tree_unflatten(
            [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
        )

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        try:
            return self._backward(grads)
        except KeyError as missing:  # a storage the last layer's backward has no place for
            raise ReplayFallback(f"a copied layer's backward has no storage {missing}") from None

    def _backward(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        record = self.replay.backward_of(self.key)
        call, capture = self.call, self.call.capture
        mapping: dict[int, int] = {}
        now = reachable(call.layer, call.position, [])
        for sid in sorted({t.storage for op in record.ops for t in (*op.inputs, *op.outputs)}):
            mapping[sid] = self._place(sid, record, grads, now)
        path = capture.modules.name_of(call.layer) or record.path
        append_copies(
            capture, record.ops, record.assumptions, mapping, record.path, path, record.op_count
        )
        out: list[torch.Tensor | None] = []
        for leaf in self.inputs:
            given = record.grad_inputs.get(leaf)
            out.append(_made(capture, mapping[given[0]], given[1]) if given else None)
        # the weights' gradients are set as AccumulateGrad sets them (the last layer's copied
        # ops hold the detach it records for each)
        for name, param in self.params:
            given = record.param_grads.get(name)
            if given is not None:
                local = _made(capture, mapping[given[0]], given[1])
                param.grad = _dtensor(local, record.grad_specs.get(name), capture)
        return tuple(out)

    def _place(
        self,
        sid: int,
        record: _Backward,
        grads: tuple[torch.Tensor | None, ...],
        now: dict[Route, torch.Tensor],
    ) -> int:
        """Where storage ``sid`` of the last layer's backward is in this layer's."""
        storage = self.call.capture.storage
        if sid in record.grad_outputs:
            grad = grads[record.grad_outputs.index(sid)]
            if grad is None:
                raise ReplayFallback("a copied layer was given no gradient for an output")
            return storage.storage_id(grad)
        if sid in record.reach:
            return storage.storage_id(now[record.reach[sid]])
        if sid in record.forward_internal:
            return self.mapping[record.correspondence[sid]]
        if sid in record.forward_external:
            return storage.storage_id(self.call.reach[record.forward_external[sid]])
        if sid >= record.first_sid:
            return storage.fresh_id()
        trace = self.call.capture.trace
        if sid in trace.parameters or sid in trace.roles:
            raise ReplayFallback("a layer's backward read another layer's weights")
        return sid


def _made(capture: Capture, sid: int, view: View) -> torch.Tensor:
    shape, stride, offset, nbytes, dtype, device = view
    kind = getattr(torch, dtype)
    with tensors_made_aside(capture):
        tensor = torch.empty_strided(shape, stride, dtype=kind, device=device)
        if offset or tensor.untyped_storage().nbytes() != nbytes:  # a view into a larger one
            raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
            tensor = raw.view(kind).as_strided(shape, stride, offset)
    capture.storage.bind(tensor, sid)
    return tensor


def _dtensor(
    local: torch.Tensor, spec: tuple[Any, Any, Any, Any] | None, capture: Capture
) -> torch.Tensor:
    """A weight's gradient whose local part is ``local``: with the last layer's gradient
    ``spec`` (a tensor-parallel weight's), a DTensor of its mesh, placements, shape and
    stride; ``local`` itself otherwise."""
    if spec is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    with tensors_made_aside(capture):
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )


class _CopiedLayer(torch.autograd.Function):
    """A copied layer as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, job: _Job, *tensors: torch.Tensor) -> Any:
        ctx.job = job
        ctx.set_materialize_grads(False)  # an output no loss reads gets None, not zeros
        made = job.forward()
        with tensors_made_aside(job.call.capture):  # not views: the model may change them
            made = tuple(t.detach() for t in made)
        return made if len(made) != 1 else made[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        job, ctx.job = ctx.job, None  # it reaches the inputs, whose nodes reach this one
        return (None, *job.backward(grads))

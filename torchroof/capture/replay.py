"""Repeated layers traced once: the first layer of each distinct kind runs under the capture
and its ops are kept; every later layer of the same kind, called on inputs of the same
shapes, is given those ops again under its own module path and storages, and outputs of
the shapes the first one returned, without its forward running on meta.

What makes two calls the same (:func:`call_key`): the layer's class, every submodule's
plain attributes (head counts, sliding window, layer type; not its index), its parameters'
and buffers' shapes and dtypes, and every tensor the call reads (arguments, the layer's
entry of a transformers ``Cache``) by shape, stride and dtype. A call whose representative
read a storage it could not place (another layer's weights or cache), left state behind
that is not its cache entry's, or returned a view of its input runs for real every time:
replaying is an optimisation, never a guess. Training steps copy their layers' backward
too (:mod:`torchroof.capture.replay_training`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from torchroof.capture.layer_calls import (
    Route,
    cache_entries,
    caches_in,
    call_key,
    entry_changes,
    entry_key,
    entry_snapshot,
    hooked,
    module_state,
    reachable,
    structure_key,
    tensors_of,
)
from torchroof.capture.replay_check import verified
from torchroof.capture.symbolic import is_fake, tensors_made_aside
from torchroof.records.assumptions import Assumption
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import Role, remapped
from torchroof.records.trace import CopiedSpan

if TYPE_CHECKING:
    from torchroof.capture.mode import Capture

# a layer's own position, not what it computes: two layers that differ only here are alike


@dataclass
class LayerCounts:
    """How the repeated layers of one capture were traced."""

    traced: int = 0  # calls that ran (each distinct kind's first, and any not replayable)
    replayed: int = 0  # calls given their representative's ops
    kinds: int = 0  # distinct kinds met
    not_replayed: list[str] = field(default_factory=list)  # why a kind ran every time

    def describe(self, layers: int) -> str:
        """One line for the summary: ``80 decoder layers: 1 kind traced, 79 replayed``."""
        kinds = f"{self.kinds} distinct kind{'s' if self.kinds != 1 else ''}"
        calls = self.traced + self.replayed
        called = f" ({calls} calls)" if calls != layers else ""  # micro-batches each call them
        line = f"{layers} repeated layers{called}, {kinds}: {self.traced} traced, "
        line += f"{self.replayed} copied"
        if self.not_replayed:
            line += f" ({'; '.join(sorted(set(self.not_replayed)))})"
        return line


@dataclass
class CallTemplate:
    """What a representative call did, in the terms a later call's replay needs."""

    path: str  # the representative's module path
    ops: list[OpRecord]
    assumptions: list[Assumption]  # op_index relative to the first op
    external: dict[int, Route]  # storages the call read that its caller owns -> how reached
    internal: list[int]  # storages the call created, in the order it created them
    created: dict[int, tuple[int, str, str]]  # created storage -> (bytes, dtype, device)
    outputs: list[Any]  # per output leaf: ("new", sid, view) | ("path", path) | ("same", x)
    output_spec: Any
    cache_changes: list[dict[tuple[str, Any], Any]]  # per cache entry: (attribute, item) -> leaf
    object_changes: list[tuple[int, str, Any]]  # (argument leaf, attribute, value at own index)
    roles: dict[int, Role]  # created storages given a role during the call
    role_bytes: dict[str, int]  # bytes the call added to each role
    op_count: int  # aten ops it ran (recorded or not), for the op budget
    refusal: str = ""  # why later calls of this kind run for real


@dataclass
class LayerCall:
    """One call of a repeated layer, as the stand-in for its forward sees it."""

    capture: Capture
    layer: torch.nn.Module
    position: int
    original: Any  # the layer's own forward
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: list[Any]  # (args, kwargs) flattened
    reach: dict[Route, torch.Tensor]

    def run(self) -> Any:
        return self.original(*self.args, **self.kwargs)

    def record(self) -> tuple[Any, CallTemplate]:
        """Run it for real, kept as a template (:func:`record_call`)."""
        return record_call(
            self.capture,
            self.layer,
            self.position,
            self.reach,
            self.leaves,
            self.original,
            self.args,
            self.kwargs,
        )


class TrainingCopies(Protocol):
    """How calls with gradients on are copied (:mod:`torchroof.capture.replay_training`)."""

    def call(
        self, call: LayerCall, key: tuple[Any, ...], shape: tuple[Any, ...], counts: LayerCounts
    ) -> Any: ...


class LayerReplay:
    """Context manager: ``layers`` (the model's list of repeated blocks) traced once per
    distinct kind under whichever capture is recording when they run; with ``positions``,
    only the layers at those (a pipeline stage's own), the others run as they are."""

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        training: TrainingCopies | None = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        self._layers = list(layers)
        self._positions = range(len(self._layers)) if positions is None else positions
        self._training = training
        self._shapes: dict[int, tuple[Any, ...]] = {}
        self._templates: dict[tuple[Any, ...], CallTemplate] = {}  # (id(capture), key, entries)
        self.counts: dict[int, LayerCounts] = {}  # id(capture) -> counts
        self._captures: dict[int, Capture] = {}  # held, so no capture's id is reused
        self._checked: set[tuple[Any, ...]] = set()  # kinds whose second call was compared
        self._patched: list[tuple[torch.nn.Module, Any]] = []

    def __enter__(self) -> LayerReplay:
        seen: set[int] = set()
        shared = {id(m) for m in self._layers if self._layers.count(m) > 1}
        for position, layer in enumerate(self._layers):
            if id(layer) in seen or id(layer) in shared or position not in self._positions:
                continue  # one module run at several depths: its calls differ only by order
            seen.add(id(layer))
            self._shapes[id(layer)] = structure_key(layer)
            previous = layer.__dict__.get("forward")
            original = layer.forward
            stand_in = functools.partial(self._call, layer, position, original)
            layer.__dict__["forward"] = stand_in
            self._patched.append((layer, previous))
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer, previous in self._patched:
            if previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.__dict__["forward"] = previous
        self._patched = []

    def counts_for(self, trace: Any) -> LayerCounts | None:
        """How the layers ran under the capture that recorded ``trace``."""
        for key, capture in self._captures.items():
            if capture.trace is trace:
                return self.counts.get(key)
        return None

    def _call(
        self, layer: torch.nn.Module, position: int, original: Any, *args: Any, **kwargs: Any
    ) -> Any:
        capture = recording_capture()
        if (
            capture is None
            or not capture.modules
            or capture.modules.name_of(layer) != capture.modules.innermost()
            or (torch.is_grad_enabled() and self._training is None)
            or hooked(layer)
            or _other_global_hooks()
        ):  # a forward called directly (not as a module), training, or hooks a copy would
            # not run: as it is
            return original(*args, **kwargs)
        phase = capture.context()[0]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        reach = reachable(layer, position, leaves)
        key = (
            id(capture),
            call_key(self._shapes[id(layer)], reach, leaves, spec, capture.suppressed, phase),
            tuple(entry_key(e) for e in cache_entries(leaves, position)),
        )
        self._captures[id(capture)] = capture
        # what the summary counts: the recorded step's layers (not a context run unrecorded)
        counts = (
            LayerCounts()
            if capture.suppressed
            else self.counts.setdefault(id(capture), LayerCounts())
        )
        if torch.is_grad_enabled():
            assert self._training is not None
            call = LayerCall(capture, layer, position, original, args, kwargs, leaves, reach)
            return self._training.call(call, key, self._shapes[id(layer)], counts)
        template = self._templates.get(key)
        if template is None:
            counts.kinds += 1
            counts.traced += 1
            out, template = record_call(
                capture, layer, position, reach, leaves, original, args, kwargs
            )
            self._templates[key] = template
            if template.refusal:
                counts.not_replayed.append(template.refusal)
            return out
        if template.refusal:
            counts.traced += 1
            return original(*args, **kwargs)
        if key not in self._checked:  # the second of its kind runs too, held to the first
            self._checked.add(key)
            counts.traced += 1
            out, second = record_call(
                capture, layer, position, reach, leaves, original, args, kwargs
            )
            template.refusal = second.refusal or verified(template, second)
            if template.refusal:
                counts.not_replayed.append(template.refusal)
            return out
        copied = replay_call(capture, template, layer, position, reach, leaves)
        if copied is None:  # a storage it read has no counterpart here
            counts.traced += 1
            return original(*args, **kwargs)
        counts.replayed += 1
        return copied[0]


def _other_global_hooks() -> bool:
    """Module hooks registered for every module besides the capture's own pair."""
    hooks = torch.nn.modules.module
    return (
        len(hooks._global_forward_pre_hooks) > 1
        or len(hooks._global_forward_hooks) > 1
        or bool(hooks._global_backward_hooks or hooks._global_backward_pre_hooks)
    )


def recording_capture() -> Capture | None:
    """The capture whose dispatch mode is innermost on the stack, if one is."""
    from torchroof.capture.dispatch import OpRecorder

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, OpRecorder):
            return mode.capture
    return None


# -- the representative ------------------------------------------------------------------


@dataclass
class _Before:
    """The capture and the call's state before the representative runs."""

    first_op: int
    first_sid: int
    first_assumption: int
    op_count: int
    roles: dict[int, Role]
    role_bytes: dict[str, int]
    named: int
    entries: list[Any]  # the layer's entries of the caches it is given
    entries_before: list[dict[tuple[str, Any], Any]]
    caches: list[Any]
    caches_before: list[dict[tuple[str, Any], Any]]
    modules: list[dict[str, Any]]
    objects: dict[int, dict[tuple[str, Any], Any]]  # other argument objects' state, by leaf


def _before(capture: Capture, layer: torch.nn.Module, position: int, leaves: list[Any]) -> _Before:
    trace = capture.trace
    entries = cache_entries(leaves, position)
    caches = [cache for leaf in leaves for _, cache in caches_in(leaf)]
    return _Before(
        len(trace.ops),
        capture.storage.next_id,
        len(trace.assumptions),
        capture.budget.op_count,
        dict(trace.roles),
        dict(trace.role_bytes),
        len(trace.parameters),
        entries,
        [entry_snapshot(e) for e in entries],
        caches,
        [entry_snapshot(c) for c in caches],
        module_state(layer),
        {i: entry_snapshot(leaf) for i, leaf in enumerate(leaves) if _stateful(leaf)},
    )


def _stateful(leaf: Any) -> bool:
    """An argument whose attributes a call could change: an object, not a tensor, a plain
    value or a module."""
    plain = (torch.Tensor, torch.nn.Module, bool, int, float, str, type(None), type)
    return not isinstance(leaf, plain) and hasattr(leaf, "__dict__")


def object_changes(
    before: _Before, leaves: list[Any], position: int
) -> tuple[list[tuple[int, str, Any]], str]:
    """(what the call set in its arguments' state, why that cannot be copied): only a plain
    value at this layer's own index of a list or dict an argument holds can be
    (an encoder-decoder cache's ``is_updated[layer_idx] = True``); any other change, a
    list grown or an entry's list grown, is refused."""
    found: list[tuple[int, str, Any]] = []
    for index, snapshot in before.objects.items():
        for (attr, item), value in entry_changes(snapshot, entry_snapshot(leaves[index])).items():
            if item != position or not isinstance(value, (bool, int, float, str, type(None))):
                return [], "a layer changed the state of an argument"
            found.append((index, attr, value))
    for entry, snapshot in zip(before.entries, before.entries_before, strict=True):
        for attr, value in vars(entry).items():
            kept = isinstance(value, list) and snapshot.get((attr, None)) is value
            if kept and len(value) != _length(snapshot, attr):
                return [], "a layer grew its cache entry"
    return found, ""


def _length(snapshot: dict[tuple[str, Any], Any], attr: str) -> int:
    return sum(1 for (a, item) in snapshot if a == attr and item is not None)


def _state_refusal(capture: Capture, layer: torch.nn.Module, before: _Before) -> str:
    """Why the call's state after it ran is not a copyable one ("" when it is)."""
    if module_state(layer) != before.modules:
        return "a layer kept state of its own"
    if len(capture.trace.parameters) != before.named:
        return "a layer named parameters as it ran"
    if any(
        entry_changes(b, entry_snapshot(c))
        for c, b in zip(before.caches, before.caches_before, strict=True)
    ):
        return "a layer grew the cache"  # a lazily made cache entry: not its own to copy
    if len(before.entries) != len(before.caches):
        return "a layer's cache has no entry for it"
    return ""


class _Returned:
    """What a representative handed back (outputs, cache entries), as a replay remakes it:
    ("new", storage, view) for a tensor it made, ("path", path) for one it was given,
    ("same", value) for anything else; ``refusal`` says why it cannot be remade."""

    def __init__(
        self,
        storage: Any,
        external: dict[int, Route],
        by_object: dict[int, Route],
        internal: set[int],
    ) -> None:
        self._storage, self._external = storage, external
        self._by_object, self._internal = by_object, internal
        self.created: dict[int, tuple[int, str, str]] = {}
        self.refusal = ""

    def __call__(self, value: Any) -> tuple[Any, ...]:
        if not isinstance(value, torch.Tensor):
            if tensors_of(value):
                self.refusal = self.refusal or "a layer returned tensors in a container it made"
            return ("same", value)
        if type(value) is not torch.Tensor and not is_fake(value):
            self.refusal = self.refusal or "a layer returned a tensor subclass"
            return ("same", value)
        if id(value) in self._by_object:
            return ("path", self._by_object[id(value)])
        sid = self._storage.storage_id(value)
        if sid in self._external:
            self.refusal = self.refusal or "a layer returned a view of its input"
        elif sid in self._internal:
            dtype = str(value.dtype).removeprefix("torch.")
            self.created[sid] = (value.untyped_storage().nbytes(), dtype, str(value.device))
            view = (tuple(value.shape), tuple(value.stride()), value.storage_offset())  # SymInts

            return ("new", sid, view)
        return ("same", value)


def record_call(
    capture: Capture,
    layer: torch.nn.Module,
    position: int,
    reach: dict[Route, torch.Tensor],
    leaves: list[Any],
    original: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, CallTemplate]:
    """Run the representative call for real and keep what a replay needs."""
    trace, storage = capture.trace, capture.storage
    external = {storage.storage_id(t): path for path, t in reach.items()}
    before = _before(capture, layer, position, leaves)
    out = original(*args, **kwargs)
    ops = trace.ops[before.first_op :]
    refusal = _state_refusal(capture, layer, before)
    objects, changed = object_changes(before, leaves, position)
    refusal = refusal or changed
    # per cache entry: (attribute, item or None) -> new value
    changes = [
        entry_changes(snapshot, entry_snapshot(entry))
        for entry, snapshot in zip(before.entries, before.entries_before, strict=True)
    ]
    handed_back = {
        storage.storage_id(t)
        for value in (out, *(v for change in changes for v in change.values()))
        for t in tensors_of(pytree.tree_leaves(value))
    }
    # every storage first met during the call is its own: a per-call constant or lazily
    # made cache tensor is a new storage in every layer of a full trace too
    touched = _storages_of(ops)
    internal = {sid for sid in touched | handed_back if sid >= before.first_sid} - set(external)
    if any(
        sid in trace.parameters or sid in trace.roles for sid in touched - internal - set(external)
    ):
        refusal = refusal or "a layer read another layer's weights or cache"
    returned = _Returned(storage, external, {id(t): path for path, t in reach.items()}, internal)
    out_leaves, out_spec = pytree.tree_flatten(out)
    outputs = [returned(leaf) for leaf in out_leaves]
    cache_changes = [{slot: returned(v) for slot, v in change.items()} for change in changes]
    new_roles = {sid: r for sid, r in trace.roles.items() if sid not in before.roles}
    if any(sid not in internal for sid in new_roles):
        refusal = refusal or "a layer labelled storages it did not create"
    template = CallTemplate(
        path=capture.modules.innermost(),
        ops=list(ops),
        assumptions=[
            Assumption(a.op_index - before.first_op, a.module, a.what, a.kind)
            for a in trace.assumptions[before.first_assumption :]
        ],
        external={sid: path for sid, path in external.items() if sid in touched},
        internal=sorted(internal),
        created=returned.created,
        outputs=outputs,
        output_spec=out_spec,
        cache_changes=cache_changes,
        object_changes=objects,
        roles=new_roles,
        role_bytes={
            role: size - before.role_bytes.get(role, 0)
            for role, size in trace.role_bytes.items()
            if size != before.role_bytes.get(role, 0)
        },
        op_count=capture.budget.op_count - before.op_count,
        refusal=refusal or returned.refusal,
    )
    return out, template


def _storages_of(ops: list[OpRecord]) -> set[int]:
    return {t.storage for op in ops for t in (*op.inputs, *op.outputs)}


# -- the replay --------------------------------------------------------------------------


def replay_call(
    capture: Capture,
    template: CallTemplate,
    layer: torch.nn.Module,
    position: int,
    reach: dict[Route, torch.Tensor],
    leaves: list[Any],
) -> tuple[Any, dict[int, int]] | None:
    """The representative's ops recorded again for this call, and its outputs and cache
    entry made at the shapes the representative's had, with the storage ids it gave the
    representative's; None when a storage it read has no counterpart here."""
    storage, trace = capture.storage, capture.trace
    mapping: dict[int, int] = {}
    for sid, reached in template.external.items():
        tensor = reach.get(reached)
        if tensor is None:
            return None
        mapping[sid] = storage.storage_id(tensor)
    for sid in template.internal:
        mapping[sid] = storage.fresh_id()
    append_copies(
        capture,
        template.ops,
        template.assumptions,
        mapping,
        template.path,
        capture.modules.innermost(),
        template.op_count,
    )
    for sid, role in template.roles.items():
        trace.roles[mapping[sid]] = role
    for held, size in template.role_bytes.items():
        trace.role_bytes[held] = trace.role_bytes.get(held, 0) + size
    made = made_storages(template, mapping, capture)
    by_path = dict(reach)

    def value_of(leaf: Any) -> Any:
        if leaf[0] == "new":
            base = made[leaf[1]]
            shape, stride, offset = leaf[2]
            with tensors_made_aside(capture):
                return base.as_strided(shape, stride, offset)
        if leaf[0] == "path":
            return by_path[leaf[1]]
        return leaf[1]

    for index, attr, value in template.object_changes:
        getattr(leaves[index], attr)[position] = value
    entries = cache_entries(leaves, position)
    for entry, change in zip(entries, template.cache_changes, strict=True):
        for (attr, item), leaf in change.items():
            if item is None:
                setattr(entry, attr, value_of(leaf))
            else:  # an item of a list or dict the entry updates in place
                getattr(entry, attr)[item] = value_of(leaf)
    outputs = [value_of(leaf) for leaf in template.outputs]
    return pytree.tree_unflatten(outputs, template.output_spec), mapping


def append_copies(
    capture: Capture,
    ops: list[OpRecord],
    assumptions: list[Assumption],
    mapping: dict[int, int],
    source: str,
    path: str,
    op_count: int,
) -> None:
    """Record ``ops`` again (their storages through ``mapping``, the modules under
    ``source`` renamed under ``path``) and the assumptions made on them (``op_index``
    counted from the first of ``ops``); ``op_count`` ops more against the op budget."""
    trace = capture.trace
    first = len(trace.ops)
    renamed: dict[str, str] = {}

    def module_of(name: str) -> str:
        found = renamed.get(name)
        if found is None:
            found = name
            if name == source or name.startswith(source + "."):
                found = path + name[len(source) :]
            renamed[name] = found
        return found

    capture.budget.count_ops(op_count)
    for op in ops:
        trace.ops.append(
            OpRecord(
                len(trace.ops),
                op.name,
                remapped(op.inputs, mapping),
                remapped(op.outputs, mapping),
                dict(op.args),
                module_of(op.module),
                op.phase,
                op.synthetic,
            )
        )
        capture.writer.note_progress(op.phase)
    trace.assumptions.extend(
        Assumption(a.op_index + first, module_of(a.module), a.what, a.kind) for a in assumptions
    )
    if ops:
        trace.copies.append(CopiedSpan(first, len(ops), ops[0].index))


def made_storages(
    template: CallTemplate, mapping: dict[int, int], capture: Capture
) -> dict[int, torch.Tensor]:
    """A tensor over a fresh storage for each storage the call handed back (outputs, cache
    entries), of the representative's bytes and device (meta, or a fake tensor's), known
    to the capture by its new id."""
    made: dict[int, torch.Tensor] = {}
    for sid, (nbytes, dtype, device) in template.created.items():
        kind = getattr(torch, dtype)
        with tensors_made_aside(capture):
            if kind.itemsize and isinstance(nbytes, torch.SymInt):  # one op on symbols
                base = torch.empty(nbytes // kind.itemsize, dtype=kind, device=device)
            else:
                raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
                base = raw.view(kind) if kind.itemsize else raw
        capture.storage.bind(base, mapping[sid])
        made[sid] = base
    return made

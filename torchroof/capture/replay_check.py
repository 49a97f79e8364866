"""Two calls of one kind of layer held to each other before any is copied
(:mod:`torchroof.capture.replay`): the second layer of each kind runs for real too, and the
others are copies only if its ops are the first's under its own names, on storages that
correspond (the same route to an argument, weight or cache entry; a storage each made for
itself; or the very same storage, a constant every layer shares). What a layer's forward
reads of its own index (a scale by ``1 / (layer_idx + 1)``, a row picked by it), a storage
another layer made (a cache entry shared across layers), or a per-call constant shows up
here as a difference or as the sharing it is."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchroof.capture.replay import CallTemplate


def verified(first: CallTemplate, second: CallTemplate) -> str:
    """Why ``second`` is not ``first`` again ("" when it is). ``first.internal`` loses any
    storage the two share (a constant first met inside the first call)."""
    if len(first.ops) != len(second.ops):
        return "layers of one kind ran other ops"
    if [leaf[0] for leaf in first.outputs] != [leaf[0] for leaf in second.outputs]:
        return "layers of one kind returned other things"
    if [set(c) for c in first.cache_changes] != [set(c) for c in second.cache_changes]:
        return "layers of one kind changed their cache entries otherwise"
    if [c[:2] for c in first.object_changes] != [c[:2] for c in second.object_changes]:
        return "layers of one kind changed their arguments otherwise"
    if first.role_bytes != second.role_bytes or len(first.roles) != len(second.roles):
        return "layers of one kind labelled other storages"
    own_first, own_second = set(first.internal), set(second.internal)
    shared: set[int] = set()
    pairs: dict[int, int] = {}
    for a, b in zip(first.ops, second.ops, strict=True):
        module = b.module
        if module == second.path or module.startswith(second.path + "."):
            module = first.path + module[len(second.path) :]
        same = (a.name, a.phase, a.synthetic, repr(a.args), a.module) == (
            b.name,
            b.phase,
            b.synthetic,
            repr(b.args),
            module,
        )
        if not same or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs):
            return "layers of one kind ran other ops"
        for x, y in zip((*a.inputs, *a.outputs), (*b.inputs, *b.outputs), strict=True):
            if (x.shape, x.stride, x.dtype, x.offset) != (y.shape, y.stride, y.dtype, y.offset):
                return "layers of one kind ran on other shapes"
            if pairs.setdefault(x.storage, y.storage) != y.storage:
                return "layers of one kind share storages otherwise"
            if x.storage in first.external:
                if first.external[x.storage] != second.external.get(y.storage):
                    return "layers of one kind read other tensors"
            elif x.storage == y.storage:
                shared.add(x.storage)  # one storage both read: a constant they share
            elif not (x.storage in own_first and y.storage in own_second):
                return "a layer read a storage another layer made"
    handed_back = set(first.created)
    if shared & handed_back:
        return "a layer handed back a storage it did not make"
    first.internal = [sid for sid in first.internal if sid not in shared]
    return ""

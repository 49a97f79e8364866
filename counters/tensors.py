"""Byte helpers shared by the rules: unique bytes, mutated arguments, op schemas."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, cast

import torch

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta, TensorRef


def tensor_key(t: TensorMeta) -> tuple[Any, ...]:
    return (t.storage, t.offset, t.shape, t.stride, t.dtype)


def distinct(tensors: Iterable[TensorMeta]) -> list[TensorMeta]:
    """Each tensor once, in first-seen order (the same tensor passed twice is read once)."""
    seen: dict[tuple[Any, ...], TensorMeta] = {}
    for t in tensors:
        seen.setdefault(tensor_key(t), t)
    return list(seen.values())


def unique_bytes(tensors: Iterable[TensorMeta]) -> int:
    """Bytes of the distinct tensors in ``tensors`` (``a + a`` reads ``a`` once)."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for t in tensors:
        key = tensor_key(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


@cache
def resolve_overload(name: str) -> Any | None:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default`` (None if it does not exist)."""
    namespace, packet, overload = name.rsplit(".", 2)
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return None


@cache
def mutated_args(name: str) -> frozenset[str]:
    """Schema arguments an op writes in place (``Tensor(a!)``)."""
    func = resolve_overload(name)
    if func is None:
        return frozenset()
    return frozenset(
        a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    )


@cache
def out_args(name: str) -> tuple[str, ...]:
    """Schema arguments that are ``out=`` destinations (written, never read). Only the
    schema says so: ``output`` of ``tanh_backward`` is an input (the forward's result)."""
    func = resolve_overload(name)
    if func is None:
        return ()
    return tuple(a.name for a in func._schema.arguments if a.is_out)


@cache
def is_view_schema(name: str) -> bool:
    """True when every output aliases an input without writing it (a view)."""
    func = resolve_overload(name)
    if func is None or not func._schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def refs_of(value: Any) -> list[int]:
    if isinstance(value, TensorRef):
        return [value.index]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in refs_of(v)]
    return []


def inputs_except(op: OpRecord, *names: str) -> list[TensorMeta]:
    """Input tensors not passed (only) through the named arguments."""
    skip = {i for name in names for i in refs_of(op.args.get(name))}
    keep = {i for key, v in op.args.items() if key not in names for i in refs_of(v)}
    return [t for i, t in enumerate(op.inputs) if i not in skip or i in keep]


def tensor_arg(op: OpRecord, name: str) -> TensorMeta:
    """The tensor argument ``name`` that ``op``'s schema requires (``OpRecord.tensor``, typed as
    present). Nothing is checked: a trace that lacks it (a malformed file) fails where the rule
    reads it, with the AttributeError pricing reports as a rule unable to read its op."""
    return cast(TensorMeta, op.tensor(name))


def read_tensors(op: OpRecord) -> list[TensorMeta]:
    """Inputs an op reads: all tensor arguments except ``out=`` destinations."""
    outs = [k for k in out_args(op.name) if k in op.args]
    return inputs_except(op, *outs) if outs else list(op.inputs)


def written_tensors(op: OpRecord) -> list[TensorMeta]:
    """Outputs plus tensors mutated in place (void ops such as ``_foreach_add_`` return none)."""
    written = list(op.outputs)
    for name in mutated_args(op.name):
        written.extend(op.inputs[i] for i in refs_of(op.args.get(name)))
    return written


def io_bytes(op: OpRecord) -> tuple[int, int]:
    """(bytes read, bytes written), each tensor counted once."""
    return unique_bytes(read_tensors(op)), unique_bytes(written_tensors(op))


def out_numel(op: OpRecord) -> int:
    """Elements computed: the first output's, or the mutated ``self`` for in-place ops."""
    written = written_tensors(op)
    return written[0].unique_numel if written else 0


def compute_dtype(tensors: Iterable[TensorMeta]) -> str:
    """The floating dtype a kernel computes in: the first floating tensor's dtype."""
    first = ""
    for t in tensors:
        first = first or t.dtype
        if t.dtype.startswith(("float", "bfloat", "complex")):
            return t.dtype
    return first

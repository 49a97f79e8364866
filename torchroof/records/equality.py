"""Whether two traces record the same step: op for op the same overloads, shapes, strides,
dtypes, arguments, module paths and phases, and storages shared in the same pattern
(storage ids are numbered in the order a capture meets them, so two traces of one step
may number them differently; what is compared is which ops touch the same storage), with
the same roles and role bytes, parameter names and assumptions. How a trace whose repeated
layers were copied (:mod:`torchroof.capture.replay`) is held to the trace that ran every
layer."""

from __future__ import annotations

from typing import Any

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta
from torchroof.records.trace import Trace


def first_difference(full: Trace, other: Trace) -> str:
    """The first way ``other`` differs from ``full`` as one line; "" when they record the
    same step."""
    if len(full.ops) != len(other.ops):
        return f"{len(full.ops)} ops against {len(other.ops)}"
    numbering: list[dict[int, int]] = [{}, {}]
    for a, b in zip(full.ops, other.ops, strict=True):
        left, right = _canonical(a, numbering[0]), _canonical(b, numbering[1])
        if left != right:
            field = next(name for name, x, y in zip(_FIELDS, left, right, strict=True) if x != y)
            return f"op {a.index} ({a.name} in {a.module or 'no module'}): {field} differ"
    roles = [_roles(t, n) for t, n in zip((full, other), numbering, strict=True)]
    if roles[0] != roles[1]:
        return "the storages given roles (weights, gradients, KV cache) differ"
    if full.role_bytes != other.role_bytes:
        return f"role bytes differ: {full.role_bytes} against {other.role_bytes}"
    names = [_names(t, n) for t, n in zip((full, other), numbering, strict=True)]
    if names[0] != names[1]:
        return "the parameters the ops read are named otherwise"
    assumed = [
        [(a.op_index, a.module, a.what, a.kind) for a in t.assumptions] for t in (full, other)
    ]
    if assumed[0] != assumed[1]:
        return "the values capture had to assume differ"
    return ""


def _names(trace: Trace, numbering: dict[int, int]) -> list[tuple[int, str]]:
    """The names of the parameters the ops touch, by their place in the ops."""
    return sorted((numbering[sid], n) for sid, n in trace.parameters.items() if sid in numbering)


_FIELDS = ("names", "module paths", "phases", "synthetic marks", "inputs", "outputs", "arguments")


def _canonical(op: OpRecord, numbering: dict[int, int]) -> tuple[Any, ...]:
    def tensor(t: TensorMeta) -> tuple[Any, ...]:
        return (
            t.shape,
            t.stride,
            t.dtype,
            numbering.setdefault(t.storage, len(numbering)),
            t.offset,
        )

    return (
        op.name,
        op.module,
        op.phase,
        op.synthetic,
        tuple(map(tensor, op.inputs)),
        tuple(map(tensor, op.outputs)),
        repr(op.args),
    )


def _roles(trace: Trace, numbering: dict[int, int]) -> list[tuple[int, str]]:
    """The roles of the storages the ops touch, by their place in the ops."""
    return sorted((numbering[sid], role) for sid, role in trace.roles.items() if sid in numbering)

"""The one registry of cost rules, keyed by aten overload packet (``"aten.mm"``).

Like ``torch.utils.flop_counter.register_flop_formula``: one pure rule per packet,
registered by decorator, a second registration raises. Rules see an ``OpRecord`` (shapes,
dtypes, non-tensor args), never tensors. An op without a rule is still charged its input
and output bytes and marked ``counted=False`` (every op is accounted: never a silent zero).

Each registration also declares the op's :data:`OpKind`, the one classification the rest of
torchroof reads (fusion, column reductions, recompute, the optimizer step): there is no
second list of packet names to keep in step with this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple

import torch
from torchroof.counters.cost import ZERO, Cost, Unit
from torchroof.counters.tensors import compute_dtype, io_bytes, is_view_schema, read_tensors

from torchroof.records.ops import OpRecord

Rule = Callable[[OpRecord], Cost]

OpKind = Literal[
    "pointwise",
    "cast",
    "copy",
    "rearrange",
    "gather",
    "creation",
    "dropout",
    "reduction",
    "sum",
    "softmax",
    "norm",
    "norm_backward",
    "column_reduction",
    "loss",
    "matmul",
    "attention",
    "scatter",
    "foreach",
    "optimizer",
    "collective",
    "view",
    "metadata",
    "opaque",
]
"""What kind of kernel an op is, as the fusion stage (docs/concepts/fusion.md) sees it; declared
where its rule is registered. :data:`OP_KINDS` says how each kind is treated."""

OP_KINDS: dict[OpKind, str] = {
    "pointwise": "elementwise arithmetic, activations and their backward, in-place forms, "
    "fills (add, mul, silu, gelu, pow, where, fill_): fused with the ops it shares data "
    "with; a compiled backward rebuilds a cheap forward pointwise tensor instead of reading "
    "it (torchroof/kernels/recompute.py); an optimizer step's elementwise update",
    "cast": "a dtype conversion (_to_copy): fused and rebuilt like pointwise (an fp32 "
    "upcast is never saved); the cross-entropy chain of loss='chunked' walks through it; "
    "elementwise in an optimizer step",
    "copy": "a copy of each element to the same index (clone, copy_): fused; saved, never "
    "rebuilt; the cross-entropy chain of loss='chunked' walks through it; elementwise in an "
    "optimizer step",
    "rearrange": "a copy that puts elements at computed positions, or constants around them "
    "(cat, constant_pad_nd, tril, repeat, flip, roll, a view's gradient slice_backward, "
    "nll_loss_backward's one-hot gradient): fused as index arithmetic in a neighbour's loop; "
    "saved, never rebuilt",
    "gather": "an indexed load (index, index_select, gather): fused into its consumer's "
    "loop, charged the rows it reads",
    "creation": "writes a tensor from a shape, a scalar or a random draw (zeros_like, "
    "arange, randn): fused; reads its template's shape, never its values; in an optimizer "
    "step, state initialisation (a first step)",
    "dropout": "native_dropout and its backward: fused like pointwise, but the mask is "
    "drawn at random, so the output is saved, never rebuilt",
    "reduction": "a reduction along rows (amax, var, logsumexp, a softmax's backward) and "
    "the norms whose statistics run over channels or groups (batch, group norm): fused with "
    "its producers and consumers; its output is saved, never rebuilt",
    "sum": "sum and mean: a reduction; over leading dimensions that keep the last one (a "
    "bias gradient) a column reduction, split as Inductor splits it "
    "(torchroof/kernels/column_reductions.py)",
    "softmax": "softmax and log-softmax forward: fused; rebuilt from its input and two fp32 "
    "row statistics (max, log-sum-exp) that its kernel writes instead of the output",
    "norm": "a norm over the last dimension (layer norm, RMS norm) forward: fused; its "
    "output is rebuilt from its input and the per-row statistics it writes",
    "norm_backward": "the backward of a norm over the last dimension: fused; its "
    "weight and bias gradients are split off as column reductions",
    "column_reduction": "the synthetic kernels of a split column reduction "
    "(torchroof.column_*): they run in their own loop order, fusing with a row kernel only "
    "as a mix-order partial, and inline any pointwise producer",
    "loss": "the negative log-likelihood's target gather (nll_loss_forward): its own "
    "kernel, which reads the log-probabilities at the targets only, so it can rebuild a "
    "cheap forward log-softmax there; loss='chunked' takes it into the LM head's kernel",
    "matmul": "a dense GEMM (mm, addmm, bmm, baddbmm): its own kernel, named after it when "
    "it leads a group; with epilogue=True it absorbs the elementwise ops that only consume "
    "its output; the LM head of loss='chunked'",
    "attention": "a fused attention kernel (flash, efficient, cuDNN, MLA decode): its own "
    "kernel, named after it when it leads a group; attention='math' prices the SDPA ones as "
    "the naive kernel",
    "scatter": "a write at data-dependent positions (index_put_, scatter_add_, an "
    "embedding's backward): its own kernel",
    "foreach": "a _foreach_ elementwise op over a list of tensors (torch.optim's foreach "
    "path): its own kernel; an optimizer step's elementwise update",
    "optimizer": "a fused optimizer kernel (_fused_adamw_, torchroof.fused_optimizer_step): "
    "its own kernel",
    "collective": "a collective over the network (all-reduce, all-gather, reduce-scatter): "
    "its own kernel, never fused with compute",
    "view": "an alias of its input (view, transpose, slice): no kernel, no bytes",
    "metadata": "allocation, metadata queries, asserts, profiler markers: no kernel; an "
    "allocation (empty_like) then updated in place initialises optimizer state",
    "opaque": "its own kernel, which fusion neither joins nor extends: scans, sorts, GEMVs "
    "and other library calls, ops whose fusion is not modelled (an NB where they are "
    "registered), and every op without a rule",
}
"""How torchroof treats each :data:`OpKind` (fusion, recompute, column reductions, the
optimizer step)."""


class Registration(NamedTuple):
    """A packet's cost rule and its declared kind."""

    rule: Rule
    kind: OpKind


_REGISTRY: dict[str, Registration] = {}
_VERSION = 0  # bumped by every registration (registry_version)


class DuplicateRuleError(ValueError):
    """Raised when a packet already has a rule."""


def register(*packets: str, kind: OpKind) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each packet name (``"aten.mm"``; no overload suffix) as an op
    of ``kind`` (see :data:`OP_KINDS`). Decorators stack, one kind each, when one rule
    prices packets that fuse differently."""
    if kind not in OP_KINDS:
        raise ValueError(f"unknown op kind {kind!r}; expected one of {', '.join(OP_KINDS)}")

    def decorate(rule: Rule) -> Rule:
        for packet in packets:
            if packet.count(".") != 1:
                raise ValueError(f"register packets as 'namespace.op', got {packet!r}")
            if packet in _REGISTRY:
                raise DuplicateRuleError(
                    f"{packet} already has a rule: {_REGISTRY[packet].rule.__name__}"
                )
            _REGISTRY[packet] = Registration(rule, kind)
        global _VERSION
        _VERSION += 1
        return rule

    return decorate


def registry_version() -> int:
    """A number that changes whenever a rule is registered: kernels worked out under one
    version are stale under another (an op priced as uncounted may now have a rule)."""
    return _VERSION


def aten_packets(*names: str) -> list[str]:
    """``aten.<name>`` for each name this torch defines (newer ops are skipped on older
    torch rather than failing at import)."""
    return [f"aten.{n}" for n in names if hasattr(torch.ops.aten, n)]


def register_per_element(
    table: Mapping[str, int | tuple[int, Unit]],
    *,
    kind: OpKind,
    elements: Callable[[OpRecord], int],
    what: str,
    unit: Unit = "vector",
    prefix: str = "",
    in_place: bool = True,
) -> None:
    """Register ``W = f · elements(op)``, inputs read once, outputs written once, for every
    ``name: f`` (or ``name: (f, unit)``) in ``table``, each an op of ``kind``; ``in_place``
    adds ``name_`` where this torch has it. ``what`` names the table in each rule's
    docstring."""
    for name, entry in table.items():
        flops, op_unit = entry if isinstance(entry, tuple) else (entry, unit)
        variants = (name, f"{name}_") if in_place else (name,)
        packets = aten_packets(*(prefix + v for v in variants))
        if not packets:
            continue

        def rule(op: OpRecord, flops: int = flops, op_unit: Unit = op_unit) -> Cost:
            read, written = io_bytes(op)
            dtype = compute_dtype(read_tensors(op))
            return Cost(flops * elements(op), read, written, op_unit, dtype)

        rule.__name__ = f"{prefix}{name}"
        rule.__doc__ = f"{prefix}{name}: {flops} FLOP per element on the {op_unit} unit ({what})."
        register(*packets, kind=kind)(rule)


def rule_for(packet: str) -> Rule | None:
    registration = _REGISTRY.get(packet)
    return registration.rule if registration is not None else None


def kind_of(packet: str) -> OpKind:
    """The declared kind of ``packet`` (``"aten.mm"``); an op without a rule is opaque: it
    is charged its bytes and never fused (a view-schema op without a rule costs nothing, so
    it launches nothing whatever its kind)."""
    registration = _REGISTRY.get(packet)
    return registration.kind if registration is not None else "opaque"


def registered_packets() -> frozenset[str]:
    return frozenset(_REGISTRY)


def uncounted_cost(op: OpRecord) -> Cost:
    """Fallback for an op without a rule: its input and output bytes, flagged uncounted."""
    read, written = io_bytes(op)
    return Cost(0, read, written, "none", "", counted=False)


def cost_of(op: OpRecord) -> Cost:
    """W and compulsory Q of one recorded op."""
    registration = _REGISTRY.get(op.packet)
    if registration is not None:
        return registration.rule(op)
    if is_view_schema(op.name):
        return ZERO  # views cost nothing, whatever their namespace
    return uncounted_cost(op)

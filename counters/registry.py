"""The one registry of cost rules, keyed by aten overload packet (``"aten.mm"``).

Like ``torch.utils.flop_counter.register_flop_formula``: one pure rule per packet,
registered by decorator, a second registration raises. Rules see an ``OpRecord`` (shapes,
dtypes, non-tensor args), never tensors. An op without a rule is still charged its input
and output bytes and marked ``counted=False`` (DESIGN rule 1: never a silent zero).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torchroof.counters.cost import ZERO, Cost, Unit
from torchroof.counters.tensors import compute_dtype, io_bytes, is_view_schema, read_tensors

from torchroof.records import OpRecord

Rule = Callable[[OpRecord], Cost]

_RULES: dict[str, Rule] = {}


class DuplicateRuleError(ValueError):
    """Raised when a packet already has a rule."""


def register(*packets: str) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each packet name (``"aten.mm"``; no overload suffix)."""

    def decorate(rule: Rule) -> Rule:
        for packet in packets:
            if packet.count(".") != 1:
                raise ValueError(f"register packets as 'namespace.op', got {packet!r}")
            if packet in _RULES:
                raise DuplicateRuleError(f"{packet} already has a rule: {_RULES[packet].__name__}")
            _RULES[packet] = rule
        return rule

    return decorate


def aten_packets(*names: str) -> list[str]:
    """``aten.<name>`` for each name this torch defines (newer ops are skipped on older
    torch rather than failing at import)."""
    return [f"aten.{n}" for n in names if hasattr(torch.ops.aten, n)]


def register_per_element(
    table: Mapping[str, int | tuple[int, Unit]],
    *,
    elements: Callable[[OpRecord], int],
    what: str,
    unit: Unit = "vector",
    prefix: str = "",
    in_place: bool = True,
) -> None:
    """Register ``W = f · elements(op)``, inputs read once, outputs written once, for every
    ``name: f`` (or ``name: (f, unit)``) in ``table``; ``in_place`` adds ``name_`` where this
    torch has it. ``what`` names the table in each rule's docstring."""
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
        register(*packets)(rule)


def rule_for(packet: str) -> Rule | None:
    return _RULES.get(packet)


def registered_packets() -> frozenset[str]:
    return frozenset(_RULES)


def uncounted_cost(op: OpRecord) -> Cost:
    """Fallback for an op without a rule: its input and output bytes, flagged uncounted."""
    read, written = io_bytes(op)
    return Cost(0, read, written, "none", "", counted=False)


def cost_of(op: OpRecord) -> Cost:
    """W and compulsory Q of one recorded op."""
    rule = _RULES.get(op.packet)
    if rule is not None:
        return rule(op)
    if is_view_schema(op.name):
        return ZERO  # DESIGN rule 2: views cost nothing, whatever their namespace
    return uncounted_cost(op)

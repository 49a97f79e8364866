"""Cost rules: one pure rule per aten overload packet -> ``Cost(W, Q, unit)``.

Importing this package registers every rule. ``cost_of(op)`` prices one ``OpRecord``;
``kind_of(packet)`` is the kind its registration declared (``OP_KINDS`` says how fusion
treats each).
"""

from torchroof.counters import (  # noqa: F401  (imported for their registrations)
    attention,
    collectives,
    losses,
    matmul,
    memory,
    norms,
    optimizers,
    pointwise,
    quantized,
    reductions,
)
from torchroof.counters.cost import ZERO, Cost, Unit
from torchroof.counters.registry import (
    OP_KINDS,
    DuplicateRuleError,
    OpKind,
    cost_of,
    kind_of,
    register,
    registered_packets,
    registry_version,
    rule_for,
)

__all__ = [
    "OP_KINDS",
    "ZERO",
    "Cost",
    "DuplicateRuleError",
    "OpKind",
    "Unit",
    "cost_of",
    "kind_of",
    "register",
    "registered_packets",
    "registry_version",
    "rule_for",
]

"""Cost rules: one pure rule per aten overload packet -> ``Cost(W, Q, unit)``.

Importing this package registers every rule. ``cost_of(op)`` prices one ``OpRecord``.
"""

from torchroof.counters import (  # noqa: F401  (imported for their registrations)
    attention,
    losses,
    matmul,
    memory,
    norms,
    optimizers,
    pointwise,
    reductions,
)
from torchroof.counters.cost import ZERO, Cost, Unit
from torchroof.counters.registry import (
    DuplicateRuleError,
    cost_of,
    register,
    registered_packets,
    rule_for,
)

__all__ = [
    "ZERO",
    "Cost",
    "DuplicateRuleError",
    "Unit",
    "cost_of",
    "register",
    "registered_packets",
    "rule_for",
]

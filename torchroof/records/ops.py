"""One recorded aten op (OpRecord), the phases of a step and the rows ops are grouped into."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from torchroof.records.tensors import TensorMeta, TensorRef

Phase = Literal["forward", "backward", "recompute", "optimizer"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute", "optimizer")

TOP_LEVEL = "(top level)"  # row of ops run outside any module
OPTIMIZER = "optimizer"  # row of the optimizer step


def layer_key(module: str, phase: str, depth: int | None = None) -> str:
    """Row a kernel belongs to.

    Default (``depth=None``): the repeated block, i.e. the module path up to its first
    numeric component (``model.layers.3``), else the innermost module (``lm_head``).
    ``depth=k`` keeps the first k components of the path instead.
    """
    if phase == OPTIMIZER:
        return OPTIMIZER
    if not module:
        return TOP_LEVEL
    parts = module.split(".")
    if depth is not None:
        return ".".join(parts[: max(depth, 1)])
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return module


def block_index(name: str) -> tuple[str, int] | None:
    """(``model.layers``, 3) for a numbered block ``model.layers.3``; None for any other
    name."""
    head, _, tail = name.rpartition(".")
    return (head, int(tail)) if head and tail.isdigit() else None


def stack_key(name: str) -> str:
    """The stack a numbered block belongs to (``model.layers.3`` -> ``model.layers.*``);
    any other row name as it is."""
    index = block_index(name)
    return f"{index[0]}.*" if index else name


@cache
def _split_name(name: str) -> tuple[str, ...]:
    """(packet, overload) of an op name (a few hundred distinct names in any trace)."""
    return tuple(name.rsplit(".", 1))


@dataclass(slots=True)
class OpRecord:
    """One aten op as it ran: its overload, tensors, non-tensor arguments and context."""

    index: int  # position in execution order
    name: str  # aten overload, e.g. "aten.mm.default"
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    args: dict[str, Any]  # schema argument name -> value; tensors appear as TensorRef
    module: str  # innermost module's qualified name ("" = outside any module)
    phase: Phase
    synthetic: bool = False  # True when capture emitted it in place of a decomposition

    @property
    def packet(self) -> str:
        """The overload packet (``aten.mm``), which is what rules are registered for."""
        return _split_name(self.name)[0]

    @property
    def overload(self) -> str:
        return _split_name(self.name)[1]

    def arg(self, name: str, default: Any = None) -> Any:
        """A non-tensor argument by schema name; tensor arguments come back as TensorMeta."""
        value = self.args.get(name, default)
        return self._resolve(value)

    def tensor(self, name: str) -> TensorMeta | None:
        value = self.args.get(name)
        return self.inputs[value.index] if isinstance(value, TensorRef) else None

    def tensors(self, name: str) -> list[TensorMeta]:
        """A ``Tensor[]`` argument (``_foreach_*``, ``cat``) as TensorMetas; [] when absent."""
        value = self.args.get(name)
        if isinstance(value, TensorRef):
            return [self.inputs[value.index]]
        if isinstance(value, (list, tuple)):
            return [self.inputs[v.index] for v in value if isinstance(v, TensorRef)]
        return []

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, TensorRef):
            return self.inputs[value.index]
        if isinstance(value, (list, tuple)) and any(isinstance(v, TensorRef) for v in value):
            return [self._resolve(v) for v in value]
        return value

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "i": self.index,
            "op": self.name,
            "in": [t.to_json() for t in self.inputs],
            "out": [t.to_json() for t in self.outputs],
            "args": {k: _args_to_json(v) for k, v in self.args.items()},
            "module": self.module,
            "phase": self.phase,
        }
        if self.synthetic:
            data["synthetic"] = True
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpRecord:
        return cls(
            index=data["i"],
            name=data["op"],
            inputs=tuple(TensorMeta.from_json(t) for t in data["in"]),
            outputs=tuple(TensorMeta.from_json(t) for t in data["out"]),
            args={k: _args_from_json(v) for k, v in data["args"].items()},
            module=data["module"],
            phase=data["phase"],
            synthetic=data.get("synthetic", False),
        )


def _args_to_json(value: Any) -> Any:
    if isinstance(value, TensorRef):
        return {"$t": value.index}
    if isinstance(value, (list, tuple)):
        return [_args_to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"$f": repr(value)}
    return value


def _args_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "$t" in value:
            return TensorRef(value["$t"])
        if "$f" in value:
            return float(value["$f"])
    if isinstance(value, list):
        return [_args_from_json(v) for v in value]
    return value

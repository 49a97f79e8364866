"""The recorded facts of a traced step: tensors, ops and the trace that holds them.

Everything here is plain data (no torch tensors), so a trace can be written to JSON and
estimated again on other hardware without re-running the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

Phase = Literal["forward", "backward", "recompute", "optimizer"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute", "optimizer")

TOP_LEVEL = "(top level)"  # row of ops run outside any module
OPTIMIZER = "optimizer"  # row of the optimizer step

Role = Literal["weights", "gradients", "optimizer_state", "kv_cache"]
ROLES: tuple[Role, ...] = ("weights", "gradients", "optimizer_state", "kv_cache")
"""What a storage holds; every storage without a role holds activations."""

TRACE_FORMAT_VERSION = 1


@cache
def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype named without the ``torch.`` prefix."""
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch_dtype.itemsize


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


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, layout and storage identity of one tensor an op touched."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    storage: int  # storage id, unique within one trace
    offset: int = 0  # storage offset in elements

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def unique_numel(self) -> int:
        """Distinct elements addressed: a broadcast (stride-0) dimension is read once."""
        count = 1
        for size, step in zip(self.shape, self.stride, strict=True):
            if size == 0:
                return 0
            if step:
                count *= size
        return count

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Compulsory bytes to read or write this tensor once (unique elements only)."""
        return self.unique_numel * self.itemsize

    def to_json(self) -> list[Any]:
        return [list(self.shape), list(self.stride), self.dtype, self.storage, self.offset]

    @classmethod
    def from_json(cls, data: list[Any]) -> TensorMeta:
        shape, stride, dtype, storage, offset = data
        return cls(tuple(shape), tuple(stride), dtype, storage, offset)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor argument inside ``OpRecord.args``: an index into ``OpRecord.inputs``."""

    index: int


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
        return self.name.rsplit(".", 1)[0]

    @property
    def overload(self) -> str:
        return self.name.rsplit(".", 1)[1]

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


@dataclass(frozen=True, slots=True)
class Assumption:
    """A value capture had to invent (e.g. ``Tensor.item()`` on meta), kept for the report."""

    op_index: int
    module: str
    what: str


@dataclass
class Trace:
    """Every aten op of a step in execution order, plus what capture had to assume.

    ``parameters`` maps storage ids of ``nn.Parameter``s seen during capture to their
    qualified names; ``roles`` maps storage ids to what they hold (weights, gradients,
    optimizer state, KV cache) and ``role_bytes`` sums each role's storage bytes, so later
    stages can label traffic and size the memory footprint.
    """

    ops: list[OpRecord] = field(default_factory=list)
    assumptions: list[Assumption] = field(default_factory=list)
    parameters: dict[int, str] = field(default_factory=dict)
    roles: dict[int, Role] = field(default_factory=dict)
    role_bytes: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def estimate(self, hardware: Any = "h100-sxm", **options: Any) -> Any:
        """Price every op and time it with the roofline on ``hardware`` (name, alias, path
        or HardwareSpec). Options are those of :class:`torchroof.roofline.RooflineOptions`."""
        from torchroof.pipeline import estimate_trace

        return estimate_trace(self, hardware, **options)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "torchroof-trace",
            "version": TRACE_FORMAT_VERSION,
            "metadata": self.metadata,
            "parameters": {str(k): v for k, v in self.parameters.items()},
            "roles": {str(k): v for k, v in self.roles.items()},
            "role_bytes": self.role_bytes,
            "assumptions": [[a.op_index, a.module, a.what] for a in self.assumptions],
            "ops": [op.to_json() for op in self.ops],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        if data.get("format") != "torchroof-trace":
            raise ValueError("not a torchroof trace (missing format marker)")
        if data.get("version") != TRACE_FORMAT_VERSION:
            raise ValueError(
                f"trace format version {data.get('version')} is not supported "
                f"(this torchroof reads version {TRACE_FORMAT_VERSION})"
            )
        return cls(
            ops=[OpRecord.from_json(op) for op in data["ops"]],
            assumptions=[Assumption(*a) for a in data["assumptions"]],
            parameters={int(k): v for k, v in data["parameters"].items()},
            roles={int(k): v for k, v in data["roles"].items()},
            role_bytes=dict(data["role_bytes"]),
            metadata=data["metadata"],
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_dict(json.loads(Path(path).read_text()))

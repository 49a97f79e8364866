"""The trace of a step: every op in order, what capture assumed, and what each storage holds.

Everything here is plain data (no torch tensors), so a trace can be written to JSON and
estimated again on other hardware without re-running the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchroof.records.assumptions import Assumption, AssumptionKind
from torchroof.records.facts import StepFacts
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import Role
from torchroof.records.trace_file import TRACE_FORMAT_VERSION, TraceFileError, trace_problems


def _legacy_kind(what: str) -> AssumptionKind:
    """The kind of an assumption saved before kinds were recorded (format <= 2), from the
    only three sentences capture then wrote for routed tokens."""
    routed = what.startswith(("nonzero of", "boolean mask", "Tensor.tolist()"))
    return "routing" if routed else "scalar"


@dataclass(frozen=True)
class CopiedSpan:
    """``count`` ops from ``first`` on are a copy of those from ``source`` on: a repeated
    layer given its representative's ops under its own module path and storages
    (:mod:`torchroof.capture.replay`), so pricing may build its kernels once; or a training
    step's micro-batch given the ops of one before it (:mod:`torchroof.workloads.
    microbatches`), whose own ops may hold layer copies."""

    first: int
    count: int
    source: int


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
    facts: StepFacts = field(default_factory=StepFacts)
    # which ops are copies of which (not saved: a loaded trace is priced op by op)
    copies: list[CopiedSpan] = field(default_factory=list, compare=False, repr=False)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "torchroof-trace",
            "version": TRACE_FORMAT_VERSION,
            "op_count": len(self.ops),
            "metadata": self.facts.to_dict(),
            "parameters": {str(k): v for k, v in self.parameters.items()},
            "roles": {str(k): v for k, v in self.roles.items()},
            "role_bytes": self.role_bytes,
            "assumptions": [[a.op_index, a.module, a.what, a.kind] for a in self.assumptions],
            "ops": [op.to_json() for op in self.ops],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """The trace a :meth:`to_dict` wrote, checked before anything is built.

        Refused with a :class:`TraceFileError` listing every problem found: not a JSON
        object or no ``"format": "torchroof-trace"`` marker; a format version that is newer
        than this torchroof or unknown; no version at all (no torchroof ever wrote such a
        file: it was written or edited by hand; re-save the trace with this torchroof,
        ``Trace.save`` or ``torchroof estimate ... --save-trace PATH``); a missing field; an
        op count other than the one recorded at save time (ops deleted or added); an op
        whose name is not an overload name, whose tensors are not ``[shape, stride, dtype,
        storage, offset]`` with integer shape and stride of one length and a known dtype,
        whose phase is not one of ``PHASES``, whose tensor arguments point at no input, or
        whose position (``i``) does not follow the op before it. Version 1 files (saved
        before the op count was recorded) are read with every check but the count: their
        completeness is assumed.
        """
        problems = trace_problems(data)
        if problems:
            raise TraceFileError(problems)
        return cls(
            ops=[OpRecord.from_json(op) for op in data["ops"]],
            assumptions=[
                Assumption(*a) if len(a) == 4 else Assumption(a[0], a[1], a[2], _legacy_kind(a[2]))
                for a in data["assumptions"]
            ],
            parameters={int(k): v for k, v in data["parameters"].items()},
            roles={int(k): v for k, v in data["roles"].items()},
            role_bytes=dict(data["role_bytes"]),
            facts=StepFacts.from_dict(data["metadata"]),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace :meth:`save` wrote; :class:`TraceFileError` (a ``ValueError``)
        naming the file if it cannot be read, is not JSON or fails :meth:`from_dict`."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as error:
            raise TraceFileError([f"cannot read it: {error.strerror or error}"], path) from error
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise TraceFileError([f"not valid JSON: {error}"], path) from error
        try:
            return cls.from_dict(data)
        except TraceFileError as error:
            raise TraceFileError(error.problems, path) from None

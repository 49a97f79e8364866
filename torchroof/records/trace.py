"""The recorded facts of a traced step: tensors, ops and the trace that holds them.

Everything here is plain data (no torch tensors), so a trace can be written to JSON and
estimated again on other hardware without re-running the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
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

TRACE_FORMAT_VERSION = 3
"""Written by ``Trace.save``. 3: each assumption carries its kind. 2: the op count is
recorded (``op_count``) and checked on load. 1: no count; still read, with every check but
the count (see :meth:`Trace.from_dict`)."""
OLDEST_TRACE_FORMAT_VERSION = 1
PROBLEMS_LISTED = 5  # problems a TraceFileError message lists before "and N more"
MAX_TENSOR_ELEMENTS = 2**53  # elements one saved tensor may hold (exact in a float)
_TRACE_REGIMES = ("prefill", "decode", "train")  # the regimes a saved step can be from
_PARALLEL_DEGREES = ("tp", "fsdp", "ep", "cp")  # a degree > 1 records collectives


class TraceFileError(ValueError):
    """A saved trace that cannot be read as one: every problem found, in one exception.

    ``problems`` lists them all; the message (one line) names the file and lists the first
    ``PROBLEMS_LISTED``::

        trace PATH: PROBLEM
        trace PATH: N problems: PROBLEM; PROBLEM; ...; and K more
    """

    def __init__(self, problems: list[str], path: str | Path | None = None) -> None:
        self.problems = list(problems)
        self.path = path
        where = "trace" if path is None else f"trace {path}"
        if len(self.problems) == 1:
            message = f"{where}: {self.problems[0]}"
        else:
            listed = self.problems[:PROBLEMS_LISTED]
            rest = len(self.problems) - len(listed)
            message = f"{where}: {len(self.problems)} problems: " + "; ".join(listed)
            message += f"; and {rest} more" if rest else ""
        super().__init__(message)


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


AssumptionKind = Literal["scalar", "routing", "selection"]
ASSUMPTION_KINDS: tuple[AssumptionKind, ...] = ("scalar", "routing", "selection")
"""What capture invented: ``scalar``, a ``Tensor.item()`` / ``tolist()`` answer (a mask
check, a step count); ``routing``, which tokens an expert router selects (``nonzero`` or a
boolean mask of a one-hot of expert indices, ``tolist()`` of expert counts): the
balanced-routing answer of :mod:`torchroof.capture.routing`; ``selection``, any other
data-dependent selection (a vocabulary shard's out-of-range tokens), answered with every
row selected."""


@dataclass(frozen=True, slots=True)
class Assumption:
    """A value capture had to invent (e.g. ``Tensor.item()`` on meta), kept for the report."""

    op_index: int
    module: str
    what: str
    kind: AssumptionKind = "scalar"


def _legacy_kind(what: str) -> AssumptionKind:
    """The kind of an assumption saved before kinds were recorded (format <= 2), from the
    only three sentences capture then wrote for routed tokens."""
    routed = what.startswith(("nonzero of", "boolean mask", "Tensor.tolist()"))
    return "routing" if routed else "scalar"


@dataclass
class StepFacts:
    """What the stage that traced a step tells the stages after it (pricing, the report).

    Every field is optional: a step traced by hand (``with torchroof.trace()``) has none.
    """

    model: str = ""  # the model as it was named (a shipped name, a path, a class)
    build_note: str = ""  # how the model was built when not as asked (its text part only)
    positions: str = ""  # set when positions beyond the model's maximum were allowed
    defaults: str = ""  # a default the model changed (seq: GPT-2's 1024 for 4096)
    workload: dict[str, Any] = field(default_factory=dict)  # the Workload's fields
    tokens: int = 0  # tokens the step processes (decode: one per sequence)
    cache: str = ""  # the cache an inference step used: static, dynamic, model, none, ...
    cache_fallback: str = ""  # why it is not the cache that was asked for
    kv_cache_tokens: int = 0  # positions the cache holds after the step
    mla: str = ""  # "absorbed" when latent attention decoded over the latent cache
    optimizer: str = ""  # train: the optimizer
    precision: str = ""  # train: bf16, fp16, fp32 or mixed
    parameters: int = 0  # train: trainable parameters
    dtype: str = ""  # the dtype a step traced from a saved file is re-labelled in
    pipeline: dict[str, Any] = field(default_factory=dict)  # a pipeline stage's split and marks
    quant: str = ""  # which linear layers a quantisation recipe changed, and how

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (an empty string, dict or 0 is left out)."""
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepFacts:
        return cls(**data)


def _facts_problems(data: Any) -> list[str]:
    if not isinstance(data, dict):
        return [f'"metadata" is {_kind(data)}, not an object']
    problems: list[str] = []
    for f in fields(StepFacts):
        if f.name not in data:
            continue
        value, wanted = data[f.name], f.type
        ok = {
            "str": isinstance(value, str),
            "int": _is_int(value),
            "dict[str, Any]": isinstance(value, dict),
        }[wanted]
        if not ok:
            problems.append(f'"metadata"."{f.name}" is {_show(value)}, not {wanted}')
    known = {f.name for f in fields(StepFacts)}
    problems += [f'"metadata" has an unknown field {_show(k)}' for k in data if k not in known]
    return problems


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
        problems = _trace_problems(data)
        if problems:
            raise TraceFileError(problems)
        return cls(
            ops=[OpRecord.from_json(op) for op in data["ops"]],
            assumptions=[
                Assumption(*a) if len(a) == 4 else Assumption(*a, kind=_legacy_kind(a[2]))
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


# -- checking a saved trace ---------------------------------------------------------------

_TRACE_FIELDS = ("metadata", "parameters", "roles", "role_bytes", "assumptions", "ops")
_OP_FIELDS = ("i", "op", "in", "out", "args", "module", "phase")


def _show(value: Any, limit: int = 40) -> str:
    """A value as compact JSON, shortened, for a one-line message."""
    try:
        text = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), _show(value))


def _trace_problems(data: Any) -> list[str]:
    """Every problem of a would-be saved trace; [] when it can be built."""
    if not isinstance(data, dict):
        return [f"not a torchroof trace: the top level is {_kind(data)}, not an object"]
    if data.get("format") != "torchroof-trace":
        return ['not a torchroof trace (no "format": "torchroof-trace" marker)']
    version = data.get("version")
    readable = f"{OLDEST_TRACE_FORMAT_VERSION}-{TRACE_FORMAT_VERSION}"
    if version is None:
        return [
            "no format version (not written by torchroof's Trace.save); re-save it with this "
            "torchroof: Trace.save, or torchroof estimate MODEL ... --save-trace PATH"
        ]
    if _is_int(version) and version > TRACE_FORMAT_VERSION:
        return [
            f"format version {version} is newer than this torchroof reads ({readable}); "
            "upgrade torchroof, or re-save the trace with this one"
        ]
    if not _is_int(version) or version < OLDEST_TRACE_FORMAT_VERSION:
        return [f"unknown format version {_show(version)} (this torchroof reads {readable})"]

    problems: list[str] = []
    fields = _TRACE_FIELDS + (("op_count",) if version >= 2 else ())
    missing = [name for name in fields if name not in data]
    if missing:
        problems.append("missing " + ", ".join(f'"{name}"' for name in missing))
    ops = data.get("ops")
    if "ops" in data and not isinstance(ops, list):
        problems.append(f'"ops" is {_kind(ops)}, not a list')
    if isinstance(ops, list):
        count = data.get("op_count")
        if "op_count" in data and (not _is_int(count) or count < 0):
            problems.append(f'"op_count" is {_show(count)}, not a non-negative integer')
        elif _is_int(count) and count != len(ops):
            problems.append(f"{len(ops)} ops found, {count} recorded at save time")
        previous = -1
        for position, op in enumerate(ops):
            problems += _op_problems(position, op, previous)
            if isinstance(op, dict) and _is_int(op.get("i")):
                previous = op["i"]
        if not problems:  # capture numbers its ops 0, 1, 2, ...: a gap is ops deleted
            gap = next((n for n, op in enumerate(ops) if op["i"] != n), None)
            if gap is not None:
                problems.append(
                    f'ops[{gap}] ({ops[gap]["op"]}): "i" is {ops[gap]["i"]}, not {gap}: ops '
                    f"{gap}-{ops[gap]['i'] - 1} are missing (deleted from the file?)"
                )
    problems += _table_problems(data)
    if not problems:
        problems += _facts_against_ops(data)
    return problems


def _facts_against_ops(data: dict[str, Any]) -> list[str]:
    """The metadata checked against itself and against the ops it describes, so an edited
    file is refused rather than priced as a step it is not: the workload's regime and
    counts, the tokens (the batch for decode, batch x seq (x microbatches) otherwise, and
    no more than the ops embed), parallel degrees above 1 (a single-GPU trace records no
    collective), and each role's bytes against the storages its ops touch."""
    facts, ops = data["metadata"], data["ops"]
    workload = facts.get("workload", {})
    problems: list[str] = []
    if not workload:
        return problems
    regime = workload.get("regime")
    if regime is not None and regime not in _TRACE_REGIMES:
        problems.append(
            f'"metadata"."workload"."regime" is {_show(regime)}, not one of {list(_TRACE_REGIMES)}'
        )
    counts = ("batch", "seq", "context", "microbatches", "tp", "dp", "fsdp", "ep", "cp", "pp")
    bad = False
    for name in counts:
        value = workload.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            problems.append(
                f'"metadata"."workload"."{name}" is {_show(value)}, not a positive integer'
            )
            bad = True
    if problems or bad:
        return problems
    tokens = facts.get("tokens", 0)
    # the tokens a regime's step processes are the regime's to say: checked against the
    # workload by torchroof.pricing.trace_checks.recorded_tokens_problem when a trace is read
    if tokens and regime in _TRACE_REGIMES and workload.get("pp", 1) == 1:
        embedded = sum(
            math.prod(op["in"][1][0]) if len(op["in"]) > 1 else 0
            for op in ops
            if op["op"].startswith("aten.embedding.") and op["phase"] == "forward"
        )
        scale = workload.get("cp", 1) * workload.get("tp", 1) * workload.get("microbatches", 1)
        if embedded and tokens > embedded * scale:
            problems.append(
                f'"metadata"."tokens" is {tokens:,}, but the ops embed {embedded:,} tokens'
            )
    collectives = any("c10d" in op["op"] for op in ops)
    for name in _PARALLEL_DEGREES:
        degree = workload.get(name, 1)
        if degree > 1 and not collectives and workload.get("pp", 1) == 1:
            problems.append(
                f'"metadata"."workload"."{name}" is {degree}, but the ops hold no collective: '
                "the trace is of one GPU"
            )
    problems += _role_bytes_against_ops(data)
    return problems


def _role_bytes_against_ops(data: dict[str, Any]) -> list[str]:
    """``role_bytes`` of weights and KV cache against the extent of their storages in the
    ops (with room for storages no op reads: a few times the bytes seen, plus 1 MiB)."""
    roles = {int(k): v for k, v in data["roles"].items()}
    seen: dict[int, int] = {}
    for op in data["ops"]:
        for shape, stride, dtype, storage, offset in op["in"] + op["out"]:
            if storage not in roles or not all(shape):
                continue
            steps = zip(shape, stride, strict=True)
            extent = offset + 1 + sum((s - 1) * abs(st) for s, st in steps)
            seen[storage] = max(seen.get(storage, 0), extent * dtype_itemsize(dtype))
    touched: dict[str, int] = {}
    for storage, size in seen.items():
        touched[roles[storage]] = touched.get(roles[storage], 0) + size
    problems = []
    for role in ("weights", "kv_cache"):
        held = data["role_bytes"].get(role, 0)
        if held > 4 * touched.get(role, 0) + 2**20:
            problems.append(
                f'"role_bytes"."{role}" is {held:,} bytes, but the ops touch '
                f"{touched.get(role, 0):,} bytes of {role}"
            )
    return problems


def _table_problems(data: dict[str, Any]) -> list[str]:
    """Problems of the trace-wide fields: metadata, parameters, roles, role_bytes, assumptions."""
    problems: list[str] = []
    if "metadata" in data:
        problems += _facts_problems(data["metadata"])
    for name, allowed in (("parameters", None), ("roles", ROLES)):
        table = data.get(name, {})
        if not isinstance(table, dict):
            problems.append(f'"{name}" is {_kind(table)}, not an object')
            continue
        for key, value in table.items():
            if not key.lstrip("-").isdigit():
                problems.append(f'"{name}" key {_show(key)} is not a storage id (an integer)')
            elif allowed is None and not isinstance(value, str):
                problems.append(f'"{name}"[{key}] is {_show(value)}, not a name')
            elif allowed is not None and value not in allowed:
                problems.append(f'"{name}"[{key}] is {_show(value)}, not one of {list(allowed)}')
    role_bytes = data.get("role_bytes", {})
    if not isinstance(role_bytes, dict):
        problems.append(f'"role_bytes" is {_kind(role_bytes)}, not an object')
    else:
        for key, value in role_bytes.items():
            if key not in ROLES:
                problems.append(f'"role_bytes" key {_show(key)} is not one of {list(ROLES)}')
            elif not _is_int(value) or value < 0:
                problems.append(f'"role_bytes"[{key}] is {_show(value)}, not a byte count')
    assumptions = data.get("assumptions", [])
    if not isinstance(assumptions, list):
        problems.append(f'"assumptions" is {_kind(assumptions)}, not a list')
    else:
        for n, item in enumerate(assumptions):
            if not (
                isinstance(item, list)
                and len(item) in (3, 4)
                and _is_int(item[0])
                and isinstance(item[1], str)
                and isinstance(item[2], str)
                and (len(item) == 3 or item[3] in ASSUMPTION_KINDS)
            ):
                problems.append(
                    f"assumptions[{n}] is {_show(item)}, not [op index, module, what, kind] "
                    f"with a kind in {list(ASSUMPTION_KINDS)}"
                )
    return problems


def _op_problems(position: int, op: Any, previous: int) -> list[str]:
    """Problems of ``ops[position]``; ``previous`` is the index of the op before it."""
    if not isinstance(op, dict):
        return [f"ops[{position}] is {_kind(op)}, not an object"]
    name = op.get("op")
    where = f"ops[{position}]" + (f" ({name})" if isinstance(name, str) else "")
    missing = [key for key in _OP_FIELDS if key not in op]
    problems = [f"{where}: missing " + ", ".join(f'"{key}"' for key in missing)] if missing else []
    index = op.get("i")
    if "i" in op and not _is_int(index):
        problems.append(f'{where}: "i" is {_show(index)}, not an integer')
    elif "i" in op and index <= previous:
        problems.append(f'{where}: "i" is {index}, not above the op before\'s ({previous})')
    elif "i" in op and index < 0:
        problems.append(f'{where}: "i" is {index}, not a non-negative integer')
    if "op" in op:
        head, dot, tail = name.rpartition(".") if isinstance(name, str) else ("", "", "")
        if not (dot and head and tail):
            problems.append(
                f"{where}: name {_show(name)} is not an overload (e.g. aten.mm.default)"
            )
    if "module" in op and not isinstance(op["module"], str):
        problems.append(f'{where}: "module" is {_show(op["module"])}, not a string')
    if "phase" in op and op["phase"] not in PHASES:
        problems.append(f"{where}: phase {_show(op['phase'])} is not one of {list(PHASES)}")
    if "synthetic" in op and not isinstance(op["synthetic"], bool):
        problems.append(f'{where}: "synthetic" is {_show(op["synthetic"])}, not true/false')
    inputs = op.get("in")
    for key in ("in", "out"):
        if key not in op:
            continue
        tensors = op[key]
        if not isinstance(tensors, list):
            problems.append(f'{where}: "{key}" is {_kind(tensors)}, not a list of tensors')
            continue
        for n, tensor in enumerate(tensors):
            problems += [f"{where} {key}[{n}]: {p}" for p in _tensor_problems(tensor)]
    if "args" in op:
        args = op["args"]
        if not isinstance(args, dict):
            problems.append(f'{where}: "args" is {_kind(args)}, not an object')
        else:
            count = len(inputs) if isinstance(inputs, list) else 0
            for key, value in args.items():
                problems += [f"{where} args.{key}: {p}" for p in _arg_problems(value, count)]
            if not problems:
                problems += [f"{where}: {p}" for p in _rule_problems(op)]
    return problems


# The tensor arguments the cost rules of the ops below read, with the rank each must have
# (a rule reads their shapes, so a saved op without them, or of another rank, cannot be
# priced: it is refused naming the op and the argument).
_OPERAND_RANKS: dict[str, dict[str, int]] = {
    "aten.mm": {"self": 2, "mat2": 2},
    "aten._int_mm": {"self": 2, "mat2": 2},
    "aten._scaled_mm": {"self": 2, "mat2": 2},
    "aten.addmm": {"mat1": 2, "mat2": 2},
    "aten._addmm_activation": {"mat1": 2, "mat2": 2},
    "aten.bmm": {"self": 3, "mat2": 3},
    "aten.baddbmm": {"batch1": 3, "batch2": 3},
    "aten.addbmm": {"batch1": 3, "batch2": 3},
    "aten.mv": {"self": 2, "vec": 1},
    "aten.addmv": {"mat": 2, "vec": 1},
    **{  # (..., heads, length, head_dim): at least 3-d (a caller's [B, L, D] is one head)
        f"aten._scaled_dot_product_{kind}{suffix}": {"query": 3, "key": 3, "value": 3}
        for kind in (
            "flash_attention",
            "efficient_attention",
            "cudnn_attention",
            "flash_attention_for_cpu",
        )
        for suffix in ("", "_backward")
    },
    **{
        f"aten._{kind}_attention_{part}": {"query": 4, "key": 4, "value": 4}
        for kind in ("flash", "efficient")
        for part in ("forward", "backward")
    },
}
# the ops above whose operands may have more leading (batch) dimensions than their rank
_LEADING_DIMS_ALLOWED = {
    packet for packet in _OPERAND_RANKS if packet.startswith("aten._scaled_dot_product_")
}
# the inner dimensions of a product (argument, dim) pairs that must agree
_INNER_DIMS: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "aten.mm": (("self", 1), ("mat2", 0)),
    "aten.addmm": (("mat1", 1), ("mat2", 0)),
    "aten.bmm": (("self", 2), ("mat2", 1)),
    "aten.baddbmm": (("batch1", 2), ("batch2", 1)),
}


def _referenced(value: Any, found: set[int]) -> set[int]:
    if isinstance(value, dict) and "$t" in value:
        found.add(value["$t"])
    elif isinstance(value, list):
        for item in value:
            _referenced(item, found)
    return found


def _rule_problems(op: dict[str, Any]) -> list[str]:
    """An op that passes the structure check but that its cost rule cannot read: an input
    no argument refers to (arguments emptied or edited), an operand a rule reads missing,
    of the wrong rank, or whose inner dimension does not match its partner's."""
    inputs, args = op["in"], op["args"]
    if not isinstance(inputs, list):
        return []
    found: set[int] = set()
    for value in args.values():
        _referenced(value, found)
    unused = [n for n in range(len(inputs)) if n not in found]
    if unused:
        return [
            f"input {unused[0]} is referenced by no argument (args {_show(sorted(args))}; "
            "arguments emptied or edited)"
        ]
    packet = op["op"].rpartition(".")[0]
    problems: list[str] = []
    shapes: dict[str, list[int]] = {}
    for name, rank in _OPERAND_RANKS.get(packet, {}).items():
        ref = args.get(name)
        if not (isinstance(ref, dict) and _is_int(ref.get("$t"))):
            problems.append(f"argument {name!r} (a {rank}-d tensor its rule reads) is missing")
            continue
        tensor = inputs[ref["$t"]]
        shape = tensor[0] if isinstance(tensor, list) and tensor else []
        leading = packet in _LEADING_DIMS_ALLOWED
        if not isinstance(shape, list) or len(shape) < rank or (len(shape) > rank and not leading):
            needs = f"at least {rank}-d" if leading else f"{rank}-d"
            problems.append(
                f"argument {name!r} has shape {_show(shape)}: {len(shape)}-d, "
                f"its rule needs {needs}"
            )
        else:
            shapes[name] = shape
    inner = _INNER_DIMS.get(packet)
    if inner and not problems:
        (a, i), (b, j) = inner
        if shapes[a][i] != shapes[b][j]:
            problems.append(
                f"inner dimensions differ: {a} {_show(shapes[a])} and {b} {_show(shapes[b])}"
            )
    return problems


def _tensor_problems(data: Any) -> list[str]:
    """Problems of one ``TensorMeta.to_json`` record."""
    if not isinstance(data, list) or len(data) != 5:
        return [f"{_show(data)} is not [shape, stride, dtype, storage, offset]"]
    shape, stride, dtype, storage, offset = data
    problems = []
    shape_ok = isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)
    stride_ok = isinstance(stride, list) and all(_is_int(s) for s in stride)
    if not shape_ok:
        problems.append(f"shape {_show(shape)} is not a list of non-negative integers")
    if not stride_ok:
        problems.append(f"stride {_show(stride)} is not a list of integers")
    if shape_ok and stride_ok and len(shape) != len(stride):
        problems.append(f"shape {_show(shape)} and stride {_show(stride)} differ in length")
    if shape_ok and math.prod(shape) > MAX_TENSOR_ELEMENTS:
        problems.append(
            f"shape {_show(shape)} holds more than {MAX_TENSOR_ELEMENTS:.0e} elements "
            "(no device holds such a tensor)"
        )
    if stride_ok and any(abs(s) > MAX_TENSOR_ELEMENTS for s in stride):
        problems.append(f"stride {_show(stride)} is beyond any tensor's")
    if not isinstance(dtype, str) or not _known_dtype(dtype):
        problems.append(f"unknown dtype {_show(dtype)}")
    if not _is_int(storage):
        problems.append(f"storage {_show(storage)} is not an integer id")
    if not _is_int(offset) or offset < 0:
        problems.append(f"offset {_show(offset)} is not a non-negative integer")
    return problems


def _known_dtype(name: str) -> bool:
    try:
        dtype_itemsize(name)
    except ValueError:
        return False
    return True


def _arg_problems(value: Any, inputs: int) -> list[str]:
    """Problems of one argument as ``_args_to_json`` wrote it (``inputs``: the op's count)."""
    if isinstance(value, list):
        return [p for v in value for p in _arg_problems(v, inputs)]
    if not isinstance(value, dict):
        return []
    if "$t" in value:
        ref = value["$t"]
        if not _is_int(ref) or not 0 <= ref < inputs:
            return [f"tensor reference {_show(ref)} points at no input (the op has {inputs})"]
    elif "$f" in value:
        try:
            float(value["$f"])
        except (TypeError, ValueError):
            return [f"float {_show(value['$f'])} is not a number"]
    return []

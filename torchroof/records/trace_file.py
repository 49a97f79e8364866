"""The trace file format: its version, and the checks a saved trace passes before it is read."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from torchroof.config.checks import unknown_fields
from torchroof.config.choices import REGIMES
from torchroof.config.errors import first_line
from torchroof.config.workload import Workload
from torchroof.records.assumptions import ASSUMPTION_KINDS
from torchroof.records.facts import StepFacts
from torchroof.records.ops import PHASES
from torchroof.records.tensors import ROLES, dtype_itemsize

TRACE_FORMAT_VERSION = 3
"""Written by ``Trace.save``. 3: each assumption carries its kind. 2: the op count is
recorded (``op_count``) and checked on load. 1: no count; still read, with every check but
the count (see :meth:`Trace.from_dict`)."""
OLDEST_TRACE_FORMAT_VERSION = 1
PROBLEMS_LISTED = 5  # problems a TraceFileError message lists before "and N more"
MAX_TENSOR_ELEMENTS = 2**53  # elements one saved tensor may hold (exact in a float)
_TRACE_REGIMES = REGIMES  # the regimes a saved step can be from: every regime there is
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


def _facts_problems(data: Any) -> list[str]:
    if not isinstance(data, dict):
        return [f'"metadata" is {_kind(data)}, not an object']
    problems: list[str] = []
    for f in fields(StepFacts):
        if f.name not in data:
            continue
        value, wanted = data[f.name], str(f.type)  # a str: annotations are not evaluated
        saved_as_fields = ("Workload | None", "StageFacts | None")  # a dataclass, as its fields
        wanted = "dict[str, Any]" if wanted in saved_as_fields else wanted
        ok = {
            "str": isinstance(value, str),
            "int": _is_int(value),
            "float": _is_number(value),
            "bool": isinstance(value, bool),
            "dict[str, Any]": isinstance(value, dict),
        }[wanted]
        if not ok:
            problems.append(f'"metadata"."{f.name}" is {_show(value)}, not {wanted}')
    known = {f.name for f in fields(StepFacts)}
    problems += [f'"metadata" has an unknown field {_show(k)}' for k in data if k not in known]
    return problems


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


def _is_number(value: Any) -> bool:
    """A finite int or float (not a boolean): what a float fact may be saved as."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _kind(value: Any) -> str:
    kinds: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
    return kinds.get(type(value), _show(value))


def trace_problems(data: Any) -> list[str]:
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
        count: Any = data.get("op_count")
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
    if not problems:
        problems += _workload_problems(workload)
    problems += _role_bytes_against_ops(data)
    return problems


def _workload_problems(workload: dict[str, Any]) -> list[str]:
    """The saved workload as the Workload the facts hold once read: a field this torchroof
    lacks, or a combination a Workload refuses (checked as one is made)."""
    if unknown := unknown_fields(Workload, workload):
        return [f'"metadata"."workload" has fields this torchroof lacks: {unknown}']
    try:
        Workload(**workload)
    except (TypeError, ValueError) as error:
        return [f'"metadata"."workload": {first_line(error)}']
    return []


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
    index: Any = op.get("i")
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

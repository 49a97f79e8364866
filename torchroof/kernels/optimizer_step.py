"""What a traced optimizer step holds and how a GPU would run it, read from the trace alone.

A training step traced by hand (``loss.backward(); opt.step()`` under ``torchroof.trace()``)
carries no labels beyond the parameters: capture knows which ops ran in the optimizer phase,
not which tensors are gradients or optimizer state. This module finds them:

- gradients: tensors the backward wrote that the optimizer reads (not parameters);
- optimizer state: tensors the optimizer updates in place that are neither parameters nor
  gradients, and that either existed before the trace (a steady-state step: ``exp_avg``,
  ``exp_avg_sq``, ``step``) or were made in the step by a creation op (a first step:
  ``zeros_like`` in ``_init_group``), which is *state initialisation*. Step counters count
  (4 B each): ``fused=True`` keeps them on the device.

On meta ``torch.optim`` runs its single-tensor path (a Python loop over parameters; foreach
needs CUDA tensors, ``fused=True`` a real device). Under the ``fused`` policy each parameter
group's update is priced as the one kernel ``fused=True`` launches on a GPU: the step's
elementwise ops are split into connected components (one per parameter on the single-tensor
path, one per group on the foreach path), components that run the same ops with the same
scalars on the same dtypes are one parameter group, and each group becomes a
``torchroof.fused_optimizer_step`` that reads every tensor it needs from outside once and
writes parameters and state once (AdamW fp32: 4·(2 + 1 + 2 + 2) = 28 B/param). Steps that
are not elementwise (Muon's Newton-Schulz, Adafactor's factored reductions) are left to
:mod:`torchroof.kernels.fusion` as traced.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from torchroof.counters import OpKind, cost_of, kind_of
from torchroof.counters.tensors import is_view_schema, read_tensors, written_tensors
from torchroof.records.ops import OPTIMIZER, OpRecord, Phase
from torchroof.records.tensors import TensorMeta, TensorRef, storage_extent_bytes
from torchroof.records.trace import Trace

FUSED_STEP = "torchroof.fused_optimizer_step.default"

# Kinds (counters/registry.py OP_KINDS) of the ops that make a tensor from nothing: in the
# optimizer phase, when the tensor is then updated in place, they initialise optimizer
# state (a first step). ``metadata`` holds the allocations (``empty_like``); its other ops
# return no new tensor.
_INIT_KINDS: frozenset[OpKind] = frozenset({"creation", "metadata"})
# What one fused optimizer kernel can do per element (elementwise ops, casts, copies,
# fills, and their _foreach_ forms).
_ELEMENTWISE_KINDS: frozenset[OpKind] = frozenset({"pointwise", "cast", "copy", "foreach"})


def _elementwise(op: OpRecord) -> bool:
    return kind_of(op.packet) in _ELEMENTWISE_KINDS


@dataclass
class _Group:
    """One parameter group of a traced step: the ops that update it and what they touch."""

    ops: list[OpRecord] = field(default_factory=list)
    params: int = 0  # parameter tensors updated
    folded: list[OpRecord] = field(default_factory=list)  # 0-d updates (step counters)


@dataclass
class OptimizerStep:
    """The optimizer phase of a trace, read from its ops (see the module docstring)."""

    roles: dict[int, str] = field(default_factory=dict)  # storages the trace did not label
    role_bytes: dict[str, int] = field(default_factory=dict)  # their bytes, per role
    init_ops: list[int] = field(default_factory=list)  # positions of state initialisation
    init_bytes: int = 0  # bytes those ops write
    groups: list[_Group] = field(default_factory=list)  # elementwise updates, per group
    single_tensor: bool = False  # torch.optim ran its per-parameter loop
    params: set[int] = field(default_factory=set)  # parameters the optimizer touched
    grads: set[int] = field(default_factory=set)  # gradients it read
    kept: set[int] = field(default_factory=set)  # outlive the step: written back when written

    @property
    def replaced_ops(self) -> int:
        return sum(len(g.ops) + len(g.folded) for g in self.groups)

    def assumptions(self, policy: str) -> list[str]:
        lines = []
        if self.init_ops:
            lines.append(
                f"optimizer: first step traced: {self.init_bytes:,} B of state initialisation "
                f"priced ({len(self.init_ops)} tensors created in the step); trace a second "
                "step for the steady state"
            )
        if self.groups and policy == "fused":
            params = sum(g.params for g in self.groups)
            lines.append(
                f"optimizer: the traced step ({self.replaced_ops} ops over {params} parameter "
                f"tensors) priced as {len(self.groups)} fused kernel(s), one per parameter "
                "group, as fused=True runs on a GPU: parameters, gradients and state read "
                "once, parameters and state written once; fusion='eager' prices the ops as "
                "traced"
            )
        elif self.single_tensor and policy == "eager":
            lines.append(
                "optimizer: torch.optim ran its per-parameter loop on meta (foreach needs CUDA "
                "tensors): one launch per op and parameter, where a GPU's default foreach "
                "path launches one per op and group (same bytes); pass foreach=True to trace "
                "that path"
            )
        return lines


def analyse(trace: Trace) -> OptimizerStep:
    """Gradients, optimizer state, state initialisation and parameter groups of every
    optimizer step in ``trace`` (nothing when it has none)."""
    ops = trace.ops
    runs = _optimizer_runs(ops)
    result = OptimizerStep()
    if not runs:
        return result
    params = set(trace.parameters) | {s for s, r in trace.roles.items() if r == "weights"}
    existed: dict[int, bool] = {}  # storage -> first touched as an input (made before)
    widest: dict[int, TensorMeta] = {}
    written_backward: set[int] = set()
    for op in ops:
        for t in op.inputs:
            existed.setdefault(t.storage, True)
            _widen(widest, t)
        for t in op.outputs:
            existed.setdefault(t.storage, False)
            _widen(widest, t)
        if op.phase == "backward" and not is_view_schema(op.name):
            written_backward.update(t.storage for t in written_tensors(op))
    derived: dict[int, str] = {}
    run_of: dict[int, int] = {}  # gradient storage -> the step that read it
    for run in runs:
        step = [ops[i] for i in run]
        touched = {t.storage for op in step for t in (*op.inputs, *op.outputs)}
        if not params & touched:
            continue  # parameters unknown (the trace holds the step alone): p looks like state
        reads, writes, mutated = set(), set(), set()
        for op in step:
            if is_view_schema(op.name) or op.synthetic:
                continue
            ins = {t.storage for t in op.inputs}
            out = {t.storage for t in written_tensors(op)}
            reads |= {t.storage for t in read_tensors(op)}
            writes |= out
            mutated |= out & ins
        grads = {s for s in reads - params if s in written_backward} | {
            s
            for s in reads - writes - params
            if existed.get(s) and widest[s].shape != () and s not in trace.roles
        }
        created = {
            t.storage: op.index
            for op in step
            if kind_of(op.packet) in _INIT_KINDS
            for t in op.outputs
            if not existed.get(t.storage)
        }
        state = {s for s in mutated - params - grads if existed.get(s) or s in created}
        init = sorted({created[s] for s in state if s in created})
        positions = {op.index: i for i, op in zip(run, step, strict=True)}
        result.init_ops += [positions[i] for i in init]
        result.init_bytes += sum(cost_of(ops[positions[i]]).bytes for i in init)
        result.params |= params & (reads | writes)
        result.grads |= grads
        result.kept |= params | state | set(trace.roles)
        for s in params & (reads | writes):
            derived[s] = "weights"
        for s in grads:
            derived[s] = "gradients"
            run_of.setdefault(s, run[0])
        for s in state:
            derived[s] = "optimizer_state"
        _find_groups(step, set(init), params, state, result)
    gradients: dict[int, int] = defaultdict(int)  # per step: set_to_none makes new ones
    for s, role in derived.items():
        if s in trace.roles:
            continue
        result.roles[s] = role
        size = storage_extent_bytes(widest[s])
        if role == "gradients":
            gradients[run_of[s]] += size
        else:
            result.role_bytes[role] = result.role_bytes.get(role, 0) + size
    if gradients:
        result.role_bytes["gradients"] = max(gradients.values())
    return result


def fused_ops(ops: Sequence[OpRecord], step: OptimizerStep) -> list[OpRecord]:
    """``ops`` with each parameter group's elementwise update replaced by one
    ``torchroof.fused_optimizer_step`` (a step's 0-d counters folded into its first)."""
    if not step.groups:
        return list(ops)
    replaced: dict[int, OpRecord | None] = {}
    for group in step.groups:
        members = group.ops + group.folded
        fused = _fused_record(members, ops, step)
        for op in members:
            replaced[op.index] = None
        replaced[min(op.index for op in members)] = fused
    out = []
    for op in ops:
        if op.index not in replaced:
            out.append(op)
        elif (record := replaced[op.index]) is not None:
            out.append(record)
    return out


# -- internals ---------------------------------------------------------------------------
def _optimizer_runs(ops: Sequence[OpRecord]) -> list[list[int]]:
    """Positions of each contiguous run of optimizer-phase ops (one per traced step)."""
    runs: list[list[int]] = []
    for i, op in enumerate(ops):
        if op.phase != OPTIMIZER:
            continue
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _widen(widest: dict[int, TensorMeta], t: TensorMeta) -> None:
    known = widest.get(t.storage)
    if known is None or storage_extent_bytes(t) > storage_extent_bytes(known):
        widest[t.storage] = t


def _find_groups(
    step: list[OpRecord],
    init: set[int],
    params: set[int],
    state: set[int],
    result: OptimizerStep,
) -> None:
    """Split the step's priced, non-initialising ops into connected components over the
    tensors they touch (0-d tensors do not connect: every parameter's chain reads the same
    scalars); elementwise components that update a parameter, grouped by what they run,
    are the parameter groups. Ops on 0-d tensors alone that only update state (the step
    counters) are folded into the first group's kernel; other 0-d work (a norm's clamp in
    Muon) stays where it is."""
    work = [
        op
        for op in step
        if not op.synthetic and op.index not in init and (c := cost_of(op)).flops + c.bytes
    ]
    parent = list(range(len(work)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}  # storage -> an op that touches it
    scalar_only: dict[int, None] = {}  # ordered set
    for i, op in enumerate(work):
        touched = [t.storage for t in (*op.inputs, *op.outputs) if t.shape != ()]
        if not touched:
            scalar_only[i] = None
        for s in touched:
            if s in owner:
                parent[find(i)] = find(owner[s])
            else:
                owner[s] = i
    components: dict[int, list[OpRecord]] = defaultdict(list)
    for i, op in enumerate(work):
        if i not in scalar_only:
            components[find(i)].append(op)
    by_signature: dict[tuple, _Group] = {}  # this step's groups
    for members in components.values():
        if not all(_elementwise(op) for op in members):
            continue
        updated = {
            t.storage: t for op in members for t in written_tensors(op) if t.storage in params
        }
        if not updated:
            continue
        if not any(op.packet.startswith("aten._foreach_") for op in members):
            result.single_tensor = True
        signature = (
            tuple((op.name, _scalars(op)) for op in members),
            tuple(sorted({t.dtype for t in updated.values()})),
        )
        group = by_signature.get(signature)
        if group is None:
            group = by_signature[signature] = _Group()
            result.groups.append(group)
        group.ops.extend(members)
        group.params += len(updated)
    if by_signature:
        next(iter(by_signature.values())).folded += [
            work[i]
            for i in scalar_only
            if _elementwise(work[i])
            and (written := {t.storage for t in written_tensors(work[i])})
            and written <= state
        ]


def _scalars(op: OpRecord) -> tuple:
    """The op's non-tensor arguments (learning rate, betas, weight decay, eps)."""
    return tuple(
        sorted((k, repr(v)) for k, v in op.args.items() if not _has_ref(v)),
    )


def _has_ref(value: Any) -> bool:
    if isinstance(value, TensorRef):
        return True
    return isinstance(value, (list, tuple)) and any(_has_ref(v) for v in value)


def _fused_record(
    members: list[OpRecord], ops: Sequence[OpRecord], step: OptimizerStep
) -> OpRecord:
    """One fused kernel for ``members``: it reads what they read from outside (first access
    a read) and writes what they write that is read after them or kept (first access
    anywhere else a write), once each."""
    inside = {op.index for op in members}
    members = sorted(members, key=lambda op: op.index)
    read_outside: set[int] = set()
    for op in ops:
        if op.index not in inside and op.index > members[0].index:
            read_outside.update(t.storage for t in read_tensors(op))
    widest: dict[int, TensorMeta] = {}
    first_access: dict[int, str] = {}
    written: set[int] = set()
    for op in members:
        for t in read_tensors(op):
            first_access.setdefault(t.storage, "read")
            _widen(widest, t)
        for t in written_tensors(op):
            first_access.setdefault(t.storage, "write")
            written.add(t.storage)
            _widen(widest, t)
    kinds: dict[str, list[TensorMeta]] = defaultdict(list)
    for s, how in first_access.items():
        read = how == "read"
        write = s in written and (read or s in read_outside or s in step.kept)
        if read and write:
            kinds["params" if s in step.params else "states"].append(widest[s])
        elif read:
            kinds["grads" if s in step.grads else "inputs"].append(widest[s])
        elif write:
            kinds["params_out"].append(widest[s])
    inputs: list[TensorMeta] = []
    args: dict[str, Any] = {}
    for key in ("params", "grads", "states", "inputs", "params_out"):
        refs = []
        for t in kinds.get(key, []):
            inputs.append(t)
            refs.append(TensorRef(len(inputs) - 1))
        args[key] = refs
    args["flops"] = sum(cost_of(op).flops for op in members)
    args["replaces"] = len(members)
    first = members[0]
    phase = cast(Phase, OPTIMIZER)  # records.ops.OPTIMIZER is a plain str, this Phase's name
    return OpRecord(first.index, FUSED_STEP, tuple(inputs), (), args, first.module, phase, True)

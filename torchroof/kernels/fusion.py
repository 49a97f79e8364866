"""Kernels from a trace: which ops a runtime launches together, and what they move.

A kernel boundary is a memory boundary (docs/concepts/fusion.md). Fusing leaves W unchanged
and cuts Q to the group's external traffic: inputs produced outside it and outputs read
outside it (fusion changes Q, never W).

Policies:
- ``eager``: one kernel per op that moves bytes or computes (what PyTorch eager launches);
  views and allocation-only ops launch nothing (views cost nothing).
- ``fused``: what torch.compile's Inductor launches on a GPU, refereed by the compiler
  itself (torchroof/validation/referee.py: fusion is refereed by the compiler, PyTorch's
  torch.compile / TorchInductor docs). Data-connected runs of pointwise ops,
  casts, copies, gathers, row reductions, norms, softmax and their backward become one
  kernel, across module and block boundaries (a kernel is booked to the module of its
  first op); independent sibling kernels that read a common tensor over the same number of
  elements become one; a reduction over rows that keeps the last dimension is a split
  reduction of its own (torchroof/kernels/column_reductions.py); the forward writes what the
  compiled backward reads, which rebuilds cheap pointwise work from saved sources
  (torchroof/kernels/recompute.py). Matmuls, attention and scatters stay their own kernels.
  ``epilogue=True`` lets a matmul absorb the elementwise ops that consume only its output
  (bias, activation, residual).

Orthogonal options: ``loss="chunked"`` fuses the LM head's GEMMs with the cross-entropy
forward and backward (no N_t x V tensor in HBM: Wijmans et al. 2024; Hsu et al. 2024, Liger);
``attention="math"`` prices attention as the naive kernel that writes S and P.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from torchroof import progress
from torchroof.config import PricingOptions
from torchroof.counters import Cost, OpKind, cost_of, kind_of
from torchroof.counters.attention import materialized_attention_cost
from torchroof.counters.tensors import read_tensors, tensor_key, written_tensors
from torchroof.kernels.column_reductions import split_column_reductions
from torchroof.kernels.groups import Graph, Group, own_loop_order
from torchroof.kernels.horizontal import merge_horizontal
from torchroof.kernels.save_plan import SavePlan, save_plan
from torchroof.records.dims import Dim
from torchroof.records.ops import OpRecord, Phase
from torchroof.records.tensors import TensorMeta, storage_extent_bytes

FUSED_KINDS: frozenset[OpKind] = frozenset(
    {
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
    }
)
"""Op kinds an Inductor-style compiler fuses with the ops they share data with: elementwise
work, casts, copies, gathers, row reductions, norms, softmax (each kind's treatment:
counters/registry.py ``OP_KINDS``). Every other kind is a kernel of its own."""

_CROSS_ENTROPY_KINDS: frozenset[OpKind] = frozenset({"loss", "cast", "copy"})
"""What the fused linear-cross-entropy takes beside the log-softmax in the forward: the
target gather and the casts and copies between them."""


@dataclass(frozen=True)
class SpillFlag:
    """A fused kernel whose live state per row exceeds the on-chip budget; its text is what
    the report shows (kept as numbers until then: a size's text is made at its point)."""

    live_row_bytes: int
    budget_bytes: int

    def __str__(self) -> str:
        return (
            f"on-chip state {self.live_row_bytes:,} B per row exceeds the "
            f"{self.budget_bytes:,} B budget: may spill"
        )


@dataclass(frozen=True)
class Kernel:
    """One launched kernel: its member ops, their cost with the group's external bytes,
    and flags (e.g. an on-chip budget the fused group exceeds)."""

    ops: tuple[OpRecord, ...]
    cost: Cost
    flags: tuple[SpillFlag, ...] = ()

    @property
    def lead(self) -> OpRecord:
        """The member that names the kernel: the matmul or attention if there is one, else
        the first member."""
        for op in self.ops:
            if kind_of(op.packet) in ("matmul", "attention"):
                return op
        return self.ops[0]

    @property
    def name(self) -> str:
        if len(self.ops) == 1:
            return self.lead.name
        return f"fused[{self.lead.name} +{len(self.ops) - 1}]"

    @property
    def module(self) -> str:
        return self.lead.module

    @property
    def phase(self) -> Phase:
        return self.lead.phase


@dataclass(frozen=True)
class Coverage:
    """How many ops were seen and which had no rule (every op is accounted: listed by name)."""

    ops: int
    uncounted: dict[str, int]


def _is_fusable(op: OpRecord, cost: Cost) -> bool:
    return cost.counted and kind_of(op.packet) in FUSED_KINDS


def price(op: OpRecord, attention: str = "flash") -> Cost:
    """The op's cost under the attention policy (``math`` writes S and P to HBM)."""
    if (
        attention == "math"
        and op.name.startswith("aten._scaled_dot_product_")
        and "math" not in op.name
    ):
        return materialized_attention_cost(op)
    return cost_of(op)


def _loss_groups(ops: Sequence[OpRecord], costs: Sequence[Cost]) -> list[list[int]]:
    """The LM head's GEMMs and the cross-entropy around them, forward and backward, as one
    fused linear-cross-entropy kernel per loss (Wijmans et al. 2024, "Cut Your Losses")."""
    producer: dict[int, int] = {}
    consumers: dict[int, list[int]] = defaultdict(list)
    for i, (op, cost) in enumerate(zip(ops, costs, strict=True)):
        for t in read_tensors(op):
            consumers[t.storage].append(i)
        if cost.flops or cost.bytes:
            for t in written_tensors(op):
                producer[t.storage] = i
    groups: list[list[int]] = []
    for i, op in enumerate(ops):
        if op.packet != "aten._log_softmax" or op.phase != "forward":
            continue
        chain = {i}
        # back from the log-softmax through casts to the head GEMM
        j = producer.get(op.inputs[0].storage)
        while j is not None and kind_of(ops[j].packet) in ("cast", "copy"):
            chain.add(j)
            j = producer.get(ops[j].inputs[0].storage)
        if j is None or kind_of(ops[j].packet) != "matmul":
            continue
        chain.add(j)
        frontier = [t.storage for t in ops[i].outputs]
        # forward on to the loss, its backward, and the GEMMs that consume grad-logits
        seen: set[int] = set()
        while frontier:
            storage = frontier.pop()
            if storage in seen:
                continue
            seen.add(storage)
            for k in consumers.get(storage, ()):
                if k in chain or not (costs[k].flops or costs[k].bytes):
                    continue  # views share their base's storage: its readers are found too
                kind = kind_of(ops[k].packet)
                if kind == "matmul":
                    if ops[k].phase == "backward":
                        chain.add(k)  # dX and dW GEMMs of the head; their outputs leave
                    continue
                if kind in _CROSS_ENTROPY_KINDS or (
                    kind in FUSED_KINDS and ops[k].phase == "backward"
                ):
                    chain.add(k)
                    frontier.extend(t.storage for t in written_tensors(ops[k]))
        groups.append(sorted(chain))
    return groups


def _group_ops(
    ops: Sequence[OpRecord], costs: Sequence[Cost], options: PricingOptions
) -> list[Group]:
    """Greedy vertical fusion in execution order.

    An op joins the group of one of its producers when the group can still run as one
    kernel: every other input of the op was produced before anything outside the group
    first read the group's output (otherwise that input may depend on the group and the
    merged kernel would wait on itself).
    """
    groups: list[Group] = []
    group_of: dict[int, int] = {}
    taken: set[int] = set()
    if options.loss == "chunked":
        for members in _loss_groups(ops, costs):
            if taken.intersection(members):
                continue
            groups.append(Group(members=list(members), kind="loss"))
            for i in members:
                group_of[i] = len(groups) - 1
            taken.update(members)
    last_writer: dict[int, int] = {}  # storage -> op index

    def note_reads(i: int, own: int) -> None:
        if own_loop_order(ops[i]):
            return  # a column reduction inlines its pointwise producers: no wait on them
        for t in read_tensors(ops[i]):
            w = last_writer.get(t.storage)
            if w is None:
                continue
            g = group_of[w]
            if g != own and groups[g].first_outside_read is None:
                groups[g].first_outside_read = i

    for i, (op, cost) in enumerate(zip(ops, costs, strict=True)):
        if not (cost.flops or cost.bytes):
            continue
        if i in taken:
            note_reads(i, group_of[i])
            for t in written_tensors(op):
                last_writer[t.storage] = i
            continue
        chosen = None
        if options.fusion == "fused" and _is_fusable(op, cost) and not own_loop_order(op):
            chosen = _joinable_group(i, ops, groups, group_of, last_writer, options)
            if chosen is not None:
                _merge_siblings(i, chosen, ops, groups, group_of, last_writer)
        if (
            chosen is None
            and options.fusion == "fused"
            and options.dequantise_in_gemm
            and kind_of(op.packet) == "matmul"
        ):
            chosen = _dequantising_prologue(i, ops, groups, group_of, last_writer)
            if chosen is not None:
                groups[chosen].kind = "epilogue" if options.epilogue else "anchor"
        if chosen is None:
            kind = "fusable" if (options.fusion == "fused" and _is_fusable(op, cost)) else "anchor"
            if kind == "anchor" and options.epilogue and kind_of(op.packet) == "matmul":
                kind = "epilogue"
            groups.append(Group(kind=kind))
            chosen = len(groups) - 1
        groups[chosen].members.append(i)
        if _reduces_to_scalar(op):
            groups[chosen].reduced_to_scalar = True
        group_of[i] = chosen
        note_reads(i, chosen)
        for t in written_tensors(op):
            last_writer[t.storage] = i
    return groups


# Weight formats a mixed-input GEMM reads as stored and widens in registers.
NARROW_WEIGHT_DTYPES = frozenset(
    {"int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
)
_DEQUANTISING_KINDS: frozenset[OpKind] = frozenset({"pointwise", "cast", "copy", "rearrange"})


def _dequantising_prologue(
    i: int,
    ops: Sequence[OpRecord],
    groups: list[Group],
    group_of: dict[int, int],
    last_writer: dict[int, int],
) -> int | None:
    """The group that widens a narrow weight into matmul ``i``'s operand, which the matmul
    absorbs as its prologue: the weight is read at its stored width and never written wide
    (weight-only int8 / fp8, torchroof.quant.recipes). Inductor does this only in its Triton GEMM
    templates (max-autotune's prologue fusion) and in the M = 1 GEMV it decomposes under
    coordinate-descent tuning (gpt-fast's and torchao's settings); by default it launches a
    cast that writes the wide weight and a library GEMM that reads it (the referee's
    ``int8_weight_only_linear`` case; ``dequantise_in_gemm=False`` prices that). Serving
    stacks run a mixed-input GEMM (Marlin, Machete, TensorRT-LLM). A group qualifies when
    its members are elementwise casts and arithmetic of one phase, it reads a tensor of a
    narrow dtype, and nothing else has read its output yet."""
    op = ops[i]
    for t in read_tensors(op):
        w = last_writer.get(t.storage)
        if w is None:
            continue
        g = group_of[w]
        group = groups[g]
        if group.kind != "fusable" or group.first_outside_read is not None:
            continue
        members = [ops[m] for m in group.members]
        if any(
            m.phase != op.phase or kind_of(m.packet) not in _DEQUANTISING_KINDS for m in members
        ):
            continue
        if any(x.dtype in NARROW_WEIGHT_DTYPES for m in members for x in m.inputs):
            return g
    return None


# Inductor splits a reduction to few outputs over blocks of the device once it reduces more
# than this many elements (torch/_inductor/choices.py, the split threshold on an H100;
# 524,288 on sm_100, where the count of kernels differs but not the bytes).
SPLIT_REDUCTION_MIN_ELEMENTS = 8192


def _reduces_to_scalar(op: OpRecord) -> bool:
    """A reduction of more than :data:`SPLIT_REDUCTION_MIN_ELEMENTS` elements to one value
    (torchao Float8's tensorwise amax): no block holds the tensor, so nothing that reads
    the tensor again can run in the same pass."""
    if kind_of(op.packet) not in ("reduction", "sum") or not op.outputs or not op.inputs:
        return False
    return op.outputs[0].numel <= 1 and op.inputs[0].numel > SPLIT_REDUCTION_MIN_ELEMENTS


def _reads_after_scalar(op: OpRecord, group: Group) -> bool:
    """``op`` would read a tensor of more than one element in a group that already reduced
    a large tensor to a scalar: the tensor is read again in a second kernel (Inductor splits
    the reduction and launches its consumers after it; torchao's tensorwise scaling reads
    each tensor twice, once for its amax and once for the cast)."""
    return group.reduced_to_scalar and any(t.numel > 1 for t in read_tensors(op))


def _merge_siblings(
    i: int,
    chosen: int,
    ops: Sequence[OpRecord],
    groups: list[Group],
    group_of: dict[int, int],
    last_writer: dict[int, int],
) -> None:
    """Op ``i`` joins ``chosen`` and also reads another fusable group's output (a diamond:
    RoPE's ``q·cos`` and ``rotate_half(q)·sin`` meet in one add). While nothing outside
    either group has read them, nothing can depend on them, so they merge into one kernel."""
    target = groups[chosen]
    if target.first_outside_read is not None:
        return
    for t in read_tensors(ops[i]):
        w = last_writer.get(t.storage)
        if w is None or group_of[w] == chosen:
            continue
        h = group_of[w]
        other = groups[h]
        same_phase = ops[other.members[0]].phase == ops[i].phase
        if other.kind != "fusable" or other.first_outside_read is not None or not same_phase:
            continue
        if _reads_after_scalar(ops[i], other):
            continue
        target.members.extend(other.members)
        target.reduced_to_scalar |= other.reduced_to_scalar
        for j in other.members:
            group_of[j] = chosen
        other.members = []


def _joinable_group(
    i: int,
    ops: Sequence[OpRecord],
    groups: list[Group],
    group_of: dict[int, int],
    last_writer: dict[int, int],
    options: PricingOptions,
) -> int | None:
    op = ops[i]
    producers = [last_writer.get(t.storage) for t in read_tensors(op)]
    candidates = sorted(
        {group_of[w] for w in producers if w is not None}, key=lambda g: -groups[g].members[-1]
    )
    for g in candidates:
        group = groups[g]
        if group.kind not in ("fusable", "epilogue") or _reads_after_scalar(op, group):
            continue
        first = ops[group.members[0]]
        if first.phase != op.phase:
            continue
        if group.kind == "epilogue" and group.first_outside_read is not None:
            continue  # the matmul output is needed elsewhere: it must be written anyway
        limit = group.first_outside_read
        others = [w for w in producers if w is not None and group_of[w] != g]
        if limit is None or all(w < limit for w in others):
            return g
    return None


def _group_kernel(
    members: list[int],
    ops: Sequence[OpRecord],
    costs: Sequence[Cost],
    graph: Graph,
    roles: Mapping[int, str],
    options: PricingOptions,
    plan: SavePlan,
) -> Kernel:
    """Sum W; Q is the external traffic only (fusion changes Q, never W)."""
    if len(members) == 1 and not _planned(members[0], ops, plan):
        i = members[0]
        return Kernel((ops[i],), costs[i])
    member_set = set(members)
    produced: set[int] = set()
    reads: dict[tuple, tuple[TensorMeta, int]] = {}
    writes: dict[tuple, tuple[TensorMeta, int]] = {}
    row_bytes: dict[int, int] = {}  # storage -> bytes of one row held on chip
    born: dict[int, int] = {}  # storage -> position of its producer in the group
    last_use: dict[int, int] = {}  # storage -> position of its last reader in the group
    total = Cost()

    def read(t: TensorMeta, size: int) -> None:
        key = tensor_key(t)
        reads[key] = (t, max(size, reads[key][1] if key in reads else 0))

    for position, i in enumerate(members):
        op, cost = ops[i], costs[i]
        total = total + Cost(cost.flops, 0, 0, cost.unit, cost.dtype, cost.counted)
        explicit = {tensor_key(t): n for t, n in cost.reads}
        rebuilt = plan.rebuilt_by.get(i, {})
        creation = kind_of(op.packet) == "creation"  # reads its template's shape, not values
        for t in read_tensors(op):
            if t.storage in produced:
                last_use[t.storage] = position
                continue
            size = 0 if creation else explicit.get(tensor_key(t), t.nbytes)
            if t.storage not in rebuilt:
                read(t, size)
                continue
            share = size / t.nbytes if t.nbytes else 0.0  # a gather reads some rows
            for source in rebuilt[t.storage].sources:
                if source.storage not in produced:
                    read(source, math.ceil(source.nbytes * share))
        for t in [*written_tensors(op), *plan.statistics.get(i, ())]:
            produced.add(t.storage)
            live = (
                t.storage in roles
                or t.storage in plan.forced
                or (
                    t.storage not in plan.dropped
                    and (
                        graph.read_after(t.storage, i, member_set)
                        or not graph.read_later(t.storage, i)
                    )
                )
            )
            if live:
                writes[tensor_key(t)] = (t, t.nbytes)
            if t.shape:
                row_bytes[t.storage] = t.shape[-1] * t.itemsize
                born.setdefault(t.storage, position)
    cost = _external_cost(total, reads, writes)
    live_row = _peak_row_state(row_bytes, born, last_use, len(members))
    return Kernel(tuple(ops[i] for i in members), cost, _spill_flags(live_row, options))


def _external_cost(
    total: Cost,
    reads: dict[tuple, tuple[TensorMeta, int]],
    writes: dict[tuple, tuple[TensorMeta, int]],
) -> Cost:
    """The group's summed W with Q = the bytes it reads from and writes to outside itself."""
    read_list = _per_storage(reads.values())
    write_list = _per_storage(writes.values())
    return Cost(
        total.flops,
        sum(n for _, n in read_list),
        sum(n for _, n in write_list),
        total.unit,
        total.dtype,
        total.counted,
        reads=read_list,
        writes=write_list,
    )


def _spill_flags(live_row: int, options: PricingOptions) -> tuple[SpillFlag, ...]:
    """The flag of a fused kernel whose live state per row exceeds the on-chip budget. A
    symbolic size (:mod:`torchroof.records.dims`) keeps the flag undecided: each point
    decides it for its own numbers (:func:`torchroof.pricing.symbolic_plan.kernel_at`),
    so the threshold splits no plan."""
    if isinstance(live_row, Dim):
        return (SpillFlag(live_row, options.on_chip_budget_bytes),)
    if live_row > options.on_chip_budget_bytes:
        return (SpillFlag(live_row, options.on_chip_budget_bytes),)
    return ()


def _planned(i: int, ops: Sequence[OpRecord], plan: SavePlan) -> bool:
    """Does the save plan change what op ``i`` reads or writes?"""
    if i in plan.rebuilt_by or i in plan.statistics:
        return True
    return any(
        t.storage in plan.dropped or t.storage in plan.forced for t in written_tensors(ops[i])
    )


def _peak_row_state(
    row_bytes: dict[int, int], born: dict[int, int], last_use: dict[int, int], length: int
) -> int:
    """Most bytes of one row a fused kernel holds at once: each intermediate lives from the
    member that makes it to the last member that reads it (what limits fusion:
    docs/concepts/fusion.md)."""
    delta = [0] * (length + 1)
    for storage, size in row_bytes.items():
        start = born[storage]
        end = max(last_use.get(storage, start), start)
        delta[start] += size
        delta[end + 1] -= size
    live = peak = 0
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak


def _per_storage(views: Iterable[tuple[TensorMeta, int]]) -> tuple[tuple[TensorMeta, int], ...]:
    """Overlapping views of one storage (``q`` and its two halves in RoPE) are moved once:
    a storage costs at most the extent its views reach."""
    by_storage: dict[int, list[tuple[TensorMeta, int]]] = defaultdict(list)
    for t, size in views:
        by_storage[t.storage].append((t, size))
    out: list[tuple[TensorMeta, int]] = []
    for entries in by_storage.values():
        total = sum(size for _, size in entries)
        extent = max(storage_extent_bytes(t) for t, _ in entries)
        if len(entries) == 1 or total <= extent:
            out.extend(entries)
        else:
            widest = max(entries, key=lambda e: storage_extent_bytes(e[0]))[0]
            out.append((widest, extent))
    return tuple(out)


def build_kernels(
    ops: Iterable[OpRecord],
    options: PricingOptions | None = None,
    roles: Mapping[int, str] | None = None,
    pricer: Callable[[OpRecord], Cost] | None = None,
) -> tuple[list[Kernel], Coverage]:
    """Group a trace's ops into the kernels a runtime would launch under ``options``."""
    options = options or PricingOptions()
    ops = list(ops)
    report = progress.current()
    report.begin(f"pricing {len(ops):,} ops", total=len(ops), unit="ops")
    costs = [pricer(op) if pricer else price(op, options.attention) for op in report.track(ops)]
    report.begin("fusing ops into kernels" if options.fusion == "fused" else "one kernel per op")
    uncounted = Counter(op.name for op, c in zip(ops, costs, strict=True) if not c.counted)
    coverage = Coverage(len(ops), dict(uncounted))
    if options.fusion == "fused":
        known = {id(op): cost for op, cost in zip(ops, costs, strict=True)}
        ops = split_column_reductions(ops, [c.flops for c in costs])
        costs = [known.get(id(op)) or cost_of(op) for op in ops]
    graph = Graph(ops, costs)
    groups = _group_ops(ops, costs, options)
    if options.fusion == "fused":
        merge_horizontal(groups, ops, graph)
    roles = roles or {}
    plan = save_plan(ops, costs, groups, graph, roles) if options.fusion == "fused" else SavePlan()
    kernels = [
        _group_kernel(sorted(g.members), ops, costs, graph, roles, options, plan)
        for g in sorted((g for g in groups if g.members), key=lambda g: min(g.members))
    ]
    return kernels, coverage

"""Kernels from a trace: which ops a runtime launches together, and what they move.

seed 000 "Fusion": a kernel boundary is a memory boundary. Fusing leaves W unchanged and
cuts Q to the group's external traffic: inputs produced outside it and outputs read
outside it (DESIGN rule 6).

Policies:
- ``eager``: one kernel per op that moves bytes or computes (what PyTorch eager launches);
  views and allocation-only ops launch nothing (DESIGN rule 2).
- ``fused``: what torch.compile's Inductor launches on a GPU, refereed by the compiler
  itself (torchroof/validation/referee.py, DESIGN rule 8). Data-connected runs of pointwise ops,
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
forward and backward (no N_t x V tensor in HBM, seed 000 "The fix is a roofline fix");
``attention="math"`` prices attention as the naive kernel that writes S and P.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from torchroof import progress
from torchroof.config.options import PricingOptions
from torchroof.counters import Cost, OpKind, cost_of, kind_of
from torchroof.counters.attention import materialized_attention_cost
from torchroof.counters.tensors import read_tensors, tensor_key, written_tensors
from torchroof.kernels.column_reductions import split_column_reductions
from torchroof.kernels.recompute import Recomputable, recomputable_tensors, statistics_producer
from torchroof.records.trace import OpRecord, Phase, TensorMeta
from torchroof.report.memory import storage_extent_bytes

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
class Kernel:
    """One launched kernel: its member ops, their cost with the group's external bytes,
    and flags (e.g. an on-chip budget the fused group exceeds)."""

    ops: tuple[OpRecord, ...]
    cost: Cost
    flags: tuple[str, ...] = ()

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
    """How many ops were seen and which had no rule (DESIGN rule 1: listed by name)."""

    ops: int
    uncounted: dict[str, int]


@dataclass
class _Group:
    members: list[int] = field(default_factory=list)
    first_outside_read: int | None = None  # first op outside the group reading its output
    kind: str = "fusable"  # fusable | anchor | epilogue (a matmul taking followers) | loss
    # holds a reduction of a whole large tensor to a scalar (a tensorwise amax): what reads
    # the scalar and the tensor again is a second pass, another kernel (_reads_after_scalar)
    reduced_to_scalar: bool = False


class _Graph:
    """Who writes and who reads each storage, in execution order (views excluded)."""

    def __init__(self, ops: Sequence[OpRecord], costs: Sequence[Cost]) -> None:
        self.readers: dict[int, list[int]] = defaultdict(list)
        self.writers: dict[int, list[int]] = defaultdict(list)
        for i, (op, cost) in enumerate(zip(ops, costs, strict=True)):
            if not (cost.flops or cost.bytes):
                continue  # a view or metadata op touches nothing
            for t in read_tensors(op):
                self.readers[t.storage].append(i)
            for t in written_tensors(op):
                self.writers[t.storage].append(i)

    def read_after(self, storage: int, index: int, group: set[int]) -> bool:
        """Is ``storage`` read after op ``index`` by an op outside ``group``?"""
        return any(j > index and j not in group for j in self.readers.get(storage, ()))

    def read_later(self, storage: int, index: int) -> bool:
        return any(j > index for j in self.readers.get(storage, ()))


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
    fused linear-cross-entropy kernel per loss (seed 000 "The fix is a roofline fix")."""
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
) -> list[_Group]:
    """Greedy vertical fusion in execution order.

    An op joins the group of one of its producers when the group can still run as one
    kernel: every other input of the op was produced before anything outside the group
    first read the group's output (otherwise that input may depend on the group and the
    merged kernel would wait on itself).
    """
    groups: list[_Group] = []
    group_of: dict[int, int] = {}
    taken: set[int] = set()
    if options.loss == "chunked":
        for members in _loss_groups(ops, costs):
            if taken.intersection(members):
                continue
            groups.append(_Group(members=list(members), kind="loss"))
            for i in members:
                group_of[i] = len(groups) - 1
            taken.update(members)
    last_writer: dict[int, int] = {}  # storage -> op index

    def note_reads(i: int, own: int) -> None:
        if _own_loop_order(ops[i]):
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
        if options.fusion == "fused" and _is_fusable(op, cost) and not _own_loop_order(op):
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
            groups.append(_Group(kind=kind))
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
    groups: list[_Group],
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


def _reads_after_scalar(op: OpRecord, group: _Group) -> bool:
    """``op`` would read a tensor of more than one element in a group that already reduced
    a large tensor to a scalar: the tensor is read again in a second kernel (Inductor splits
    the reduction and launches its consumers after it; torchao's tensorwise scaling reads
    each tensor twice, once for its amax and once for the cast)."""
    return group.reduced_to_scalar and any(t.numel > 1 for t in read_tensors(op))


def _own_loop_order(op: OpRecord) -> bool:
    """A column reduction that cannot run inside a row kernel starts a kernel of its own
    (torchroof/kernels/column_reductions.py); a mix-order partial may join one (a final kernel is
    never mix-order)."""
    return kind_of(op.packet) == "column_reduction" and not op.arg("mix_order")


def _merge_siblings(
    i: int,
    chosen: int,
    ops: Sequence[OpRecord],
    groups: list[_Group],
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


# Inductor tries sibling pairs no more than this many nodes apart
# (torch._inductor.config.max_fusion_buffer_group_pairwise_attempts = 64).
SIBLING_WINDOW_OPS = 64
# How many tensors the independence search may follow before it gives up and keeps the two
# kernels apart (an MoE expert loop with 600k ops otherwise spends minutes here).
SIBLING_SEARCH_STORAGES = 256


def _merge_horizontal(groups: list[_Group], ops: Sequence[OpRecord], graph: _Graph) -> None:
    """Sibling fusion: two fusable kernels of one phase that read a common tensor, run over
    the same number of elements and do not depend on each other become one kernel that
    reads the shared tensor once (Inductor's horizontal fusion, scored by shared bytes).
    SwiGLU backward's ``g·silu(gate)`` and ``silu_backward(g·up, gate)`` both read ``g``
    and ``gate``; RoPE's q and k kernels both read cos and sin."""
    group_of = {i: n for n, g in enumerate(groups) for i in g.members}
    produced: list[set[int]] = [set() for _ in groups]
    reads: list[set[int]] = [set() for _ in groups]
    domain: list[int] = [0] * len(groups)
    columns = [any(_own_loop_order(ops[i]) for i in g.members) for g in groups]
    for n, g in enumerate(groups):
        for i in g.members:
            for t in written_tensors(ops[i]):
                produced[n].add(t.storage)
                domain[n] = max(domain[n], t.numel)
            if kind_of(ops[i].packet) == "creation":
                continue  # ``zeros_like(p)`` reads p's shape, not its values
            for t in read_tensors(ops[i]):
                if t.numel > 1:  # a 0-d constant is inlined, not a shared buffer
                    reads[n].add(t.storage)
                domain[n] = max(domain[n], t.numel)
    for n in range(len(groups)):
        reads[n] -= produced[n]

    def depends(later: int, earlier: int) -> bool:
        """Does group ``later`` read, through any chain of kernels, what ``earlier`` makes?
        Only readers between the two groups can form the chain (reader lists are in
        execution order, so each is cut by bisection: a tensor every expert reads has
        thousands)."""
        start, stop = min(groups[earlier].members), max(groups[later].members)
        frontier = list(produced[earlier])
        seen_groups: set[int] = set()
        seen_storages = set(frontier)
        while frontier:
            if len(seen_storages) > SIBLING_SEARCH_STORAGES:
                return True  # too tangled to prove independent: do not merge (never wrong)
            readers = graph.readers.get(frontier.pop(), ())
            lo, hi = bisect.bisect_right(readers, start), bisect.bisect_right(readers, stop)
            for j in readers[lo:hi]:
                h = group_of.get(j)
                if h is None or h == earlier or h in seen_groups:
                    continue
                if h == later:
                    return True
                seen_groups.add(h)
                for storage in produced[h]:
                    if storage not in seen_storages:
                        seen_storages.add(storage)
                        frontier.append(storage)
        return False

    order = sorted(
        (n for n, g in enumerate(groups) if g.kind == "fusable" and g.members),
        key=lambda n: min(groups[n].members),
    )
    by_read: dict[int, list[int]] = defaultdict(list)  # storage -> groups that read it
    last = {n: max(groups[n].members) for n in order}
    for n in order:
        first = min(groups[n].members)
        candidates: set[int] = set()
        for storage in reads[n]:
            readers = by_read.get(storage)
            if not readers:
                continue
            # the order is by first member: a group out of the window now stays out
            readers[:] = [h for h in readers if first - last[h] <= SIBLING_WINDOW_OPS]
            candidates.update(readers)
        merged = False
        for h in sorted(candidates, key=lambda h: -last[h]):
            if (
                not groups[h].members
                or ops[groups[h].members[0]].phase != ops[first].phase
                or domain[h] != domain[n]
                or columns[h] != columns[n]
                or depends(n, h)
                or depends(h, n)
            ):
                continue
            groups[h].members.extend(groups[n].members)
            groups[n].members = []
            last[h] = max(last[h], last[n])
            new_reads = reads[n] - reads[h] - produced[h]
            produced[h] |= produced[n]
            reads[h] = (reads[h] | reads[n]) - produced[h]
            for i in groups[h].members:
                group_of[i] = h
            for storage in new_reads:
                by_read[storage].append(h)
            merged = True
            break
        if not merged:
            for storage in reads[n]:
                by_read[storage].append(n)


def _joinable_group(
    i: int,
    ops: Sequence[OpRecord],
    groups: list[_Group],
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


@dataclass
class _SavePlan:
    """What the compiled backward rebuilds instead of reading (torchroof/kernels/recompute.py)."""

    rebuilt_by: dict[int, dict[int, Recomputable]] = field(default_factory=dict)  # op -> T
    dropped: set[int] = field(default_factory=set)  # forward tensors never written
    forced: set[int] = field(default_factory=set)  # sources that must be written
    statistics: dict[int, list[TensorMeta]] = field(default_factory=dict)  # op -> row stats


def _rebuilds(op: OpRecord, group: _Group, rebuilt: Recomputable, made_in: Phase) -> bool:
    """Can this reader rebuild a pointwise input inside its own kernel instead of reading
    it? A column reduction inlines its producer whatever it costs (Inductor fuses the
    pointwise work into the reduction's loop); for a forward tensor, when the rebuild is
    cheap, so can a fused backward kernel (the partitioner's recompute) and the
    cross-entropy gather, which reads x[t] − max − lse at its targets; a matmul cannot."""
    kind = kind_of(op.packet)
    if kind == "column_reduction":
        return True
    if made_in not in ("forward", "recompute") or not rebuilt.cheap:
        return False
    if kind == "loss" and group.kind == "anchor":
        return True
    return group.kind == "fusable" and op.phase in ("backward", "recompute")


def _save_plan(
    ops: Sequence[OpRecord],
    costs: Sequence[Cost],
    groups: list[_Group],
    graph: _Graph,
    roles: dict[int, str],
) -> _SavePlan:
    """A forward tensor whose every reader outside its kernel can rebuild it is not
    written; those readers read its sources instead, and the sources are written."""
    plan = _SavePlan()
    group_of = {i: n for n, g in enumerate(groups) for i in g.members}
    for storage, rebuilt in recomputable_tensors(ops, costs, roles).items():
        made_by = group_of[graph.writers[storage][0]]
        if groups[made_by].kind == "loss":
            continue
        readers = graph.readers.get(storage, ())
        made_in = ops[graph.writers[storage][0]].phase
        if not any(ops[j].phase == made_in for j in readers):
            continue  # read by backward alone: an output of the step, which is written
        outside = [j for j in readers if group_of.get(j) != made_by]
        users = {group_of[j] for j in (outside if made_in != "backward" else readers)}
        if len(users) > 1 and rebuilt.large():
            continue  # reused and heavy: realized, not inlined into each user
        if not outside or not all(
            _rebuilds(ops[j], groups[group_of[j]], rebuilt, made_in) for j in outside
        ):
            continue
        plan.dropped.add(storage)
        for j in outside:
            plan.rebuilt_by.setdefault(j, {})[storage] = rebuilt
        for source in rebuilt.sources:
            plan.forced.add(source.storage)
            producer = statistics_producer(source)
            if producer is not None:
                stats = plan.statistics.setdefault(producer, [])
                if source not in stats:
                    stats.append(source)
    return plan


def _group_kernel(
    members: list[int],
    ops: Sequence[OpRecord],
    costs: Sequence[Cost],
    graph: _Graph,
    roles: dict[int, str],
    options: PricingOptions,
    plan: _SavePlan,
) -> Kernel:
    """Sum W; Q is the external traffic only (DESIGN rule 6)."""
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
    read_list = _per_storage(reads.values())
    write_list = _per_storage(writes.values())
    cost = Cost(
        total.flops,
        sum(n for _, n in read_list),
        sum(n for _, n in write_list),
        total.unit,
        total.dtype,
        total.counted,
        reads=read_list,
        writes=write_list,
    )
    flags: tuple[str, ...] = ()
    live_row = _peak_row_state(row_bytes, born, last_use, len(members))
    if live_row > options.on_chip_budget_bytes:
        flags = (
            f"on-chip state {live_row:,} B per row exceeds the "
            f"{options.on_chip_budget_bytes:,} B budget: may spill",
        )
    return Kernel(tuple(ops[i] for i in members), cost, flags)


def _planned(i: int, ops: Sequence[OpRecord], plan: _SavePlan) -> bool:
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
    member that makes it to the last member that reads it (seed 000 "What limits fusion")."""
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
    roles: dict[int, str] | None = None,
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
    graph = _Graph(ops, costs)
    groups = _group_ops(ops, costs, options)
    if options.fusion == "fused":
        _merge_horizontal(groups, ops, graph)
    roles = roles or {}
    plan = (
        _save_plan(ops, costs, groups, graph, roles) if options.fusion == "fused" else _SavePlan()
    )
    kernels = [
        _group_kernel(sorted(g.members), ops, costs, graph, roles, options, plan)
        for g in sorted((g for g in groups if g.members), key=lambda g: min(g.members))
    ]
    return kernels, coverage

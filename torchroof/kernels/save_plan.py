"""Save versus recompute: the forward tensors a compiled backward rebuilds instead of reading."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torchroof.counters import Cost, kind_of
from torchroof.kernels.groups import Graph, Group
from torchroof.kernels.recompute import Recomputable, recomputable_tensors, statistics_producer
from torchroof.records.ops import OpRecord, Phase
from torchroof.records.tensors import TensorMeta


@dataclass
class SavePlan:
    """What the compiled backward rebuilds instead of reading (torchroof/kernels/recompute.py)."""

    rebuilt_by: dict[int, dict[int, Recomputable]] = field(default_factory=dict)  # op -> T
    dropped: set[int] = field(default_factory=set)  # forward tensors never written
    forced: set[int] = field(default_factory=set)  # sources that must be written
    statistics: dict[int, list[TensorMeta]] = field(default_factory=dict)  # op -> row stats


def _rebuilds(op: OpRecord, group: Group, rebuilt: Recomputable, made_in: Phase) -> bool:
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


def _may_rebuild(op: OpRecord) -> bool:
    """Could ``op`` rebuild a tensor it reads (:func:`_rebuilds`): a column reduction, a
    loss, or any op of the backward pass or a recompute."""
    return op.phase in ("backward", "recompute") or kind_of(op.packet) in (
        "column_reduction",
        "loss",
    )


def save_plan(
    ops: Sequence[OpRecord],
    costs: Sequence[Cost],
    groups: list[Group],
    graph: Graph,
    roles: Mapping[int, str],
) -> SavePlan:
    """A forward tensor whose every reader outside its kernel can rebuild it is not
    written; those readers read its sources instead, and the sources are written."""
    plan = SavePlan()
    if not any(_may_rebuild(op) for op in ops):
        return plan  # no reader that rebuilds: a forward step without losses or column sums
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

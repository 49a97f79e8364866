"""Rank 0's trace of a training program carried to another number of data-parallel
replicas, where only its collectives' groups change.

A training step that replicates over ``dp`` ranks (DDP: ``zero`` 0, nothing sharded over
them; or HSDP: FSDP shards over ``fsdp``, each replica of those ranks holds the same
shards) runs the same local ops on the same shapes whatever the number of replicas: each
data rank trains its own micro-batch, FSDP shards over ``fsdp`` alone, and the replicas
only average their gradients in an all-reduce over the ``dp`` dimension (torch docs,
"DistributedDataParallel"; FSDP2 ``fully_shard`` on a 2-D mesh, "HSDP"), which NCCL
divides by the ranks itself where the gradients are reduced in fp32 or bf16. In fp16
FSDP2 divides them in kernels of its own before and after, and skips a division by 1
(``_get_gradient_divide_factors``), so an fp16 step's ops change with the replicas: it is
not carried. An all-reduce's message is its buffer, whatever the group's size
(nccl-tests' ``S``); its wire bytes and link follow from the group, which pricing reads
off the ranks recorded with it. So a trace
over ``b`` replicas is the trace over ``b'`` with every group that spans the ``dp``
dimension given the ranks it spans over ``b'`` (the mesh is torchtitan's, ``dp`` outside
``fsdp``, ``cp`` and ``tp``: :data:`~torchroof.config.parallel_plan.MESH_DIMS`); the other
groups hold the same ranks. Where a group spanning ``dp`` is anything else (an all-gather,
whose message grows with the group; a group that is not all of the ranks along its
dimensions), nothing is carried (:func:`regrouped` gives None).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

from torchroof.config import Workload
from torchroof.config.parallel_plan import MESH_DIMS
from torchroof.counters.collectives import collective_kind
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace

SIZE_FREE = frozenset({"all_reduce", "broadcast"})
"""Collectives whose message is the same whatever the size of their group."""
REPLICAS = MESH_DIMS.index("dp")


def replicated(workload: Workload) -> bool:
    """Whether ``workload``'s step is the same program over any number of replicas past
    one, but its groups over them: a training step over ``dp`` > 1 replicas that shard
    nothing over them (ZeRO 0: DDP, or HSDP's replicas of ``fsdp`` shards), without a
    pipeline or expert parallel (whose groups may span the replicas), its gradients not
    reduced in fp16 (see the module)."""
    plan = workload.parallel_plan
    return (
        workload.trains
        and workload.zero == 0
        and workload.precision != "fp16"
        and plan.dp > 1
        and plan.pp == plan.ep == 1
    )


def replica_free(workload: Workload) -> Workload:
    """``workload`` as every :func:`replicated` step of its program is keyed: its replicas
    set to 2."""
    return replace(workload, dp=2) if replicated(workload) else workload


def regrouped(trace: Trace, workload: Workload) -> Trace | None:
    """``trace``, rank 0 of a :func:`replicated` step, as rank 0 of the same step over
    ``workload``'s replicas (``workload`` equal to its own but for them): a copy whose
    collectives over the ``dp`` dimension span ``workload``'s replicas, its facts keeping
    ``workload``; ``trace`` itself where the replicas are its own; None where a group that
    spans them is not carried (see the module)."""
    traced = trace.facts.workload
    if traced is None or not replicated(traced) or not replicated(workload):
        return None
    if replica_free(traced) != replica_free(workload):
        return None
    if traced.dp == workload.dp:
        return trace
    before, after = traced.parallel_plan.mesh_shape, workload.parallel_plan.mesh_shape
    ops = list(trace.ops)
    for position, op in enumerate(ops):
        ranks = op.args.get("group_ranks")
        if ranks is None:
            continue
        moved = _moved(op, list(ranks), before, after)
        if moved is None:
            return None
        if moved != ranks:
            args: dict[str, Any] = {**op.args, "group_ranks": moved, "group_size": len(moved)}
            ops[position] = replace(op, args=args)
    facts = replace(trace.facts)
    facts.workload = workload
    return replace(trace, ops=ops, facts=facts, copies=list(trace.copies))


def _moved(
    op: OpRecord, ranks: list[int], before: tuple[int, ...], after: tuple[int, ...]
) -> list[int] | None:
    """The ranks of ``op``'s group on the mesh ``after``: the same where the group does not
    span the replicas (rank 0's coordinates outside its dimensions are 0, and only the
    replicas' size changes), else every rank along the same dimensions of ``after`` in
    the mesh's order; None where it spans them but is no size-free collective, or is not
    every rank along its dimensions."""
    coordinates = [_unravel(rank, before) for rank in ranks]
    spanned = [d for d in range(len(before)) if any(c[d] for c in coordinates)]
    if REPLICAS not in spanned:
        return ranks
    try:
        kind = collective_kind(op)
    except ValueError:  # a collective pricing does not know: traced, it is left uncounted
        return None
    if kind not in SIZE_FREE or ranks != _along(spanned, before):
        return None
    return _along(spanned, after)


def _unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``rank``'s coordinates on a mesh of ``shape`` (row-major, as DeviceMesh lays ranks)."""
    out = []
    for size in reversed(shape):
        rank, coordinate = divmod(rank, size)
        out.append(coordinate)
    return tuple(reversed(out))


def _along(dims: list[int], shape: tuple[int, ...]) -> list[int]:
    """Every rank whose coordinates are 0 outside ``dims``, in the mesh's order."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    ranges = [range(shape[d]) for d in dims]
    return sorted(
        sum(c * strides[d] for c, d in zip(point, dims, strict=True))
        for point in itertools.product(*ranges)
    )

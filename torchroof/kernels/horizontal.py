"""Horizontal (sibling) fusion: independent kernels that read a common tensor become one."""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Sequence

from torchroof.counters import kind_of
from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.kernels.groups import Graph, Group, own_loop_order
from torchroof.records.ops import OpRecord

# Inductor tries sibling pairs no more than this many nodes apart
# (torch._inductor.config.max_fusion_buffer_group_pairwise_attempts = 64).
SIBLING_WINDOW_OPS = 64
# How many tensors the independence search may follow before it gives up and keeps the two
# kernels apart (an MoE expert loop with 600k ops otherwise spends minutes here).
SIBLING_SEARCH_STORAGES = 256


def _footprints(
    groups: list[Group], ops: Sequence[OpRecord]
) -> tuple[list[set[int]], list[set[int]], list[list[int]]]:
    """Per group: the storages it writes, the storages it reads from outside itself, and
    the elements of each tensor it writes or reads, in that order (its domain is the
    most of them: :func:`_domains`)."""
    produced: list[set[int]] = [set() for _ in groups]
    reads: list[set[int]] = [set() for _ in groups]
    touched: list[list[int]] = [[] for _ in groups]
    for n, g in enumerate(groups):
        for i in g.members:
            for t in written_tensors(ops[i]):
                produced[n].add(t.storage)
                touched[n].append(t.numel)
            if kind_of(ops[i].packet) == "creation":
                continue  # ``zeros_like(p)`` reads p's shape, not its values
            for t in read_tensors(ops[i]):
                if t.numel > 1:  # a 0-d constant is inlined, not a shared buffer
                    reads[n].add(t.storage)
                touched[n].append(t.numel)
    for n in range(len(groups)):
        reads[n] -= produced[n]
    return produced, reads, touched


def _domains(touched: list[list[int]]) -> Callable[[int], int]:
    """Each group's domain (the most elements any of its tensors holds, over its members
    before any merge), worked out when first compared: on a symbolic trace the larger of a
    weight and an activation is a comparison on sizes, taken only for the groups a sibling
    is weighed against (a GEMM's never is), so a plan holds over every batch where they
    agree."""
    found: dict[int, int] = {}

    def domain(n: int) -> int:
        if n not in found:
            found[n] = max((0, *touched[n]))
        return found[n]

    return domain


def _depends(
    later: int,
    earlier: int,
    groups: list[Group],
    produced: list[set[int]],
    group_of: dict[int, int],
    graph: Graph,
) -> bool:
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


def merge_horizontal(groups: list[Group], ops: Sequence[OpRecord], graph: Graph) -> None:
    """Sibling fusion: two fusable kernels of one phase that read a common tensor, run over
    the same number of elements and do not depend on each other become one kernel that
    reads the shared tensor once (Inductor's horizontal fusion, scored by shared bytes).
    SwiGLU backward's ``g·silu(gate)`` and ``silu_backward(g·up, gate)`` both read ``g``
    and ``gate``; RoPE's q and k kernels both read cos and sin."""
    group_of = {i: n for n, g in enumerate(groups) for i in g.members}
    columns = [any(own_loop_order(ops[i]) for i in g.members) for g in groups]
    produced, reads, touched = _footprints(groups, ops)
    domain = _domains(touched)

    def depends(later: int, earlier: int) -> bool:
        return _depends(later, earlier, groups, produced, group_of, graph)

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
                or domain(h) != domain(n)
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

"""A kernel's HBM bytes split by what they hold: weights, activations, KV cache, gradients,
optimizer state."""

from __future__ import annotations

from collections import defaultdict

from torchroof.counters.tensors import read_tensors, unique_bytes, written_tensors
from torchroof.kernels.fusion import Kernel

ACTIVATIONS = "activations"


def traffic_by_role(kernel: Kernel, roles: dict[int, str]) -> tuple[dict[str, int], dict[str, int]]:
    """The kernel's (read, written) bytes split by what they hold (weights, activations,
    KV cache, gradients, optimizer state). Where the rule said which tensors its bytes come
    from, that is used; otherwise each side is split in proportion to the unique bytes of
    the tensors it touches, so the parts always sum to the rule's own byte counts."""
    cost = kernel.cost
    sides: list[dict[str, int]] = []
    for explicit, tensors, total in (
        (cost.reads, [t for op in kernel.ops for t in read_tensors(op)], cost.bytes_read),
        (cost.writes, [t for op in kernel.ops for t in written_tensors(op)], cost.bytes_written),
    ):
        if explicit:  # the rule said which tensors its bytes come from
            split: dict[str, int] = defaultdict(int)
            for t, size in explicit:
                split[roles.get(t.storage, ACTIVATIONS)] += size
            sides.append(dict(split))
            continue
        by_role: dict[str, list] = defaultdict(list)
        for t in tensors:
            by_role[roles.get(t.storage, ACTIVATIONS)].append(t)
        sizes = {role: unique_bytes(ts) for role, ts in by_role.items()}
        whole = sum(sizes.values())
        if not whole:
            sides.append({ACTIVATIONS: total} if total else {})
            continue
        sides.append({role: round(total * size / whole) for role, size in sizes.items() if size})
    return sides[0], sides[1]

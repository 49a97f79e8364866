"""The device mesh of a parallel plan on CPU, with only the sub-groups rank 0 is in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchroof.config.parallel_plan import MESH_DIMS, ParallelPlan

FSDP_CP = "fsdp_cp"
"""The flattened fsdp x cp dimension of a context-parallel mesh: context-parallel ranks hold
the same parameters and sum their gradients, so torchtitan's FSDP shards over them too
(its ``dp_shard_cp``)."""


def build_mesh(plan: ParallelPlan) -> DeviceMesh:
    """The device mesh of ``plan`` on CPU, every dimension named (size-1 ones too, so
    ``mesh["tp"]`` always exists), and under context parallel the flattened
    :data:`FSDP_CP`. Needs a process group of ``plan.world`` ranks."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"build_mesh needs a process group of {plan.world} ranks: "
            f"call it inside `with fake_process_group({plan.world}):`"
        )
    if dist.get_world_size() != plan.world:
        raise ValueError(
            f"{plan} spans {plan.world} ranks, but the process group has {dist.get_world_size()}"
        )
    from torch.utils._python_dispatch import _disable_current_modes

    # every mode off: under a symbolic capture's fake tensor mode the mesh's rank tensor
    # would be fake, and ``rank in ranks`` a guard on a data-dependent value
    with _rank_zero_groups(), _disable_current_modes():
        mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_DIMS)
        if plan.cp > 1:  # FSDP shards over the fsdp and cp ranks together (torchtitan)
            mesh["fsdp", "cp"]._flatten(FSDP_CP)
        return mesh


class _NotThisRank:
    """A sub-group this rank is not in: the mesh reads only its (unused) name."""

    group_name = None


@contextlib.contextmanager
def _rank_zero_groups() -> Iterator[None]:
    """Create only the mesh's sub-groups that hold this rank (rank 0 is the one traced).
    ``init_device_mesh`` makes every group of every dimension (world / size of each), which
    a real job needs on every rank but a fake one does not: with it the cost of a step grew
    with the world size (140,000 groups, 12 s, for tp=2 x dp=20,000) though rank 0's trace
    is the same; without, it is a handful of groups whatever the world."""
    import torch.distributed.device_mesh as device_mesh

    real = device_mesh.new_group
    rank = dist.get_rank()

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is not None and rank not in ranks:
            return _NotThisRank()
        return real(ranks, *args, **kwargs)

    device_mesh.new_group = new_group
    try:
        yield
    finally:
        device_mesh.new_group = real

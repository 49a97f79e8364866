"""How many ranks each kind of parallelism spans: the mesh sizes of a step's program."""

from __future__ import annotations

import math
from dataclasses import dataclass

MESH_DIMS = ("pp", "dp", "fsdp", "cp", "tp")
"""Mesh dimensions, outermost first, as torchtitan orders them: tensor parallel innermost,
so a TP group is consecutive ranks (one node's NVLink domain); pipeline stages outermost,
so stage s runs on ranks s · (world / pp) + ... ."""


@dataclass(frozen=True)
class ParallelPlan:
    """How many ranks each kind of parallelism spans; the world is their product.

    ``pp``: pipeline stages (one traced program per distinct stage,
    torchroof.parallel.pipeline.price).
    ``dp``: replicas (HSDP's replicate dimension when ``fsdp`` > 1). ``fsdp``: ranks each
    parameter is sharded over (FSDP2, ZeRO-3). ``cp``: context parallel (sequence shards).
    ``tp``: tensor parallel (the model's ``base_model_tp_plan``). ``ep``: expert parallel,
    not a dimension of its own: the routed experts are sharded over groups of ``ep``
    consecutive ranks of one stage (torchroof.parallel.expert), which hold different
    tokens (dp, fsdp: other batches; cp: other shares of the sequences) or the same ones
    (tp) for everything else.
    """

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_DIMS, "ep"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelPlan.{name} must be a positive integer, got {size!r}")

    @property
    def world(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def shards_data(self) -> bool:
        """Parameters are sharded or replicated over data ranks (FSDP2 / HSDP / DDP),
        context-parallel ones included (they hold the same parameters and sum their
        gradients): a training step reduces its gradients over them."""
        return self.fsdp * self.dp * self.cp > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes in :data:`MESH_DIMS` order."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return MESH_DIMS

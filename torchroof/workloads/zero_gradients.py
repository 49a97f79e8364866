"""What ZeRO-1 holds of each gradient beside the traced program, recorded in the step's
facts: the whole-gradient buffer DeepSpeed's stage 1 and Megatron's distributed optimizer
keep until the reduce-scatter (Rajbhandari et al. 2020, ZeRO, Sec. 5: P_os keeps gradients
whole), in the reduction's dtype, over the sharded fp32 gradients the traced step keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from torchroof.capture.storage import local_shard
from torchroof.records.facts import StepFacts, bf16_buffer

if TYPE_CHECKING:
    from torchroof.config import Workload

# Mesh dimensions a parameter is split over that ZeRO leaves split (its gradient too).
_MODEL_PARALLEL_DIMS = ("tp", "ep", "pp", "cp")


def record_zero_gradients(
    facts: StepFacts, params: Sequence[torch.Tensor], workload: Workload
) -> None:
    """Under ZeRO-1, ``facts.whole_gradients`` (and ``whole_gradients_traced`` where the
    reduction waits for the last micro-batch); nothing for another stage."""
    if workload.zero != 1:
        return
    if workload.defer_gradient_sync and workload.microbatches > 1:
        # the traced program itself holds every gradient FSDP2 shards unsharded until the
        # last micro-batch (it accumulates them, in the reduce dtype): ZeRO-1's whole
        # buffer; those of parameters it leaves whole are held as traced, beside it
        facts.whole_gradients_traced = True
        facts.whole_gradients = unsharded_share(params)
        return
    whole = whole_over_sharded(params)
    if workload.precision == "mixed" and workload.reduce_dtype == "bf16":
        whole = bf16_buffer(whole)  # Megatron's grad_reduce_in_fp32=False
    facts.whole_gradients = whole


def _data_ranks(p: torch.Tensor) -> int:
    """The data-parallel ranks ``p`` is split over (FSDP2's shard, over the dp ranks under
    ZeRO, or the ranks holding the same experts); 1 for a tensor split only over
    model-parallel ranks, or not at all."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:  # a plain tensor: held whole already
        return 1
    names = mesh.mesh_dim_names or ()
    ranks = 1
    for dim, placement in enumerate(getattr(p, "placements", ())):
        name = names[dim] if dim < len(names) else ""
        # FSDP2 shards a tensor-parallel or expert weight with a strided shard
        split = placement.is_shard() or type(placement).__name__ == "_StridedShard"
        if split and name not in _MODEL_PARALLEL_DIMS:
            ranks *= mesh.size(dim)
    return ranks


def unsharded_share(params: Sequence[torch.Tensor]) -> float:
    """The share of the rank's traced gradient elements whose parameters no data-parallel
    rank shards (experts held by one rank each, parameters FSDP2 leaves out): FSDP2 does
    not accumulate theirs, so they are held as traced."""
    held = kept = 0
    for p in params:
        count = local_shard(p).numel()
        held += count
        kept += count if _data_ranks(p) == 1 else 0
    return kept / held if held else 0.0


def whole_over_sharded(params: Sequence[torch.Tensor]) -> float:
    """The elements of ``params`` whole over their data-parallel shards, tensor and expert
    shards kept, over the elements the rank holds: what ZeRO-1 keeps of each gradient until
    it is reduced, against what the traced program keeps."""
    held = whole = 0
    for p in params:
        count = local_shard(p).numel()
        held += count
        whole += count * _data_ranks(p)
    return whole / held if held else 1.0

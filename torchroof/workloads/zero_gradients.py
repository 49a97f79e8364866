"""What ZeRO-1 holds of each gradient beside the traced program, recorded in the step's
facts: the whole-gradient buffer DeepSpeed's stage 1 and Megatron's distributed optimizer
keep until the reduce-scatter (Rajbhandari et al. 2020, ZeRO, Sec. 5: P_os keeps gradients
whole), in the reduction's dtype, over the sharded fp32 gradients the traced step keeps;
and, for ZeRO-1 and DDP whose reduction waits for the last micro-batch, that the traced
accumulation is that buffer (the gradients the optimizer reads are views of it)."""

from __future__ import annotations

import math
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
    reduction waits for the last micro-batch); under DDP whose reduction waits for the last
    micro-batch, ``whole_gradients_traced``; nothing otherwise."""
    if workload.zero not in (0, 1):
        return
    if workload.accumulates_whole_gradients:
        # the traced program itself holds every gradient FSDP2 shards or replicates
        # unsharded until the last micro-batch (it accumulates them, in the reduce dtype):
        # ZeRO-1's whole buffer, DDP's gradient buffer (Megatron's main_grad, torch DDP's
        # param.grad under no_sync); those of parameters it leaves out are held as
        # traced, beside it
        facts.whole_gradients_traced = True
        facts.whole_gradients = unsharded_share(params)
        return
    if workload.zero == 0:
        return
    whole = whole_over_sharded(params)
    if workload.precision == "mixed" and workload.reduce_dtype == "bf16":
        whole = bf16_buffer(whole)  # Megatron's grad_reduce_in_fp32=False
    facts.whole_gradients = whole


def _data_dims(p: torch.Tensor) -> list[tuple[int, bool]]:
    """The data-parallel mesh dimensions of more than one rank ``p`` lies on, each with its
    size and whether ``p`` is split over it (FSDP2's shard, over the dp ranks under ZeRO,
    or the ranks holding the same experts) rather than replicated (DDP); none for a plain
    tensor or one split only over model-parallel ranks."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:  # a plain tensor: held whole already
        return []
    names = mesh.mesh_dim_names or ()
    dims = []
    for dim, placement in enumerate(getattr(p, "placements", ())):
        name = names[dim] if dim < len(names) else ""
        if name in _MODEL_PARALLEL_DIMS or mesh.size(dim) == 1:
            continue
        # FSDP2 shards a tensor-parallel or expert weight with a strided shard
        split = placement.is_shard() or type(placement).__name__ == "_StridedShard"
        dims.append((mesh.size(dim), split))
    return dims


def _data_ranks(p: torch.Tensor) -> int:
    """The data-parallel ranks ``p`` is split over; 1 for a tensor replicated over them,
    split only over model-parallel ranks, or not at all."""
    return math.prod(size for size, split in _data_dims(p) if split)


def unsharded_share(params: Sequence[torch.Tensor]) -> float:
    """The share of the rank's traced gradient elements whose parameters lie on no
    data-parallel ranks (experts held by one rank each, parameters FSDP2 leaves out):
    FSDP2 does not accumulate theirs, so they are held as traced."""
    held = kept = 0
    for p in params:
        count = local_shard(p).numel()
        held += count
        kept += count if not _data_dims(p) else 0
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

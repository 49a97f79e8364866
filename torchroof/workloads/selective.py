"""Selective activation checkpointing as torchtitan runs it: a per-op policy over
``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

torchtitan's ``op`` policy (``torchtitan/distributed/activation_checkpoint.py``,
``_op_sac_save_list`` and ``_get_custom_policy``) keeps the outputs of the costly ops of a
block (matrix multiplications, attention, reduce-scatters and ``max``, which fp8 scaling
reads) and recomputes the rest in backward, except that every second ``mm`` is recomputed
too, to hold the memory down. Attention is recorded as the flash kernel a GPU launches
(:mod:`torchroof.capture.sdpa`), which the policy never sees: its output is kept, as the
policy keeps ``_scaled_dot_product_flash_attention``'s, and the recompute re-runs the math
path unrecorded (``SdpaSubstitution.keep_forward_outputs``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _save_list() -> frozenset[Any]:
    """The ops whose outputs torchtitan's per-op policy keeps (those this torch has)."""
    ops = [
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten.max.default,
    ]
    functional = getattr(torch.ops, "_c10d_functional", None)
    scatter = getattr(functional, "reduce_scatter_tensor", None)
    if scatter is not None:
        ops.append(scatter.default)
    return frozenset(ops)


SAVE_LIST = _save_list()


def torchtitan_op_policy() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: one block's contexts,
    counting its ``mm`` calls in the forward and in the recompute separately (both must
    make the same choices)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        every_second_mm = func == aten.mm.default and counts[mode] % 2 == 0
        if func in SAVE_LIST and not every_second_mm:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)

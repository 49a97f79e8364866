"""Normalisation layers, forward and backward.

seed 000 Table 3: RMSNorm ~5 FLOP/element and LayerNorm (mean + var) ~9, each a read of x
and a write of y (I = 1.25 and 2.25 in bf16). Backward reads dy, x and the saved statistics
and writes dx (and dweight, dbias when asked).
"""

from __future__ import annotations

from torchroof.counters.registry import register_per_element

from torchroof.records import OpRecord

# FLOPs per element of the normalised input.
NORM_FLOPS: dict[str, int] = {
    "_fused_rms_norm": 5,  # Table 3: square, sum, rsqrt·x, weight multiply (~5)
    "native_layer_norm": 9,  # Table 3: LayerNorm (mean + var) ~9
    "native_group_norm": 9,  # as LayerNorm, statistics per group
    "native_batch_norm": 9,  # training: statistics and normalise
    "_native_batch_norm_legit": 9,
    "_native_batch_norm_legit_functional": 9,
    "_batch_norm_with_update": 9,
    "_batch_norm_with_update_functional": 9,
    "_native_batch_norm_legit_no_training": 2,  # inference: one scale and one shift
    "_batch_norm_no_update": 2,
    # backward: recompute x̂ (2), g·w (1), two row sums (2), combine (4), dweight/dbias (3)
    "_fused_rms_norm_backward": 9,
    "native_layer_norm_backward": 13,
    "native_group_norm_backward": 13,
    "native_batch_norm_backward": 13,
    "batch_norm_backward": 13,
}


def _normalised_numel(op: OpRecord) -> int:
    return op.inputs[0].numel if op.inputs else 0


register_per_element(
    NORM_FLOPS, elements=_normalised_numel, what="seed 000 Table 3", in_place=False
)

"""Normalisation layers, forward and backward.

RMSNorm ~5 FLOP/element and LayerNorm (mean + var) ~9, each a read of x
and a write of y (I = 1.25 and 2.25 in bf16). Backward reads dy, x and the saved statistics
and writes dx (and dweight, dbias when asked).
"""

from __future__ import annotations

from torchroof.counters.registry import register_per_element

from torchroof.records.ops import OpRecord

# FLOPs per element of the normalised input, per kind (counters/registry.py OP_KINDS).
# Norms over the last dimension: per-row statistics, from which a compiled backward
# rebuilds y.
ROW_NORM_FLOPS: dict[str, int] = {
    "_fused_rms_norm": 5,  # square, sum, rsqrt·x, weight multiply (~5)
    "native_layer_norm": 9,  # LayerNorm (mean + var) ~9
}
# Their backward: recompute x̂ (2), g·w (1), two row sums (2), combine (4), dweight/dbias (3);
# the weight and bias gradients are column reductions (torchroof/kernels/column_reductions.py).
ROW_NORM_BACKWARD_FLOPS: dict[str, int] = {
    "_fused_rms_norm_backward": 9,
    "native_layer_norm_backward": 13,
}
# Statistics over channels or groups, forward and backward: fused as reductions.
CHANNEL_NORM_FLOPS: dict[str, int] = {
    "native_group_norm": 9,  # as LayerNorm, statistics per group
    "native_batch_norm": 9,  # training: statistics and normalise
    "_native_batch_norm_legit": 9,
    "_native_batch_norm_legit_functional": 9,
    "_batch_norm_with_update": 9,
    "_batch_norm_with_update_functional": 9,
    "_native_batch_norm_legit_no_training": 2,  # inference: one scale and one shift
    "_batch_norm_no_update": 2,
    "native_group_norm_backward": 13,  # as the row norms' backward
    "native_batch_norm_backward": 13,
    "batch_norm_backward": 13,
}
NORM_FLOPS: dict[str, int] = {**ROW_NORM_FLOPS, **ROW_NORM_BACKWARD_FLOPS, **CHANNEL_NORM_FLOPS}


def _normalised_numel(op: OpRecord) -> int:
    return op.inputs[0].numel if op.inputs else 0


_WHAT = "the norm counts above"
register_per_element(
    ROW_NORM_FLOPS, kind="norm", elements=_normalised_numel, what=_WHAT, in_place=False
)
register_per_element(
    ROW_NORM_BACKWARD_FLOPS,
    kind="norm_backward",
    elements=_normalised_numel,
    what=_WHAT,
    in_place=False,
)
register_per_element(
    CHANNEL_NORM_FLOPS, kind="reduction", elements=_normalised_numel, what=_WHAT, in_place=False
)

"""Loss kernels. ``cross_entropy`` decomposes into ``_log_softmax`` + ``nll_loss``.

Large-vocabulary logits (Wijmans et al. 2024, "Cut Your Losses"): the N_t × V logits are read by the
log-softmax, and its gradient is a full N_t × V write, which is where the traffic lies.
"""

from __future__ import annotations

from torchroof.counters.cost import Cost
from torchroof.counters.registry import aten_packets, register, register_per_element
from torchroof.counters.tensors import (
    distinct,
    read_tensors,
    tensor_arg,
    unique_bytes,
    written_tensors,
)

from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta


@register("aten.nll_loss_forward", kind="loss")
@register(*aten_packets("nll_loss2d_forward"), kind="opaque")  # NB: not modelled as a gather
def nll_loss(op: OpRecord) -> Cost:
    """Gathers one log-probability per target and sums: reads N values (not N·C), N targets."""
    log_probs, target = tensor_arg(op, "self"), tensor_arg(op, "target")
    weight = op.tensor("weight")
    reads: tuple[tuple[TensorMeta, int], ...] = (
        (log_probs, target.numel * log_probs.itemsize),
        (target, target.nbytes),
    )
    reads += ((weight, weight.nbytes),) if weight is not None else ()
    read = sum(n for _, n in reads)
    return Cost(
        target.numel, read, unique_bytes(op.outputs), "vector", log_probs.dtype, reads=reads
    )


@register("aten.nll_loss_backward", kind="rearrange")  # one-hot, built in its reader
@register(*aten_packets("nll_loss2d_backward"), kind="opaque")  # NB: not modelled as fusing
def nll_loss_backward(op: OpRecord) -> Cost:
    """Zero-filled N × C gradient with -w/total at each target: one full write. ``self``
    (the log-probabilities) gives only its shape: its values are not read."""
    log_probs, target = tensor_arg(op, "self"), tensor_arg(op, "target")
    reads = tuple((t, 0 if t is log_probs else t.nbytes) for t in distinct(read_tensors(op)))
    written = unique_bytes(written_tensors(op))
    read = sum(n for _, n in reads)
    return Cost(target.numel, read, written, "vector", log_probs.dtype, reads=reads)


# FLOPs per element for the elementwise losses and their gradients.
ELEMENTWISE_LOSS_FLOPS: dict[str, int] = {
    "mse_loss": 3,  # subtract, square, sum
    "mse_loss_backward": 3,  # subtract, scale, multiply by g
    "l1_loss": 3,
    "smooth_l1_loss": 5,
    "smooth_l1_loss_backward": 4,
    "huber_loss": 5,
    "huber_loss_backward": 4,
    "binary_cross_entropy": 6,  # two logs, two multiplies, add, sum
    "binary_cross_entropy_backward": 5,
    "binary_cross_entropy_with_logits": 8,  # log-sigmoid form
    "soft_margin_loss": 5,
    "soft_margin_loss_backward": 5,
    "multilabel_margin_loss_forward": 3,
}


def _first_input_numel(op: OpRecord) -> int:
    return op.inputs[0].numel


# NB: kernels of their own (their pointwise work and sum are not modelled as fusing).
register_per_element(
    ELEMENTWISE_LOSS_FLOPS,
    kind="opaque",
    elements=_first_input_numel,
    what="inputs read once",
    in_place=False,
)

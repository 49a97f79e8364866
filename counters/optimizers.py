"""Fused optimizer kernels (what ``torch.optim`` runs with ``fused=True`` on a GPU).

Optimizers as memory workloads (docs/concepts/optimizer-bytes.md; Adam: Kingma & Ba 2015):
Adam reads param, grad, m, v and writes param,
m, v, ~12 FLOPs per parameter; the gradient is written back only when a grad scaler
unscales it in place.
"""

from __future__ import annotations

from torchroof.counters.cost import Cost
from torchroof.counters.registry import aten_packets, register
from torchroof.counters.tensors import distinct, unique_bytes

from torchroof.records.ops import OpRecord

# FLOPs per parameter element.
ADAM_FLOPS = 12  # about 12 FLOPs per parameter against 30 bytes moved (fp32 master + bf16)
SGD_FLOPS = 2  # p -= lr·g (+ weight decay)
SGD_MOMENTUM_FLOPS = 4  # b = μ·b + g; p -= lr·b
ADAGRAD_FLOPS = 6  # s += g²; p -= lr·g / (√s + eps)
# A moment kept as 8-bit codes with one fp32 scale per block (Dettmers et al. 2022, "8-bit
# Optimizers via Block-wise Quantization"; torchao.optim's quant_utils), per element:
#   dequantise   code -> map value (table lookup) 1, x block scale 1           = 2
#   requantise   |x| and the block's running max 2, / block max 1,
#                8-step branchless binary search over the 256-entry map
#                (one compare-select per step) 8, round to the nearer code 1   = 12
# (index arithmetic and the gathers' addresses are not counted: NB a modest count).
QUANTISED_MOMENT_FLOPS = 2 + 12
ADAM_8BIT_FLOPS = ADAM_FLOPS + 2 * QUANTISED_MOMENT_FLOPS  # 12 + 2·14 = 40


def _fused_cost(op: OpRecord, flops_per_element: int, state: tuple[str, ...]) -> Cost:
    params = op.tensors("self") or op.tensors("params")
    grads = op.tensors("grads")
    states = [t for name in state for t in op.tensors(name)]
    steps = op.tensors("state_steps")
    grads_written = grads if op.tensor("grad_scale") is not None else []
    numel = sum(t.numel for t in params)
    read = unique_bytes(params + grads + states + steps)
    written = unique_bytes(params + states + grads_written)
    dtype = params[0].dtype if params else ""
    return Cost(flops_per_element * numel, read, written, "vector", dtype)


@register(
    *aten_packets("_fused_adam_", "_fused_adamw_", "_fused_adam", "_fused_adamw"),
    kind="optimizer",
)
def fused_adam(op: OpRecord) -> Cost:
    """Adam/AdamW: reads p, g, m, v (and max v for AMSGrad), writes p, m, v (Kingma & Ba 2015)."""
    return _fused_cost(op, ADAM_FLOPS, ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))


@register(*aten_packets("_fused_sgd_", "_fused_sgd"), kind="optimizer")
def fused_sgd(op: OpRecord) -> Cost:
    """SGD (momentum buffers when given): 14 B/param plain, 22 with momentum under the
    fp32-master convention (Micikevicius et al. 2018; docs/concepts/optimizer-bytes.md)."""
    has_momentum = bool(op.tensors("momentum_buffer_list"))
    flops = SGD_MOMENTUM_FLOPS if has_momentum else SGD_FLOPS
    return _fused_cost(op, flops, ("momentum_buffer_list",))


@register(*aten_packets("_fused_adagrad_", "_fused_adagrad"), kind="optimizer")
def fused_adagrad(op: OpRecord) -> Cost:
    """Adagrad: reads p, g, the squared-gradient sum; writes p and the sum."""
    return _fused_cost(op, ADAGRAD_FLOPS, ("state_sums",))


@register("torchroof.fused_optimizer_step", kind="optimizer")
def fused_optimizer_step(op: OpRecord) -> Cost:
    """The one fused kernel a training runtime launches for the whole update:
    reads params, grads and state buffers once; writes params and state once, plus the
    low-precision weight copy (``params_out``) when fp32 masters are kept. AdamW with fp32
    masters and a bf16 copy: 4 + 4 + 4 + 4 read, 4 + 4 + 4 + 2 written = 30 B/param. Low-bit
    state is priced by what it stores (each state tensor's nbytes): 8-bit Adam's uint8 codes
    and fp32 block scales, 4 + 4 + 1 + 1 read, 4 + 1 + 1 + 2 written = 18 B/param plus
    2·4·2/256 B of scales (8-bit Adam, Dettmers et al. 2022: about 16 B without the bf16 copy).

    A traced ``torch.optim`` step priced this way (torchroof.kernels.optimizer_step) may also pass
    ``inputs`` (other tensors read once: a learning-rate tensor) and ``flops`` (the total of
    the ops it replaces) instead of ``flops_per_element``."""
    params, grads = op.tensors("params"), op.tensors("grads")
    states, params_out = op.tensors("states"), op.tensors("params_out")
    numel = sum(t.numel for t in params)
    reads = tuple((t, t.nbytes) for t in distinct(params + grads + states + op.tensors("inputs")))
    writes = tuple((t, t.nbytes) for t in distinct(params + states + params_out))
    total = op.arg("flops")
    flops = int(total) if total is not None else int(op.arg("flops_per_element")) * numel
    dtype = params[0].dtype if params else ""
    return Cost(
        flops,
        sum(n for _, n in reads),
        sum(n for _, n in writes),
        "vector",
        dtype,
        reads=reads,
        writes=writes,
    )

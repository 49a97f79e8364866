"""Train: forward, cross-entropy on labels, the real autograd backward and a steady-state
optimizer step (state already allocated), all traced (about 6N FLOPs per token: Kaplan et
al. 2020; optimizer bytes: docs/concepts/optimizer-bytes.md)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers

from torchroof.capture.mode import Capture
from torchroof.capture.storage import local_shard
from torchroof.config.errors import WorkloadError
from torchroof.counters.optimizers import (
    ADAM_8BIT_FLOPS,
    ADAM_FLOPS,
    SGD_FLOPS,
    SGD_MOMENTUM_FLOPS,
)
from torchroof.models.sources import model_dtype
from torchroof.parallel.sequence import loss_context
from torchroof.parallel.stages import per_microbatch, stage_backward
from torchroof.progress import silenced
from torchroof.records.trace import Trace
from torchroof.workloads.hf_cache import recurrent_only_cache
from torchroof.workloads.inputs import labels_for, patch_inputs, random_ids, seq_of, token_ids
from torchroof.workloads.microbatches import run_microbatches
from torchroof.workloads.parallel_step import plan_label
from torchroof.workloads.selective import torchtitan_op_policy
from torchroof.workloads.spec import TARGET, Regime
from torchroof.workloads.zero_gradients import record_zero_gradients

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from torchroof.config import Workload

# torchao 0.18 AdamW8bit defaults (torchao/optim/adam.py, subclass_8bit.py).
EIGHT_BIT_BLOCK = 256  # elements sharing one fp32 scale
EIGHT_BIT_MIN_NUMEL = 4096  # smaller tensors keep full-precision moments


@dataclass(frozen=True)
class FusedOptimizer:
    """An optimizer priced as the single fused kernel a GPU runs: its FLOPs per parameter
    element and the state it keeps per parameter (docs/concepts/optimizer-bytes.md: Adam
    ~12 FLOPs, two moments; SGD one step, momentum one buffer)."""

    flops_per_element: int
    moments: int  # state buffers per parameter
    moment_dtype: torch.dtype | None = None  # None: the dtype of the weights it updates
    eight_bit: bool = False  # torchao's block-quantised moments where a parameter allows

    def quantises(self, param: torch.Tensor) -> bool:
        """torchao.optim ``_new_buffer``: only tensors of >= 4096 elements that split into
        whole blocks get 8-bit state (as bitsandbytes); the others keep full moments."""
        numel = param.numel()
        return self.eight_bit and numel >= EIGHT_BIT_MIN_NUMEL and numel % EIGHT_BIT_BLOCK == 0

    def flops(self, param: torch.Tensor) -> int:
        per_element = ADAM_8BIT_FLOPS if self.quantises(param) else self.flops_per_element
        return per_element * param.numel()


FUSED_OPTIMIZERS: dict[str, FusedOptimizer] = {
    "adamw": FusedOptimizer(ADAM_FLOPS, 2),
    "adam": FusedOptimizer(ADAM_FLOPS, 2),
    "sgd": FusedOptimizer(SGD_FLOPS, 0),
    "sgd-momentum": FusedOptimizer(SGD_MOMENTUM_FLOPS, 1),
    # torchao.optim.AdamW8bit: each parameter's update is one torch.compile'd kernel
    # (single_param_adam), which cannot run under capture's dispatch mode; priced as this
    # fused step over uint8 codes + fp32 block scales (Dettmers et al. 2022: 8-bit Adam).
    "adamw8bit": FusedOptimizer(ADAM_FLOPS, 2, eight_bit=True),
    # bf16 moments whatever the precision (DeepSeek-V3 technical report, "Low-Precision
    # Storage and Communication"); with precision="mixed" the fp32 masters and grads stay.
    "adamw-bf16-moments": FusedOptimizer(ADAM_FLOPS, 2, moment_dtype=torch.bfloat16),
}
# Optimizers whose torch.optim step is traced as it runs (no single fused kernel exists).
TRACED_OPTIMIZERS = ("adafactor", "muon")
OPTIMIZERS = (*FUSED_OPTIMIZERS, *TRACED_OPTIMIZERS)


def compute_dtype(workload: Workload) -> torch.dtype:
    """Mixed precision computes in bf16 (fp32 masters and state); otherwise the precision."""
    return torch.bfloat16 if workload.precision == "mixed" else model_dtype(workload.precision)


# -- training -------------------------------------------------------------------------------
@dataclass
class _OptimizerState:
    """What the optimizer keeps per parameter: fp32 masters (mixed), gradients it reads,
    and its moment buffers."""

    params: list[torch.Tensor]
    masters: list[torch.Tensor]  # == params unless precision is mixed
    grads: list[torch.Tensor]  # what the optimizer reads (fp32 main grads when mixed)
    states: list[torch.Tensor]  # every state buffer of every parameter (8-bit: codes, scales)
    steps: list[torch.Tensor]


def _allocate_state(params: Sequence[torch.Tensor], workload: Workload) -> _OptimizerState:
    mixed = workload.precision == "mixed"

    def like(p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is None:
            dtype = torch.float32 if mixed else p.dtype
        return torch.empty_like(p, dtype=dtype, device="meta")

    masters = [like(p) for p in params] if mixed else list(params)
    grads = [like(p) for p in params] if mixed else []
    spec = FUSED_OPTIMIZERS.get(workload.optimizer, FusedOptimizer(0, 0))
    states = [t for m in masters for t in _moments(m, spec, like)]
    steps = [torch.ones((), dtype=torch.float32) for _ in params]
    return _OptimizerState(list(params), masters, grads, states, steps)


def _moments(
    master: torch.Tensor, spec: FusedOptimizer, like: Callable[..., torch.Tensor]
) -> list[torch.Tensor]:
    """The moment buffers of one parameter: 8-bit, per moment one uint8 code per element
    and one fp32 scale per block of 256 (torchao ``OptimState8bit.zeros``); otherwise one
    tensor per moment in ``spec.moment_dtype`` (the masters' dtype when unset)."""
    if spec.quantises(master):
        blocks = master.numel() // EIGHT_BIT_BLOCK
        return [
            t
            for _ in range(spec.moments)
            for t in (
                like(master, torch.uint8),
                torch.empty(blocks, dtype=torch.float32, device="meta"),
            )
        ]
    return [like(master, spec.moment_dtype) for _ in range(spec.moments)]


def _fused_step(
    capture: Capture, state: _OptimizerState, grads: list[torch.Tensor], workload: Workload
) -> None:
    """One fused kernel over every parameter this rank holds: reads weights, ``grads`` and
    state once, writes weights and state once (and the bf16 weights from the fp32 masters
    when mixed). Its FLOPs are each parameter's: 8-bit Adam's dequantise/requantise work
    only where the moments are quantised."""
    spec = FUSED_OPTIMIZERS[workload.optimizer]
    mixed = workload.precision == "mixed"
    capture.record_synthetic(
        "torchroof.fused_optimizer_step.default",
        {
            "params": state.masters,
            "grads": grads,
            "states": state.states,
            "params_out": state.params if mixed else [],
        },
        {"optimizer": workload.optimizer, "flops": sum(spec.flops(p) for p in state.masters)},
        phase="optimizer",
    )


def _traced_step(capture: Capture, state: _OptimizerState, workload: Workload, opt: Any) -> None:
    """Run a torch.optim step as it is (Adafactor: Shazeer & Stern 2018; Muon: Jordan et al.
    2024); with mixed precision it updates
    the fp32 masters and the bf16 weights are rewritten from them."""
    with capture.phase("optimizer"), torch.no_grad():
        opt.step()
        if workload.precision == "mixed":
            torch._foreach_copy_(state.params, state.masters)


def _make_torch_optimizer(workload: Workload, state: _OptimizerState, names: list[str]) -> Any:
    masters = state.masters
    if workload.precision == "mixed":
        for master, grad in zip(masters, state.grads, strict=True):
            master.grad = grad
    if workload.optimizer == "adafactor":
        return torch.optim.Adafactor(masters, lr=1e-3, foreach=True)
    # Muon orthogonalises 2-D hidden matrices; embeddings, the head and 1-D parameters
    # take AdamW, as the Muon write-up (Jordan et al. 2024) prescribes.
    hidden = [
        p
        for p, n in zip(masters, names, strict=True)
        if p.ndim == 2 and "embed" not in n and "lm_head" not in n and "wte" not in n
    ]
    rest = [p for p in masters if all(p is not h for h in hidden)]
    return _MuonWithAdamW(
        torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4, foreach=True)
    )


class _MuonWithAdamW:
    def __init__(self, muon: Any, adamw: Any) -> None:
        self.parts = [muon, adamw]
        self.state = {**muon.state, **adamw.state}

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def state_tensors(self) -> list[torch.Tensor]:
        return [
            t
            for part in self.parts
            for per_param in part.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor) and t.is_meta
        ]


def trace_train(models: Mapping[str, torch.nn.Module], workload: Workload) -> Trace:
    """``microbatches`` forward passes, cross-entropy on labels and real autograd backward
    passes (gradients accumulate), then one steady-state optimizer step (state already
    allocated), all traced.

    On a parallel plan the step is rank 0's: the optimizer updates the local
    shards (a DTensor parameter's ``to_local()``), its state is allocated at their shapes,
    and FSDP2 reduce-scatters each micro-batch's gradients, as torchtitan's trainer does
    (it leaves gradient sync on); ``defer_gradient_sync`` turns it off before all but the
    last micro-batch (``set_requires_gradient_sync(False)``): one reduction per step, the
    unsharded gradients held between micro-batches. With sequence parallel the
    cross-entropy runs on the vocabulary-sharded logits under ``loss_parallel()``
    (transformers' own loss, given a DTensor, works there as it is)."""
    model = models[TARGET]
    if workload.optimizer in TRACED_OPTIMIZERS and workload.parallel_plan.world > 1:
        raise WorkloadError(
            f"the {workload.optimizer} optimizer is not yet traced on sharded parameters: its "
            "update reads whole matrices (row and column statistics, Newton-Schulz), which a "
            "rank's shard is not; use " + ", ".join(FUSED_OPTIMIZERS)
        )
    model.train()
    if workload.checkpointing:
        selective = workload.checkpoint_policy == "selective"
        _checkpoint_activations(model, workload.checkpoint_every, selective)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    state = _allocate_state([local_shard(p) for p in params], workload)
    opt = _warmed_up_optimizer(workload, state, names, params)
    ids = token_ids(model, workload.batch, seq_of(workload))
    capture = Capture()
    capture.sdpa.keep_forward_outputs = workload.checkpoint_policy == "selective"
    with capture as trace:
        _mark_state(capture, state, workload, opt)
        copied = run_microbatches(
            capture,
            workload,
            lambda micro: _microbatch(model, ids, capture, state, params, workload, micro),
        )
        if workload.precision == "mixed":
            grads = state.grads
        else:
            capture.mark([p.grad for p in params if p.grad is not None], "gradients")
            with capture.phase("backward", "gradient layout"), torch.no_grad():
                grads = _local_grads(params)
            capture.mark(grads, "gradients", count_bytes=False)  # a redistributed copy
        _optimizer_step(capture, state, grads, workload, opt)
    _record_step(trace, params, workload)
    trace.facts.repeated_microbatches = copied
    return trace


def _checkpoint_activations(
    model: torch.nn.Module, every: int = 1, selective: bool = False
) -> None:
    """transformers' activation checkpointing (non-reentrant) on the model's layers, every
    ``every``-th decoder layer (``every_n_layers``; the others keep their activations, as
    torchtitan's selective layer policy does with ``selective_ac_option = "2"``); with
    ``selective``, each checkpointed layer under torchtitan's per-op policy
    (:func:`torchroof.workloads.selective.torchtitan_op_policy`)."""
    enable_activations = getattr(model, "activation_checkpointing_enable", None)
    enable_gradients = getattr(model, "gradient_checkpointing_enable", None)
    if enable_gradients is None and enable_activations is None:
        raise WorkloadError("activation checkpointing needs a transformers model")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = torchtitan_op_policy
    takes_every = enable_activations is not None and (
        "every_n_layers" in inspect.signature(enable_activations).parameters
    )
    if every != 1 and not takes_every:
        raise WorkloadError(
            "checkpoint_every needs a transformers whose activation_checkpointing_enable "
            f"takes every_n_layers (this is {transformers.__version__}): upgrade transformers"
        )
    if enable_activations is not None:  # transformers >= 5.x
        layers = {"every_n_layers": every} if takes_every else {}
        enable_activations(activation_checkpointing_kwargs=kwargs, **layers)
    elif enable_gradients is not None:
        enable_gradients(gradient_checkpointing_kwargs=kwargs)


def _warmed_up_optimizer(
    workload: Workload,
    state: _OptimizerState,
    names: list[str],
    params: Sequence[torch.Tensor],
) -> Any:
    """The torch.optim optimizer a traced step runs (Adafactor, Muon), its state allocated
    by one untraced warm-up step; None for a fused optimizer (priced as one kernel)."""
    if workload.optimizer not in TRACED_OPTIMIZERS:
        return None
    opt = _make_torch_optimizer(workload, state, names)
    if workload.precision != "mixed":
        for p in params:
            p.grad = torch.empty_like(p)
    with silenced(), Capture():  # warm-up step: allocates state; answers .item() on meta
        opt.step()
    for p in params:
        p.grad = None
    return opt


def _mark_state(capture: Capture, state: _OptimizerState, workload: Workload, opt: Any) -> None:
    """The optimizer's masters, state and gradients, held before the step begins."""
    capture.mark(state.masters, "optimizer_state" if workload.precision == "mixed" else "weights")
    capture.mark(state.states, "optimizer_state")
    capture.mark(state.grads, "gradients")
    if opt is not None:
        held = opt.state_tensors() if hasattr(opt, "state_tensors") else _state_of(opt)
        capture.mark(held, "optimizer_state")


def _microbatch(
    model: torch.nn.Module,
    ids: torch.Tensor,
    capture: Capture,
    state: _OptimizerState,
    params: Sequence[torch.Tensor],
    workload: Workload,
    micro: int,
) -> None:
    """Micro-batch ``micro``: forward, loss and backward, then (mixed precision) its bf16
    gradients accumulated into the fp32 ones."""
    last = micro == workload.microbatches - 1
    deferred = workload.defer_gradient_sync and not last
    sync = _fsdp_switch_off(model, "set_requires_gradient_sync", off=deferred)
    # ZeRO-1 and ZeRO-2 hold every parameter whole through the step: gathered once, in
    # the first micro-batch's forward, kept until the last one's backward
    whole = workload.zero in (1, 2) and not last
    kept = _fsdp_switch_off(model, "set_reshard_after_backward", off=whole)
    with sync, kept, loss_context(workload):  # sequence parallel: loss on vocab shards
        stage_backward(model, _loss(model, ids), capture)
    # a micro-batch whose reduction is deferred leaves its gradients unsharded
    # where FSDP accumulates them (none on the parameters): they join the fp32 ones
    # after the last micro-batch's reduction
    if workload.precision == "mixed":
        # bf16 gradients are accumulated into the fp32 main gradients the optimizer
        # reads (Megatron-style), once per micro-batch; they are transient, so only
        # the fp32 ones are held.
        if not deferred:
            with capture.phase("backward", "gradient accumulation"), torch.no_grad():
                grads = _local_grads(params)
                capture.mark(grads, "gradients", count_bytes=False)
                torch._foreach_add_(state.grads, grads)
        per_microbatch(model, capture)  # a pipeline stage: each micro-batch's
        if not deferred:
            for p in params:
                p.grad = None


def _optimizer_step(
    capture: Capture,
    state: _OptimizerState,
    grads: list[torch.Tensor],
    workload: Workload,
    opt: Any,
) -> None:
    """The fused kernel, or the torch.optim optimizer's step as it runs."""
    if opt is None:
        _fused_step(capture, state, grads, workload)
    else:
        _traced_step(capture, state, workload, opt)


def _record_step(trace: Trace, params: Sequence[torch.Tensor], workload: Workload) -> None:
    trace.facts.optimizer = workload.optimizer
    trace.facts.precision = workload.precision
    trace.facts.parameters = sum(p.numel() for p in params)
    record_zero_gradients(trace.facts, params, workload)


def train_module(
    module: torch.nn.Module, loss: Callable[[], torch.Tensor], workload: Workload
) -> Trace:
    """A training step of a plain module (no transformers config, one GPU): ``loss()`` (its
    forward on the caller's inputs and the loss), the real autograd backward, and the
    workload's optimizer step over the module's trainable parameters in ``precision``,
    priced as :func:`trace_train` prices a causal LM's (one micro-batch)."""
    if workload.checkpointing:
        raise WorkloadError("activation checkpointing needs a transformers model")
    module.train()
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise WorkloadError(f"{type(module).__name__} has no trainable parameters to train")
    names, params = [n for n, _ in named], [p for _, p in named]
    mixed = workload.precision == "mixed"
    state = _allocate_state(params, workload)
    opt = _warmed_up_optimizer(workload, state, names, params)
    capture = Capture()
    with capture as trace:
        _mark_state(capture, state, workload, opt)
        loss().backward()  # forward and backward phases are told apart by capture
        grads = [p.grad for p in params if p.grad is not None]
        capture.mark(grads, "gradients", count_bytes=not mixed)
        if mixed:  # the bf16 gradients accumulated into the fp32 ones the optimizer reads
            with capture.phase("backward", "gradient accumulation"), torch.no_grad():
                torch._foreach_add_(state.grads, grads)
            grads = state.grads
        _optimizer_step(capture, state, grads, workload, opt)
    _record_step(trace, params, workload)
    return trace


@contextlib.contextmanager
def _fsdp_switch_off(model: torch.nn.Module, setter: str, off: bool) -> Iterator[None]:
    """FSDP2's per-module switch ``setter`` turned off for this micro-batch (``off``) and
    back on after it; a model FSDP does not shard has none. ``set_requires_gradient_sync``
    off: its gradients are accumulated unsharded, not reduced after this backward;
    ``set_reshard_after_backward`` off: its parameters stay gathered after this backward,
    so the next micro-batch's forward gathers none (how a step whose ranks hold whole
    parameters, ZeRO-1 and ZeRO-2 run as FSDP2, runs its micro-batches: one all-gather a
    step as DeepSpeed and Megatron move it)."""
    switch = getattr(model, setter, None)
    if switch is None or not off:
        yield
        return
    switch(False)
    try:
        yield
    finally:
        switch(True)


def _local_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients this rank updates its parameters with: each parameter's, its local
    shard when sharded. A gradient laid out otherwise than its parameter (transformers'
    vocabulary-parallel embedding leaves a replicated one) is redistributed to the
    parameter's placements first, as a DTensor optimizer does (a slice, copied)."""
    grads = []
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        placements = getattr(p, "placements", None)
        if placements is not None and getattr(grad, "placements", placements) != placements:
            # both are DTensors: the parameter has placements, the gradient others
            grad = cast("DTensor", grad).redistribute(cast("DTensor", p).device_mesh, placements)
        grads.append(local_shard(grad))
    return grads


def _state_of(opt: Any) -> list[torch.Tensor]:
    return [
        t
        for per in opt.state.values()
        for t in per.values()
        if isinstance(t, torch.Tensor) and t.is_meta
    ]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    inputs: dict[str, Any] = {"input_ids": ids, "labels": labels_for(model, ids)}
    inputs.update(patch_inputs(model, *ids.shape))
    if recurrent_only_cache(model) is not None:
        inputs["use_cache"] = False  # a training step keeps no state (and the mask then
        # needs no cache: see recurrent_only_cache)
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids  # teacher forcing on a target as long as the source
    try:
        out = model(**inputs)
    except TypeError:
        out = None
    loss = getattr(out, "loss", None)
    if loss is None:
        raise WorkloadError(
            f"{type(model).__name__} returned no loss for labels=: the train regime needs a "
            "causal LM that computes cross-entropy on labels"
        )
    return loss


def label(model: str, w: Workload) -> str:
    label = f"{model} train, batch {w.batch} x {w.seq} tokens"
    label += f" x {w.microbatches} micro-batches" if w.microbatches > 1 else ""
    label += f", {w.optimizer}, {w.precision} precision"
    if w.checkpointing:
        every = f" every {w.checkpoint_every} layers" if w.checkpoint_every > 1 else ""
        kind = "selective " if w.checkpoint_policy == "selective" else ""
        label += f", {kind}activation checkpointing{every}"
    return label + plan_label(w)


PRECISION_LINES = {
    "mixed": "mixed (bf16 compute, fp32 master weights, gradients and optimizer state)",
    "bf16": "bf16 throughout (weights, gradients and optimizer state)",
    "fp16": "fp16 throughout (weights, gradients and optimizer state)",
    "fp32": "fp32 throughout (weights, gradients and optimizer state)",
}


def summary(est: Any) -> list[str]:
    """Which precision priced the step (the default is mixed)."""
    precision = est.facts.precision or (est.workload.precision if est.workload else "")
    if not precision:
        return []
    return [f"precision: {PRECISION_LINES.get(precision, precision)}"]


def real_step(
    model: torch.nn.Module, workload: Workload, device: str, steps: int
) -> Callable[[], None]:
    """Forward, loss, backward and a foreach AdamW step on a real device."""
    ids = random_ids(model, workload.batch, seq_of(workload), device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def train() -> None:
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train


REGIME = Regime(
    name="train",
    help="forward, loss, backward and an optimizer step",
    trace=trace_train,
    tokens=lambda w: w.batch * seq_of(w) * w.microbatches,
    positions=seq_of,
    compute_dtype=compute_dtype,
    label=label,
    real_step=real_step,
    trains=True,
    summary=summary,
)

"""Train: forward, cross-entropy on labels, the real autograd backward and a steady-state
optimizer step (state already allocated), all traced (seed 000, "Training: 6N per token"
and "Optimizers as memory workloads")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchroof.capture import Capture
from torchroof.errors import WorkloadError
from torchroof.models import model_dtype
from torchroof.records import Trace
from torchroof.workloads.hf_cache import recurrent_only_cache
from torchroof.workloads.inputs import labels_for, patch_inputs, random_ids, token_ids
from torchroof.workloads.spec import TARGET, Regime

if TYPE_CHECKING:
    from torchroof.options import Workload

PRECISIONS = ("bf16", "fp16", "fp32", "mixed")
# Optimizers priced as the single fused kernel a GPU runs (FLOPs per parameter element,
# and the number of state tensors per parameter). seed 000 "Optimizers as memory
# workloads": Adam ~12 FLOPs, two moments; SGD one step, momentum one buffer.
FUSED_OPTIMIZERS: dict[str, tuple[int, int]] = {
    "adamw": (12, 2),
    "adam": (12, 2),
    "sgd": (2, 0),
    "sgd-momentum": (4, 1),
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
    states: list[list[torch.Tensor]]  # one list per state buffer kind
    steps: list[torch.Tensor]


def _allocate_state(params: list[torch.Tensor], workload: Workload) -> _OptimizerState:
    mixed = workload.precision == "mixed"

    def like(p: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(p, dtype=torch.float32 if mixed else p.dtype, device="meta")

    masters = [like(p) for p in params] if mixed else list(params)
    grads = [like(p) for p in params] if mixed else []
    buffers = FUSED_OPTIMIZERS.get(workload.optimizer, (0, 0))[1]
    states = [[like(p) for p in params] for _ in range(buffers)]
    steps = [torch.ones((), dtype=torch.float32) for _ in params]
    return _OptimizerState(params, masters, grads, states, steps)


def _fused_step(capture: Capture, state: _OptimizerState, workload: Workload) -> None:
    """One fused kernel over every parameter: reads weights, gradients and state once,
    writes weights and state once (and the bf16 weights from the fp32 masters when mixed)."""
    flops, _ = FUSED_OPTIMIZERS[workload.optimizer]
    mixed = workload.precision == "mixed"
    grads = state.grads if mixed else [p.grad for p in state.params]
    capture.record_synthetic(
        "torchroof.fused_optimizer_step.default",
        {
            "params": state.masters,
            "grads": grads,
            "states": [t for kind in state.states for t in kind],
            "params_out": state.params if mixed else [],
        },
        {"optimizer": workload.optimizer, "flops_per_element": flops},
        phase="optimizer",
    )


def _traced_step(capture: Capture, state: _OptimizerState, workload: Workload, opt: Any) -> None:
    """Run a torch.optim step as it is (Adafactor, Muon); with mixed precision it updates
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
    # take AdamW, as the Muon write-up prescribes.
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
    """Forward, cross-entropy on labels, the real autograd backward and a steady-state
    optimizer step (state already allocated), all traced."""
    model = models[TARGET]
    model.train()
    if workload.checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable") and not hasattr(
            model, "activation_checkpointing_enable"
        ):
            raise WorkloadError("activation checkpointing needs a transformers model")
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    state = _allocate_state(params, workload)
    opt = None
    if workload.optimizer in TRACED_OPTIMIZERS:
        opt = _make_torch_optimizer(workload, state, names)
        if workload.precision != "mixed":
            for p in params:
                p.grad = torch.empty_like(p)
        with Capture():  # warm-up step: allocates state; answers .item() on meta
            opt.step()
        for p in params:
            p.grad = None
    ids = token_ids(model, workload.batch, workload.seq)
    capture = Capture()
    with capture as trace:
        capture.mark(
            state.masters, "optimizer_state" if workload.precision == "mixed" else "weights"
        )
        capture.mark([t for kind in state.states for t in kind], "optimizer_state")
        capture.mark(state.grads, "gradients")
        if opt is not None:
            capture.mark(
                opt.state_tensors() if hasattr(opt, "state_tensors") else _state_of(opt),
                "optimizer_state",
            )
        loss = _loss(model, ids)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        if workload.precision == "mixed":
            # bf16 gradients are accumulated into the fp32 main gradients the optimizer
            # reads (Megatron-style); they are transient, so only the fp32 ones are held.
            capture.mark(grads, "gradients", count_bytes=False)
            with capture.phase("backward", "gradient accumulation"), torch.no_grad():
                torch._foreach_add_(state.grads, grads)
        else:
            capture.mark(grads, "gradients")
        if opt is None:
            _fused_step(capture, state, workload)
        else:
            _traced_step(capture, state, workload, opt)
    trace.facts.optimizer = workload.optimizer
    trace.facts.precision = workload.precision
    trace.facts.parameters = sum(p.numel() for p in params)
    return trace


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
    label = f"{model} train, batch {w.batch} x {w.seq} tokens, {w.optimizer}, "
    label += f"{w.precision} precision"
    return label + (", activation checkpointing" if w.checkpointing else "")


def real_step(
    model: torch.nn.Module, workload: Workload, device: str, steps: int
) -> Callable[[], None]:
    """Forward, loss, backward and a foreach AdamW step on a real device."""
    ids = random_ids(model, workload.batch, workload.seq, device)
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
    tokens=lambda w: w.batch * w.seq,
    positions=lambda w: w.seq,
    compute_dtype=compute_dtype,
    label=label,
    real_step=real_step,
    trains=True,
)

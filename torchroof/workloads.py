"""Drive a model through prefill, decode or a training step under capture.

One path for every regime (STYLE.md: no per-regime formula sheets): the real model runs
on meta, and only what meta cannot do is supplied here — a KV cache built directly at
context N, optimizer state allocated before the traced step, and the fused optimizer
kernel a GPU would launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchroof.capture import Capture, OpBudgetExceeded
from torchroof.errors import first_line
from torchroof.options import (
    CACHES,
    FUSED_OPTIMIZERS,
    MLA_DECODES,
    OPTIMIZERS,
    PRECISIONS,
    REGIMES,
    TRACED_OPTIMIZERS,
    Workload,
    WorkloadError,
)
from torchroof.records import Trace

__all__ = [
    "CACHES",
    "FUSED_OPTIMIZERS",
    "MLA_DECODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "REGIMES",
    "TRACED_OPTIMIZERS",
    "Workload",
    "WorkloadError",
    "run_workload",
]


def compute_dtype(workload: Workload) -> torch.dtype:
    """The dtype the model's weights and activations are built in for this workload."""
    from torchroof.models import model_dtype

    if workload.regime == "train" and workload.precision != "mixed":
        return model_dtype(workload.precision)
    if workload.regime == "train":
        return torch.bfloat16
    return model_dtype(workload.dtype)


def run_workload(model: torch.nn.Module, workload: Workload) -> Trace:
    """Trace one step of ``workload`` on ``model`` (which must live on meta)."""
    if workload.regime == "prefill":
        trace = _prefill(model, workload)
    elif workload.regime == "decode":
        trace = _decode(model, workload)
    else:
        trace = _train(model, workload)
    note = getattr(model, "torchroof_build_note", None)
    if note:
        trace.metadata["build_note"] = note
    trace.metadata["workload"] = workload.to_dict()
    trace.metadata["tokens"] = workload.tokens
    return trace


# -- inference ------------------------------------------------------------------------------
def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise WorkloadError(
            f"{type(model).__name__} has no transformers config: prefill with a KV cache and "
            "decode need a transformers causal LM (trace other modules with torchroof.trace())"
        )
    return config.get_text_config(decoder=True)


def kv_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(KV heads, head dim) from the config; a clear error when the config lacks them."""
    text = _text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if heads is None or hidden is None:
        raise WorkloadError(
            f"config {type(text).__name__} has no num_attention_heads / hidden_size: "
            "cannot size a KV cache for it"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return kv_heads, head_dim


def token_ids(model: torch.nn.Module, batch: int, length: int) -> torch.Tensor:
    """Input ids on meta: [batch, length], or [batch · codebooks, length] for a decoder over
    parallel audio codebooks (MusicGen)."""
    codebooks = getattr(getattr(model, "config", None), "num_codebooks", None) or 1
    return torch.zeros(batch * codebooks, length, dtype=torch.long, device="meta")


def _labels(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Labels for ``ids``: the ids themselves; [batch, length, codebooks] for MusicGen."""
    codebooks = getattr(model.config, "num_codebooks", None) or 1
    if codebooks == 1:
        return ids
    return ids.view(-1, codebooks, ids.shape[-1]).transpose(1, 2)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def build_kv_cache(
    model: torch.nn.Module, batch: int, capacity: int, filled: int, kind: str, capture: Capture
) -> Any:
    """A transformers cache on meta, already holding ``filled`` tokens (no prefill is run).

    ``static`` preallocates ``capacity`` slots and writes new tokens in place (what paged
    and static-cache runtimes do). Its layers allocate on their first update, from the
    model's own K/V shapes (MLA's wider keys, per-layer head counts), without the
    allocation being recorded. ``dynamic`` is HF's ``DynamicCache``, which ``cat``s the
    whole cache every step; it is filled up front from the config's KV shape.
    """
    from transformers import DynamicCache, StaticCache

    _text_config(model)  # a clear error for a module without a transformers config
    config = model.config
    if kind == "static":
        cache = StaticCache(config=config, max_cache_len=capacity)
        for layer in cache.layers:
            _allocate_unrecorded(layer, capture)
        return cache
    kv_heads, head_dim = kv_shape(model)
    dtype = _model_dtype(model)
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        length = min(filled, window - 1) if window else filled
        layer.lazy_initialization(
            *(torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device="meta"),) * 2
        )
        layer.keys = torch.empty(batch, kv_heads, length, head_dim, dtype=dtype, device="meta")
        layer.values = torch.empty(batch, kv_heads, length, head_dim, dtype=dtype, device="meta")
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = filled
    return cache


def _allocate_unrecorded(layer: Any, capture: Capture) -> None:
    """Make a cache layer's lazy allocation invisible to the trace and label its tensors
    as KV cache (the cache exists before the step; allocating it is not the step's work)."""
    original = getattr(layer, "lazy_initialization", None)
    if original is None:  # placeholder layers (KV shared with another layer) hold nothing
        return

    def initialise(*args: Any, **kwargs: Any) -> None:
        with capture.unrecorded():
            original(*args, **kwargs)
        capture.mark(state_tensors(layer), "kv_cache")

    layer.lazy_initialization = initialise


_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params", "state", "past_buckets_states")
_CACHE_OUTPUTS = ("past_key_values", "cache", "cache_params", "state", "past_buckets_states")


def _forward_parameters(model: torch.nn.Module) -> Any:
    """The names ``model.forward`` accepts."""
    import inspect

    return inspect.signature(model.forward).parameters


def _cache_argument(params: Any) -> str | None:
    """The forward argument (of ``params``) a model takes its cache or recurrent state in."""
    return next((name for name in _CACHE_ARGUMENTS if name in params), None)


def _forward_kwargs(model: torch.nn.Module, positions: torch.Tensor, cache: Any) -> dict[str, Any]:
    params = _forward_parameters(model)
    kwargs: dict[str, Any] = {"use_cache": True}
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    name = _cache_argument(params)
    if cache is not None and name is not None:
        kwargs[name] = cache
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1  # generation needs the last token's logits only
    kwargs.update(_patch_inputs(model, *positions.shape, params))
    return kwargs


def _patch_inputs(
    model: torch.nn.Module, batch: int, length: int, params: Any = None
) -> dict[str, Any]:
    """A byte-latent model (BLT) groups bytes into patches where a small LM's entropy
    spikes, which meta cannot evaluate: it is given fixed patches of ``patch_size`` bytes
    (BLT's static patching), the same count of patches as its mean patch size gives."""
    config = getattr(model, "config", None)
    size = getattr(config, "patch_size", None)
    if not size:
        return {}
    takes = "patch_lengths" in (params if params is not None else _forward_parameters(model))
    if not (takes or hasattr(config, "patching_mode")):
        return {}
    patches = -(-length // size)
    return {"patch_lengths": torch.full((batch, patches), size, dtype=torch.long, device="meta")}


def _returned_cache(output: Any) -> Any:
    for name in _CACHE_OUTPUTS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def state_tensors(cache: Any, depth: int = 4) -> list[torch.Tensor]:
    """Every floating tensor a cache object holds, at any nesting (a transformers Cache's
    layers, a recurrent model's conv/SSM/RNN states in dicts, lists or attributes)."""
    found: dict[int, torch.Tensor] = {}

    def walk(value: Any, level: int) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.setdefault(id(value), value)
        elif level <= 0 or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, level - 1)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, level - 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
            for item in vars(value).values():
                walk(item, level - 1)

    walk(cache, depth)
    return list(found.values())


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _inference_step(model: torch.nn.Module, workload: Workload, new: int, filled: int) -> Trace:
    """Attention-only models: a cache built directly at context N. Models with recurrent
    state (SSM, linear attention, hybrids) or a cache of their own: the context is run
    unrecorded first, so the traced step reads and updates a warm state."""
    _text_config(model)  # a clear error for a module without a transformers config
    if getattr(model.config, "is_encoder_decoder", False):
        return _encoder_decoder_step(model, workload, new, filled)
    can_generate = getattr(model, "can_generate", lambda: True)()
    if not can_generate:
        if filled:
            raise WorkloadError(
                f"{type(model).__name__} is an encoder: it does not generate, so it has no "
                "decode step (prefill and train trace it)"
            )
        return _warm_state_step(model, workload, new, filled, static=False)
    from torchroof.mla import mla_layers

    reasons: list[str] = []
    uniform = _attention_only_static_cache(model)
    if workload.cache == "dynamic" and not (uniform and not mla_layers(model)):
        # latent or recurrent layers: the model's own DynamicCache, filled by the context
        trace = _warm_state_step(model, workload, new, filled, static=False)
        trace.metadata["cache"] = "dynamic"
        return trace
    if workload.cache == "dynamic" or uniform:
        trace = _prebuilt_cache_step(model, workload, new, filled, reasons)
        if trace is not None:
            return trace
    try:
        trace = _warm_state_step(model, workload, new, filled, static=True)
    except OpBudgetExceeded:
        raise
    except Exception as error:  # noqa: BLE001 - the model refuses a StaticCache: use its own
        reasons.append(f"a StaticCache was refused: {first_line(error)}")
        trace = _warm_state_step(model, workload, new, filled, static=False)
    if reasons and "cache_fallback" not in trace.metadata:
        trace.metadata["cache_fallback"] = "; ".join(reasons)
    return trace


def recurrent_only_cache(model: torch.nn.Module) -> Any:
    """A ``DynamicCache`` for a hybrid whose config has no attention layer (Bamba,
    GraniteMoeHybrid at their defaults: Mamba layers only), or None for any other model.

    Their forward still builds the full-attention mask, which asks the cache for its
    sequence length, and a cache of only linear-attention layers refuses (transformers
    raises "can only be called on Attention layers"), the model's own cache included.
    No layer reads that mask, so the cache answers as an empty attention cache would."""
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    try:
        probe = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - a config transformers cannot size a cache for
        return None
    if not probe.layers or any(isinstance(layer, CacheLayerMixin) for layer in probe.layers):
        return None

    class RecurrentOnlyCache(DynamicCache):
        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

        def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
            return query_length, 0

    return RecurrentOnlyCache(config=model.config)


def _attention_only_static_cache(model: torch.nn.Module) -> bool:
    from transformers import StaticCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    _text_config(model)  # a clear error for a module without a transformers config
    try:
        cache = StaticCache(config=model.config, max_cache_len=1)
    except Exception:  # noqa: BLE001 - a config transformers cannot size a cache for
        return False
    return not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


@contextlib.contextmanager
def _latent_attention(
    model: torch.nn.Module, workload: Workload, capture: Capture, trace: Trace
) -> Iterator[None]:
    """A decode step of a latent-attention model runs absorbed unless asked otherwise."""
    from torchroof.mla import absorbed_mla

    if workload.regime != "decode" or workload.mla != "absorbed":
        yield
        return
    with absorbed_mla(model, capture) as absorbed:
        if absorbed:
            trace.metadata["mla"] = "absorbed"
        yield


def _prebuilt_cache_step(
    model: torch.nn.Module, workload: Workload, new: int, filled: int, reasons: list[str]
) -> Trace | None:
    """The step against a cache that already holds ``filled`` tokens; None when the model
    ignored the cache it was given (a recurrent model that takes its state elsewhere)."""
    batch = workload.batch
    capacity = filled + new
    capture = Capture()
    cache = build_kv_cache(model, batch, capacity, filled, workload.cache, capture)
    ids = token_ids(model, batch, new)
    positions = torch.arange(filled, capacity, device="meta").unsqueeze(0).expand(batch, -1)
    kwargs = _forward_kwargs(model, positions, cache)
    try:
        with torch.no_grad(), capture as trace:
            capture.mark(state_tensors(cache), "kv_cache")
            with _latent_attention(model, workload, capture, trace):
                model(ids, **kwargs)
            capture.mark(state_tensors(cache), "kv_cache")  # a dynamic cache's new tensors
    except OpBudgetExceeded:
        raise
    except Exception as error:
        if workload.cache == "dynamic":
            raise
        reasons.append(f"a cache prefilled to the context was refused: {first_line(error)}")
        return None
    held = state_tensors(cache)
    if workload.cache == "static" and not held:
        reasons.append("the model keeps its state outside the cache it was given")
        return None
    # The footprint is the cache as the step leaves it (a dynamic cache's old tensors die).
    trace.role_bytes["kv_cache"] = _storage_bytes(held)
    trace.metadata["cache"] = workload.cache
    trace.metadata["kv_cache_tokens"] = capacity
    return trace


def _warm_state_step(
    model: torch.nn.Module, workload: Workload, new: int, filled: int, static: bool
) -> Trace:
    """Run the ``filled`` context tokens unrecorded (filling a StaticCache, or the cache
    or recurrent state the model makes itself), then trace the ``new`` tokens against it.
    The state the step reads and writes (K/V, conv and SSM states) is the decode cache."""
    from transformers import StaticCache

    batch = workload.batch
    capacity = filled + new
    if static:
        cache = StaticCache(config=model.config, max_cache_len=capacity)
    else:
        cache = recurrent_only_cache(model)  # None: the model makes its own
    capture = Capture()
    with torch.no_grad(), capture as trace:
        if filled:
            with capture.unrecorded():
                context = token_ids(model, batch, filled)
                positions = torch.arange(filled, device="meta").unsqueeze(0).expand(batch, -1)
                out = model(context, **_forward_kwargs(model, positions, cache))
                cache = _returned_cache(out) if cache is None else cache
            if cache is None:
                raise WorkloadError(
                    f"{type(model).__name__} returned no cache or state after its context: "
                    "cannot trace a decode step for it"
                )
        capture.mark(state_tensors(cache), "kv_cache")
        ids = token_ids(model, batch, new)
        positions = torch.arange(filled, capacity, device="meta").unsqueeze(0).expand(batch, -1)
        with _latent_attention(model, workload, capture, trace):
            out = model(ids, **_forward_kwargs(model, positions, cache))
        cache = _returned_cache(out) if cache is None or not static else cache
        held = state_tensors(cache)
        capture.mark(held, "kv_cache")  # state made by this step (a prefill's, a cat's)
    if filled and not held:
        return _recompute_step(model, workload, capacity)
    trace.role_bytes["kv_cache"] = _storage_bytes(held)
    trace.metadata["cache"] = ("static" if static else "model") if held else "none"
    trace.metadata["kv_cache_tokens"] = capacity
    return trace


def _recompute_step(model: torch.nn.Module, workload: Workload, length: int) -> Trace:
    """A model that keeps no cache (GPT-1, XLNet without memory) generates by running the
    whole sequence again: the step is a forward over all N + 1 tokens."""
    capture = Capture()
    ids = token_ids(model, workload.batch, length)
    positions = torch.arange(length, device="meta").unsqueeze(0).expand(workload.batch, -1)
    kwargs = _forward_kwargs(model, positions, None)
    kwargs.pop("use_cache")
    with torch.no_grad(), capture as trace:
        model(ids, **kwargs)
    trace.role_bytes["kv_cache"] = 0
    trace.metadata["cache"] = "none"
    trace.metadata["cache_fallback"] = (
        f"the model keeps no cache: each generated token recomputes all {length} tokens"
    )
    trace.metadata["kv_cache_tokens"] = 0
    return trace


def _encoder_decoder_step(
    model: torch.nn.Module, workload: Workload, new: int, filled: int
) -> Trace:
    """An encoder–decoder (T5, BART). Prefill: the encoder over the ``seq`` source tokens
    and the decoder's first token, which writes the self- and cross-attention caches.
    Decode: one decoder token against a source of ``context`` tokens and ``context``
    generated tokens, both cached (the context is run unrecorded first)."""
    from transformers.modeling_outputs import BaseModelOutput

    batch = workload.batch
    capture = Capture()
    source_length = new if not filled else filled
    source = torch.zeros(batch, source_length, dtype=torch.long, device="meta")
    start = torch.zeros(batch, 1, dtype=torch.long, device="meta")
    with torch.no_grad(), capture as trace:
        if filled:
            with capture.unrecorded():
                prefix = token_ids(model, batch, filled)
                out = model(input_ids=source, decoder_input_ids=prefix, use_cache=True)
            cache = _returned_cache(out)
            # A ModelOutput, not a bare tuple: BART wraps a tuple itself, ProphetNet reads
            # ``encoder_outputs.last_hidden_state`` from what it is given.
            encoded = BaseModelOutput(last_hidden_state=out.encoder_last_hidden_state)
            capture.mark(state_tensors(cache), "kv_cache")
            out = model(
                encoder_outputs=encoded,
                decoder_input_ids=start,
                use_cache=True,
                **{_cache_argument(_forward_parameters(model)) or "past_key_values": cache},
            )
        else:
            out = model(input_ids=source, decoder_input_ids=start, use_cache=True)
        held = state_tensors(_returned_cache(out))
        capture.mark(held, "kv_cache")
    trace.role_bytes["kv_cache"] = _storage_bytes(held)
    trace.metadata["cache"] = "encoder-decoder"
    trace.metadata["kv_cache_tokens"] = filled + 1
    return trace


def _prefill(model: torch.nn.Module, workload: Workload) -> Trace:
    """B sequences of T tokens, writing their K/V into the cache."""
    model.eval()
    return _inference_step(model, workload, new=workload.seq, filled=0)


def _decode(model: torch.nn.Module, workload: Workload) -> Trace:
    """One new token for each of B sequences against a cache already holding N tokens."""
    model.eval()
    return _inference_step(model, workload, new=1, filled=workload.context)


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


def _train(model: torch.nn.Module, workload: Workload) -> Trace:
    """Forward, cross-entropy on labels, the real autograd backward and a steady-state
    optimizer step (state already allocated), all traced."""
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
    trace.metadata["optimizer"] = workload.optimizer
    trace.metadata["precision"] = workload.precision
    trace.metadata["parameters"] = sum(p.numel() for p in params)
    return trace


def _state_of(opt: Any) -> list[torch.Tensor]:
    return [
        t
        for per in opt.state.values()
        for t in per.values()
        if isinstance(t, torch.Tensor) and t.is_meta
    ]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    inputs: dict[str, Any] = {"input_ids": ids, "labels": _labels(model, ids)}
    inputs.update(_patch_inputs(model, *ids.shape))
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


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V of one token across all layers: 2 · s · h_kv · d_head · L (seed 000).

    Multi-head latent attention (DeepSeek-V2/V3) caches one latent per token and MLA
    layer instead: s · (kv_lora_rank + qk_rope_head_dim) · L_MLA.
    """
    from torchroof.mla import mla_layers

    text = _text_config(model)
    itemsize = _model_dtype(model).itemsize
    latent = getattr(text, "kv_lora_rank", None)
    if latent:
        rope = getattr(text, "qk_rope_head_dim", 0) or 0
        # hybrids (Kimi-Linear, Bailing) have latent attention in some layers only
        layers = len(mla_layers(model)) or text.num_hidden_layers
        return itemsize * (latent + rope) * layers
    kv_heads, head_dim = kv_shape(model)
    return 2 * itemsize * kv_heads * head_dim * text.num_hidden_layers

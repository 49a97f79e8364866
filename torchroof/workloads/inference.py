"""An inference step against a cache: ``new`` tokens for B sequences whose cache already
holds ``filled`` (prefill: filled = 0; decode: new = 1). One path for attention-only models
(a cache built directly at the context), models with recurrent state or their own cache
(the context run unrecorded first), encoder–decoders, and models that keep no cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from torchroof.capture.budget import OpBudgetExceeded
from torchroof.capture.mode import Capture
from torchroof.capture.symbolic import sized, step_size
from torchroof.config.errors import WorkloadError, first_line
from torchroof.models.mla import absorbed_mla, dequantised_latents, mla_layers
from torchroof.quant.kv_cache import narrow_dtype
from torchroof.records.trace import Trace
from torchroof.workloads.hf_cache import (
    attention_only_static_cache,
    build_kv_cache,
    caches_attention_kv,
    quantise_on_write,
    recurrent_only_cache,
    returned_cache,
    state_tensors,
    storage_bytes,
)
from torchroof.workloads.inputs import (
    cache_argument,
    forward_kwargs,
    forward_parameters,
    model_config,
    text_config,
    token_ids,
)

if TYPE_CHECKING:
    from torchroof.config import Workload


def inference_step(model: torch.nn.Module, workload: Workload, new: int, filled: int) -> Trace:
    """Attention-only models: a cache built directly at context N. Models with recurrent
    state (SSM, linear attention, hybrids) or a cache of their own: the context is run
    unrecorded first, so the traced step reads and updates a warm state."""
    text_config(model)  # a clear error for a module without a transformers config
    quantised = narrow_dtype(workload.kv_dtype) is not None
    if quantised:
        _check_quantised_cache(model, workload)
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
    reasons: list[str] = []
    uniform = attention_only_static_cache(model)
    if workload.cache == "dynamic" and not (uniform and not mla_layers(model)):
        # latent or recurrent layers: the model's own DynamicCache, filled by the context
        trace = _warm_state_step(model, workload, new, filled, static=False)
        trace.facts.cache = "dynamic"
        return trace
    if workload.cache == "dynamic" or uniform:
        prebuilt = _prebuilt_cache_step(model, workload, new, filled, reasons)
        if prebuilt is not None:
            return prebuilt
    try:
        trace = _warm_state_step(model, workload, new, filled, static=True)
    except (OpBudgetExceeded, WorkloadError):
        raise
    except Exception as error:  # noqa: BLE001 - the model refuses a StaticCache: use its own
        if quantised:  # its own cache would hold K/V at the model's dtype
            raise WorkloadError(
                f"kv_dtype={workload.kv_dtype!r}: {type(model).__name__} refused the "
                f"quantised StaticCache ({first_line(error)})"
            ) from error
        reasons.append(f"a StaticCache was refused: {first_line(error)}")
        trace = _warm_state_step(model, workload, new, filled, static=False)
    if reasons and not trace.facts.cache_fallback:
        trace.facts.cache_fallback = "; ".join(reasons)
    return trace


def kv_label(workload: Workload) -> str:
    """The part of a step's label that names a quantised KV cache ("" for the model's)."""
    return "" if workload.kv_dtype == "model" else f", {workload.kv_dtype} KV cache"


def _check_quantised_cache(model: torch.nn.Module, workload: Workload) -> None:
    """A quantised KV cache is one torchroof builds (a StaticCache, or the DynamicCache of
    an attention-only model), read by the attention kernel it records from SDPA or absorbed
    MLA: a clear error for a step that would use another cache (holding K/V at the model's
    dtype) or another attention (eager matmuls of bf16 queries by fp8 keys)."""
    config = model.config
    implementation = getattr(text_config(model), "_attn_implementation", "sdpa")
    if getattr(config, "is_encoder_decoder", False):
        why = "an encoder-decoder keeps its caches itself"
    elif not getattr(model, "can_generate", lambda: True)():
        why = "an encoder keeps no cache"
    elif not caches_attention_kv(model):
        why = "it caches no attention K/V (its state is recurrent: conv and SSM states)"
    elif implementation != "sdpa":
        why = (
            f"its attention runs as {implementation!r}, not SDPA: torchroof prices a quantised "
            "cache read by a fused attention kernel (vLLM's and TensorRT-LLM's fp8 KV cache)"
        )
    elif workload.cache == "dynamic" and (
        mla_layers(model) or not attention_only_static_cache(model)
    ):
        why = (
            "its dynamic cache is its own (latent or recurrent layers) and holds K/V at the "
            "model's dtype: a quantised cache needs cache='static'"
        )
    else:
        return
    raise WorkloadError(f"kv_dtype={workload.kv_dtype!r} for {type(model).__name__}: {why}")


@contextlib.contextmanager
def _latent_attention(
    model: torch.nn.Module, workload: Workload, filled: int, capture: Capture, trace: Trace
) -> Iterator[None]:
    """A step of a latent-attention model against a filled cache (decode) runs absorbed
    unless asked otherwise; expanded, a quantised latent cache is widened before expansion."""
    absorb = filled and workload.mla == "absorbed"  # absorption pays off reading a cache
    with contextlib.ExitStack() as stack:
        if absorb and stack.enter_context(absorbed_mla(model, capture)):
            trace.facts.mla = "absorbed"
        else:  # transformers' expansion reads the latent cache at the model's dtype
            stack.enter_context(dequantised_latents(model, narrow_dtype(workload.kv_dtype)))
        yield


def _prebuilt_cache_step(
    model: torch.nn.Module, workload: Workload, new: int, filled: int, reasons: list[str]
) -> Trace | None:
    """The step against a cache that already holds ``filled`` tokens; None when the model
    ignored the cache it was given (a recurrent model that takes its state elsewhere)."""
    batch = step_size("batch", workload.batch)
    capacity = filled + new
    capture = Capture()
    kv_dtype = narrow_dtype(workload.kv_dtype)
    cache = build_kv_cache(model, batch, capacity, filled, workload.cache, capture, kv_dtype)
    ids = token_ids(model, batch, new)
    positions = torch.arange(filled, capacity, device="meta").unsqueeze(0).expand(batch, -1)
    kwargs = forward_kwargs(model, positions, cache)
    try:
        with torch.no_grad(), capture as trace:
            capture.mark(state_tensors(cache), "kv_cache")
            with _latent_attention(model, workload, filled, capture, trace):
                model(ids, **kwargs)
            capture.mark(state_tensors(cache), "kv_cache")  # a dynamic cache's new tensors
    except OpBudgetExceeded:
        raise
    except Exception as error:
        if workload.cache == "dynamic":
            raise
        if kv_dtype is not None:  # not silently a cache in the model's dtype
            raise
        reasons.append(f"a cache prefilled to the context was refused: {first_line(error)}")
        return None
    held = state_tensors(cache)
    if workload.cache == "static" and not held:
        reasons.append("the model keeps its state outside the cache it was given")
        return None
    # The footprint is the cache as the step leaves it (a dynamic cache's old tensors die).
    trace.role_bytes["kv_cache"] = storage_bytes(held)
    trace.facts.cache = workload.cache
    trace.facts.kv_cache_tokens = sized(capacity)
    return trace


def _warm_state_step(
    model: torch.nn.Module, workload: Workload, new: int, filled: int, static: bool
) -> Trace:
    """Run the ``filled`` context tokens unrecorded (filling a StaticCache, or the cache
    or recurrent state the model makes itself), then trace the ``new`` tokens against it.
    The state the step reads and writes (K/V, conv and SSM states) is the decode cache."""
    from transformers import StaticCache

    batch = step_size("batch", workload.batch)
    capacity = filled + new
    kv_dtype = narrow_dtype(workload.kv_dtype)
    if static:
        cache = StaticCache(config=model_config(model), max_cache_len=capacity)
        quantise_on_write(cache, kv_dtype)
    else:
        cache = recurrent_only_cache(model)  # None: the model makes its own
    capture = Capture()
    with torch.no_grad(), capture as trace:
        if filled:
            with capture.unrecorded():
                context = token_ids(model, batch, filled)
                positions = torch.arange(filled, device="meta").unsqueeze(0).expand(batch, -1)
                out = model(context, **forward_kwargs(model, positions, cache))
                cache = returned_cache(out) if cache is None else cache
            if cache is None:
                raise WorkloadError(
                    f"{type(model).__name__} returned no cache or state after its context: "
                    "cannot trace a decode step for it"
                )
        capture.mark(state_tensors(cache), "kv_cache")
        ids = token_ids(model, batch, new)
        positions = torch.arange(filled, capacity, device="meta").unsqueeze(0).expand(batch, -1)
        with _latent_attention(model, workload, filled, capture, trace):
            out = model(ids, **forward_kwargs(model, positions, cache))
        cache = returned_cache(out) if cache is None or not static else cache
        held = state_tensors(cache)
        capture.mark(held, "kv_cache")  # state made by this step (a prefill's, a cat's)
    if kv_dtype is not None and not any(t.dtype == kv_dtype for t in held):
        raise WorkloadError(
            f"kv_dtype={workload.kv_dtype!r}: {type(model).__name__} wrote no K/V into the "
            "quantised cache it was given (it keeps no cache, or keeps it elsewhere)"
        )
    if filled and not held:
        return _recompute_step(model, workload, capacity)
    trace.role_bytes["kv_cache"] = storage_bytes(held)
    trace.facts.cache = ("static" if static else "model") if held else "none"
    trace.facts.kv_cache_tokens = sized(capacity)
    return trace


def _recompute_step(model: torch.nn.Module, workload: Workload, length: int) -> Trace:
    """A model that keeps no cache (GPT-1, XLNet without memory) generates by running the
    whole sequence again: the step is a forward over all N + 1 tokens."""
    capture = Capture()
    batch = step_size("batch", workload.batch)
    ids = token_ids(model, batch, length)
    positions = torch.arange(length, device="meta").unsqueeze(0).expand(batch, -1)
    kwargs = forward_kwargs(model, positions, None)
    kwargs.pop("use_cache")
    with torch.no_grad(), capture as trace:
        model(ids, **kwargs)
    trace.role_bytes["kv_cache"] = 0
    trace.facts.cache = "none"
    trace.facts.cache_fallback = (
        f"the model keeps no cache: each generated token recomputes all {length} tokens"
    )
    trace.facts.kv_cache_tokens = 0
    return trace


def _encoder_decoder_step(
    model: torch.nn.Module, workload: Workload, new: int, filled: int
) -> Trace:
    """An encoder–decoder (T5, BART). Prefill: the encoder over the ``seq`` source tokens
    and the decoder's first token, which writes the self- and cross-attention caches.
    Decode: one decoder token against a source of ``context`` tokens and ``context``
    generated tokens, both cached (the context is run unrecorded first)."""
    from transformers.modeling_outputs import BaseModelOutput

    batch = step_size("batch", workload.batch)
    capture = Capture()
    source_length = new if not filled else filled
    source = torch.zeros(batch, source_length, dtype=torch.long, device="meta")
    start = torch.zeros(batch, 1, dtype=torch.long, device="meta")
    with torch.no_grad(), capture as trace:
        if filled:
            with capture.unrecorded():
                prefix = token_ids(model, batch, filled)
                out = model(input_ids=source, decoder_input_ids=prefix, use_cache=True)
            cache = returned_cache(out)
            # A ModelOutput, not a bare tuple: BART wraps a tuple itself, ProphetNet reads
            # ``encoder_outputs.last_hidden_state`` from what it is given.
            encoded = BaseModelOutput(last_hidden_state=out.encoder_last_hidden_state)
            capture.mark(state_tensors(cache), "kv_cache")
            out = model(
                encoder_outputs=encoded,
                decoder_input_ids=start,
                use_cache=True,
                **{cache_argument(forward_parameters(model)) or "past_key_values": cache},
            )
        else:
            out = model(input_ids=source, decoder_input_ids=start, use_cache=True)
        held = state_tensors(returned_cache(out))
        capture.mark(held, "kv_cache")
    trace.role_bytes["kv_cache"] = storage_bytes(held)
    trace.facts.cache = "encoder-decoder"
    trace.facts.kv_cache_tokens = sized(filled + 1)
    return trace

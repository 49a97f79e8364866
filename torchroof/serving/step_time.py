"""The time of one engine step of any composition, from a model prepared for decode.

A step of sequences i, each with n_i new tokens over c_i cached (:class:`SequenceWork`),
costs, on the roofline of the accelerator and runtime given:

- every kernel but attention and the output projection (embedding, norms, the q/k/v/o and
  MLP GEMMs, rotary embedding, KV-cache writes, MoE routing, tensor- and expert-parallel
  collectives, the runtime's launches and host overhead) as the prepared decode step runs
  them on N = Σ n_i rows: a decode of batch N processes N tokens through them exactly as
  an engine's flattened step does;
- the output projection on the L rows whose logits the step computes, as a decode of
  batch L runs it (one per sampling sequence: vLLM computes logits only where it samples;
  k + 1 for a speculative verification of k drafted tokens);
- attention per layer as ragged kernels over each sequence's own cache
  (:mod:`torchroof.serving.attention`).

A step with a prompt chunk in it, or with requests of different numbers of new tokens,
launches its kernels eagerly (the runtimes replay a full CUDA graph for uniform decode
steps, speculative verifications of equal length included: vLLM's piecewise graphs for
mixed steps have no figure in its profile). Each batch priced is a
:meth:`~torchroof.prepared.PreparedModel.kernel_times` of the prepared step at that
batch, kept for later steps. A step of B decodes at the
prepared context is that decode step, but for the dense mask transformers builds for a
static cache (one byte per key and layer), which an engine's paged kernels do not read.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.accuracy.expected import correction
from torchroof.api import config_of
from torchroof.config import PricingOptions, split_knobs
from torchroof.config.choices import REGIME_FACTS
from torchroof.config.errors import OptionError
from torchroof.counters import kind_of
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import check_positions, position_limit, text_config
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.runtime import runtime_at, with_knobs
from torchroof.progress import silenced
from torchroof.records.tensors import dtype_itemsize
from torchroof.records.trace import Trace
from torchroof.report.memory import MemoryFootprint
from torchroof.serving.attention import (
    AttentionGeometry,
    decode_geometry,
    expand_kernels,
    ragged_decode,
    ragged_prefill,
)
from torchroof.serving.composition import SequenceWork, StepMix, check_step, items_of
from torchroof.serving.parts import (
    DecodeParts,
    grid_neighbours,
    head_module,
    refuse_windows,
    split_parts,
)
from torchroof.serving.requests import Request
from torchroof.timing.roofline import time_kernel
from torchroof.timing.runtime import StepRuntime

if TYPE_CHECKING:
    from torchroof.prepared import PreparedModel


@dataclass(frozen=True)
class StepTime:
    """One engine step's time and where it goes (seconds)."""

    time_s: float
    body_s: float  # every kernel but attention and the output projection, on N tokens
    head_s: float  # the output projection on the logit rows
    attention_s: float  # every layer's ragged attention kernels
    tokens: int  # N: new tokens processed
    sequences: int
    logit_rows: int  # L: rows the output projection computes


class StepTimer:
    """Prices engine steps of any composition for a model prepared for decode.

    >>> prepared = torchroof.prepare("llama-3-8b", "decode", context=1024)  # doctest: +SKIP
    >>> timer = StepTimer(prepared, "h100-sxm", mode="realistic")           # doctest: +SKIP
    >>> timer.time([prompt(512), *decodes(31, 1024)]).time_s               # doctest: +SKIP

    ``hardware`` and ``pricing`` (or its fields as keywords) are as
    :meth:`~torchroof.prepared.PreparedModel.price` takes them. Every token count is
    priced at its own batch, or, with ``exact_up_to``, only those up to it, larger ones
    interpolated between grid batches (:data:`~torchroof.serving.parts.GRID_RATIO`: exact on
    the pure roofline, up to 8.5% off in realistic mode). The prepared step must be a
    decode with a static cache (an engine writes its cache in place) on one pipeline stage
    and without context parallel. The prepared
    step is traced and priced once here, so that a model or plan it cannot price is
    refused before any step.
    """

    def __init__(
        self,
        prepared: PreparedModel,
        hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
        *,
        pricing: PricingOptions | None = None,
        exact_up_to: int | None = None,
        **pricing_knobs: Any,
    ) -> None:
        if exact_up_to is not None and (
            isinstance(exact_up_to, bool) or not isinstance(exact_up_to, int) or exact_up_to < 1
        ):
            raise OptionError(
                f"exact_up_to must be a whole number >= 1 or None, got {exact_up_to!r}"
            )
        workload_knobs, pricing_only = split_knobs(pricing_knobs)
        if workload_knobs:
            raise OptionError(
                f"{', '.join(sorted(workload_knobs))} choose the prepared step: give them to "
                "torchroof.prepare(), not to a step timer"
            )
        self.exact_up_to = exact_up_to
        base = prepared.workload_for()
        _check_base(base)
        self._regime = base.regime
        self._spec, _ = resolve_hardware(hardware)  # a bad name fails before any tracing
        self.prepared = prepared
        self.hardware = hardware
        self.pricing = with_knobs(pricing, pricing_only)
        self._eager = replace(self.pricing, cuda_graphs=False)
        # the calibrated mode's factor: the decode probes carry it, the attention timed here
        # takes it too, so every engine step is the realistic one times the decode steps'
        self._correction = correction(self.pricing.mode, base)
        self._config = config_of(prepared.model)
        refuse_windows(self._config)
        self._name = str(prepared.model) if isinstance(prepared.model, (str, Path)) else None
        self._allow_beyond = base.allow_beyond_max_positions
        self._checked_length = 0  # the longest sequence checked against the positions
        self._probes: dict[tuple[int, bool], DecodeParts] = {}
        self._runtimes: dict[tuple[int, bool], StepRuntime] = {}
        self._activations: dict[tuple[int, int], int] = {}
        self._prefill: PreparedModel | None = None
        self.context, self._head, self._layers = self._read_trace()
        _check_latent(self._config, self._layers, base)
        self._probe(1, eager=False)  # a plan the hardware cannot run fails here

    def time(self, step: Sequence[SequenceWork] | StepMix, graphed: int | None = None) -> StepTime:
        """The time of one engine step processing ``step``'s sequences (or their
        :class:`~torchroof.serving.composition.StepMix`, as the scheduler sums it).
        ``graphed``: the new tokens per request of the only batches that replay a CUDA
        graph (k + 1 under speculative decoding); by default decodes of 1 token and
        verifications alike."""
        mix = self._mix(step, graphed)
        return self._timed(mix, mix.launched_eagerly(graphed))

    def group_times(
        self, steps: Sequence[StepMix], ranks: int, graphed: int | None = None
    ) -> list[StepTime]:
        """Each step's time where ``ranks`` data-parallel ranks (of which these are the busy
        ones) step together, as vLLM aligns them (vllm/v1/worker/dp_utils.py): where every
        rank's step replays a full CUDA graph padded to the group's most tokens (decodes
        within the captured sizes), every rank runs that many; else every rank is launched
        eagerly at its own tokens (vLLM's piecewise graphs, padded likewise where every
        rank fits them, are priced as eager launches here), its routed experts at the
        group's mean tokens (balanced routing sends every rank's rows to all the experts
        alike) and their all-to-alls at the group's most (the busiest rank sends longest).
        Attention and the output projection are each rank's own."""
        if not steps:
            raise OptionError("a lock-step group's step needs at least one busy rank")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < len(steps):
            raise OptionError(
                f"ranks must be a whole number of at least the {len(steps)} steps, got {ranks!r}"
            )
        mixes = [self._mix(step, graphed) for step in steps]
        most = max(mix.tokens for mix in mixes)
        graphs = not any(mix.launched_eagerly(graphed) for mix in mixes)
        if graphs and self._graphed(most):  # every rank replays the graph of `most` tokens
            return [self._timed(mix, False, padded=most) for mix in mixes]
        mean = -(-sum(mix.tokens for mix in mixes) // ranks)
        return [self._timed(mix, True, experts=(mean, most)) for mix in mixes]

    def _mix(self, step: Sequence[SequenceWork] | StepMix, graphed: int | None) -> StepMix:
        """``step`` as a checked :class:`~torchroof.serving.composition.StepMix`."""
        if isinstance(step, SequenceWork):
            raise OptionError("a step is a list of SequenceWork: wrap the one sequence in [ ]")
        if graphed is not None and (
            isinstance(graphed, bool) or not isinstance(graphed, int) or graphed < 1
        ):
            raise OptionError(f"graphed must be a whole number of tokens >= 1, got {graphed!r}")
        if not isinstance(step, StepMix):
            step = tuple(step)
            check_step(step)
            step = StepMix.of(items_of(step))
        elif step.sequences < 1:
            raise OptionError("an engine step needs at least one sequence")
        if step.longest > self._checked_length and self._config is not None:
            check_positions(self._config, step.longest, self._allow_beyond, name=self._name)
            self._checked_length = step.longest
        return step

    def _timed(
        self,
        step: StepMix,
        eager: bool,
        padded: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> StepTime:
        """``step``'s time launched eagerly where ``eager``; its body run at ``padded``
        tokens where given; its routed experts' kernels at ``experts[0]`` tokens and their
        all-to-alls at ``experts[1]`` where given."""
        tokens = padded or step.tokens
        body = self._between(tokens, "body_s", eager)
        if experts is not None:
            mean, most = experts
            body += self._between(mean, "experts_s", eager) - self._between(
                tokens, "experts_s", eager
            )
            body += self._between(most, "exchange_s", eager) - self._between(
                tokens, "exchange_s", eager
            )
        head = self._between(step.rows, "head_s", eager) if step.rows else 0.0
        attention = self._attention(step, eager)
        return StepTime(
            body + head + attention, body, head, attention, step.tokens, step.sequences, step.rows
        )

    def attention_s(self, step: Sequence[SequenceWork], tokens: int, eager: bool = False) -> float:
        """Every layer's attention for ``step``: a ragged kernel over its decodes and one
        over its prefill chunks (or speculative verifications), under the runtime a decode
        of batch ``tokens`` runs (launched eagerly where ``eager``)."""
        mix = StepMix.of(items_of(step))
        return self._attention(replace(mix, tokens=tokens), eager)

    def _attention(self, mix: StepMix, eager: bool) -> float:
        pricing = self._eager if eager else self.pricing
        runtime = self._runtime(mix.tokens, eager)
        total = 0.0
        for layer, count in self._layers.items():  # layers alike are timed once
            kernels = [ragged_decode(layer, mix.decodes, mix.decode_keys)] if mix.decodes else []
            if mix.chunks and layer.prefill is not None:
                kernels += _latent_chunks(layer, mix)
            elif mix.chunks:
                kernels.append(
                    ragged_prefill(
                        layer, mix.chunks, mix.chunk_rows, mix.chunk_keys, mix.chunk_pairs
                    )
                )
            total += count * sum(
                time_kernel(cost, self._spec, pricing, shape, shape.itemsize, runtime).time_s
                for cost, shape in kernels
            )
        return total * self._correction

    @property
    def config(self) -> Any:
        """The model's configuration (None for a module without one)."""
        return self._config

    @property
    def lockstep(self) -> int:
        """The data-parallel ranks the prepared step's experts couple (ep / tp, where the
        experts span more GPUs than tp: data-parallel attention), which step together; 1
        where they do not."""
        base = self.prepared.workload_for()
        return coupled_ranks(base.tp, base.ep)

    def layers(self) -> dict[AttentionGeometry, int]:
        """Each kind of attention layer's geometry, read off the prepared decode step's
        trace, with how many layers are of that kind."""
        return dict(self._layers)

    def memory(self, tokens: int) -> MemoryFootprint:
        """The memory footprint of the prepared decode at batch ``tokens``: its weights and
        the activations of a step of that many tokens, per GPU."""
        memory = self._probe(tokens, eager=True).memory
        if memory is None:
            raise OptionError("the prepared decode step has no memory footprint")
        return memory

    def step_activations(self, tokens: int, rows: int) -> int:
        """The activations one GPU holds at the peak of the largest step an engine runs:
        ``tokens`` new tokens spread over ``rows`` sequences (more where a sequence would
        outgrow the model's positions), a prefill with logits for each one's last token,
        as vLLM's profiling run sizes it (the budget of tokens over ``max_num_seqs``
        requests, then the sampler on each)."""
        key = (tokens, rows)
        found = self._activations.get(key)
        if found is None:
            batch = max(1, min(rows, tokens))
            limit = position_limit(self._config) if self._config is not None else None
            if limit is not None:  # no sequence longer than the model's positions
                batch = max(batch, math.ceil(tokens / limit[1]))
            if self._prefill is None:
                self._prefill = self.prepared.for_regime("prefill")
            with silenced():  # the first size priced from its own trace, not on symbols
                memory = self._prefill.price(
                    self.hardware, pricing=self.pricing, batch=batch, seq=max(1, tokens // batch)
                ).memory
            found = self._activations[key] = memory.activations_peak_bytes if memory else 0
        return found

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token adds to the cache on one GPU, over every layer."""
        return sum(
            count * layer.kv_heads * layer.kv_width * dtype_itemsize(layer.kv_dtype)
            for layer, count in self._layers.items()
        )

    def check_lengths(self, requests: Sequence[Request]) -> None:
        """Refuse a request longer (prompt and output) than the model's positions."""
        longest = max(requests, key=lambda r: r.input_len + r.output_len)
        if self._config is not None:
            length = longest.input_len + longest.output_len
            check_positions(self._config, length, self._allow_beyond, name=self._name)

    def describe(self) -> dict[str, Any]:
        """What a result records of the deployment: the model, the accelerator or
        cluster, the prepared step's parallel plan and the pricing."""
        base = self.prepared.workload_for()
        hardware = self.hardware if isinstance(self.hardware, (str, Path)) else self.hardware.name
        return {
            "model": self._name or type(self.prepared.model).__name__,
            "hardware": str(hardware),
            "tp": base.tp,
            "ep": base.ep,
            "dtype": base.dtype,
            "kv_dtype": base.kv_dtype,
            "quant": base.quant,
            "mode": self.pricing.mode,
            "runtime": self.pricing.runtime,
            "cuda_graphs": self.pricing.cuda_graphs,
            "exact_up_to": self.exact_up_to,
        }

    def _between(self, count: int, part: str, eager: bool) -> float:
        """``part`` of the decode at batch ``count``: priced at that batch up to
        ``exact_up_to``, above it interpolated linearly between the two grid batches
        around it."""
        if self.exact_up_to is None or count <= self.exact_up_to:
            return float(getattr(self._probe(count, eager), part))
        low, high = grid_neighbours(count, self.exact_up_to)
        below = float(getattr(self._probe(low, eager), part))
        if high == low:
            return below
        above = float(getattr(self._probe(high, eager), part))
        return below + (above - below) * (count - low) / (high - low)

    def _probe(self, batch: int, eager: bool) -> DecodeParts:
        if eager and not self._graphed(batch):
            eager = False  # the decode at this batch replays no graph: launched eagerly anyway
        parts = self._probes.get((batch, eager))
        if parts is None:
            pricing = self._eager if eager else self.pricing
            with silenced():  # a step inside a simulation: its stage reports the whole
                counted = self.prepared.kernel_times(self.hardware, pricing=pricing, batch=batch)
            parts = self._probes[(batch, eager)] = split_parts(counted, self._head)
        return parts

    def _graphed(self, batch: int) -> bool:
        """Whether the prepared decode at ``batch`` replays a CUDA graph under the pricing."""
        return self._runtime(batch, eager=False).graph_replayed

    def _runtime(self, batch: int, eager: bool) -> StepRuntime:
        """What the runtime sets for the prepared decode at ``batch`` (launched eagerly
        where ``eager``), worked out once per batch."""
        runtime = self._runtimes.get((batch, eager))
        if runtime is None:
            pricing = self._eager if eager else self.pricing
            runtime = self._runtimes[(batch, eager)] = runtime_at(pricing, self._regime, batch)
        return runtime

    def _read_trace(self) -> tuple[int, str, dict[AttentionGeometry, int]]:
        """(the prepared context, the output projection's module, each kind of attention
        layer with its count), read off the prepared decode step's trace."""
        trace = self.prepared.trace()
        if not isinstance(trace, Trace):
            raise OptionError("a step timer prices one pipeline stage")
        workload = trace.facts.workload
        context = workload.context if workload is not None else None
        if context is None:
            raise OptionError("the prepared decode step states no context")
        ops = [op for op in trace.ops if kind_of(op.packet) == "attention"]
        if not ops:
            raise OptionError(
                "the prepared decode step runs no fused attention kernel (transformers "
                "runs this model's attention as separate matmuls and a softmax): not "
                "priced per sequence yet"
            )
        text = text_config(self._config)
        layers = dict(Counter(decode_geometry(op, context, text) for op in ops))
        return context, head_module(trace), layers


def coupled_ranks(tp: int, ep: int) -> int:
    """The data-parallel ranks whose experts ``ep`` spreads over at ``tp`` (ep / tp where
    ep is above tp, else 1), which step together."""
    return ep // tp if ep > tp else 1


def _check_latent(config: Any, layers: dict[AttentionGeometry, int], base: Any) -> None:
    """Refuse latent attention the step timer would price wrong: a model that caches a
    latent (``kv_lora_rank``) but whose traced decode does not attend over it (a sparse
    top-k indexer, or ``mla='expanded'``: every head's K and V cached), and latent
    attention at tensor parallel above 1 (transformers' plan leaves DeepSeek-V3's attention
    unsharded: every GPU would be charged every head)."""
    latent = any(layer.latent for layer in layers)
    if getattr(text_config(config), "kv_lora_rank", None) and not latent:
        raise OptionError(
            "this model caches a latent, but its traced decode attends over expanded keys "
            "(a sparse top-k indexer, or mla='expanded'): not priced per request; prepare it "
            "with mla='absorbed' (the default) where its attention is dense"
        )
    if latent and base.tp > 1:
        raise OptionError(
            f"latent attention at tensor parallel {base.tp}: its attention is not sharded "
            "here, so every GPU would be charged every head; serve it at tp 1, one engine "
            "per data-parallel rank (--dp N --ep N --replicas N)"
        )


def _latent_chunks(layer: AttentionGeometry, mix: StepMix) -> list[tuple[Any, Any]]:
    """A latent-attention layer's kernels for a step's multi-token sequences: those of at
    most :data:`~torchroof.serving.composition.SHORT_QUERY` tokens in its absorbed decode
    kernel (causal over their cache), the longer ones in the expanded form after their
    cached latents are expanded."""
    assert layer.prefill is not None
    kernels = []
    if mix.shorts:
        kernels.append(
            ragged_prefill(layer, mix.shorts, mix.short_rows, mix.short_keys, mix.short_pairs)
        )
    longs = mix.chunks - mix.shorts
    if longs:
        rows, keys = mix.chunk_rows - mix.short_rows, mix.chunk_keys - mix.short_keys
        pairs = mix.chunk_pairs - mix.short_pairs
        kernels.append(ragged_prefill(layer.prefill, longs, rows, keys, pairs))
        if keys > rows:
            kernels += expand_kernels(layer, keys - rows)
    return kernels


def _check_base(base: Any) -> None:
    """Refuse a prepared step a step timer cannot price from."""
    facts = REGIME_FACTS[base.regime]
    if facts.tokens_per_sequence != 1 or "cache" not in facts.knobs:  # a decode step
        raise OptionError(
            f"a step timer prices from a decode step: prepare the model with regime "
            f"'decode', not '{base.regime}'"
        )
    if base.cache != "static":
        raise OptionError(
            f"a step timer needs cache='static' (an engine writes its KV cache in place), "
            f"not '{base.cache}'"
        )
    if base.pp > 1 or base.cp > 1:
        raise OptionError(
            "a step timer prices one pipeline stage without context parallel "
            f"(pp={base.pp}, cp={base.cp} given)"
        )

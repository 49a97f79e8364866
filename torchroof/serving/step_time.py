"""The time of one engine step of any composition, from a model prepared for decode.

A step of sequences i, each with n_i new tokens over c_i cached (:class:`SequenceWork`),
costs, on the roofline of the accelerator and runtime given:

- every kernel but attention and the output projection (embedding, norms, the q/k/v/o and
  MLP GEMMs, rotary embedding, KV-cache writes, MoE routing, tensor- and expert-parallel
  collectives, the runtime's launches and host overhead) as the prepared decode step runs
  them on N = Σ n_i rows: a decode of batch N processes N tokens through them exactly as
  an engine's flattened step does;
- the output projection on the S rows that sample a token, as a decode of batch S runs it
  (vLLM computes logits at the sampled positions only);
- attention per layer as ragged kernels over each sequence's own cache
  (:mod:`torchroof.serving.attention`).

Each batch priced is a :meth:`~torchroof.prepared.PreparedModel.price` of the prepared
step at that batch, kept for later steps of the same size. A step of B decodes at the
prepared context is that decode step, but for the dense mask transformers builds for a
static cache (B·(context + 1) bytes per layer), which an engine's paged kernels do not read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.api import config_of
from torchroof.config import PricingOptions
from torchroof.config.errors import OptionError
from torchroof.counters import kind_of
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import check_positions
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.runtime import timing_of, with_knobs
from torchroof.records.trace import Trace
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.serving.attention import (
    AttentionGeometry,
    chunk_kernel,
    decode_geometry,
    decode_kernel,
)
from torchroof.serving.composition import SequenceWork, check_step
from torchroof.timing.roofline import time_kernel
from torchroof.timing.runtime import StepRuntime

if TYPE_CHECKING:
    from torchroof.prepared import PreparedModel


@dataclass(frozen=True)
class StepTime:
    """One engine step's time and where it goes (seconds)."""

    time_s: float
    body_s: float  # every kernel but attention and the output projection, on N tokens
    head_s: float  # the output projection on the sampled rows
    attention_s: float  # every layer's ragged attention kernels
    tokens: int  # N: new tokens processed
    sequences: int
    sampled: int  # S: rows the output projection computes


@dataclass(frozen=True)
class _Probe:
    """A decode step of batch N priced whole, split into the parts a mixed step reuses."""

    time_s: float
    attention_s: float
    head_s: float

    @property
    def body_s(self) -> float:
        return self.time_s - self.attention_s - self.head_s


class StepTimer:
    """Prices engine steps of any composition for a model prepared for decode.

    >>> prepared = torchroof.prepare("llama-3-8b", "decode", context=1024)  # doctest: +SKIP
    >>> timer = StepTimer(prepared, "h100-sxm", mode="realistic")           # doctest: +SKIP
    >>> timer.time([prompt(512), *decodes(31, 1024)]).time_s               # doctest: +SKIP

    ``hardware`` and ``pricing`` (or its fields as keywords) are as
    :meth:`~torchroof.prepared.PreparedModel.price` takes them. The prepared step must be a
    decode with a static cache (an engine writes its cache in place) on one pipeline stage
    and without context parallel.
    """

    def __init__(
        self,
        prepared: PreparedModel,
        hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
        *,
        pricing: PricingOptions | None = None,
        **pricing_knobs: Any,
    ) -> None:
        base = prepared.workload_for()
        if base.regime != "decode":
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
        self._spec, _ = resolve_hardware(hardware)  # a bad name fails before any tracing
        self.prepared = prepared
        self.hardware = hardware
        self.pricing = with_knobs(pricing, pricing_knobs)
        self.context: int | None = None  # the prepared decode's, once it is traced
        self._config = config_of(prepared.model)
        self._name = str(prepared.model) if isinstance(prepared.model, (str, Path)) else None
        self._allow_beyond = base.allow_beyond_max_positions
        self._checked_length = 0  # the longest sequence checked against the positions
        self._probes: dict[int, _Probe] = {}
        self._layers: dict[AttentionGeometry, int] | None = None
        self._runtimes: dict[int, StepRuntime] = {}

    def time(self, step: Sequence[SequenceWork]) -> StepTime:
        """The time of one engine step processing ``step``'s sequences."""
        check_step(step)
        longest = max(work.length for work in step)
        if longest > self._checked_length and self._config is not None:
            check_positions(self._config, longest, self._allow_beyond, name=self._name)
            self._checked_length = longest
        tokens = sum(work.new_tokens for work in step)
        sampled = sum(1 for work in step if work.samples)
        body = self._probe(tokens).body_s
        head = self._probe(sampled).head_s if sampled else 0.0
        attention = self.attention_s(step, tokens)
        return StepTime(
            time_s=body + head + attention,
            body_s=body,
            head_s=head,
            attention_s=attention,
            tokens=tokens,
            sequences=len(step),
            sampled=sampled,
        )

    def attention_s(self, step: Sequence[SequenceWork], tokens: int) -> float:
        """Every layer's attention for ``step``: a ragged kernel over its decodes and one
        over its prefill chunks (or speculative verifications), under the runtime the
        prepared decode of batch ``tokens`` runs."""
        layers = self.layers()
        spec = self._spec
        runtime = self._runtimes.get(tokens)
        if runtime is None:
            workload = self.prepared.workload_for(batch=tokens)
            runtime = self._runtimes[tokens] = timing_of(self.pricing, workload)
        decodes = [work for work in step if work.new_tokens == 1]
        chunks = [work for work in step if work.new_tokens > 1]
        total = 0.0
        for layer, count in layers.items():  # layers alike are timed once
            kernels = ([decode_kernel(layer, decodes)] if decodes else []) + (
                [chunk_kernel(layer, chunks)] if chunks else []
            )
            total += count * sum(
                time_kernel(cost, spec, self.pricing, shape, shape.itemsize, runtime).time_s
                for cost, shape in kernels
            )
        return total

    def layers(self) -> dict[AttentionGeometry, int]:
        """Each kind of attention layer's geometry, read off the prepared decode step's
        trace, with how many layers are of that kind."""
        if self._layers is None:
            trace = self.prepared.trace()
            if not isinstance(trace, Trace):
                raise OptionError("a step timer prices one pipeline stage")
            ops = [op for op in trace.ops if kind_of(op.packet) == "attention"]
            if not ops:
                raise OptionError(
                    "the prepared decode step runs no fused attention kernel (transformers "
                    "runs this model's attention as separate matmuls and a softmax): not "
                    "priced per sequence yet"
                )
            workload = trace.facts.workload
            context = workload.context if workload is not None else None
            if context is None:
                raise OptionError("the prepared decode step states no context")
            self.context = context
            self._layers = dict(Counter(decode_geometry(op, context) for op in ops))
        return self._layers

    def _probe(self, batch: int) -> _Probe:
        probe = self._probes.get(batch)
        if probe is None:
            estimate = self.prepared.price(self.hardware, pricing=self.pricing, batch=batch)
            probe = self._probes[batch] = _split(estimate)
        return probe


def _split(estimate: Estimate) -> _Probe:
    """A decode step's time, its attention kernels' and its output projection's: the run
    of kernels that ends the step in one module outside the decoder layers."""
    kernels = estimate.kernels
    attention = sum(k.time_s for k in kernels if _is_attention(k))
    head_module = kernels[-1].module if kernels else ""
    head = 0.0
    if head_module and not any(part.isdigit() for part in head_module.split(".")):
        for kernel in reversed(kernels):
            if kernel.module != head_module:
                break
            head += kernel.time_s
    return _Probe(estimate.time_s, attention, head)


def _is_attention(kernel: KernelEstimate) -> bool:
    return any(kind_of(name.rsplit(".", 1)[0]) == "attention" for name in kernel.ops)

"""Variants side by side and sweeps: which GPU, which batch, GQA or not, bf16 or fp8,
fused or eager — one estimate per variant, one table (seed 000's labs on real models)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torchroof import analysis
from torchroof.api import check_quant_hardware, estimate, trace_model
from torchroof.options import PRICING_KNOBS, WORKLOAD_KNOBS, Workload, value_type
from torchroof.pipeline import estimate_trace
from torchroof.render_files import write_sweep_csv
from torchroof.render_text import layer_deltas, sweep_table, variants_table
from torchroof.report import Estimate

# The knobs, by name (torchroof/options.py), plus where the step runs; every other key
# compare is given is a model-config field.
PRICING_KEYS = {"hardware", *PRICING_KNOBS}  # variants differing only in these share a trace
ESTIMATE_KEYS = {*WORKLOAD_KNOBS, *PRICING_KEYS}
_INT_KEYS = {f.name for f in fields(Workload) if value_type(f) is int}
# What a sweep may vary: every integer size of the step (batch, seq, context, tp, fsdp, dp,
# microbatches, ...), not the op budget.
SWEEP_KEYS = tuple(f.name for f in fields(Workload) if value_type(f) is int and f.name != "max_ops")


def parse_value(key: str, text: str) -> Any:
    """A CLI value in the type the key takes: ints for sizes and most config fields,
    floats where they have a point, booleans for true/false, strings otherwise."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    if key in _INT_KEYS:
        raise ValueError(f"{key} takes integers, got {text!r}")
    try:
        return float(text)
    except ValueError:
        return text.strip()


def _with_config_fields(model: Any, fields: dict[str, Any]) -> Any:
    """The model's config with ``fields`` replaced (a copy; the original is untouched)."""
    from torchroof.models import load_config

    if not fields:
        return model
    config = copy.deepcopy(load_config(model if not hasattr(model, "config") else model.config))
    for key, value in fields.items():
        if not hasattr(config, key):
            known = sorted(ESTIMATE_KEYS)
            raise ValueError(
                f"unknown key {key!r}: not an estimate argument ({', '.join(known)}) "
                f"nor a field of {type(config).__name__}"
            )
        setattr(config, key, value)
    return config


@dataclass
class Variant:
    label: str
    settings: dict[str, Any]
    estimate: Estimate


@dataclass
class Comparison:
    """One estimate per variant, in the order asked."""

    variants: list[Variant]

    def table(self, tablefmt: str = "simple") -> str:
        """A column per variant (:func:`torchroof.render_text.variants_table`)."""
        return variants_table(self, tablefmt)

    def layer_deltas(self, depth: int | None = None) -> str:
        """Per-layer time of every variant against the first."""
        return layer_deltas(self, depth)

    def to_html(self, path: str | Path | None = None) -> str:
        """The variants side by side in one interactive HTML page; also written to ``path``
        when given (:func:`torchroof.render_html.comparison_html`)."""
        from torchroof.render_html import comparison_html

        return comparison_html(self, path)


def compare(model: Any, vary: dict[str, Sequence[Any]], **base: Any) -> Comparison:
    """Estimate ``model`` once per value of each varied key (the others held at ``base``).

    Keys are ``hardware``, any field of :class:`torchroof.options.Workload` or
    :class:`torchroof.options.PricingOptions` by its name, or a model-config field
    (``num_key_value_heads=[64, 8]``).
    """
    if not vary:
        raise ValueError("nothing to vary: give at least one key with its values")
    variants: list[Variant] = []
    traces: dict[str, Any] = {}  # variants that differ only in pricing share one trace
    for key, values in vary.items():  # a recipe a part cannot run fails before any tracing
        for value in values:
            settings = {**base, key: value}
            check_quant_hardware(
                settings.get("quant", "none"), settings.get("hardware", "h100-sxm")
            )
    for key, values in vary.items():
        if not values:
            raise ValueError(f"{key}: no values to compare")
        for value in values:
            settings = {**base, key: value}
            pricing = {k: v for k, v in settings.items() if k in PRICING_KEYS}
            tracing = {k: v for k, v in settings.items() if k not in PRICING_KEYS}
            cache_key = repr(sorted(tracing.items(), key=lambda kv: kv[0]))
            if cache_key not in traces:
                traces[cache_key] = _trace(model, tracing)
            est = estimate_trace(traces[cache_key], **pricing)
            variants.append(Variant(f"{key}={value}", settings, est))
    return Comparison(variants)


def _trace(model: Any, tracing: dict[str, Any]) -> Any:
    fields = {k: v for k, v in tracing.items() if k not in ESTIMATE_KEYS}
    kwargs = {k: v for k, v in tracing.items() if k in ESTIMATE_KEYS}
    return trace_model(_with_config_fields(model, fields), **kwargs)


@dataclass(frozen=True)
class SweepPoint:
    value: int
    estimate: Estimate


@dataclass
class Sweep:
    """One estimate per value of a size (batch, context or seq)."""

    key: str
    points: list[SweepPoint]

    @property
    def ridge_batch(self) -> float:
        """B* from the first point (the same at every batch: it is a weights property)."""
        return self.points[0].estimate.ridge_batch

    @property
    def kv_crossover_batch(self) -> float:
        return self.points[0].estimate.kv_crossover_batch

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for point in self.points:
            e = point.estimate
            traffic = e.traffic()
            out.append(
                {
                    self.key: point.value,
                    "step_time_s": e.time_s,
                    "tokens_per_s": e.tokens_per_s,
                    "gpus": analysis.ranks(e)[0],
                    "tokens_per_s_per_gpu": analysis.tokens_per_s_per_gpu(e),
                    "exposed_communication_s": analysis.communication(e).exposed_s,
                    "mfu": e.mfu,
                    "weight_bytes": traffic.get("weights", 0),
                    "kv_bytes": traffic.get("kv_cache", 0),
                    "activation_bytes": traffic.get("activations", 0),
                    "memory_bytes": e.memory.total_bytes if e.memory else 0,
                    "fits": e.memory.fits if e.memory else True,
                }
            )
        return out

    def table(self) -> str:
        """A row per value (:func:`torchroof.render_text.sweep_table`)."""
        return sweep_table(self)

    def to_csv(self, path: str | Path) -> None:
        write_sweep_csv(self, path)

    def to_html(self, path: str | Path | None = None) -> str:
        """The curves (B* and the KV crossover marked over batch) and every point's report
        in one interactive HTML page (:func:`torchroof.render_html.sweep_html`)."""
        from torchroof.render_html import sweep_html

        return sweep_html(self, path)


def sweep(model: Any, key: str, values: Sequence[int], **base: Any) -> Sweep:
    """Estimate ``model`` at each value of ``key``, one of :data:`SWEEP_KEYS` (batch, seq,
    context, the parallel sizes: ``fsdp`` over 8, 16, 32, 64 GPUs is a sweep over GPU counts)."""
    if key not in SWEEP_KEYS:
        raise ValueError(f"sweep over one of {', '.join(SWEEP_KEYS)}, got {key!r}")
    if not values:
        raise ValueError("no values to sweep")
    points = [SweepPoint(int(v), estimate(model, **{**base, key: int(v)})) for v in values]
    return Sweep(key, points)

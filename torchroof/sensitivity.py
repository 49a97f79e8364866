"""Which figure an estimate rests on: the step priced again with each hardware figure, and
each uncertain assumption, 10% lower and 10% higher.

A traced step is priced once per change, every other figure as it was (a one-at-a-time
sensitivity analysis, the simplest of those in Saltelli et al., *Global Sensitivity
Analysis: The Primer*, Wiley 2008, chapter 1). The figures are the accelerator file's
(HBM bandwidth, tensor and vector peaks, launch overhead, HBM latency, the on-chip
bandwidths, the achievable fractions of the realistic mode) and the cluster file's (each
link's bandwidth and per-collective latency, alpha); the assumption is the MoE routing's
imbalance of a step whose experts are sharded over ranks, varied upwards only (balanced
routing is its floor). A figure the realistic mode
alone reads (launch, latency, on-chip, achievable) moves nothing in the pure roofline, and
the table says so by a change of 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tabulate import tabulate

from torchroof.api import estimate_trace
from torchroof.config import PricingOptions
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.hardware.cluster import Link
from torchroof.hardware.toml_checks import Figure
from torchroof.parallel.pipeline.trace import PipelineTrace
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.price import TracePlans, pricing_options
from torchroof.pricing.routing import top_k_by_experts
from torchroof.progress import current, silenced
from torchroof.records.trace import Trace
from torchroof.render.units import ms

STEP = 0.10
"""How far each figure is moved, down and up: 10%."""

Where = tuple[HardwareSpec, ClusterSpec | None]


@dataclass(frozen=True)
class Change:
    """One figure or assumption moved: what it is, its value, and the step time with it
    ``STEP`` lower and higher (None: not moved that way)."""

    name: str
    value: str
    lower_s: float | None
    higher_s: float | None
    note: str = ""

    def moves(self, base_s: float) -> float:
        """The largest relative change of the step time either way."""
        return max(abs(t / base_s - 1) for t in (self.lower_s, self.higher_s) if t is not None)


@dataclass(frozen=True)
class Sensitivity:
    """The step time as estimated and with each figure moved, the largest moves first."""

    base_s: float
    changes: tuple[Change, ...]
    step: float = STEP

    def table(self) -> str:
        def cell(t: float | None) -> str:
            if t is None or self.base_s <= 0:
                return "-" if t is None else f"{ms(t)} ms"
            return f"{ms(t)} ms ({100 * (t / self.base_s - 1):+.1f}%)"

        pct = f"{100 * self.step:.0f}%"
        rows = [[c.name, c.value, cell(c.lower_s), cell(c.higher_s), c.note] for c in self.changes]
        headers = ["figure", "value", f"{pct} lower: step", f"{pct} higher: step", "note"]
        return tabulate(rows, headers, disable_numparse=True)

    def lines(self) -> list[str]:
        """The table under a line naming the figure the step rests on most."""
        top = self.changes[0] if self.changes and self.base_s > 0 else None
        head = f"sensitivity: the step time ({ms(self.base_s)} ms) with each figure moved "
        head += f"{100 * self.step:.0f}% either way, one at a time"
        if top is not None and top.moves(self.base_s) > 0:
            head += f"; it rests most on {top.name} ({100 * top.moves(self.base_s):.1f}%)"
        return [head, self.table()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_s": self.base_s,
            "step": self.step,
            "changes": [vars(c) for c in self.changes],
        }


def _scaled(figure: Figure, factor: float, cap: float | None = None) -> tuple[Figure, bool]:
    value = figure.value * factor
    capped = cap is not None and value > cap
    return replace(figure, value=min(value, cap) if cap is not None else value), capped


@dataclass(frozen=True)
class _Knob:
    """A figure of the accelerator or a link: its name, its value as text, and the hardware
    with it scaled (and whether a cap held it)."""

    name: str
    value: str
    scale: Callable[[float], tuple[Where, bool]]


def _spec_knob(
    spec: HardwareSpec,
    cluster: ClusterSpec | None,
    field: str,
    name: str,
    show: Callable[[float], str],
) -> _Knob | None:
    figure = getattr(spec, field)
    if figure is None:
        return None
    cap = 1.0 if field.startswith("achievable") else None

    def scale(factor: float) -> tuple[Where, bool]:
        new, capped = _scaled(figure, factor, cap)
        changed = replace(spec, **{field: new})
        return (changed, _with_accelerator(cluster, changed)), capped

    return _Knob(name, show(figure.value), scale)


def _peaks_knob(
    spec: HardwareSpec, cluster: ClusterSpec | None, field: str, name: str, extra: tuple[str, ...]
) -> _Knob:
    """Every entry of a table of peaks (every dtype), and the single peaks in ``extra``."""
    table: dict[str, Figure] = getattr(spec, field)
    bf16 = table.get("bf16") or next(iter(table.values()))

    def scale(factor: float) -> tuple[Where, bool]:
        fields: dict[str, Any] = {field: {k: _scaled(f, factor)[0] for k, f in table.items()}}
        for single in extra:
            figure = getattr(spec, single)
            if figure is not None:
                fields[single] = _scaled(figure, factor)[0]
        changed = replace(spec, **fields)
        return (changed, _with_accelerator(cluster, changed)), False

    key = "bf16" if "bf16" in table else next(iter(table))
    return _Knob(name, f"{key} {bf16.value / 1e12:,.1f} TFLOP/s", scale)


def _with_accelerator(cluster: ClusterSpec | None, spec: HardwareSpec) -> ClusterSpec | None:
    return replace(cluster, accelerator=spec) if cluster is not None else None


LINK_FIGURES = {  # a link's knob -> the figures it moves together
    "bandwidth": ("line_bytes_per_s", "nvls_all_reduce_bus_bytes_per_s"),
    "latency (alpha)": ("latency_s",),
}


def _link_knobs(spec: HardwareSpec, cluster: ClusterSpec) -> Iterator[_Knob]:
    """Each link's bandwidth (its line rate, so its achieved bus bandwidth, and its NVLink
    SHARP rate with it) and its per-collective latency."""
    links: list[tuple[str, Link]] = [("intra_node", cluster.intra_node)]
    if cluster.network is not None:
        links.append(("network", cluster.network))
    for slot, link in links:
        label = "network" if slot == "network" else link.kind
        for what, names in LINK_FIGURES.items():
            figure = getattr(link, names[0])
            if figure is None:
                continue

            def scale(
                factor: float, slot: str = slot, link: Link = link, names: tuple[str, ...] = names
            ) -> tuple[Where, bool]:
                moved = {n: _scaled(getattr(link, n), factor)[0] for n in names if getattr(link, n)}
                return (spec, replace(cluster, **{slot: replace(link, **moved)})), False

            shown = _us(figure.value) if what.startswith("latency") else _gb_s(figure.value)
            yield _Knob(f"{label} {what}", shown, scale)


def _tb_s(value: float) -> str:
    return f"{value / 1e12:.2f} TB/s"


def _gb_s(value: float) -> str:
    return f"{value / 1e9:.1f} GB/s"


def _us(value: float) -> str:
    return f"{value * 1e6:.2f} us"


def _ns(value: float) -> str:
    return f"{value * 1e9:.0f} ns"


def _fraction(value: float) -> str:
    return f"{value:.2f}"


def figure_knobs(spec: HardwareSpec, cluster: ClusterSpec | None) -> list[_Knob]:
    """Every figure of the accelerator and its cluster that is moved, in a fixed order."""
    found = [
        _spec_knob(spec, cluster, "hbm_bytes_per_s", "HBM bandwidth", _tb_s),
        _peaks_knob(spec, cluster, "tensor_flops_per_s", "tensor peak (every dtype)",
                    ("fp16_accumulate_tensor_flops_per_s",)),
        _peaks_knob(spec, cluster, "vector_flops_per_s", "vector and SFU peaks",
                    ("sfu_flops_per_s",)),
        _spec_knob(spec, cluster, "launch_overhead_s", "launch overhead per kernel", _us),
        _spec_knob(spec, cluster, "eager_launch_s", "eager launch per kernel (this device's)",
                   _us),
        _spec_knob(spec, cluster, "memory_latency_s", "HBM latency", _ns),
        _spec_knob(spec, cluster, "l2_bytes_per_s", "L2 bandwidth", _tb_s),
        _spec_knob(spec, cluster, "shared_memory_bytes_per_s", "shared-memory bandwidth", _tb_s),
        _spec_knob(spec, cluster, "achievable_hbm_fraction", "achievable HBM fraction",
                   _fraction),
        _spec_knob(spec, cluster, "achievable_tensor_fraction", "achievable tensor fraction",
                   _fraction),
    ]  # fmt: skip
    out = [k for k in found if k is not None]
    if cluster is not None:
        out += _link_knobs(spec, cluster)
    return out


RUNTIME_SETS = {
    "launch overhead per kernel": "a runtime's launch applies (or the file's eager launch)",
    "eager launch per kernel (this device's)": "read only for eager launches under a runtime",
}
"""Launch figures that apply only under some runtimes, and what a row that moved nothing
says: without a runtime the file's launch overhead, under one its eager launch where the
file lists one (the runtime's own figure otherwise, and for a CUDA graph's replay)."""


def _runtime_note(change: Change) -> Change:
    """A launch figure that moved nothing says why."""
    unmoved = change.lower_s == change.higher_s
    if change.name in RUNTIME_SETS and unmoved:
        return replace(change, note=RUNTIME_SETS[change.name])
    return change


def _shards_routed_experts(trace: Trace | PipelineTrace) -> bool:
    """The step routes tokens to experts sharded over ep > 1 ranks: the routing imbalance
    prices its busiest rank (with ep = 1 every expert is on every rank)."""
    workload = trace.facts.workload
    if workload is None or workload.ep <= 1:
        return False
    traces = trace.traces.values() if isinstance(trace, PipelineTrace) else [trace]
    return any(top_k_by_experts(t) for t in traces)


def sensitivity(
    trace: Trace | PipelineTrace,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    pricing: PricingOptions | None = None,
    *,
    step: float = STEP,
    plans: TracePlans | None = None,
    **knobs: Any,
) -> Sensitivity:
    """``trace`` priced on ``hardware`` as estimated (``pricing`` or its fields as keywords,
    as :func:`torchroof.api.estimate_trace` takes them), then with each figure
    (:func:`figure_knobs`) and the routing imbalance moved ``step`` down and up, one at a
    time."""
    pricing = pricing_options(pricing, knobs)
    if isinstance(step, bool) or not 0 < step < 1:
        raise ValueError(f"the sensitivity step is a fraction between 0 and 1, got {step!r}")
    spec, cluster = resolve_hardware(hardware)
    plans = plans if plans is not None else TracePlans()

    def priced(where: Where, options: PricingOptions) -> float:
        """The step's time on ``where``; its stages are this one's (silenced)."""
        on_spec, on_cluster = where
        with silenced():
            return estimate_trace(trace, on_cluster or on_spec, options, plans=plans).time_s

    moved = figure_knobs(spec, cluster)
    routes = _shards_routed_experts(trace)
    progress = current()
    progress.begin("pricing the step with each figure moved", 2 * len(moved) + 1 + routes)
    base_s = priced((spec, cluster), pricing)
    progress.advance()
    changes = []
    for knob in moved:
        times, notes = [], []
        for factor in (1 - step, 1 + step):
            where, capped = knob.scale(factor)
            times.append(priced(where, pricing))
            progress.advance()
            if capped:
                notes.append("capped at 1 when raised")
        changes.append(Change(knob.name, knob.value, times[0], times[1], "; ".join(notes)))
    if routes:
        imbalance = pricing.routing_imbalance
        higher = priced((spec, cluster), replace(pricing, routing_imbalance=imbalance * (1 + step)))
        progress.advance()
        note = "balanced is its floor: raised only"
        changes.append(Change("MoE routing imbalance", f"{imbalance:g}", None, higher, note))
    progress.end()
    if pricing.runtime and pricing.realistic:
        changes = [_runtime_note(c) for c in changes]
    ordered = sorted(changes, key=lambda c: -c.moves(base_s) if base_s else 0.0)
    return Sensitivity(base_s, tuple(ordered), step)

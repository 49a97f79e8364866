"""A serving run's pictures (matplotlib, the ``plot`` extra), from the numbers of
:mod:`torchroof.serving.series` and :mod:`torchroof.serving.load_curve`:

- the empirical CDFs of TTFT, TPOT, ITL and end-to-end latency, the targets drawn where
  given;
- the KV cache over time: the share of each replica's blocks in use, step by step, and the
  preemptions so far;
- the batches over time: prompt and decode tokens per step (stacked) and the sequences in
  each step, for the first replica's steps;
- against the offered rate: throughput (and goodput under the targets), P50 and P99 TTFT
  and TPOT, with the targets, the knee and its threshold.

:func:`serving_figures` gives each picture as its own figure; :func:`serving_plot` writes
them as panels of one file, :func:`rate_plot` the rate curves (PNG, SVG or PDF by the
file's suffix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from torchroof.config.errors import OptionError
from torchroof.render.plots import check_plot_path, pyplot
from torchroof.serving.load_curve import KNEE_FACTOR, LoadCurve
from torchroof.serving.results import ServeResult
from torchroof.serving.series import (
    CDF_LATENCIES,
    CDF_LOG_SPAN,
    batches_shown,
    ecdf,
    kv_title,
    log_scale,
    replica_name,
    step_series,
)

PANELS = ("latency", "kv_cache", "batch")


def check_serving_plot(path: str | Path) -> Path:
    """``path`` if a plot can be written there (an image suffix, matplotlib installed):
    checked before any work."""
    path = check_plot_path(path)
    pyplot()
    return path


def _targets(ttft_slo_s: float | None, tpot_slo_s: float | None) -> dict[str, float | None]:
    return {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s}


def draw_latencies(
    fig: Any, result: ServeResult, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
) -> None:
    """Four CDF panels (ms) on ``fig`` (a figure or a subfigure), each with its P99 in the
    title and its target, where one is given, as a dashed line."""
    axes = fig.subplots(2, 2)
    targets = _targets(ttft_slo_s, tpot_slo_s)
    for ax, (name, label) in zip(axes.flat, CDF_LATENCIES, strict=True):
        values = result.latencies(name)
        if not values.size:
            ax.set_title(f"{label}: no values")
            ax.set_axis_off()
            continue
        x, cdf = ecdf(values)
        ax.step(x * 1e3, cdf, where="post", color="tab:blue")
        target = targets.get(name)
        if target is not None:
            ax.axvline(
                target * 1e3, color="tab:red", ls="--", lw=1, label=f"target {target * 1e3:g} ms"
            )
            ax.legend(fontsize=8, loc="lower right")
        if log_scale(x, CDF_LOG_SPAN):
            ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("share of values at or below")
        ax.set_title(
            f"{label}: P50 {np.percentile(values, 50) * 1e3:.3g} ms, "
            f"P99 {np.percentile(values, 99) * 1e3:.3g} ms",
            fontsize=10,
        )
        ax.grid(True, lw=0.3, alpha=0.5)


def draw_kv_cache(fig: Any, result: ServeResult) -> None:
    """Each replica's KV blocks in use (%) step by step, and the preemptions so far."""
    series = step_series(result)
    ax = fig.subplots()
    for replica in np.unique(series.replica):
        mine = series.replica == replica
        ax.step(
            series.start_s[mine], series.kv_share[mine] * 100, where="post", lw=1,
            label=replica_name(result.engine, int(replica)),
        )  # fmt: skip
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV blocks in use (%)")
    twin = ax.twinx()
    twin.step(series.start_s, series.preemptions, where="post", color="tab:red", lw=1)
    twin.set_ylabel("preemptions so far", color="tab:red")
    preempted = int(series.preemptions[-1]) if len(series) else 0
    ax.set_title(kv_title(result.engine, preempted), fontsize=10)
    if len(np.unique(series.replica)) > 1:
        ax.legend(fontsize=8, loc="upper left")


def draw_batches(fig: Any, result: ServeResult) -> None:
    """The first replica's steps: prompt and decode tokens (stacked) and sequences per
    step."""
    series = step_series(result)
    first, which = batches_shown(result.engine, series)
    start = series.start_s[first]
    ax = fig.subplots()
    ax.stackplot(
        start,
        series.prefill_tokens[first],
        series.decode_tokens[first],
        labels=["prompt tokens", "decode tokens"],
        colors=["tab:orange", "tab:blue"],
        step="post",
        alpha=0.7,
    )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens per step")
    twin = ax.twinx()
    twin.step(start, series.sequences[first], where="post", color="black", lw=0.8)
    twin.set_ylabel("sequences per step")
    ax.set_title("batches" + which, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def serving_figures(
    result: ServeResult, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
) -> dict[str, Any]:
    """Each picture of ``result`` as its own matplotlib figure: ``latency`` (the four
    CDFs), ``kv_cache`` and ``batch``. Close them with ``matplotlib.pyplot.close``."""
    plt = pyplot()
    latency = plt.figure(figsize=(11, 8), layout="constrained")
    draw_latencies(latency, result, ttft_slo_s, tpot_slo_s)
    kv = plt.figure(figsize=(11, 4), layout="constrained")
    draw_kv_cache(kv, result)
    batch = plt.figure(figsize=(11, 4), layout="constrained")
    draw_batches(batch, result)
    return {"latency": latency, "kv_cache": kv, "batch": batch}


def _title(result: ServeResult) -> str:
    engine = result.engine
    return (
        f"{engine['model']} on {engine['hardware']}: {len(result.requests):,} requests over "
        f"{result.duration_s:.3g} s"
    )


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def serving_plot(
    result: ServeResult,
    path: str | Path,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> Path:
    """Write the pictures of :func:`serving_figures` as panels of one file (its suffix
    picks PNG, SVG or PDF)."""
    path = check_serving_plot(path)
    fig = pyplot().figure(figsize=(11, 15), layout="constrained")
    latency, kv, batch = fig.subfigures(3, 1, height_ratios=[2.2, 1, 1])
    draw_latencies(latency, result, ttft_slo_s, tpot_slo_s)
    draw_kv_cache(kv, result)
    draw_batches(batch, result)
    fig.suptitle(_title(result))
    return _save(fig, path)


def _scale(ax: Any, which: str, values: list[float]) -> None:
    """A log scale on ``ax``'s ``which`` axis ("x" or "y") where ``values`` span 10x or
    more, ticked at 1, 2 and 5 times each power of ten and labelled as plain numbers."""
    if not log_scale(values):
        return
    import matplotlib.ticker as ticker

    getattr(ax, f"set_{which}scale")("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def rate_figure(curve: LoadCurve, factor: float = KNEE_FACTOR) -> Any:
    """Throughput, TTFT and TPOT against the offered rate, each rate served a point: the
    targets dashed, the knee dotted, TTFT's knee threshold (``factor`` x its one-at-a-time
    P99) dash-dotted."""
    rows = curve.rows()
    if not rows:
        raise OptionError(
            "no rate was served at open arrivals: nothing to draw against the rate (serve a "
            "list of rates: --rates, torchroof.serving.serve_rates)"
        )
    knee = curve.knee(factor)
    rates = [row["rate"] for row in rows]
    plt = pyplot()
    fig, (put, ttft, tpot) = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    put.plot(rates, [r["request_throughput_per_s"] for r in rows], "o-", label="served")
    if curve.ttft_s is not None or curve.tpot_s is not None:
        put.plot(rates, [r["goodput_per_s"] for r in rows], "s--", label="goodput (within targets)")
    put.plot(rates, rates, color="grey", lw=0.6, label="served = offered")
    put.set_ylabel("requests/s")
    _scale(put, "y", rates)
    put.set_title("throughput", fontsize=10)
    for ax, key, target, label in (
        (ttft, "ttft_s", curve.ttft_s, "TTFT"),
        (tpot, "tpot_s", curve.tpot_s, "TPOT"),
    ):
        for p, style in ((50, "o-"), (99, "s-")):
            ax.plot(rates, [r[f"p{p}_{key}"] * 1e3 for r in rows], style, label=f"P{p} {label}")
        if target is not None:
            ax.axhline(
                target * 1e3, color="tab:red", ls="--", lw=1, label=f"target {target * 1e3:g} ms"
            )
        ax.set_ylabel(f"{label} (ms)")
        _scale(ax, "y", [r[f"p{p}_{key}"] * 1e3 for r in rows for p in (50, 99)])
        ax.set_title(label, fontsize=10)
    ttft.axhline(
        knee.threshold_s * 1e3, color="grey", ls="-.", lw=1,
        label=f"{factor:g}x P99 one at a time ({knee.threshold_s * 1e3:.3g} ms)",
    )  # fmt: skip
    for ax in (put, ttft, tpot):
        if knee.rate is not None and knee.first_past is not None:  # a knee among the rates
            ax.axvline(knee.rate, color="grey", ls=":", lw=1.2, label=f"knee {knee.rate:.4g}/s")
        _scale(ax, "x", rates)
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        ax.legend(fontsize=8)
    engine = curve.alone.result.engine
    fig.suptitle(f"{engine['model']} on {engine['hardware']} against the offered rate")
    return fig


def rate_plot(curve: LoadCurve, path: str | Path, factor: float = KNEE_FACTOR) -> Path:
    """Write :func:`rate_figure` (its suffix picks PNG, SVG or PDF)."""
    path = check_serving_plot(path)
    return _save(rate_figure(curve, factor), path)

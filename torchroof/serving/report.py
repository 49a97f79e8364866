"""A serving run as one offline HTML page: the summary (latency percentiles, throughput,
goodput, KV peak, preemptions), the latency CDFs, the KV cache and the batches over time,
and, where rates were served, the curves against the offered rate with the knee.

The charts are plotly's (the ``html`` extra), plotly.js inlined once: no CDN, no server.
A long run keeps at most :data:`CDF_POINTS` points of each CDF (each an exact point of it,
:func:`torchroof.serving.series.ecdf`) and at most :data:`PAGE_STEPS` steps (every k-th,
the page says so); the same inputs give the same bytes.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from tabulate import tabulate

from torchroof.render.files import check_html_path
from torchroof.render.html import plotly_js
from torchroof.render.serving import LATENCY_ROWS, serving_lines
from torchroof.render.serving_curves import curve_table, knee_sentence
from torchroof.serving.load_curve import KNEE_FACTOR, LoadCurve
from torchroof.serving.results import ServeResult
from torchroof.serving.series import (
    CDF_LATENCIES,
    CDF_LOG_SPAN,
    batches_shown,
    ecdf,
    log_scale,
    replica_name,
    step_series,
)

CDF_POINTS = 2000
PAGE_STEPS = 20_000
TEMPLATE = "plotly_white"
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.note { color: #555; }
"""


def _go() -> Any:
    plotly_js()  # the clear error without plotly
    import plotly.graph_objects as go

    return go


def _subplots(**kwargs: Any) -> Any:
    _go()
    from plotly.subplots import make_subplots

    return make_subplots(**kwargs)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def latency_figure(
    result: ServeResult, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
) -> Any:
    """The four latency CDFs (ms) as one plotly figure of 2 x 2 panels."""
    titles = [label for _, label in CDF_LATENCIES]
    fig = _subplots(rows=2, cols=2, subplot_titles=titles)
    targets = {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s}
    for i, (name, label) in enumerate(CDF_LATENCIES):
        row, col = divmod(i, 2)
        x, cdf = ecdf(result.latencies(name), CDF_POINTS)
        trace = _go().Scatter(x=x * 1e3, y=cdf, mode="lines", line_shape="hv", name=label)
        fig.add_trace(trace, row=row + 1, col=col + 1)
        scale = "log" if log_scale(x, CDF_LOG_SPAN) else "linear"
        fig.update_xaxes(title_text=f"{label} (ms)", type=scale, row=row + 1, col=col + 1)
        fig.update_yaxes(range=[0, 1.02], row=row + 1, col=col + 1)
        target = targets.get(name)
        if target is not None:
            fig.add_vline(
                x=target * 1e3, line_dash="dash", line_color="red", row=row + 1, col=col + 1
            )
    fig.update_layout(template=TEMPLATE, height=700, showlegend=False)
    return fig


def _notes(lines: list[str]) -> list[str]:
    """What the page says beside its tables: the pricing, and every line the text prints
    after its latency table (throughput, engine, prefix cache, swaps, speculation, the
    disaggregated sides)."""
    after = lines.index("") + 1 if "" in lines else len(lines)
    return [lines[1], *lines[after:]]


def _stride(steps: int) -> int:
    return max(1, math.ceil(steps / PAGE_STEPS))


def kv_figure(result: ServeResult) -> Any:
    """Each replica's KV blocks in use (%) step by step, and the preemptions so far."""
    series = step_series(result)
    series = series.every(_stride(len(series)))
    fig = _subplots(specs=[[{"secondary_y": True}]])
    go = _go()
    for replica in sorted(set(series.replica.tolist())):
        mine = series.replica == replica
        fig.add_trace(
            go.Scatter(
                x=series.start_s[mine], y=series.kv_share[mine] * 100, mode="lines",
                line_shape="hv",
                name=f"{replica_name(result.engine, int(replica))}: KV blocks in use (%)",
            ),
            secondary_y=False,
        )  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=series.start_s, y=series.preemptions, mode="lines", line_shape="hv",
            name="preemptions so far", line_color="red",
        ),
        secondary_y=True,
    )  # fmt: skip
    fig.update_xaxes(title_text="time (s)")
    fig.update_yaxes(title_text="KV blocks in use (%)", secondary_y=False)
    fig.update_yaxes(title_text="preemptions so far", secondary_y=True)
    fig.update_layout(template=TEMPLATE, height=380)
    return fig


def batch_figure(result: ServeResult) -> Any:
    """The first replica's steps: prompt and decode tokens (stacked), sequences per step."""
    series = step_series(result)
    series = series.every(_stride(len(series)))
    first, _ = batches_shown(result.engine, series)
    fig = _subplots(specs=[[{"secondary_y": True}]])
    go = _go()
    x = series.start_s[first]
    for values, name in (
        (series.prefill_tokens[first], "prompt tokens"),
        (series.decode_tokens[first], "decode tokens"),
    ):
        fig.add_trace(
            go.Scatter(x=x, y=values, mode="lines", line_shape="hv", stackgroup="tokens", name=name)
        )
    fig.add_trace(
        go.Scatter(
            x=x, y=series.sequences[first], mode="lines", line_shape="hv",
            name="sequences per step", line_color="black",
        ),
        secondary_y=True,
    )  # fmt: skip
    fig.update_xaxes(title_text="time (s)")
    fig.update_yaxes(title_text="tokens per step", secondary_y=False)
    fig.update_yaxes(title_text="sequences per step", secondary_y=True)
    fig.update_layout(template=TEMPLATE, height=380)
    return fig


def rate_curve_figure(curve: LoadCurve, factor: float = KNEE_FACTOR) -> Any:
    """Throughput (and goodput), TTFT and TPOT (P50, P99) against the offered rate, with
    the targets, TTFT's knee threshold and the knee."""
    rows = curve.rows()
    knee = curve.knee(factor)
    rates = [row["rate"] for row in rows]
    fig = _subplots(rows=1, cols=3, subplot_titles=["throughput (requests/s)", "TTFT", "TPOT"])
    go = _go()
    served = [row["request_throughput_per_s"] for row in rows]
    fig.add_trace(go.Scatter(x=rates, y=served, name="served"), row=1, col=1)
    if curve.ttft_s is not None or curve.tpot_s is not None:
        good = [row["goodput_per_s"] for row in rows]
        fig.add_trace(go.Scatter(x=rates, y=good, name="goodput (within targets)"), row=1, col=1)
    for col, key, target, label in (
        (2, "ttft_s", curve.ttft_s, "TTFT"),
        (3, "tpot_s", curve.tpot_s, "TPOT"),
    ):
        for p in (50, 99):
            values = [row[f"p{p}_{key}"] * 1e3 for row in rows]
            fig.add_trace(go.Scatter(x=rates, y=values, name=f"P{p} {label} (ms)"), row=1, col=col)
        if target is not None:
            fig.add_hline(y=target * 1e3, line_dash="dash", line_color="red", row=1, col=col)
        values = [row[f"p{p}_{key}"] * 1e3 for row in rows for p in (50, 99)]
        scale = "log" if log_scale(values) else "linear"
        fig.update_yaxes(type=scale, title_text=f"{label} (ms)", row=1, col=col)
    fig.add_hline(y=knee.threshold_s * 1e3, line_dash="dashdot", line_color="grey", row=1, col=2)
    if knee.rate is not None and knee.first_past is not None:  # a knee among the rates
        for col in (1, 2, 3):
            fig.add_vline(x=knee.rate, line_dash="dot", line_color="grey", row=1, col=col)
    scale = "log" if log_scale(rates) else "linear"
    fig.update_xaxes(title_text="offered rate (requests/s)", type=scale)
    fig.update_layout(template=TEMPLATE, height=420)
    return fig


def _div(fig: Any, name: str) -> str:
    config = {"displaylogo": False}
    return str(fig.to_html(full_html=False, include_plotlyjs=False, div_id=name, config=config))


def summary_tables(
    result: ServeResult, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
) -> str:
    """The run's latency table (ms: mean, P50, P90, P99) and its figures, as HTML tables
    (the numbers as ``torchroof serve`` prints them)."""
    summary = result.summary(ttft_slo_s, tpot_slo_s)
    rows = [
        [label, *(_ms(summary[key][k]) for k in ("mean", "p50", "p90", "p99"))]
        for key, label in LATENCY_ROWS
    ]
    latency = tabulate(
        rows,
        headers=["latency (ms)", "mean", "P50", "P90", "P99"],
        tablefmt="html",
        disable_numparse=True,
    )
    figures = [
        ["requests", f"{summary['requests']:,}"],
        ["duration (s)", f"{summary['duration_s']:.4g}"],
        ["requests/s", f"{summary['request_throughput_per_s']:.2f}"],
        ["output tokens/s", f"{summary['output_tokens_per_s']:,.0f}"],
        ["tokens/s with the prompts", f"{summary['total_tokens_per_s']:,.0f}"],
    ]
    if ttft_slo_s is not None or tpot_slo_s is not None:
        figures += [
            ["goodput (requests/s within targets)", f"{summary['goodput_per_s']:.2f}"],
            ["requests within targets", f"{summary['requests_meeting_slo']:,}"],
        ]
    figures += [
        ["KV cache peak in use", f"{summary['kv_blocks_peak_share']:.1%}"],
        ["preemptions", f"{summary['preemptions']:,}"],
        ["steps", f"{summary['steps']:,}"],
    ]
    table = tabulate(figures, headers=["figure", "value"], tablefmt="html", disable_numparse=True)
    return f"{latency}\n{table}"


def serving_html(
    result: ServeResult,
    path: str | Path | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    curve: LoadCurve | None = None,
    factor: float = KNEE_FACTOR,
    title: str = "",
    about: str = "",
) -> str:
    """The page of ``result`` (and of ``curve``'s rates, where given, with the knee by
    ``factor``; ``about`` says which run ``result`` is); written to ``path`` (a .html
    file) when given."""
    if path is not None:
        check_html_path(path)
    summary = result.summary(ttft_slo_s, tpot_slo_s)
    lines = serving_lines(summary, result.engine)
    title = title or lines[0]
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{"<br>".join(html.escape(line) for line in _notes(lines))}</p>',
        f"<p>{html.escape(about)}</p>" if about else "",
        "<h2>Summary</h2>",
        summary_tables(result, ttft_slo_s, tpot_slo_s),
        "<h2>Latency distributions</h2>",
        _div(latency_figure(result, ttft_slo_s, tpot_slo_s), "latency"),
        "<h2>KV cache</h2>",
        _div(kv_figure(result), "kv-cache"),
        "<h2>Batches</h2>",
        _div(batch_figure(result), "batches"),
    ]
    stride = _stride(len(result.steps.start_s))
    if stride > 1:
        parts.append(f'<p class="note">The time series show one step in every {stride}.</p>')
    if curve is not None:
        data = curve.to_dict(factor)
        parts += [
            "<h2>Against the offered rate</h2>",
            curve_table(data, tablefmt="html"),
            f"<p>{html.escape(knee_sentence(data['knee']))}</p>",
        ]
        if curve.points:
            parts.append(_div(rate_curve_figure(curve, factor), "rates"))
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n"
        f"<script>\n{plotly_js()}\n</script>\n</head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body>\n</html>\n"
    )
    if path is not None:
        Path(path).write_text(page, encoding="utf-8")
    return page

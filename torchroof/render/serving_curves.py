"""Serving against the offered rate as text: each rate served with its throughput and
latencies, and the knee, read from the dictionaries
:meth:`torchroof.serving.LoadCurve.to_dict` gives (a rate search's knee alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tabulate import tabulate

from torchroof.accuracy.expected import no_range_lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def curve_table(data: Mapping[str, Any], tablefmt: str = "simple") -> str:
    """One row per load: the requests one at a time, then each rate, with the requests and
    output tokens served per second, P50 and P99 TTFT and TPOT (ms), the share within the
    targets where any was given, and the preemptions."""
    targets = data["ttft_s"] is not None or data["tpot_s"] is not None
    headers = ["rate /s", "served /s", "output tokens/s", "P50 TTFT ms", "P99 TTFT ms"]
    headers += ["P50 TPOT ms", "P99 TPOT ms", *(["within targets"] if targets else [])]
    rows = []
    for row in [data["one_at_a_time"], *data["rates"]]:
        cells = [
            row["how"] or f"{row['rate']:,.4g}",
            f"{row['request_throughput_per_s']:,.4g}",
            f"{row['output_tokens_per_s']:,.0f}",
            *(_ms(row[key]) for key in ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s")),
        ]
        if targets:
            cells.append(f"{row['within_targets']:.0%}")
        rows.append([*cells, f"{row['preemptions']:,}"])
    return tabulate(
        rows, headers=[*headers, "preemptions"], tablefmt=tablefmt, disable_numparse=True
    )


def knee_sentence(knee: Mapping[str, Any]) -> str:
    """Where the P99 TTFT takes off, by the rule of :mod:`torchroof.serving.load_curve`:
    the rate, the threshold it is measured against and the first rate past it."""
    factor, baseline = knee["factor"], knee["baseline_p99_ttft_s"] * 1e3
    threshold = knee["threshold_s"] * 1e3
    rule = f"{factor:g}x its {baseline:.3g} ms one at a time, {threshold:.3g} ms"
    rate, past = knee["rate"], knee["first_past"]
    if rate is None and past is None:
        return "knee: no rate was served at open arrivals"
    if past is None:
        return (
            f"knee: not reached: the P99 TTFT stays within {rule}, up to {rate:,.4g} "
            "requests/s, the highest rate served"
        )
    past_ms = knee["first_past_p99_ttft_s"] * 1e3
    if rate is None:
        return (
            f"knee: below {past:,.4g} requests/s, the lowest rate served: its P99 TTFT, "
            f"{past_ms:.3g} ms, is already past {rule}"
        )
    return (
        f"knee: {rate:,.4g} requests/s, the last rate before the P99 TTFT passes {rule} "
        f"(at {past:,.4g} requests/s it is {past_ms:.3g} ms)"
    )


def rate_curve_lines(data: Mapping[str, Any]) -> list[str]:
    """The loads served (:func:`curve_table`) and the knee."""
    engine = data["engine"]
    head = (
        f"torchroof serve: {engine['model']} on {engine['hardware']}, the same requests at "
        f"{len(data['rates'])} rates"
    )
    return [
        head,
        curve_table(data),
        "",
        knee_sentence(data["knee"]),
        *no_range_lines(data.get("expected")),
    ]

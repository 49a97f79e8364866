"""A simulated serving run as text: its latencies, throughput, goodput and engine, read
from the summary and engine dictionaries :class:`torchroof.serving.ServeResult` gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tabulate import tabulate

from torchroof.accuracy.expected import no_range_lines
from torchroof.render.disaggregated import disaggregated_lines, disaggregated_plan

LATENCY_ROWS = (
    ("ttft_s", "time to first token"),
    ("tpot_s", "time per output token"),
    ("itl_s", "inter-token latency"),
    ("e2e_s", "end-to-end latency"),
    ("queue_s", "queueing delay"),
)


def serving_lines(summary: Mapping[str, Any], engine: Mapping[str, Any]) -> list[str]:
    """The run's latency table (ms: mean, P50, P90, P99) and its throughput, goodput and
    engine lines."""
    rows = []
    for key, label in LATENCY_ROWS:
        stats = summary[key]
        rows.append([label, *(_ms(stats[k]) for k in ("mean", "p50", "p90", "p99"))])
    table = tabulate(rows, headers=["latency (ms)", "mean", "P50", "P90", "P99"])
    lines = [
        f"torchroof serve: {engine['model']} on {engine['hardware']}, {_plan(engine)}, "
        f"{summary['requests']:,} requests over {summary['duration_s']:.1f} s",
        f"priced: {_pricing(engine)}",
        table,
        "",
        f"throughput: {summary['request_throughput_per_s']:.2f} requests/s, "
        f"{summary['output_tokens_per_s']:,.0f} output tokens/s, "
        f"{summary['total_tokens_per_s']:,.0f} tokens/s with the prompts",
    ]
    lines += no_range_lines(summary.get("expected"))
    slo = summary["slo"]
    if slo["ttft_s"] is not None or slo["tpot_s"] is not None:
        limits = [
            f"{name} <= {value * 1e3:g} ms"
            for name, value in (("TTFT", slo["ttft_s"]), ("TPOT", slo["tpot_s"]))
            if value is not None
        ]
        lines.append(
            f"goodput: {summary['goodput_per_s']:.2f} requests/s meet {' and '.join(limits)} "
            f"({summary['requests_meeting_slo']:,} of {summary['requests']:,})"
        )
    lines.append(
        f"engine: {summary['steps']:,} steps; KV cache {engine['kv_blocks']:,} blocks of "
        f"{engine['block_size']} tokens per replica (at most {summary['kv_blocks_peak_share']:.1%} "
        f"in use); {summary['preemptions']:,} preemptions"
    )
    if "disaggregate" in engine:  # each side's own cache, and the transfers
        lines[-1:] = disaggregated_lines(summary, engine)
    swap = summary.get("swap")
    if swap is not None:
        lines.append(
            f"swap preemption: {swap['swapped_out']:,} requests swapped to host memory, "
            f"{swap['swapped_in']:,} back; {swap['blocks_copied']:,} blocks copied in "
            f"{swap['copy_time_s'] * 1e3:.2f} ms of the steps; the other "
            f"{summary['preemptions'] - swap['swapped_out']:,} preemptions recomputed"
        )
    cache = summary.get("prefix_cache")
    if cache is not None:
        state = "on" if engine.get("prefix_caching", True) else "off"
        lines.append(
            f"prefix cache ({state}): {cache['hit_rate']:.1%} of {cache['queried_tokens']:,} "
            f"prompt tokens found cached (shared prefixes: {engine.get('prefix_groups', 0):,})"
        )
    spec = summary.get("speculative")
    if spec is not None:
        lines.append(
            f"speculative decoding: {engine['draft_model']} drafts "
            f"{engine['speculative_tokens']} tokens per step; {spec['acceptance_rate']:.1%} "
            f"of {spec['drafted']:,} drafts accepted, {spec['mean_acceptance_length']:.2f} "
            f"tokens per verification (the rates give {spec['expected_acceptance_length']:.2f} "
            f"for the drafts checked, {engine['expected_tokens_per_verification']:.2f} for "
            f"{engine['speculative_tokens']})"
        )
    return lines


def rate_search_lines(search: Mapping[str, Any]) -> list[str]:
    """The loads a search served (its ``tried``: rate or how, attainment, P99 TTFT and
    TPOT) and the highest rate within the targets, or why there is none."""
    rows = [
        [
            t["how"] or f"{t['rate']:,.4g}",
            f"{t['attainment']:.0%}",
            _ms(t["p99_ttft_s"]),
            _ms(t["p99_tpot_s"]),
        ]
        for t in search["tried"]
    ]
    table = tabulate(rows, headers=["rate /s", "within targets", "P99 TTFT ms", "P99 TPOT ms"])
    limits = " and ".join(
        f"{name} <= {value * 1e3:g} ms"
        for name, value in (("TTFT", search["ttft_s"]), ("TPOT", search["tpot_s"]))
        if value is not None
    )
    share = f"{search['attainment']:.0%}"
    best, first = search["best"], search["tried"][0]
    if best is not None and best["rate"] is None:
        verdict = (
            f"every request at once meets {limits} for {best['attainment']:.0%} of them: no "
            "rate limits them"
        )
    elif best is not None:
        verdict = (
            f"highest rate within the targets: {best['rate']:,.4g} requests/s "
            f"({best['attainment']:.0%} of requests meet {limits})"
        )
    elif first["attainment"] < search["attainment"]:
        verdict = (
            f"no rate meets {limits} for {share} of requests: served one at a time, "
            f"{first['attainment']:.0%} of them do"
        )
    else:
        lowest = min(t["rate"] for t in search["tried"] if t["rate"] is not None and not t["how"])
        verdict = f"no rate down to {lowest:,.4g} requests/s meets {limits} for {share} of requests"
    return [table, "", verdict, *no_range_lines(search.get("expected"))]


def _plan(engine: Mapping[str, Any]) -> str:
    replicas, group = engine["replicas"], engine.get("lockstep", 1)
    parts = [f"{replicas} replica{'s' if replicas != 1 else ''}"]
    sizes = [f"{k} {engine[k]}" for k in ("tp", "ep") if engine.get(k, 1) != 1]
    parts += sizes
    if group > 1:  # data-parallel attention: each group of ranks steps together
        ranks = f"{replicas} data-parallel ranks of {', '.join(sizes)}"
        parts = [f"{ranks}, in lock-step groups of {group}"]
    if "disaggregate" in engine:
        parts = [disaggregated_plan(engine)]
    load = (
        f"{engine['concurrency']} concurrent clients"
        if engine.get("concurrency")
        else "open arrivals"
    )
    return f"{' x '.join(parts)}, {load}"


def _pricing(engine: Mapping[str, Any]) -> str:
    parts = [engine.get("mode") or "roofline"]
    if engine.get("runtime"):
        parts.append(f"runtime {engine['runtime']}")
    if engine.get("cuda_graphs") is False:
        parts.append("every step launched eagerly")
    if engine.get("exact_up_to"):
        parts.append(f"steps of more than {engine['exact_up_to']} tokens interpolated")
    return ", ".join(parts)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"

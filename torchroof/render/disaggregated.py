"""A disaggregated serving run's own lines: each side's instances, plan and KV cache, and
the KV-cache transfers between them, read from the summary and engine dictionaries
:class:`torchroof.serving.disaggregated_result.DisaggregatedResult` gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SIDES = ("prefill", "decode")


def disaggregated_plan(engine: Mapping[str, Any]) -> str:
    """``1P2D: prefill tp 4, decode tp 2``: the layout and each side's plan."""
    sides = ", ".join(f"{side} {_side_plan(engine[side])}" for side in SIDES)
    return f"{engine['disaggregate']}: {sides}"


def disaggregated_lines(summary: Mapping[str, Any], engine: Mapping[str, Any]) -> list[str]:
    """The steps and preemptions, each side's instances and KV cache, and the transfers."""
    lines = [f"engine: {summary['steps']:,} steps; {summary['preemptions']:,} preemptions"]
    shares = summary["kv_blocks_peak_share_by_side"]
    for side in SIDES:
        about = engine[side]
        count = about["instances"]
        gpus = ", ".join(_gpus(g) for g in about["gpus"])
        lines.append(
            f"{side}: {count} instance{'s' if count != 1 else ''} ({_side_plan(about)}; GPUs "
            f"{gpus}), KV cache {about['kv_blocks']:,} blocks of {about['block_size']} tokens "
            f"each (at most {shares[side]:.1%} in use)"
        )
    sent = summary["kv_transfer"]
    if sent:
        lines.append(
            f"KV cache sent: {sent['bytes']['mean'] / 2**20:,.2f} MiB per request (mean), in "
            f"{_ms(sent['time_s']['mean'])} ms (P99 {_ms(sent['time_s']['p99'])} ms) after "
            f"{_ms(sent['wait_s']['mean'])} ms (P99 {_ms(sent['wait_s']['p99'])} ms) waiting "
            "for decode blocks and the link; both count in the time to first token"
        )
    return lines


def _side_plan(about: Mapping[str, Any]) -> str:
    parts = [f"{k} {about[k]}" for k in ("tp", "ep") if about.get(k, 1) != 1]
    return " x ".join(parts) if parts else "1 GPU"


def _gpus(gpus: list[int]) -> str:
    return str(gpus[0]) if len(gpus) == 1 else f"{gpus[0]}-{gpus[-1]}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"

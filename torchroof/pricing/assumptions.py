"""The sentences an estimate states its assumptions in: routing, how the model was built and
cached, and what capture answered for data-dependent ops."""

from __future__ import annotations

from typing import Any

from torchroof.records.trace import Trace

BALANCED_ROUTING = (
    "MoE experts: balanced routing assumed, each of the E experts receives tokens·top_k/E "
    "routed tokens; grouped-GEMM FLOPs are exact for any routing, and the expert weights read "
    "are those of min(E, tokens·top_k) experts"
)


def routing_assumptions(trace: Trace, imbalance: float = 1.0) -> list[str]:
    """The routing assumption, stated once, when the step runs routed experts."""
    routed = any("grouped_mm" in op.name for op in trace.ops) or any(
        a.kind == "routing" for a in trace.assumptions
    )
    if not routed:
        return []
    if imbalance == 1.0:
        return [BALANCED_ROUTING]
    return [
        BALANCED_ROUTING
        + f"; the step is priced on the busiest rank, whose experts get {imbalance:g}x the "
        "balanced share (routing_imbalance): its grouped GEMMs and expert all-to-alls scaled"
    ]


def trace_assumption_lines(trace: Trace) -> list[str]:
    """What capture assumed, one line per distinct answer: the first op that needed it,
    and how many more did (a MoE layer's split sizes, answered once per layer)."""
    first: dict[str, Any] = {}
    repeats: dict[str, int] = {}
    for a in trace.assumptions:
        if a.what in first:
            repeats[a.what] += 1
        else:
            first[a.what], repeats[a.what] = a, 0
    lines = []
    for what, a in first.items():
        more = f" and {repeats[what]} more ops like it" if repeats[what] else ""
        lines.append(f"op {a.op_index} ({a.module or 'top level'}){more}: {what}")
    return lines


def cache_assumptions(trace: Trace) -> list[str]:
    """How the model was built when not as asked (text-only), which cache an inference
    step used when it is not the static cache asked for, and how latent attention was
    decoded."""
    facts = trace.facts
    lines = [f"model: {facts.build_note}"] if facts.build_note else []
    if facts.quant:
        lines.append(
            f"quantised: {facts.quant}; the LM head, embeddings and MoE routers keep the "
            "model's dtype"
        )
    kv_dtype = facts.workload.kv_dtype if facts.workload else "model"
    if kv_dtype != "model":
        lines.append(
            f"KV cache in {kv_dtype}: K and V quantised as they are written (per-tensor "
            "scale), read by the attention kernel at 1 B per element and widened in registers"
        )
    if facts.positions:
        lines.append(f"positions: {facts.positions}")
    fallback = facts.cache_fallback
    if fallback:
        kind = facts.cache
        used = "no cache" if kind == "none" else f"the step used a {kind} cache"
        lines.append(f"cache: {used} ({fallback})")
    if facts.mla == "absorbed":
        lines.append(
            "MLA decode: up-projections absorbed, attention over the latent cache (FlashMLA); "
            "mla='expanded' prices transformers' per-step K/V expansion instead"
        )
    return lines

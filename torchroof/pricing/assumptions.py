"""The sentences an estimate states its assumptions in: routing, how the model was built and
cached, and what capture answered for data-dependent ops."""

from __future__ import annotations

from typing import Any

from torchroof.config.routing import BALANCED, EXPECTED, HISTOGRAM, Routing
from torchroof.pricing.routing import RoutedRank
from torchroof.records.trace import Trace

BALANCED_ROUTING = (
    "MoE experts: balanced routing assumed, each of the E experts receives tokens·top_k/E "
    "routed tokens; grouped-GEMM FLOPs are exact for any routing, and the expert weights read "
    "are those of min(E, tokens·top_k) experts"
)
EXPECTED_ROUTING = (
    "MoE experts: uniform random top-k routing (routing=expected): grouped-GEMM FLOPs are "
    "those of the traced rows, and each grouped GEMM reads the weights of the "
    "E·(1 - (1 - k/E)^tokens) experts a batch is expected to reach"
)


def routing_assumptions(trace: Trace, rank: RoutedRank | None = None) -> list[str]:
    """The routing assumption, stated once, when the step runs routed experts."""
    routed = any("grouped_mm" in op.name for op in trace.ops) or any(
        a.kind == "routing" for a in trace.assumptions
    )
    if not routed:
        return []
    rank = rank or RoutedRank(Routing(), {}, 1)
    routing = rank.routing
    if routing.kind == BALANCED:
        line = BALANCED_ROUTING
    elif routing.kind == EXPECTED:
        line = EXPECTED_ROUTING
    else:
        line = (
            f"MoE experts: a measured histogram of {len(routing.shares)} experts' shares "
            f"(the largest {max(routing.shares):.3g}): each grouped GEMM reads the weights of the "
            "Σ_e 1 - (1 - k·share_e)^tokens experts a batch is expected to reach"
        )
    if routing.kind != BALANCED:
        # the router picks among the most candidates (group-limited routers also pick groups)
        experts = max(rank.top_k, default=0)
        line += (
            f"; top-{rank.top_k[experts]} of {experts} read from the router's topk"
            if experts
            else "; no router topk in the trace: each routed row picks one expert"
        )
    if rank.imbalance != 1.0:
        why = (
            f"its expert group {rank.group} holds the histogram's largest share"
            if routing.kind == HISTOGRAM
            else "routing_imbalance"
        )
        line += (
            f"; the step is priced on the busiest rank, whose experts get "
            f"{rank.imbalance:.4g}x the balanced share ({why}): its grouped GEMMs and "
            "expert all-to-alls scaled"
        )
    return [line]


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

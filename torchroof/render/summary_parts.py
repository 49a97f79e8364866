"""The sections of the text summary: how the step was timed, its global batch, its time by
phase, a pipelined step's schedule and a multi-GPU step's communication."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabulate import tabulate

from torchroof.config import Workload
from torchroof.records.ops import PHASES
from torchroof.records.units import GIB
from torchroof.render.units import ms, plural
from torchroof.report import analysis
from torchroof.report.analysis import collective_lanes, communication, network_intensity
from torchroof.timing.streams import INTRA_NODE, NETWORK
from torchroof.workloads import regime

if TYPE_CHECKING:
    from torchroof.report.estimate import Estimate

# The realistic mode's switchable effects (torchroof.timing.roofline), as PricingOptions names.
REALISTIC_EFFECTS = ("on_chip", "waves", "latency_shelf", "achievable", "launch", "softmax_pipes")


def timing_lines(est: Estimate) -> list[str]:
    """Which mode made the numbers, and the step's time by the boundary that binds each
    kernel (the hierarchical roofline, Yang, Kurth & Williams 2020)."""
    options = est.options
    if options.realistic:
        effects = [e for e in REALISTIC_EFFECTS if getattr(options, e)]
        off = [e for e in REALISTIC_EFFECTS if not getattr(options, e)]
        line = "timing: realistic mode (" + (", ".join(effects) or "no effects") + ")"
        if off:
            line += "; off: " + ", ".join(off)
        overhead = sum(k.overhead_s for k in est.kernels)
        if overhead:
            line += f"; launches {ms(overhead)} ms"
    else:
        line = (
            "timing: pure roofline T = max(W/pi, Q/beta), a lower bound "
            "(--mode realistic: on-chip roofs, waves, latency, achievable rates, launches, softmax)"
        )
    by_boundary: dict[str, float] = {}
    counts: dict[str, int] = {}
    for k in est.kernels:
        if k.boundary and not k.communication:
            by_boundary[k.boundary] = by_boundary.get(k.boundary, 0.0) + k.time_s
            counts[k.boundary] = counts.get(k.boundary, 0) + 1
    lines = [line]
    ranked = sorted(by_boundary, key=lambda name: -by_boundary[name])
    if ranked and options.realistic:
        lines.append(
            "kernel time by the term that binds it: "
            + ", ".join(f"{name} {ms(by_boundary[name])} ms" for name in ranked)
        )
    elif ranked:
        lines.append(
            "hierarchical verdict, the memory level that would bind each kernel with the "
            "on-chip roofs (the pure roofline charges only compute and HBM): "
            + ", ".join(
                f"{name} {plural(counts[name], 'kernel')} ({ms(by_boundary[name])} ms)"
                for name in ranked
            )
        )
    return lines


def global_batch_lines(est: Estimate) -> list[str]:
    """Under data parallelism or micro-batches, the batch the whole step processes: --batch
    is per rank (tp and cp ranks share their sequences) and per micro-batch."""
    w = est.workload
    if w is None:
        return []
    dp, fsdp, micro = w.dp, w.fsdp, w.microbatches
    if dp * fsdp * micro == 1:
        return []
    batch = w.batch
    step = regime(w.regime)
    one = Workload(regime=step.name, batch=1, seq=w.seq, context=w.context)
    per_sequence = step.tokens(one)  # prefill and train: seq; decode: its one new token
    sequences = batch * dp * fsdp * micro
    parts = [f"batch {batch} per rank"]
    parts += [f"{name} {size}" for name, size in (("dp", dp), ("fsdp", fsdp)) if size > 1]
    if micro > 1:
        parts.append(plural(micro, "micro-batch"))
    new = " new" if step.new_positions else ""
    return [
        f"global batch: {plural(sequences, 'sequence')} x {plural(per_sequence, 'token')}{new} "
        f"= {sequences * per_sequence:,} tokens per step ({' x '.join(parts)})"
    ]


def compute_stream_s(est: Estimate, phase: str) -> float:
    """A phase's time on the compute stream: its compute kernels' time plus the part of its
    collectives the compute stream waited on (torchroof.timing.streams)."""
    return analysis.added(  # left to right, as the HTML page adds them
        k.exposed_s if k.communication else k.time_s for k in est.kernels if k.phase == phase
    )


def phase_lines(est: Estimate) -> list[str]:
    """The step's time by phase. When collectives run on the communication stream, each
    phase is its compute-stream time: its compute kernels and the part of its collectives
    the compute stream waited on, so the phases add up to the step."""
    phases = [p for p in PHASES if est.phase_time_s(p) > 0]
    if len(phases) <= 1:
        return []
    which = "by phase" if est.pipeline is None else "the kernels listed, by phase"
    streams = est.step_time_s is not None and any(k.communication for k in est.kernels)
    if not streams:
        return [f"{which}: " + ", ".join(f"{p} {ms(est.phase_time_s(p))} ms" for p in phases)]
    times = {p: compute_stream_s(est, p) for p in phases}
    hidden = communication(est).hidden_s
    return [
        f"{which}, on the compute stream (collectives counted where it waited on them; "
        f"{ms(hidden)} ms more ran hidden on {_streams(est)}): "
        + ", ".join(f"{p} {ms(times[p])} ms" for p in phases)
        + f" = {ms(sum(times.values()))} ms"
    ]


def pipeline_lines(est: Estimate) -> list[str]:
    """A pipelined step: the schedule, its bubble, the slowest rank and why, the
    activations' trip between stages, and one row per stage (per micro-batch times, the
    micro-batches in flight, memory)."""
    p = est.pipeline
    assert p is not None
    per_rank = len(p.stages) // p.pp
    layout = f"{p.pp} ranks" + (f" x {per_rank} stages each" if per_rank > 1 else "")
    kind = "" if p.trains else " (forward only)"
    lines = [
        f"pipeline: {p.schedule}{kind} over {layout}, {plural(p.microbatches, 'micro-batch')}: the "
        f"ranks idle {100 * p.bubble_share:.1f}% of the pipeline's {ms(p.pipeline_s)} ms "
        "(its bubble)",
        f"slowest: {p.slowest_reason}",
        f"between stages: {p.stages[0].activation_bytes / 1e6:.2f} MB per micro-batch, "
        f"send/recv {p.transfer_s * 1e6:.1f} us over {p.transfer_link} at the slowest boundary",
    ]
    if not p.trains:
        through = p.latency_s
        lines.append(
            f"one micro-batch of {est.workload.batch if est.workload else 1} through every "
            "stage: "
            f"{ms(through)} ms (a decode step's time per output token, a prefill's time to "
            "first token); every micro-batch's sequences keep K/V on every stage"
        )
        tokens = est.facts.tokens
        steady = p.steady_state_s
        rate = f", {tokens / steady:,.1f} tokens/s per replica" if tokens and steady else ""
        lines.append(
            f"steady state (successive steps' micro-batches keep every stage busy, as a "
            f"serving pipeline runs): {ms(steady)} ms per step{rate}"
        )
    headers = ["stage", "rank", "holds", "F ms", "B ms", "after ms", "in flight", "memory GiB"]
    rows = [
        [
            r.stage,
            r.rank,
            r.layers + (f" (as {r.traced_as})" if r.traced_as != r.stage else ""),
            ms(r.forward_s),
            ms(r.backward_s) + (f" (I {ms(r.input_s)} + W {ms(r.weight_s)})" if r.weight_s else ""),
            ms(r.after_s),
            r.in_flight,
            f"{r.memory_bytes / GIB:.2f}" + ("" if r.fits else " (does NOT fit)"),
        ]
        for r in p.stages
    ]
    lines.append(tabulate(rows, headers=headers, disable_numparse=True))
    return lines


def _streams(est: Estimate) -> str:
    """The communication stream, or both when collectives crossed the network beside those
    within the node (torchroof.timing.streams.lane_of)."""
    if {NETWORK, INTRA_NODE} <= collective_lanes(est.kernels):
        return "the communication streams (within the node and across the network)"
    return "the communication stream"


def communication_lines(est: Estimate) -> list[str]:
    """The step's communication (torchroof.timing.streams): its time on the communication stream,
    the part the compute stream waited on (exposed, as a share of the step) and the part
    hidden behind compute, the collectives' time by link; then each link's network
    intensity against its ridge (docs/concepts/network-ridges.md: hides iff I_net >= pi/beta)."""
    comm = communication(est)
    links = ", ".join(f"{link} {ms(s)} ms" for link, s in comm.by_link_s.items())
    copies = f", FSDP copies {ms(comm.copies_s)} ms" if comm.copies_s else ""
    lines = [
        f"communication: {ms(comm.time_s)} ms on {_streams(est)}, "
        f"{ms(comm.exposed_s)} ms exposed ({100 * comm.exposed_share:.1f}% of the "
        f"{'step' if est.pipeline is None else 'kernels listed'}), "
        f"hidden behind compute: {ms(comm.hidden_s)} ms; links: {links}{copies}"
        + (
            f"; alpha (per-collective latency, no bandwidth buys it back) "
            f"{ms(comm.latency_s)} ms of it"
            if comm.latency_s
            else ""
        )
    ]
    intensity = network_intensity(est)
    if intensity:
        above = "above: at peak the math outlasts the link's bytes, if they overlap"
        below = "below: the link binds unless hidden"
        lines.append(
            "network intensity (step FLOPs per byte a rank sends): "
            + ", ".join(
                f"{link} {li.intensity:,.0f} FLOP/B vs ridge {li.ridge:,.0f} "
                f"({above if li.hides else below})"
                for link, li in intensity.items()
            )
        )
    return lines

"""The estimate as text: the per-layer budget, the slowest kernels, two estimates side by
side, the summary and its coverage line; compare's variant and sweep tables.

The per-layer time budget: every row with its W, Q, intensity and
roofline time; rows sum as if kernels ran back to back. Figures are kept in SI units until
here, where they become ms, MB and GFLOP.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from torchroof.accuracy.expected import expected_range
from torchroof.records.ops import PHASES, TOP_LEVEL, layer_key
from torchroof.records.units import GIB
from torchroof.render.summary_parts import (
    communication_lines,
    compute_stream_s,
    global_batch_lines,
    phase_lines,
    pipeline_lines,
    timing_lines,
)
from torchroof.render.units import flop_per_byte, ms, plural, ratio
from torchroof.report import analysis
from torchroof.report.analysis import communication
from torchroof.workloads import regime

if TYPE_CHECKING:
    from torchroof.report.compare import Comparison, Grid, Sweep
    from torchroof.report.estimate import Estimate, KernelEstimate, LayerRow

# Byte categories, in the order reports show them, and their column labels.
CATEGORIES = ("weights", "activations", "kv_cache", "gradients", "optimizer_state")
CATEGORY_LABELS = {
    "weights": "weights",
    "activations": "activations",
    "kv_cache": "KV",
    "gradients": "grads",
    "optimizer_state": "opt state",
}


def members(ops: tuple[str, ...], limit: int = 6) -> str:
    """A fused kernel's member ops, short: ``_to_copy, pow, mean, add, rsqrt, mul +2``."""
    if len(ops) == 1:
        return ""
    names = [op.split(".")[1] for op in ops]
    more = f" +{len(names) - limit}" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _step_intensity(est: Estimate) -> str:
    return flop_per_byte(est.flops / est.bytes if est.bytes else float("inf"))


def estimate_label(est: Estimate) -> str:
    """Short name of how an estimate was made (hardware or cluster, and kernel policies)."""
    options = est.options
    parts = [est.cluster or est.hardware, options.fusion]
    for key, value, default in (
        ("loss", options.loss, "materialized"),
        ("attention", options.attention, "flash"),
    ):
        if value != default:
            parts.append(f"{key}={value}")
    if options.epilogue:
        parts.append("epilogue")
    return " ".join(parts)


# What a row that is not a module of its own holds, told by the ops its kernels run: the
# first labels whose ops appear (position ids only when nothing else does).
_ROW_CONTENTS = (
    ("the loss", lambda op: any(w in op for w in ("nll_loss", "log_softmax", "cross_entropy"))),
    ("rotary embedding", lambda op: op in ("cos", "sin")),
    ("attention mask", lambda op: op in ("le", "lt", "ge", "gt", "eq", "masked_fill", "tril")),
    ("collectives", lambda op: op.startswith("c10d.") or op.startswith("_c10d_functional.")),
)


def row_label(est: Estimate, name: str, names: Sequence[str], depth: int | None = None) -> str:
    """A row as the tables name it: a module's path, except the row of ops outside any
    module and the row of a module's own ops beside its sub-modules' rows (``model``), which
    say what they hold: ``outside any module: the loss``, ``model (rotary embedding)``."""
    top = name == TOP_LEVEL
    if not top and not any(other.startswith(name + ".") for other in names):
        return name
    ops = [
        op if op.startswith(("c10d.", "_c10d_functional.")) else op.split(".")[1]
        for k in est.kernels
        if layer_key(k.module, k.phase, depth) == name
        for op in k.ops
    ]
    found = [label for label, test in _ROW_CONTENTS if any(test(op) for op in ops)]
    if not found and "arange" in ops:
        found = ["position ids"]
    if not found:
        own = list(dict.fromkeys(op for op in ops if not op.startswith("c10d")))[:3]
        found = [f"own ops: {', '.join(own)}"] if own else []
    what = ", ".join(found)
    if top:
        return f"outside any module: {what}" if what else "ops outside any module"
    return f"{name} ({what})" if what else name


def layer_table(
    est: Estimate, depth: int | None = None, collapse: bool = False, tablefmt: str = "simple"
) -> str:
    """The per-layer time budget, a column per phase when the step has more
    than one, per byte category when it moves more than one, and the communication the
    compute stream waited on when the step communicates (torchroof.timing.streams); ``collapse``
    sums runs of identical consecutive blocks into one row."""
    phases = [p for p in PHASES if est.phase_time_s(p) > 0]
    split = len(phases) > 1
    step_traffic = est.traffic()
    categories = [c for c in CATEGORIES if step_traffic.get(c)]
    communicates = est.step_time_s is not None
    headers = ["layer", "kernels", "GFLOP", "MB", "FLOP/B", "time ms"]
    if split:
        headers += [f"{p} ms" for p in phases]
    if communicates:
        headers.append("exposed comm ms")
    if len(categories) > 1:
        headers += [f"{CATEGORY_LABELS[c]} MB" for c in categories]
    else:
        categories = []
    headers += ["share %", "MFU %", "mem-bound %", "bound"]
    # shares of the kernels' summed time (the step's own, without communication overlap)
    total = sum(k.time_s for k in est.kernels) or 1.0
    peak = est.reference_peak_flops_per_s
    body = []
    rows = est.rows(depth, collapse=collapse)
    names = [row.name for row in rows]
    for row in rows:
        line: list[Any] = [
            row_label(est, row.name, names, depth),
            row.kernels,
            f"{row.flops / 1e9:.3f}",
            f"{row.bytes / 1e6:.2f}",
            flop_per_byte(row.intensity),
            ms(row.time_s),
        ]
        if split:
            line += [ms(row.phase_s.get(p, 0.0)) for p in phases]
        if communicates:
            line.append(ms(row.exposed_communication_s))
        line += [f"{row.traffic.get(c, 0) / 1e6:.2f}" for c in categories]
        line += [
            f"{100 * row.time_s / total:.1f}",
            f"{100 * row.mfu(peak):.1f}" if row.time_s else "-",
            f"{100 * row.memory_bound_share:.0f}" if row.time_s else "-",
            row.boundary,
        ]
        body.append(line)
    footer: list[Any] = [
        "total",
        len(est.kernels),
        f"{est.flops / 1e9:.3f}",
        f"{est.bytes / 1e6:.2f}",
        _step_intensity(est),
        ms(est.time_s if est.pipeline is None else analysis.kernels_span_s(est)),
    ]
    if split:  # on the compute stream when collectives overlap: they add up to the step
        footer += [
            ms(compute_stream_s(est, p) if communicates else est.phase_time_s(p)) for p in phases
        ]
    if communicates:
        footer.append(ms(communication(est).exposed_s))
    footer += [f"{step_traffic.get(c, 0) / 1e6:.2f}" for c in categories]
    footer += [
        "100.0",
        f"{100 * est.mfu:.1f}",
        f"{100 * est.memory_bound_share:.0f}",
        "memory" if est.memory_bound_share >= 0.5 else "compute",
    ]
    body.append(footer)
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def _bound(kernel: KernelEstimate) -> str:
    """The bound, naming the boundary for a collective (a bound is always named with its
    boundary): ``network (nvlink)``."""
    return f"network ({kernel.link})" if kernel.bound == "network" else kernel.bound


def binds(kernel: KernelEstimate) -> str:
    """Which term of the hierarchical bound binds (a bound is always named with its
    boundary), with a GEMM's tile and, past one wave, its waves and their occupancy:
    ``l2 256x128, 4 waves 97%``."""
    parts: list[str] = [kernel.boundary or "-"]
    if kernel.tile:
        parts.append(kernel.tile)
    text = " ".join(parts)
    if kernel.waves > 1 or kernel.wave_efficiency < 0.75:
        text += f", {kernel.waves} wave{'s' if kernel.waves != 1 else ''}"
        text += f" {100 * kernel.wave_efficiency:.0f}%"
    return text


def kernel_module(kernel: KernelEstimate) -> str:
    """The module a kernel ran in, or what ran it outside any module."""
    if kernel.module:
        return kernel.module
    return "(optimizer step)" if kernel.phase == "optimizer" else "(outside any module)"


def realistic(est: Estimate) -> bool:
    """Did the realistic mode time the estimate (else the pure roofline)?"""
    return est.options.realistic


def mode_name(est: Estimate) -> str:
    return "realistic" if realistic(est) else "pure roofline"


def verdict(kernel: KernelEstimate, realistic_mode: bool) -> str:
    """The one term that set the kernel's time in the mode that timed it: a collective's
    link (``network (nvlink)``); in the pure roofline compute or hbm, its only two terms; in
    the realistic mode the term that bound it (compute, hbm, l2, smem, registers, latency)."""
    if kernel.bound == "network":
        return _bound(kernel)
    if realistic_mode and kernel.boundary:
        return kernel.boundary
    return "compute" if kernel.bound == "compute" else "hbm"


def tile_waves(kernel: KernelEstimate) -> str:
    """A tiled kernel's threadblock tile and, past one wave or under 75% busy, its waves
    over the SMs and their occupancy: ``256x128, 4 waves 97%``; empty for other kernels."""
    text = kernel.tile
    if kernel.waves and (kernel.waves > 1 or kernel.wave_efficiency < 0.75):
        text += (", " if text else "") + plural(kernel.waves, "wave")
        text += f" {100 * kernel.wave_efficiency:.0f}%"
    return text


def spill_risks(est: Estimate) -> list[KernelEstimate]:
    """Fused kernels past the on-chip budget whose verdict a spill could change: compute-bound
    ones (spilled live state is extra memory traffic, which a kernel already bound by memory
    only adds to; the estimate charges no spill, so the flag changes no time)."""
    mode = realistic(est)
    return [k for k in est.kernels if k.flags and verdict(k, mode) == "compute"]


def kernel_table(est: Estimate, top: int = 20, tablefmt: str = "simple") -> str:
    """The ``top`` kernels by time, with a fused kernel's member ops and its first warning."""
    ranked = sorted(est.kernels, key=lambda k: k.time_s, reverse=True)[:top]
    mode = realistic(est)
    risks = {k.index for k in spill_risks(est)}
    body = [
        [
            k.index,
            k.name.removeprefix("aten."),
            kernel_module(k),
            k.phase,
            f"{k.flops / 1e9:.3f}",
            f"{k.bytes / 1e6:.2f}",
            flop_per_byte(k.intensity),
            f"{k.time_s * 1e6:.1f}",
            verdict(k, mode),
            tile_waves(k),
            members(k.ops) + (" [!] " + k.flags[0] if k.index in risks else ""),
        ]
        for k in ranked
    ]
    headers = ["#", "op", "module", "phase", "GFLOP", "MB", "FLOP/B", "time us"]
    headers += [f"bound ({mode_name(est)})", "tile / waves", "members"]
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def _row_figures(row: LayerRow | None) -> tuple[float, int, int]:
    """(time, bytes, kernels) of a row; zeros for a layer the other estimate lacks."""
    return (row.time_s, row.bytes, row.kernels) if row is not None else (0.0, 0, 0)


def comparison_table(
    first: Estimate,
    second: Estimate,
    depth: int | None = None,
    collapse: bool = True,
    tablefmt: str = "simple",
) -> str:
    """Per-layer time and bytes of two estimates side by side, with the speed-up
    (``first`` / ``second``), in the spirit of the fusion bench. With
    ``collapse`` every numbered block of a stack is one row, so the two line up whatever
    their kernels."""

    def by_name(est: Estimate) -> dict[str, LayerRow]:
        rows = est.stack_rows(depth) if collapse else est.rows(depth)
        return {row.name: row for row in rows}

    mine, theirs = by_name(first), by_name(second)
    names = list(mine) + [n for n in theirs if n not in mine]
    a, b = estimate_label(first), estimate_label(second)
    headers = [
        "layer",
        f"{a} ms",
        f"{b} ms",
        "speed-up",
        f"{a} MB",
        f"{b} MB",
        f"{a} kernels",
        f"{b} kernels",
    ]
    body = []
    for name in names:
        x_time, x_bytes, x_kernels = _row_figures(mine.get(name))
        y_time, y_bytes, y_kernels = _row_figures(theirs.get(name))
        body.append(
            [
                row_label(first if name in mine else second, name, names, depth),
                ms(x_time),
                ms(y_time),
                ratio(x_time, y_time),
                f"{x_bytes / 1e6:.2f}",
                f"{y_bytes / 1e6:.2f}",
                x_kernels,
                y_kernels,
            ]
        )
    body.append(
        [
            "total",
            ms(first.time_s),
            ms(second.time_s),
            ratio(first.time_s, second.time_s),
            f"{first.bytes / 1e6:.2f}",
            f"{second.bytes / 1e6:.2f}",
            len(first.kernels),
            len(second.kernels),
        ]
    )
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def coverage_line(est: Estimate) -> str:
    """How many ops the trace held and which had no rule (every op is accounted: an op
    without a rule is charged its input+output bytes and named here)."""
    if not est.uncounted:
        return f"coverage: {est.op_count} ops, all priced by a rule"
    names = ", ".join(f"{n} x{c}" for n, c in sorted(est.uncounted.items()))
    count = sum(est.uncounted.values())
    return (
        f"coverage: {est.op_count} ops, {count} without a rule "
        f"(charged their input+output bytes only): {names}"
    )


def calibrated(est: Estimate) -> str:
    """What the calibrated mode multiplied (empty in the other modes)."""
    if est.correction == 1.0:
        return ""
    return (
        f" (calibrated: the realistic {ms(est.time_s / est.correction)} ms x {est.correction:.2f})"
    )


def summary(est: Estimate) -> str:
    """The step in a few lines: hardware (and cluster), time (by phase), communication
    (exposed, hidden, by link, network intensity) when the step has collectives, work and
    traffic, MFU, bytes by category, throughput, the decode figures, memory fit, on-chip
    pressure, coverage and every assumption the estimate rests on."""
    cluster = f" in cluster {est.cluster} (one rank priced)" if est.cluster else ""
    lines = [
        f"hardware: {est.hardware_display} ({est.hardware}){cluster}, "
        f"HBM {est.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"{est.reference_dtype} peak {est.reference_peak_flops_per_s / 1e12:.0f} TFLOP/s",
        f"step time: {ms(est.time_s)} ms over {len(est.kernels)} kernels{calibrated(est)}",
        expected_range(est).line(),
    ]
    if est.facts.defaults:  # a default the model changed: "seq: 1024, the model's maximum ..."
        lines.append(est.facts.defaults)
    if est.pipeline is not None:
        lines += pipeline_lines(est)
    lines += global_batch_lines(est)
    lines += phase_lines(est)
    if est.step_time_s is not None and any(k.communication for k in est.kernels):
        lines += communication_lines(est)
    lines += timing_lines(est)
    lines += [
        f"work: {est.flops / 1e12:.3f} TFLOP, traffic: {est.bytes / 1e9:.3f} GB, "
        f"intensity {_step_intensity(est)} FLOP/B",
        f"MFU: {100 * est.mfu:.1f}%, time memory-bound: {100 * est.memory_bound_share:.0f}%",
    ]
    traffic = est.traffic()
    if traffic:
        lines.append(
            "traffic: "
            + ", ".join(
                f"{CATEGORY_LABELS[c]} {traffic[c] / 1e9:.3f} GB"
                for c in CATEGORIES
                if c in traffic
            )
        )
    if est.tokens_per_s:
        world, shared = analysis.ranks(est)
        if world > 1:
            replica = (
                f"{est.tokens_per_s:,.1f} per replica of {shared} GPUs, "
                if 1 < shared < world
                else ""
            )
            lines.append(
                f"throughput: {analysis.tokens_per_s_per_gpu(est):,.1f} tokens/s per GPU, "
                f"{replica}{analysis.cluster_tokens_per_s(est):,.1f} tokens/s over the "
                f"{world} GPUs"
            )
        else:
            lines.append(f"throughput: {est.tokens_per_s:,.1f} tokens/s")
    step = regime(est.workload.regime) if est.workload else None
    if step is not None:
        lines += step.summary(est)
    if est.memory is not None:
        lines.append(est.memory.line())
        if step is not None:
            lines += step.memory_summary(est)
    flagged = spill_risks(est)
    if flagged:
        one = len(flagged) == 1
        lines.append(
            f"on-chip pressure: {plural(len(flagged), 'compute-bound fused kernel')} "
            f"{'exceeds' if one else 'exceed'} the on-chip budget; a spill would add memory "
            f"traffic the estimate does not charge (e.g. #{flagged[0].index} "
            f"{kernel_module(flagged[0])}: {flagged[0].flags[0]})"
        )
    lines.append(coverage_line(est))
    lines += [f"assumption: {a}" for a in est.assumptions]
    return "\n".join(lines)


def variants_table(comparison: Comparison, tablefmt: str = "simple") -> str:
    """A column per variant: time, throughput, MFU, traffic by category, memory, fit, and
    each figure's ratio to the first variant where it matters."""
    ests = [v.estimate for v in comparison.variants]
    first = ests[0]
    rows: list[list[Any]] = []

    def add(name: str, values: Sequence[str]) -> None:
        rows.append([name, *values])

    add("step time ms", [f"{e.time_s * 1e3:.3f}" for e in ests])
    add("  vs first", [f"{e.time_s / first.time_s:.3f}x" for e in ests])
    add("tokens/s", [f"{e.tokens_per_s:,.1f}" for e in ests])
    gpus = [analysis.ranks(e)[0] for e in ests]
    if any(n > 1 for n in gpus):
        add("GPUs", [str(n) for n in gpus])
        add("tokens/s per GPU", [f"{analysis.tokens_per_s_per_gpu(e):,.1f}" for e in ests])
        exposed = [communication(e).exposed_s for e in ests]
        add("exposed comm ms", [f"{x * 1e3:.3f}" for x in exposed])
    if any(e.pipeline is not None for e in ests):
        steps = [e.pipeline for e in ests]
        add("pipeline", [f"{p.schedule} x {p.microbatches}" if p else "-" for p in steps])
        add("bubble %", [f"{100 * p.bubble_share:.1f}" if p else "-" for p in steps])
        add("slowest rank", [str(p.slowest_rank) if p else "-" for p in steps])
    add("MFU %", [f"{100 * e.mfu:.1f}" for e in ests])
    add("memory-bound time %", [f"{100 * e.memory_bound_share:.0f}" for e in ests])
    traffic = [e.traffic() for e in ests]
    for category in CATEGORIES:
        if not any(t.get(category) for t in traffic):
            continue
        label = CATEGORY_LABELS[category]
        add(f"{label} GB", [f"{t.get(category, 0) / 1e9:.3f}" for t in traffic])
        base = traffic[0].get(category, 0)
        ratios = [f"{t.get(category, 0) / base:.3f}x" for t in traffic] if base else []
        if any(r != "1.000x" for r in ratios):
            add(f"  {label} vs first", ratios)
    add("total traffic GB", [f"{e.bytes / 1e9:.3f}" for e in ests])
    memories = [e.memory for e in ests if e.memory is not None]
    if len(memories) == len(ests):
        add("memory GiB", [f"{m.total_bytes / GIB:.2f}" for m in memories])
        add(
            "fits",
            ["yes" if m.fits else f"no (-{m.missing_bytes / GIB:.1f} GiB)" for m in memories],
        )
    headers = ["", *(v.label for v in comparison.variants)]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def layer_deltas(comparison: Comparison, depth: int | None = None) -> str:
    """Per-layer time of every variant against the first, one table each."""
    first = comparison.variants[0].estimate
    return "\n\n".join(
        comparison_table(first, v.estimate, depth=depth) for v in comparison.variants[1:]
    )


def sweep_table(sweep: Sweep) -> str:
    """A row per swept value: step time, tokens/s, MFU, weight and KV traffic, memory, fit;
    with GPUs, tokens/s per GPU and exposed communication when a step spans GPUs."""
    data = sweep.rows()
    spans = any(r["gpus"] > 1 for r in data)
    rows = [
        [
            r[sweep.key],
            f"{r['step_time_s'] * 1e3:.3f}",
            f"{r['tokens_per_s']:,.1f}",
            *(
                [
                    str(r["gpus"]),
                    f"{r['tokens_per_s_per_gpu']:,.1f}",
                    f"{r['exposed_communication_s'] * 1e3:.3f}",
                ]
                if spans
                else []
            ),
            f"{100 * r['mfu']:.1f}",
            f"{r['weight_bytes'] / 1e9:.2f}",
            f"{r['kv_bytes'] / 1e9:.2f}",
            f"{r['memory_bytes'] / GIB:.1f}",
            "yes" if r["fits"] else "no",
        ]
        for r in data
    ]
    headers = [
        sweep.key,
        "step ms",
        "tokens/s",
        *(["GPUs", "tokens/s per GPU", "exposed comm ms"] if spans else []),
        "MFU %",
        "weights GB",
        "KV GB",
        "memory GiB",
        "fits",
    ]
    return tabulate(rows, headers=headers, disable_numparse=True)


def grid_tables(grid: Grid) -> str:
    """A grid as text: one axis, a row per value (as :func:`sweep_table`); several, for each
    pair of axes a table of step time (ms) and one of tokens/s, the first axis down and the
    second across, every other axis at its first value (``*``: does not fit in memory)."""
    rows = grid.rows()
    if len(grid.axes) == 1:
        ((key, _),) = grid.axes
        body = [
            [
                r[key],
                f"{r['step_time_s'] * 1e3:.3f}",
                f"{r['tokens_per_s']:,.1f}",
                f"{r['memory_bytes'] / GIB:.1f}",
                "yes" if r["fits"] else "no",
            ]
            for r in rows
        ]
        return tabulate(
            body, headers=[key, "step ms", "tokens/s", "memory GiB", "fits"], disable_numparse=True
        )
    first = {key: values[0] for key, values in grid.axes}
    tables = []
    for (down, downs), (across, acrosses) in itertools.combinations(grid.axes, 2):
        fixed = {k: v for k, v in first.items() if k not in (down, across)}
        at = ", ".join(f"{k}={v}" for k, v in fixed.items())
        cells = {(r[down], r[across]): r for r in rows if all(r[k] == v for k, v in fixed.items())}
        for title, shown in (
            ("step ms", lambda r: f"{r['step_time_s'] * 1e3:.3f}"),
            ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ):
            body = [
                [
                    d,
                    *(
                        shown(cells[(d, a)]) + ("" if cells[(d, a)]["fits"] else "*")
                        for a in acrosses
                    ),
                ]
                for d in downs
            ]
            heading = f"{title}: {down} down, {across} across" + (f" ({at})" if at else "")
            table = tabulate(
                body, headers=[f"{down} \\ {across}", *map(str, acrosses)], disable_numparse=True
            )
            tables.append(f"{heading}\n{table}")
    if not all(r["fits"] for r in rows):
        tables.append("* does not fit in the accelerator's memory")
    return "\n\n".join(tables)

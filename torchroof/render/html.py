"""The estimate as one interactive, self-contained HTML page: the summary, the per-layer
budget (stacked by phase and by traffic kind, repeated blocks collapsed, each row expanding
into its kernels), the roofline with every kernel, the predicted-kernel timeline, compare's
variants and a sweep's curves side by side, the assumptions and the coverage line.

The explorers are interactive: the page is too. Every shipped accelerator is embedded with
the ceilings this estimate's kernels need, and switching to one (or moving the efficiency
sliders) re-prices every kernel in the page from its stored W and Q with the pure roofline
T = max(W/pi, Q/beta) + launch (torchroof.timing.roofline.time_kernel), a collective as
max(Q/beta, its network time) (torchroof.pricing.price.time_collective), and re-lays the
schedule from the waits each kernel keeps (torchroof.timing.streams.waits) — the same
rules, in the same floating-point order, so the page's totals are Python's to the last digit.

The page inlines plotly.js (about 4.8 MB, the ``html`` extra) and its data: no CDN, no
server, it opens offline. NB: a step the page cannot re-price (realistic mode's on-chip
effects, a pipelined step, a routing imbalance, a schedule saved before format 3) keeps its
Python numbers, and the page says why its switch is off.
"""

from __future__ import annotations

import html
import itertools
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.accuracy.expected import NoRange, expected_range
from torchroof.config.routing import HISTOGRAM, routing_kind
from torchroof.hardware import (
    HardwareSpec,
    UnknownHardwareError,
    UnsupportedDtypeError,
    available,
    get,
    spec_dtype,
)
from torchroof.records.ops import layer_key, stack_key
from torchroof.render.text import coverage_line, estimate_label, members, row_label, summary
from torchroof.report import analysis
from torchroof.workloads import regime

if TYPE_CHECKING:
    from torchroof.report.compare import Comparison, Grid, Sweep
    from torchroof.report.estimate import Estimate, KernelEstimate, LayerRow

MAX_GRID_PAGE_POINTS = 100
"""Points a grid's page holds: each embeds every kernel of its step (a 70B decode step's
1,400 kernels are some 300 kB of the page)."""

REPORT_FORMAT = "torchroof-report"
REPORT_VERSION = 1
PIPES = ("tensor", "vector", "sfu")  # units with a FLOP/s ceiling; any other unit has none
HTML_EXTRA = "pip install 'torchroof[html]' (plotly bundles the page's charting library)"


def plotly_js() -> str:
    """plotly.js, minified, as the plotly package ships it (inlined into every page)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(f"the HTML report needs plotly: {HTML_EXTRA}") from error
    return get_plotlyjs()


def peak_key(unit: str, dtype: str, allow_tf32: bool, fp16_accumulate: bool = False) -> str:
    """The name of the ceiling a kernel on ``unit`` in ``dtype`` is timed against; only an
    fp32 matmul's ceiling depends on ``allow_tf32``, and only an fp16 matmul's on
    ``fp16_accumulate`` (HardwareSpec.tensor_peak)."""
    key = spec_dtype(dtype or "bf16") if unit == "tensor" else ""
    suffix = "|tf32" if allow_tf32 and key == "fp32" else ""
    suffix += "|fp16acc" if fp16_accumulate and key == "fp16" else ""
    return f"{unit}|{dtype}{suffix}"


def _reference_key(est: Estimate) -> str:
    """The ceiling MFU is measured against: the dominant matmul dtype's tensor peak, or the
    fp32 vector peak when no kernel runs on the tensor cores (pipeline._estimate_trace)."""
    if any(k.unit == "tensor" for k in est.kernels):
        fp16_acc = est.fp16_accumulate
        return peak_key("tensor", est.reference_dtype, est.options.allow_tf32, fp16_acc)
    return "vector|fp32"


def _peak(spec: HardwareSpec, key: str) -> float:
    unit, dtype, *flags = key.split("|")
    return spec.peak(unit, dtype, allow_tf32="tf32" in flags, fp16_accumulate="fp16acc" in flags)


def _specs(names: list[str]) -> list[HardwareSpec]:
    """Every shipped accelerator, then any other the estimates were priced on (a user's
    TOML, a calibrated CPU) that still resolves by its name."""
    specs = available()
    known = {spec.name for spec in specs}
    for name in names:
        if name in known:
            continue
        try:
            specs.append(get(name))
        except (UnknownHardwareError, OSError, ValueError):
            continue  # its own numbers stay on the page ("as estimated"); no re-pricing on it
        known.add(name)
    return specs


def accelerators(keys: set[str], names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every shipped accelerator (and those of ``names``) with the ceilings ``keys`` name,
    its HBM bandwidth and capacity; a ceiling the part lacks (fp8 on an A100) is null with
    the reason in ``unsupported``."""
    table = []
    for spec in _specs(list(names)):
        peaks: dict[str, float | None] = {}
        unsupported: dict[str, str] = {}
        for key in sorted(keys):
            try:
                peaks[key] = _peak(spec, key)
            except UnsupportedDtypeError as error:
                peaks[key] = None
                unsupported[key] = str(error)
        table.append(
            {
                "name": spec.name,
                "display": spec.display_name,
                "hbm_bytes_per_s": spec.hbm_bytes_per_s.value,
                "capacity_bytes": spec.hbm_capacity_bytes.value,
                "peaks": peaks,
                "unsupported": unsupported,
            }
        )
    return table


def why_not_repriced(est: Estimate) -> str:
    """Why the page cannot re-price ``est`` from its kernels' W and Q ('' when it can)."""
    if est.options.mode != "roofline":
        return (
            "realistic mode's tiles, waves and latency shelves are priced in Python: run "
            f"torchroof estimate --mode {est.options.mode} --hardware NAME for another "
            "accelerator"
        )
    if est.options.offload_activations:
        return (
            "activation offload hides its copies behind each layer's compute, priced in "
            "Python: run torchroof estimate --offload-activations N --hardware NAME for "
            "another accelerator"
        )
    if any(k.pipelined_with is not None for k in est.kernels):
        return (
            "tensor-parallel collectives run beside their GEMMs (the runtime's "
            "tp_comm_overlap), laid on the streams in Python: run torchroof estimate "
            "--hardware NAME for another accelerator"
        )
    if est.pipeline is not None:
        return (
            "a pipelined step is priced per stage and laid on its schedule in Python: run "
            "torchroof estimate --hardware NAME (or a cluster) for another accelerator"
        )
    if est.options.routing_imbalance != 1.0:
        return "the busiest expert rank (routing_imbalance) is re-priced in Python only"
    workload = est.facts.workload
    if routing_kind(est.options.routing) == HISTOGRAM and workload and workload.ep > 1:
        return "the busiest expert rank (the routing histogram's) is re-priced in Python only"
    if est.step_time_s is not None and any(k.waits_on is None for k in est.kernels):
        return "this estimate was saved before format 3 and lacks its schedule's waits"
    return ""


def _rows_with_kernels(
    est: Estimate, depth: int | None = None, collapse: bool = True
) -> list[dict[str, Any]]:
    """The per-layer rows as the text table groups them (``depth``, ``collapse``: runs of
    identical blocks summed, report.collapse_repeats), each with the indices of its kernels
    and of the first block's kernels (what a row expands to)."""
    by_row: dict[str, list[int]] = {}
    for position, kernel in enumerate(est.kernels):
        by_row.setdefault(layer_key(kernel.module, kernel.phase, depth), []).append(position)
    plain = est.rows(depth)
    out = []
    cursor = 0
    rows = est.rows(depth, collapse=collapse)
    names = [row.name for row in rows]
    for row in rows:
        count = _repeat_count(row) if collapse else 1
        blocks = plain[cursor : cursor + count]
        cursor += count
        kernels = [i for block in blocks for i in by_row[block.name]]
        out.append(
            {
                "name": row.name,
                "label": row_label(est, row.name, names, depth),  # what the table shows
                "blocks": count,
                "kernels": kernels,
                "first": by_row[blocks[0].name],
                "traffic": _traffic(row, [est.kernels[i] for i in kernels]),
            }
        )
    return out


def _repeat_count(row: LayerRow) -> int:
    """N of a collapsed ``name (xN)`` row, 1 for any other."""
    name = row.name
    if name.endswith(")") and " (x" in name:
        return int(name.rsplit(" (x", 1)[1][:-1])
    return 1


def _traffic(row: LayerRow, kernels: list[KernelEstimate]) -> dict[str, int]:
    """The row's HBM bytes by category, and the bytes its collectives send over the links
    (``network``) when it has any."""
    traffic = {category: size for category, size in row.traffic.items() if size}
    sent = sum(k.wire_bytes for k in kernels)
    return {**traffic, "network": sent} if sent else traffic


def _stacks(est: Estimate, depth: int | None = None) -> list[dict[str, Any]]:
    """Rows with each stack of blocks summed (report.merge_stacks), as kernel indices: how
    two variants line up whatever their kernels."""
    by_name: dict[str, list[int]] = {}
    for position, kernel in enumerate(est.kernels):
        stack = stack_key(layer_key(kernel.module, kernel.phase, depth))
        by_name.setdefault(stack, []).append(position)
    return [
        {"name": row.name, "kernels": by_name[row.name.split(" (x")[0]]}
        for row in est.stack_rows(depth)
    ]


def _kernels(est: Estimate, keys: list[str]) -> dict[str, list[Any]]:
    """The kernels column by column (a page of 10,000 kernels stays a few MB)."""
    allow_tf32, fp16_acc = est.options.allow_tf32, est.fp16_accumulate
    index = {key: i for i, key in enumerate(keys)}
    columns: dict[str, list[Any]] = {
        name: []
        for name in (
            "name", "ops", "module", "phase", "flops", "bytes", "unit", "peak", "time_s",
            "bound", "boundary", "tile", "link", "network_s", "stream", "start_s",
            "waits_on", "wire_bytes", "overhead_s", "exposed_s", "lane",
        )
    }  # fmt: skip
    for k in est.kernels:
        columns["name"].append(k.name.removeprefix("aten."))
        columns["ops"].append(members(k.ops))
        columns["module"].append(k.module)
        columns["phase"].append(k.phase)
        columns["flops"].append(k.flops)
        columns["bytes"].append(k.bytes)
        columns["unit"].append(k.unit)
        columns["peak"].append(index.get(peak_key(k.unit, k.dtype, allow_tf32, fp16_acc), -1))
        columns["time_s"].append(k.time_s)
        columns["bound"].append(k.bound)
        columns["boundary"].append(k.boundary)
        columns["tile"].append(k.tile)
        columns["link"].append(k.link)
        columns["network_s"].append(k.network_s)
        columns["stream"].append("communication" if k.communication else "compute")
        columns["start_s"].append(k.start_s)
        columns["waits_on"].append(list(k.waits_on or ()))
        columns["wire_bytes"].append(k.wire_bytes)
        columns["overhead_s"].append(k.overhead_s)
        columns["exposed_s"].append(k.exposed_s)
        columns["lane"].append(k.lane)
    return columns


def _keys(est: Estimate) -> list[str]:
    allow_tf32, fp16_acc = est.options.allow_tf32, est.fp16_accumulate
    keys = {peak_key(k.unit, k.dtype, allow_tf32, fp16_acc) for k in est.kernels if k.unit in PIPES}
    return sorted(keys | {_reference_key(est)})


def estimate_data(
    est: Estimate, label: str = "", depth: int | None = None, collapse: bool = True
) -> dict[str, Any]:
    """One estimate as the page holds it: its kernels (W, Q, ceiling, Python's time and
    schedule), rows (grouped as ``Estimate.rows(depth, collapse)``), figures and text
    (summary, coverage, assumptions)."""
    keys = _keys(est)
    world, shared = analysis.ranks(est)
    workload = est.workload
    step = regime(workload.regime) if workload else None
    options = est.options
    return {
        "label": label or estimate_label(est),
        "hardware": est.hardware,
        "hardware_display": est.hardware_display,
        "cluster": est.cluster,
        "regime": workload.regime if workload else "",
        "mode": options.mode,
        "compute_efficiency": float(options.compute_efficiency),
        "bandwidth_efficiency": float(options.bandwidth_efficiency),
        "overlap": options.overlap,
        "overlap_communication": options.overlap_communication,
        "launch_overhead_s": float(options.launch_overhead_s),
        "why_not_repriced": why_not_repriced(est),
        "keys": keys,
        "reference_key": _reference_key(est),
        "reference_dtype": est.reference_dtype,
        "reference_peak_flops_per_s": est.reference_peak_flops_per_s,
        "hbm_bytes_per_s": est.hbm_bytes_per_s,
        "capacity_bytes": est.memory.capacity_bytes if est.memory else None,
        "time_s": est.time_s,
        "expected": _expected(est),
        "scheduled": est.step_time_s is not None and est.pipeline is None,
        "communicates": est.step_time_s is not None and any(k.communication for k in est.kernels),
        "pipelined": est.pipeline is not None,
        "gpus": world,  # in the step; ``shared``: GPUs sharing one replica's tokens
        "shared": shared,
        "flops": est.pipeline.rank_flops if est.pipeline is not None else est.flops,
        "tokens": est.facts.tokens,
        "batch": workload.batch if workload else 1,
        "weight_intensity": analysis.weight_gemm_intensity(est) or None,  # B* = b·ridge / it
        "kv_crossover_batch": _finite(est.kv_crossover_batch),
        "batching": step is not None and step.batching,
        "memory_bytes": est.memory.total_bytes if est.memory else None,
        "memory_line": est.memory.line() if est.memory else "",
        "summary": summary(est),
        "coverage": coverage_line(est),
        "assumptions": list(est.assumptions),
        "rows": _rows_with_kernels(est, depth, collapse),
        "stacks": _stacks(est, depth),
        "kernels": _kernels(est, keys),
    }


def _expected(est: Estimate) -> dict[str, Any]:
    """The expected range as factors on the step time (the page scales them with a step it
    re-prices), with what it is the middle 80% of; or why there is none."""
    found = expected_range(est)
    if isinstance(found, NoRange):
        return {"none": found.reason}
    return {
        "low": found.low_s / est.time_s if est.time_s else 0.0,
        "high": found.high_s / est.time_s if est.time_s else 0.0,
        "of": f"middle 80% of {found.runs} similar measured runs ({found.group})",
        "nearest": found.nearest.text(found.mode) if found.nearest else "",
    }


def _finite(value: float) -> float | None:
    return value if value != float("inf") else None


def page_data(
    kind: str,
    title: str,
    estimates: list[tuple[str, Estimate]],
    sweep: dict[str, Any] | None = None,
    depth: int | None = None,
    collapse: bool = True,
    grid: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What one page embeds: its estimates, every shipped accelerator with the ceilings
    they need, (a sweep) the swept key and values, and (a grid) its axes and each point's
    index along every axis."""
    views = [estimate_data(est, label, depth, collapse) for label, est in estimates]
    keys = {key for view in views for key in view["keys"]}
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "kind": kind,
        "title": title,
        "estimates": views,
        "accelerators": accelerators(keys, [est.hardware for _, est in estimates]),
        "sweep": sweep,
        "grid": grid,
    }


def render_page(data: dict[str, Any]) -> str:
    """The page: plotly.js, the report's script and style, and ``data`` as JSON, inlined."""
    assets = resources.files("torchroof.render") / "assets"
    script = (assets / "report.js").read_text(encoding="utf-8")
    style = (assets / "report.css").read_text(encoding="utf-8")
    # No markup characters in the inlined JSON: "</script>" would end its element early and
    # "<!--<script" would keep it from ending (a module name or label may hold either)
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(data['title'])}</title>\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<style>\n{style}\n</style>\n"
        f"<script>\n{plotly_js()}\n</script>\n"
        "</head>\n<body>\n"
        '<div id="app"></div>\n'
        f'<script type="application/json" id="torchroof-data">{payload}</script>\n'
        f"<script>\n{script}\n</script>\n"
        "</body>\n</html>\n"
    )


def describe(est: Estimate) -> str:
    """What was estimated, in a line: the regime's own label (its sizes, dtype and parallel
    plan) and how it was priced (``llama-3-8b prefill, batch 1 x 4096 tokens, bf16 on
    h100-sxm fused``); a step traced by hand has only the latter."""
    workload = est.workload
    if workload is None:
        return estimate_label(est)
    what = regime(workload.regime).label(est.facts.model or "model", workload)
    return f"{what} on {estimate_label(est)}"


def _write(text: str, path: str | Path | None) -> str:
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def estimate_html(
    est: Estimate,
    path: str | Path | None = None,
    title: str = "",
    depth: int | None = None,
    collapse: bool = True,
) -> str:
    """One estimate's page, its layer rows grouped as the text table's (``depth``,
    ``collapse``); written to ``path`` when given."""
    title = title or f"torchroof: {describe(est)}"
    data = page_data("estimate", title, [("", est)], depth=depth, collapse=collapse)
    return _write(render_page(data), path)


def comparison_html(comparison: Comparison, path: str | Path | None = None, title: str = "") -> str:
    """compare's variants side by side, each expandable into its full report."""
    estimates = [(v.label, v.estimate) for v in comparison.variants]
    title = title or f"torchroof compare: {describe(estimates[0][1])}; " + ", ".join(
        label for label, _ in estimates
    )
    return _write(render_page(page_data("comparison", title, estimates)), path)


def sweep_html(sweep: Sweep, path: str | Path | None = None, title: str = "") -> str:
    """A sweep's curves (step time and tokens/s, bytes by kind) with B* and the KV
    crossover marked when it is over batch, and every point's report."""
    estimates = [(f"{sweep.key}={p.value}", p.estimate) for p in sweep.points]
    title = title or f"torchroof sweep over {sweep.key}: {describe(estimates[0][1])}"
    info = {"key": sweep.key, "values": [p.value for p in sweep.points]}
    return _write(render_page(page_data("sweep", title, estimates, info)), path)


def check_grid_page(points: int) -> None:
    """Refuse a grid of more points than one page holds (before any is traced, where the
    command line can)."""
    if points > MAX_GRID_PAGE_POINTS:
        raise ValueError(
            f"a grid's page holds at most {MAX_GRID_PAGE_POINTS} points (each embeds every "
            f"kernel of its step); this grid has {points}: write it as .csv, .json or a "
            "plot, or narrow the axes"
        )


def grid_html(grid: Grid, path: str | Path | None = None, title: str = "") -> str:
    """A grid's page: a slider per axis picks the point whose report is shown, a heat map
    of step time over the first two axes, and every point in a table; switching the
    accelerator or an efficiency re-prices every point from its kernels' W and Q."""
    check_grid_page(len(grid.points))
    estimates = [
        (", ".join(f"{key}={value}" for key, value in point.values.items()), point.estimate)
        for point in grid.points
    ]
    axes = [{"key": key, "values": [str(v) for v in values]} for key, values in grid.axes]
    # the points are every combination, the first axis slowest (studies.sweep_grid)
    where = [list(at) for at in itertools.product(*(range(len(v)) for _, v in grid.axes))]
    if len(where) != len(grid.points) or any(
        point.values.get(key) != values[i]
        for point, at in zip(grid.points, where, strict=False)
        for (key, values), i in zip(grid.axes, at, strict=True)
    ):
        raise ValueError("a grid's points are every combination of its axes, the first slowest")
    named = " x ".join(grid.keys)
    title = title or f"torchroof grid over {named}: {describe(estimates[0][1])}"
    info = {"axes": axes, "points": where}
    return _write(render_page(page_data("grid", title, estimates, grid=info)), path)

"""The estimate as files, and the one writer, :func:`write`, that picks the format by the
file's suffix (or a ``kind`` named outright):

- ``.trace.json`` (``timeline``): the Chrome / Perfetto trace of torchroof.render.chrome_trace
- ``.json`` (``estimate``): the estimate, read back by ``Estimate.from_json``
- ``.csv`` (``csv``): one row per kernel
- ``.layers.png``, ``.layers.svg``, ``.layers.pdf`` (``layers``): stacked per-layer time
- ``.png``, ``.svg``, ``.pdf`` (``roofline``): the roofline, a point per kernel
- ``.html``, ``.htm`` (``html``): the interactive report of torchroof.render.html

Plots are drawn by torchroof.render.plots. A new output format is a function that writes it and
one row of :data:`FORMATS`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.accuracy.expected import expected_range
from torchroof.render.chrome_trace import write_chrome_trace
from torchroof.render.plots import (
    PLOT_SUFFIXES,
    check_plot_path,
    grid_plot,
    layer_plot,
    roofline_plot,
    sweep_plot,
)

if TYPE_CHECKING:
    from torchroof.report.compare import Grid, Sweep
    from torchroof.report.estimate import Estimate

# The kernel fields the CSV holds, in column order.
CSV_COLUMNS = (
    "index",
    "name",
    "module",
    "phase",
    "flops",
    "bytes_read",
    "bytes_written",
    "unit",
    "dtype",
    "counted",
    "compute_s",
    "memory_s",
    "time_s",
    "bound",
    "boundary",
    "tile",
    "waves",
    "wave_efficiency",
    "in_flight_bytes",
    "overhead_s",
)


def estimate_json(
    est: Estimate, path: str | Path | None = None, beside: dict[str, Any] | None = None
) -> str:
    """The estimate as JSON text (``Estimate.to_dict``, its totals with the expected range:
    ``torchroof.accuracy.expected``), with ``beside``'s fields at the top level (the CLI's
    sensitivity table); also written to ``path`` if given."""
    data = {**est.to_dict(), **(beside or {})}
    data["totals"]["expected"] = expected_range(est).to_dict()
    text = json.dumps(data, indent=1)
    if path is not None:
        Path(path).write_text(text)
    return text


def write_json(est: Estimate, path: str | Path) -> Path:
    estimate_json(est, path)
    return Path(path)


def write_csv(est: Estimate, path: str | Path) -> Path:
    """One row per kernel, a header of :data:`CSV_COLUMNS`; times in seconds."""
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for kernel in est.kernels:
            writer.writerow([getattr(kernel, c) for c in CSV_COLUMNS])
    return path


def write_sweep_csv(sweep: Sweep, path: str | Path) -> Path:
    """One row per swept value, the columns of ``Sweep.rows``."""
    path = Path(path)
    rows = sweep.rows()
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


HTML_SUFFIXES = (".html", ".htm")


def _write_html(est: Estimate, path: str | Path, depth: int | None) -> Path:
    from torchroof.render.html import estimate_html

    estimate_html(est, path, depth=depth)
    return Path(path)


def check_html_path(path: str | Path) -> Path:
    """An HTML report's path: named .html or .htm, and plotly importable (it bundles the
    page's charts); checked before any work, as plots are."""
    if not Path(path).name.lower().endswith(HTML_SUFFIXES):
        raise ValueError(f"an HTML report is written to a .html file, got {str(path)!r}")
    from torchroof.render.html import plotly_js

    plotly_js()
    return Path(path)


@dataclass(frozen=True)
class OutputFormat:
    """One kind of file an estimate is written as."""

    kind: str
    suffixes: tuple[str, ...]  # matched against the end of the lower-cased file name
    description: str  # what the CLI says it wrote
    render: Callable[[Estimate, str | Path, int | None], Path]  # (est, path, depth) -> path
    image: bool = False  # a plot: the suffix chooses the encoding, so it must be an image's


# In matching order: a compound suffix (.trace.json, .layers.png) before the plain one it
# ends with.
FORMATS = (
    OutputFormat(
        "timeline",
        (".trace.json",),
        "the Chrome / Perfetto timeline",
        lambda est, path, depth: write_chrome_trace(est, path),
    ),
    OutputFormat(
        "estimate",
        (".json",),
        "the estimate (JSON)",
        lambda est, path, depth: write_json(est, path),
    ),
    OutputFormat(
        "csv",
        (".csv",),
        "one row per kernel (CSV)",
        lambda est, path, depth: write_csv(est, path),
    ),
    OutputFormat(
        "html",
        HTML_SUFFIXES,
        "the interactive report (HTML)",
        lambda est, path, depth: _write_html(est, path, depth),
    ),
    OutputFormat(
        "layers",
        tuple(f".layers{s}" for s in PLOT_SUFFIXES),
        "the per-layer plot",
        lambda est, path, depth: layer_plot(est, path, depth=depth),
        image=True,
    ),
    OutputFormat(
        "roofline",
        PLOT_SUFFIXES,
        "the roofline plot",
        lambda est, path, depth: roofline_plot(est, path),
        image=True,
    ),
)
KINDS = tuple(f.kind for f in FORMATS)


def supported_suffixes() -> str:
    """The suffixes :func:`write` knows, and what each writes, in one line."""
    return "; ".join(f"{'/'.join(f.suffixes)} ({f.description})" for f in FORMATS)


def output_format(path: str | Path, kind: str | None = None) -> OutputFormat:
    """The format ``path`` is written in: the one ``kind`` names, else the one its suffix
    names. Raises ValueError naming the supported suffixes (or kinds) for anything else, and
    for a plot whose suffix is not an image format's. Writes nothing, so a caller can check
    its outputs before any work."""
    if kind is not None:
        chosen = next((f for f in FORMATS if f.kind == kind), None)
        if chosen is None:
            raise ValueError(f"unknown output kind {kind!r}; choose from {', '.join(KINDS)}")
        if chosen.image:
            check_plot_path(path)
        if chosen.kind == "html":
            check_html_path(path)
        return chosen
    name = Path(path).name.lower()
    for candidate in FORMATS:
        if name.endswith(candidate.suffixes):
            return candidate
    raise ValueError(
        f"cannot tell what to write to {str(path)!r} from its suffix; "
        f"supported: {supported_suffixes()}"
    )


def write(
    est: Estimate, path: str | Path, kind: str | None = None, depth: int | None = None
) -> Path:
    """Write ``est`` to ``path`` in the format its suffix names (the module docstring), or in
    ``kind`` whatever the name (``write(est, "run.json", kind="timeline")``). ``depth``
    groups the per-layer plot's rows as in ``Estimate.rows``. Returns the path written."""
    return output_format(path, kind).render(est, path, depth)


# A sweep's outputs, by kind: what the CLI says it wrote.
SWEEP_OUTPUTS = {
    "csv": "one row per value (CSV)",
    "plot": "the sweep plot",
    "html": "the interactive sweep report (HTML)",
}


def sweep_output(path: str | Path, kind: str | None = None) -> str:
    """The kind of sweep output ``path`` is (``csv`` or ``plot``): ``kind`` if given, else
    from the suffix; ValueError naming the supported ones otherwise. Writes nothing."""
    if kind is None:
        name = Path(path).name.lower()
        if name.endswith(".csv"):
            return "csv"
        if name.endswith(PLOT_SUFFIXES):
            return "plot"
        if name.endswith(HTML_SUFFIXES):
            check_html_path(path)
            return "html"
        raise ValueError(
            f"cannot tell what to write to {str(path)!r} from its suffix; supported: "
            f".csv ({SWEEP_OUTPUTS['csv']}); {'/'.join(PLOT_SUFFIXES)} ({SWEEP_OUTPUTS['plot']}); "
            f"{'/'.join(HTML_SUFFIXES)} ({SWEEP_OUTPUTS['html']})"
        )
    if kind not in SWEEP_OUTPUTS:
        raise ValueError(
            f"unknown sweep output kind {kind!r}; choose from {', '.join(SWEEP_OUTPUTS)}"
        )
    if kind == "plot":
        check_plot_path(path)
    if kind == "html":
        check_html_path(path)
    return kind


def write_sweep(sweep: Sweep, path: str | Path, kind: str | None = None) -> Path:
    """Write a sweep: ``.csv`` one row per value, ``.png``/``.svg``/``.pdf`` the throughput
    and step-time curve, ``.html`` the interactive report (or the ``kind`` named, whatever
    the suffix)."""
    chosen = sweep_output(path, kind)
    if chosen == "csv":
        return write_sweep_csv(sweep, path)
    if chosen == "html":
        from torchroof.render.html import sweep_html

        sweep_html(sweep, path)
        return Path(path)
    return sweep_plot(sweep, path)


GRID_OUTPUTS = {
    "csv": "one row per point (CSV)",
    "json": "one object per point (JSON)",
    "plot": "heat maps of the first two axes",
    "html": "a slider per axis and every point's report (HTML)",
}


def grid_output(path: str | Path, grid_axes: int = 2) -> str:
    """The kind of grid output ``path`` is, from its suffix (``.csv``, ``.json``, a plot);
    ValueError naming the supported ones otherwise, or for a plot of a one-axis grid."""
    name = Path(path).name.lower()
    kinds = (
        ("csv", (".csv",)),
        ("json", (".json",)),
        ("plot", PLOT_SUFFIXES),
        ("html", HTML_SUFFIXES),
    )
    for kind, suffixes in kinds:
        if name.endswith(suffixes):
            if kind == "plot":
                check_plot_path(path)
                if grid_axes < 2:
                    raise ValueError(f"{path}: a heat map needs two axes; this grid has one")
            if kind == "html":
                check_html_path(path)  # plotly importable, before any work
            return kind
    listed = "; ".join(
        f"{suffix} ({GRID_OUTPUTS[kind]})"
        for kind, suffix in (
            ("csv", ".csv"),
            ("json", ".json"),
            ("plot", "/".join(PLOT_SUFFIXES)),
            ("html", "/".join(HTML_SUFFIXES)),
        )
    )
    raise ValueError(f"{path}: a grid is written as {listed}")


def write_grid(grid: Grid, path: str | Path) -> Path:
    """Write a grid by the file's suffix: ``.csv`` or ``.json`` one row per point (the axis
    values, then step time, tokens/s, MFU, traffic, memory and fit), a plot the heat maps,
    ``.html`` the interactive page (:func:`torchroof.render.html.grid_html`)."""
    kind = grid_output(path, len(grid.axes))
    path = Path(path)
    if kind == "plot":
        return grid_plot(grid, path)
    if kind == "html":
        from torchroof.render.html import grid_html

        grid_html(grid, path)
        return path
    rows = grid.rows()
    if kind == "json":
        axes = [{"key": key, "values": values} for key, values in grid.axes]
        path.write_text(json.dumps({"axes": axes, "points": rows}, indent=1))
        return path
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path

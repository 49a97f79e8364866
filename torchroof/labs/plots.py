"""Pictures for the labs (PNG, SVG or PDF by the file's suffix; matplotlib is optional).

The roofline explorer: the accelerator's log-log roofline with every boundary's diagonal
and every pipe's ceiling (Williams et al. 2009), the reading's point marked.
The GEMM workbench: the GEMM's point at each boundary it crosses under its peak (a
hierarchical roofline chart, Yang, Kurth & Williams 2020), and the three accountings of Q
(compulsory, tiled, modelled) at the HBM boundary.
Log-log axes flatter everything: read numbers from the readouts, not the picture.
"""

from __future__ import annotations

from pathlib import Path

from torchroof.hardware import distinct_boundaries, get
from torchroof.labs.explore import RooflineReading, find_boundary
from torchroof.labs.gemm_workbench import GemmReading
from torchroof.render.plots import check_plot_path, pyplot, save_figure


def _tera(value: float) -> str:
    return f"{value / 1e12:.0f}" if value >= 1e14 else f"{value / 1e12:.3g}"


def _roof(lo: float, hi: float, peak: float, beta: float) -> tuple[list[float], list[float]]:
    """min(peak, beta·x) over [lo, hi]: a straight line on log-log axes bent at the ridge."""
    xs = sorted({lo, hi, min(hi, max(lo, peak / beta))})
    return xs, [min(peak, beta * x) for x in xs]


def roofline_lab_plot(reading: RooflineReading, path: str | Path) -> Path:
    """The roofline explorer: every boundary's diagonal beta·I up to the highest ceiling,
    every pipe's ceiling, the chosen roof min(pi, beta·I) in black and the reading's point
    on it."""
    path = check_plot_path(path)
    plt = pyplot()
    spec = reading.spec if reading.spec is not None else get(reading.hardware)
    walls = distinct_boundaries(spec)  # the boundary table as ``torchroof hardware`` lists it
    if reading.boundary not in {wall.name for wall in walls}:  # one cluster's own link
        walls.append(find_boundary(spec, reading.boundary_key)[1])
    ceilings = spec.ceilings()  # every pipe, fp64 included, as find_pipe offers them
    top = max(ceilings.values())
    ridges = [top / b.bytes_per_s for b in walls] + [reading.machine_balance]
    lo = min(0.05, reading.intensity / 4, min(ridges) / 20)
    hi = max(reading.intensity * 4, max(ridges) * 4)
    fig, ax = plt.subplots(figsize=(9, 6))
    for wall in walls:
        chosen = wall.name == reading.boundary
        approx = wall.figure.approximate
        ax.plot(
            *_roof(lo, hi, top, wall.bytes_per_s),
            ":" if approx else "-",
            lw=2.2 if chosen else 0.9,
            alpha=1.0 if chosen else 0.6,
            label=f"{wall.name} {_tera(wall.bytes_per_s)} TB/s" + (" (approx.)" if approx else ""),
        )
    # ceilings within 1% (bf16 and fp16; fp32 without FMA and fp64 vector) share one line
    same: dict[float, list[str]] = {}
    for name, peak in ceilings.items():  # highest first
        near = next((p for p in same if abs(p - peak) <= 0.01 * p), peak)
        same.setdefault(near, []).append(name)
    for peak, names in same.items():
        chosen = reading.pipe in names
        ax.axhline(peak, color="grey", lw=1.8 if chosen else 0.7, ls="-" if chosen else "--")
        label = " / ".join(names)
        ax.annotate(
            f"{label} {_tera(peak)} TF/s", (lo, peak), fontsize=7, va="bottom", color="grey"
        )
    roof = _roof(lo, hi, reading.peak_flops_per_s, reading.bandwidth_bytes_per_s)
    ax.plot(*roof, color="black", lw=2.5, label="chosen roof")
    ax.plot([reading.intensity], [reading.attainable_flops_per_s], "o", color="red", ms=9, zorder=5)
    label = reading.preset or f"I = {reading.intensity:g}"
    ax.annotate(
        f"{label}: {100 * reading.fraction_of_peak:.2f}% of peak",
        (reading.intensity, reading.attainable_flops_per_s),
        textcoords="offset points",
        xytext=(8, -14),
        color="red",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()  # many decades: the minor ticks cost more than they show
    ax.set_xlabel("arithmetic intensity (FLOP / byte crossing the boundary)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"{spec.display_name}: boundaries and pipes (the hierarchical roofline)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, alpha=0.2)
    return save_figure(fig, path, dpi=120)


def gemm_lab_plot(reading: GemmReading, path: str | Path) -> Path:
    """The GEMM workbench as a hierarchical roofline chart: the GEMM at each boundary
    (filled: on the roof that boundary allows; the lowest binds), and at HBM its
    compulsory / tiled / modelled intensities (hollow)."""
    path = check_plot_path(path)
    plt = pyplot()
    peak, flops = reading.peak_flops_per_s, reading.flops
    levels = reading.hierarchy()
    points = [r.intensity(flops) for r in levels]
    points += [reading.intensity(w) for w in ("compulsory", "tiled", "modelled")]
    ridges = [peak / r.bytes_per_s for r in levels]
    lo, hi = min(points + ridges) / 4, max(points + ridges) * 4
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.axhline(peak, color="black", lw=1.5, label=f"{reading.dtype} peak {peak / 1e12:.0f} TF/s")
    binding = reading.binding
    for r in levels:
        line = ax.plot(
            *_roof(lo, hi, peak, r.bytes_per_s),
            ":" if r.approximate else "-",
            lw=1.2,
            label=f"{r.name} {r.bytes_per_s / 1e12:.3g} TB/s"
            + (" (approx.)" if r.approximate else ""),
        )[0]
        x = r.intensity(flops)
        y = min(peak, r.bytes_per_s * x)
        ax.plot([x], [y], "o", color=line.get_color(), ms=10 if r is binding else 7, zorder=5)
        ax.annotate(f"{r.name} I={x:.1f}", (x, y), textcoords="offset points", xytext=(6, -12))
    beta = reading.bandwidth_bytes_per_s
    for which, marker in (("compulsory", "s"), ("tiled", "^"), ("modelled", "D")):
        x = reading.intensity(which)
        ax.plot(
            [x],
            [min(peak, beta * x)],
            marker,
            mfc="none",
            mec="black",
            ms=9,
            label=f"HBM, Q {which}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()  # many decades: the minor ticks cost more than they show
    ax.set_xlabel("arithmetic intensity (FLOP / byte crossing the boundary)")
    ax.set_ylabel("attainable FLOP/s")
    verdict = f"{binding.name} binds" if binding is not None else "compute-bound at every level"
    ax.set_title(
        f"GEMM {reading.m}x{reading.n}x{reading.k} {reading.dtype}, tile {reading.tile.label()}:"
        f" {verdict}, {100 * reading.hierarchical_cap:.0f}% of peak"
    )
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, alpha=0.2)
    return save_figure(fig, path, dpi=120)

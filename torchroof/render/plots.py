"""Pictures: the roofline with one point per kernel, the per-layer stacked budget, sweep
curves (PNG, SVG or PDF by the file's suffix). matplotlib is an optional extra.

Log-log axes flatter everything: read numbers from the readouts, not the picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.hardware import HardwareSpec, UnsupportedDtypeError, get
from torchroof.records.ops import PHASES
from torchroof.render.text import estimate_label

if TYPE_CHECKING:
    from torchroof.report.estimate import Estimate

PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # matplotlib picks the format from the suffix

PHASE_COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "recompute": "tab:purple",
    "optimizer": "tab:green",
}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (a clear error without the plot extra)."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "plots need matplotlib: pip install 'torchroof[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: str | Path) -> Path:
    """``path`` if its suffix names an image format a plot is written in, else ValueError."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"plots are written as .pdf, .png or .svg, got {path.name!r}")
    return path


def save_figure(fig: Any, path: str | Path, dpi: int = 150) -> Path:
    """Write ``fig`` to ``path`` (its suffix picks the format) and close it."""
    path = check_plot_path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def roof_lines(est: Estimate, spec: HardwareSpec) -> list[tuple[str, float]]:
    """(label, FLOP/s) of each roof the roofline plot draws for ``est`` on ``spec``: the
    tensor peaks the part has, the fp16-accumulate rate where the step's fp16 matmuls ran
    at it, and the fp32 vector peak."""
    roofs = []
    for key in ("fp8", "bf16", "tf32"):
        try:
            roofs.append((f"{key} tensor", spec.tensor_peak(key, allow_tf32=True)))
        except UnsupportedDtypeError:
            continue
    if est.fp16_accumulate and spec.fp16_accumulate_tensor_flops_per_s is not None:
        roofs.append(
            ("fp16 tensor, fp16 accumulate", spec.fp16_accumulate_tensor_flops_per_s.value)
        )
    roofs.append(("fp32 vector", spec.vector_peak("fp32")))
    return roofs


def roofline_plot(est: Estimate, path: str | Path, colour_by: str = "phase") -> Path:
    """Log-log roofline: the HBM diagonal, a roof per dtype and the vector-unit roof, and a
    point per kernel at (intensity, attained FLOP/s), its area proportional to its time."""
    plt = pyplot()
    spec = get(est.hardware)
    beta = spec.hbm_bytes_per_s.value
    kernels = [k for k in est.kernels if k.flops and k.bytes and k.time_s]
    xs = [k.intensity for k in kernels]
    lo, hi = min(xs + [0.1]) / 2, max(xs + [spec.ridge("bf16") * 10]) * 2
    fig, ax = plt.subplots(figsize=(8, 5.5))
    roofs = roof_lines(est, spec)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for label, peak in roofs:
        ax.plot(
            grid,
            [min(peak, beta * x) for x in grid],
            lw=1.5,
            label=f"{label} {peak / 1e12:.0f} TF/s",
        )
        ax.axvline(peak / beta, color="grey", lw=0.5, ls=":")
    total = est.time_s or 1.0
    colours = (
        [PHASE_COLOURS.get(k.phase, "black") for k in kernels]
        if colour_by == "phase"
        else ["tab:red" if k.bound == "memory" else "tab:blue" for k in kernels]
    )
    sizes = [max(4.0, 4000 * k.time_s / total) for k in kernels]
    ax.scatter(
        xs, [k.flops / k.time_s for k in kernels], s=sizes, c=colours, alpha=0.5, edgecolors="none"
    )
    for phase, colour in PHASE_COLOURS.items():
        if colour_by == "phase" and any(k.phase == phase for k in kernels):
            ax.scatter([], [], c=colour, label=f"{phase} kernels")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("attained FLOP/s (roofline)")
    ax.set_title(f"{est.facts.model} on {spec.display_name} (HBM {beta / 1e12:.2f} TB/s)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    return save_figure(fig, path)


def layer_plot(est: Estimate, path: str | Path, depth: int | None = None) -> Path:
    """Stacked per-layer time bar, one segment per phase (the per-layer time budget)."""
    plt = pyplot()
    rows = est.rows(depth, collapse=True)
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.35 * len(rows) + 1.5)))
    names = [r.name for r in rows]
    left = [0.0] * len(rows)
    for phase in PHASES:
        widths = [r.phase_s.get(phase, 0.0) * 1e3 for r in rows]
        if any(widths):
            ax.barh(names, widths, left=left, color=PHASE_COLOURS[phase], label=phase)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, roofline)")
    ax.set_title(f"per-layer budget, {estimate_label(est)}: {est.time_s * 1e3:.2f} ms")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def sweep_plot(sweep: Any, path: str | Path) -> Path:
    """Throughput and step time against the swept size, with B* and the KV crossover."""
    plt = pyplot()
    rows = sweep.rows()
    xs = [r[sweep.key] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xs, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue", label="tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(sweep.key)
    ax.set_ylabel("tokens/s")
    twin = ax.twinx()
    twin.plot(
        xs, [r["step_time_s"] * 1e3 for r in rows], "s--", color="tab:orange", label="step ms"
    )
    twin.set_ylabel("step time (ms)")
    if sweep.key == "batch":
        for value, label, colour in (
            (sweep.ridge_batch, "B* (weights at the ridge)", "grey"),
            (sweep.kv_crossover_batch, "KV reads = weight reads", "tab:red"),
        ):
            if value != float("inf"):
                ax.axvline(value, color=colour, ls=":", label=f"{label}: {value:.0f}")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        f"{sweep.points[0].estimate.facts.model} "
        f"{w.regime if (w := sweep.points[0].estimate.workload) else ''} sweep"
    )
    return save_figure(fig, path)


def grid_plot(grid: Any, path: str | Path) -> Path:
    """Heat maps of a grid's first two axes (any other at its first value): step time,
    tokens/s, and the memory-fit boundary (hatched: the point does not fit)."""
    plt = pyplot()
    (down, downs), (across, acrosses) = grid.axes[0], grid.axes[1]
    fixed = {key: values[0] for key, values in grid.axes[2:]}
    cells = {
        (r[down], r[across]): r for r in grid.rows() if all(r[k] == v for k, v in fixed.items())
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, (metric, title, scale) in zip(
        axes,
        (("step_time_s", "step time (ms)", 1e3), ("tokens_per_s", "tokens/s", 1.0)),
        strict=True,
    ):
        values = [[cells[(d, a)][metric] * scale for a in acrosses] for d in downs]
        image = ax.imshow(values, aspect="auto", origin="lower", cmap="viridis")
        fig.colorbar(image, ax=ax, label=title)
        ax.set_xticks(range(len(acrosses)), [str(a) for a in acrosses], rotation=45)
        ax.set_yticks(range(len(downs)), [str(d) for d in downs])
        ax.set_xlabel(across)
        ax.set_ylabel(down)
        for i, d in enumerate(downs):
            for j, a in enumerate(acrosses):
                if not cells[(d, a)]["fits"]:
                    ax.add_patch(
                        plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", lw=0)
                    )
        ax.set_title(title + (" (hatched: does not fit)" if metric == "step_time_s" else ""))
    first = grid.points[0].estimate
    at = ", ".join(f"{k}={v}" for k, v in fixed.items())
    fig.suptitle(f"{first.facts.model} {w.regime if (w := first.workload) else ''} {at}")
    fig.tight_layout()
    return save_figure(fig, path)

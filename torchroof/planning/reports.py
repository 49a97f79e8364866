"""A training search's pictures and pages: the priced plans as step time against memory per
GPU with the front of plans nothing beats on both (matplotlib, the ``plot`` extra), and
the best plan's own estimate as the offline HTML report (one more trace of its step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchroof.planning.search import TrainingPlans
from torchroof.prepared import prepare
from torchroof.progress import silenced
from torchroof.render.html import estimate_html
from torchroof.render.plots import check_plot_path, pyplot


def check_front_plot(path: str | Path) -> Path:
    """``path`` if the plot can be written there (an image suffix, matplotlib installed):
    checked before any work."""
    path = check_plot_path(path)
    pyplot()
    return path


def front_figure(plans: TrainingPlans) -> Any:
    """Every priced plan as a point (step time, memory per GPU): those that fit, those over
    memory, and the front joined; the GPU's memory as a line."""
    fig, ax = pyplot().subplots(figsize=(8, 5), layout="constrained")
    gib = 2**30
    for group, style, name in (
        (plans.ranked, {"color": "tab:blue"}, "fits"),
        (plans.over_memory, {"color": "tab:gray", "marker": "x"}, "over memory"),
    ):
        if group:
            ax.scatter(
                [p.step_time_s * 1e3 for p in group],
                [p.memory_bytes / gib for p in group],
                s=18,
                label=f"{name} ({len(group)})",
                **style,
            )
    front = plans.pareto()
    if front:
        ax.plot(
            [p.step_time_s * 1e3 for p in front],
            [p.memory_bytes / gib for p in front],
            color="tab:red",
            marker="o",
            label="front: none both faster and smaller",
        )
        best = front[0]
        ax.annotate(
            best.layout.label(),
            (best.step_time_s * 1e3, best.memory_bytes / gib),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=8,
        )
    ax.axhline(plans.capacity_bytes / gib, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_title(f"{len(plans.ranked) + len(plans.over_memory):,} training plans priced")
    ax.legend(loc="best", fontsize=8)
    return fig


def front_plot(plans: TrainingPlans, path: str | Path) -> Path:
    """Write :func:`front_figure` (the suffix picks PNG, SVG or PDF)."""
    path = check_front_plot(path)
    fig = front_figure(plans)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def best_plan_html(
    plans: TrainingPlans,
    model: Any,
    hardware: Any,
    seq: int,
    path: str | Path,
    workload: dict[str, Any] | None = None,
    pricing: dict[str, Any] | None = None,
) -> str:
    """The best plan's estimate (its step traced again, as ``torchroof estimate`` would)
    as the offline HTML report; ``workload`` and ``pricing`` are the search's other
    workload fields and pricing options."""
    best = plans.best
    with silenced():
        prepared = prepare(model, "train", seq=seq, **(workload or {}), **best.layout.knobs())
        estimate = prepared.price(hardware, **(pricing or {}))
    title = f"torchroof plan: the best of the search, {best.layout.label()}"
    return estimate_html(estimate, path, title=title)

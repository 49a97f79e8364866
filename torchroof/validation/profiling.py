"""The measured side of a validation: a profiled step's kernel times, matched to the prediction."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from torchroof.quiet import drop_native_lines
from torchroof.report.estimate import KernelEstimate


def normalise(name: str) -> str:
    """``aten.mm.default`` / ``aten::mm`` -> ``mm``; every SDPA flavour -> ``sdpa``."""
    core = name.removeprefix("aten::").removeprefix("aten.")
    core = core.split(".")[0]
    if "scaled_dot_product" in core or "flash_attention" in core:
        return "sdpa_backward" if "backward" in core else "sdpa"
    return core


def _event_s(event: Any, device: str) -> float:
    """An op's time: on the CPU its CPU time; on a GPU its kernels' device time (the CPU
    time of an asynchronous launch is the launch only)."""
    if device == "cpu":
        return event.cpu_time_total * 1e-6
    return getattr(event, "device_time_total", event.cpu_time_total) * 1e-6


def smallest_kernel_s(device: str, count: int = 100) -> float:
    """The profiled time of the smallest kernel, a one-element multiply into a new tensor
    (the median of ``count``): the fixed cost every profiled kernel time carries, which the
    launch overhead (measured without the profiler, into an existing output) leaves out."""
    from torch.profiler import ProfilerActivity, profile

    one = torch.ones(1, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with drop_native_lines(), profile(activities=activities) as prof:  # kineto's start/stop
        for _ in range(count):
            torch.mul(one, one)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    times = [_event_s(e, device) for e in prof.events() if e.name == "aten::mul"]
    return statistics.median(times) if times else 0.0


def measured_kernels(
    events: list[Any], names: set[str], device: str = "cpu"
) -> list[tuple[str, float]]:
    """Top-most profiler events whose op torchroof prices as a kernel, in start order."""
    chosen = []
    for event in sorted(events, key=lambda e: e.time_range.start):
        if not event.name.startswith("aten::"):
            continue
        key = normalise(event.name)
        if key not in names:
            continue
        parent, covered = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::") and normalise(parent.name) in names:
                covered = True
                break
            parent = parent.cpu_parent
        if not covered:
            chosen.append((key, _event_s(event, device)))
    return chosen


def align(
    predicted: list[KernelEstimate], measured: list[tuple[str, float]]
) -> tuple[list[float | None], list[tuple[str, float]]]:
    """Match predicted kernels to measured ones by op name, in order: the longest common
    subsequence of the two name sequences (difflib), so a kernel one side lacks (an
    accumulation the autograd engine runs elsewhere) does not shift the rest."""
    import difflib

    pred_names = [normalise(k.name) for k in predicted]
    meas_names = [name for name, _ in measured]
    matcher = difflib.SequenceMatcher(None, pred_names, meas_names, autojunk=False)
    times: list[float | None] = [None] * len(predicted)
    used: set[int] = set()
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            times[block.a + offset] = measured[block.b + offset][1]
            used.add(block.b + offset)
    unmatched = [m for j, m in enumerate(measured) if j not in used]
    return times, unmatched


def median_of_all(values: Sequence[float | None]) -> float | None:
    """The median of a kernel's times over the repeats; None unless every repeat has one."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None

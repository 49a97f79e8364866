"""An accelerator file fitted to the user's own profile of a real step: the bandwidth and
tensor rate its kernels reach and the fixed time each kernel costs.

The profile is a PyTorch profiler trace exported as Chrome JSON
(``prof.export_chrome_trace(path)``; torch.profiler docs, "Examining stack traces" and
"Using tracing functionality") or a CSV of per-op timings (a ``name`` column with the aten
op, and ``time_s``, ``time_ms`` or ``time_us``). The ops the step launched are matched to
torchroof's predicted kernels of the same step, in order, the way ``torchroof validate``
matches them (:func:`torchroof.validation.profiling.align`). On a GPU trace an op's time
is the device time of the kernels it launched (linked by the profiler's ``External id``);
on a CPU trace, the op's own time.

Each matched kernel that the pure roofline finds memory-bound takes ``L + Q / (f_hbm x
beta)``, each tensor kernel bound by its FLOPs ``L + W / (f_tensor x pi)``: two straight
lines through (bytes, time) and (FLOPs, time). Least squares on the relative error (so
small kernels weigh as much as large ones) gives the launch time ``L`` (the memory line's
intercept, where most small kernels are) and the two achievable fractions from the slopes:
the three figures the realistic mode reads for every kernel
(``launch_overhead_s``, ``achievable_hbm_fraction``, ``achievable_tensor_fraction``).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchroof.hardware import HardwareSpec
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.validation.calibrated_files import Fitted, rewrite
from torchroof.validation.profiling import align, normalise

MIN_KERNELS = 3
"""The fewest matched kernels of a class that a fraction is fitted from."""


class ProfileError(ValueError):
    """A profile that cannot be read or matched; the message says why."""


@dataclass(frozen=True)
class _Op:
    name: str
    pid: Any
    tid: Any
    start: float
    end: float
    external: Any


def _is_aten_op(event: dict[str, Any]) -> bool:
    name = str(event.get("name", ""))
    return event.get("ph") == "X" and event.get("cat") == "cpu_op" and name.startswith("aten::")


def _ops(events: list[dict[str, Any]]) -> list[_Op]:
    out = []
    for e in filter(_is_aten_op, events):
        start = float(e["ts"])
        external = (e.get("args") or {}).get("External id")
        out.append(
            _Op(e["name"], e.get("pid"), e.get("tid"), start, start + float(e["dur"]), external)
        )
    return out


def chrome_trace_ops(path: str | Path, names: set[str]) -> list[tuple[str, float]]:
    """The top-most profiled ops whose op torchroof prices as a kernel (``names``,
    normalised), in start order, each with its time in seconds: its kernels' device time on
    a GPU trace, its own time on a CPU one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ProfileError(f"{path}: not a readable Chrome trace JSON: {error}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError(f"{path}: no traceEvents list (export with prof.export_chrome_trace)")
    ops = sorted(_ops(events), key=lambda o: (o.start, -o.end))
    chosen: list[_Op] = []
    owner: dict[Any, int] = {}  # External id -> index in chosen
    open_by_thread: dict[tuple[Any, Any], list[tuple[_Op, int | None]]] = {}
    for op in ops:
        stack = open_by_thread.setdefault((op.pid, op.tid), [])
        while stack and stack[-1][0].end <= op.start:
            stack.pop()
        top = next((i for _, i in reversed(stack) if i is not None), None)
        if top is None and normalise(op.name) in names:
            top = len(chosen)
            chosen.append(op)
        if op.external is not None and top is not None:
            owner[op.external] = top
        stack.append((op, top))
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not kernels:
        return [(normalise(o.name), (o.end - o.start) * 1e-6) for o in chosen]
    device = [0.0] * len(chosen)
    for k in kernels:
        index = owner.get((k.get("args") or {}).get("External id"))
        if index is not None:
            device[index] += float(k["dur"]) * 1e-6
    return [(normalise(o.name), t) for o, t in zip(chosen, device, strict=True) if t > 0]


UNITS = {"time_s": 1.0, "time_ms": 1e-3, "time_us": 1e-6}


def csv_ops(path: str | Path) -> list[tuple[str, float]]:
    """Per-op timings from a CSV: a ``name`` column and one time column (:data:`UNITS`)."""
    try:
        with Path(path).open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as error:
        raise ProfileError(f"{path}: cannot read it: {error.strerror or error}") from None
    columns = set(rows[0]) if rows else set()
    unit = next((c for c in UNITS if c in columns), None)
    if "name" not in columns or unit is None:
        raise ProfileError(f"{path}: needs a 'name' column and one of {', '.join(UNITS)}")
    out = []
    for n, row in enumerate(rows, start=2):
        try:
            out.append((normalise(row["name"]), float(row[unit]) * UNITS[unit]))
        except ValueError:
            raise ProfileError(f"{path}:{n}: {row[unit]!r} is not a time") from None
    return out


def profiled_ops(path: str | Path, names: set[str]) -> list[tuple[str, float]]:
    """The profile's ops, from a Chrome trace or (by its suffix) a CSV."""
    if str(path).endswith(".csv"):
        return [op for op in csv_ops(path) if op[0] in names]
    return chrome_trace_ops(path, names)


@dataclass(frozen=True)
class Line:
    """``time = intercept + slope x size`` through one class of kernels."""

    kernels: int
    intercept_s: float
    slope: float  # seconds per byte or per FLOP


def fit_line(sizes: list[float], times: list[float]) -> Line | None:
    """Least squares on the relative error; None with fewer than :data:`MIN_KERNELS`."""
    if len(sizes) < MIN_KERNELS:
        return None
    x, t = np.array(sizes), np.array(times)
    design = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if intercept < 0:
        intercept, slope = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return Line(len(sizes), float(intercept), float(slope)) if slope > 0 else None


@dataclass(frozen=True)
class ProfileFit:
    """The figures fitted from a profile, and how well the kernels matched."""

    matched: int
    profiled: int
    predicted: int
    memory_kernels: int  # matched kernels the pure roofline finds memory-bound
    tensor_kernels: int  # ... and bound by the tensor units
    launch_s: float | None
    hbm_fraction: float | None
    tensor_fraction: float | None
    notes: tuple[str, ...]

    def lines(self) -> list[str]:
        def show(value: float | None, text: str) -> str:
            return text.format(value) if value is not None else "not fitted"

        return [
            f"matched {self.matched} of {self.predicted} predicted kernels to {self.profiled} "
            f"profiled ops: {self.memory_kernels} memory-bound, {self.tensor_kernels} bound by "
            "the tensor units",
            f"launch per kernel: {show(self.launch_s and self.launch_s * 1e6, '{:.2f} us')}",
            f"achievable HBM fraction: {show(self.hbm_fraction, '{:.3f}')}",
            f"achievable tensor fraction: {show(self.tensor_fraction, '{:.3f}')}",
            *(f"note: {n}" for n in self.notes),
        ]


def _tensor_bound(kernel: KernelEstimate) -> bool:
    return kernel.unit == "tensor" and kernel.bound == "compute"


def fit_profile(
    predicted: Estimate, measured: list[tuple[str, float]], spec: HardwareSpec
) -> ProfileFit:
    """The launch time and achievable fractions of ``spec`` that best explain ``measured``
    (the profiled ops) against ``predicted`` (the pure roofline estimate of the same step on
    ``spec``, eager kernels)."""
    times, _ = align(predicted.kernels, measured)
    memory_sizes, memory_times, tensor_sizes, tensor_times = [], [], [], []
    for kernel, t in zip(predicted.kernels, times, strict=True):
        if t is None or t <= 0 or kernel.communication:
            continue
        if _tensor_bound(kernel):
            tensor_sizes.append(kernel.compute_s)  # W / pi: its time at the tensor peak
            tensor_times.append(t)
        elif kernel.bound == "memory":
            memory_sizes.append(kernel.memory_s)  # Q / beta: its time at the HBM peak
            memory_times.append(t)
    matched = sum(t is not None for t in times)
    if not matched:
        raise ProfileError(
            "no profiled op matched a predicted kernel: profile the same step (model, regime, "
            "batch and length) that is traced here, run eagerly"
        )
    notes = []
    memory, tensor = fit_line(memory_sizes, memory_times), fit_line(tensor_sizes, tensor_times)
    launch = memory.intercept_s if memory else (tensor.intercept_s if tensor else None)
    fractions: list[float | None] = []
    for line, what in ((memory, "HBM"), (tensor, "tensor")):
        if line is None:
            notes.append(
                f"fewer than {MIN_KERNELS} {what}-bound kernels matched: its fraction is kept"
            )
            fractions.append(None)
            continue
        fraction = 1.0 / line.slope  # seconds at peak / seconds taken
        if fraction > 1:
            notes.append(
                f"the {what}-bound kernels ran faster than the file's peak "
                f"({fraction:.2f}x): capped at 1"
            )
        fractions.append(min(fraction, 1.0))
    return ProfileFit(
        matched,
        len(measured),
        len(predicted.kernels),
        len(memory_times),
        len(tensor_times),
        launch,
        fractions[0],
        fractions[1],
        tuple(notes),
    )


def calibrated_accelerator(spec: HardwareSpec, fitted: ProfileFit, name: str, source: str) -> str:
    """The accelerator's TOML with the fitted figures (those not fitted keep their line)."""
    figures: dict[tuple[str, str], Fitted] = {}
    how = f"{source}: {fitted.matched} profiled kernels matched, least squares"
    if fitted.launch_s is not None:
        figures[("", "launch_overhead_s")] = Fitted(fitted.launch_s, f"{how}, intercept")
    if fitted.hbm_fraction is not None:
        figures[("", "achievable_hbm_fraction")] = Fitted(
            fitted.hbm_fraction, f"{how}, Q/beta slope"
        )
    if fitted.tensor_fraction is not None:
        figures[("", "achievable_tensor_fraction")] = Fitted(
            fitted.tensor_fraction, f"{how}, W/pi slope"
        )
    text = Path(spec.path).read_text()
    return rewrite(text, name, f"{spec.display_name} (calibrated)", figures)

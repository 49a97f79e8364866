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

The fit sets the three figures the realistic mode reads for every kernel: the launch time
per kernel (``launch_overhead_s``) and the shares of the HBM bandwidth and of the tensor
peak the kernels reach (``achievable_hbm_fraction``, ``achievable_tensor_fraction``). The
step's kernels are planned once and timed in the realistic mode with candidate figures, and
the figures kept are those whose times best match the profiled ones: the least sum of
``|log(predicted / measured)|`` (Huber's loss, squared below 5%: P. J. Huber, "Robust
estimation of a location parameter", Ann. Math. Statist. 35, 1964) (a ratio's error, so
small kernels weigh as much as large ones and a kernel predicted 3x too slow as much as one
3x too fast; a sum of absolute values, so a few kernels the figures cannot explain do not
drag the rest), by coordinate descent on the figures' logarithms (a coarse grid, then
golden-section search). The first guess is two straight lines: each kernel bound by HBM
taken to run in ``L + t0 / f_hbm`` and each bound by the tensor units in ``L + t0 /
f_tensor``, with ``t0`` its realistic time at both fractions 1 and no launch. A fraction
with too few kernels bound by it keeps the file's value. Fused attention counts in the
match but not as a tensor-bound kernel: the realistic mode times it at its own measured
share of the peak where the file lists one. A runtime profile's launch time, where an
estimate names one (``--runtime``), replaces the file's.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from torchroof.config import PricingOptions
from torchroof.hardware import HardwareSpec
from torchroof.hardware.toml_checks import Figure
from torchroof.pricing.price import plan_kernels, time_kernels
from torchroof.progress import silenced
from torchroof.records.trace import Trace
from torchroof.report.estimate import KernelEstimate
from torchroof.validation.calibrated_files import Fitted, checked, rewrite
from torchroof.validation.profiling import align, normalise
from torchroof.validation.search import minimum

HUBER = 0.05
"""Below this log ratio (about 5%) a kernel's error counts squared, above it linearly."""

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
    memory_kernels: int  # matched kernels bound by HBM
    tensor_kernels: int  # ... and by the tensor units
    launch_s: float | None
    hbm_fraction: float | None
    tensor_fraction: float | None
    notes: tuple[str, ...]
    middle: tuple[float, float] = (1.0, 1.0)  # fitted / measured: its quartiles over the kernels

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
            f"fitted / measured kernel time: middle half {self.middle[0]:.2f}-{self.middle[1]:.2f}",
            *(f"note: {n}" for n in self.notes),
        ]


def unit_spec(spec: HardwareSpec) -> HardwareSpec:
    """``spec`` with both achievable fractions at 1 (the first guess's reference times;
    priced with ``launch=False``)."""
    one = Figure(1.0, "the fit's reference")
    return replace(spec, achievable_hbm_fraction=one, achievable_tensor_fraction=one)


def with_figures(spec: HardwareSpec, launch_s: float, hbm: float, tensor: float) -> HardwareSpec:
    """``spec`` with the three figures the fit sets."""
    return replace(
        spec,
        launch_overhead_s=Figure(launch_s, "fitted"),
        achievable_hbm_fraction=Figure(hbm, "fitted"),
        achievable_tensor_fraction=Figure(tensor, "fitted"),
    )


KernelTimes = Callable[[float, float, float], list[float]]
"""Every kernel's realistic time with the launch, HBM fraction and tensor fraction given."""


def kernel_timer(trace: Trace, spec: HardwareSpec) -> tuple[list[KernelEstimate], KernelTimes]:
    """The step's eager kernels timed on :func:`unit_spec` without launches (the first
    guess's reference), and a function that times them all again with other figures (the
    kernels are planned once; only their times are made again)."""
    pricing = PricingOptions(mode="realistic", fusion="eager")
    plan = plan_kernels(trace, pricing)
    unit, *_ = time_kernels(
        plan.kernels, plan.roles, unit_spec(spec), None, replace(pricing, launch=False)
    )

    def times(launch_s: float, hbm: float, tensor: float) -> list[float]:
        changed = with_figures(spec, launch_s, hbm, tensor)
        with silenced():  # one timing of hundreds in the fit's stage
            timed, *_ = time_kernels(plan.kernels, plan.roles, changed, None, pricing)
        return [k.time_s for k in timed]

    return unit, times


def _tensor_bound(kernel: KernelEstimate) -> bool:
    attention = normalise(kernel.name).startswith("sdpa")
    return kernel.unit == "tensor" and kernel.bound == "compute" and not attention


def _first_guess(
    kernels: list[KernelEstimate], times: list[float | None]
) -> tuple[Line | None, Line | None, tuple[int, int]]:
    """Lines through (t0, measured) for the HBM-bound and the tensor-bound kernels, and how
    many matched kernels each holds."""
    memory: tuple[list[float], list[float]] = ([], [])
    tensor: tuple[list[float], list[float]] = ([], [])
    for kernel, t in zip(kernels, times, strict=True):
        if t is None or t <= 0 or kernel.communication:
            continue
        chosen = tensor if _tensor_bound(kernel) else memory if kernel.bound == "memory" else None
        if chosen is not None:
            chosen[0].append(kernel.time_s)
            chosen[1].append(t)
    return fit_line(*memory), fit_line(*tensor), (len(memory[0]), len(tensor[0]))


def _huber(off: np.ndarray) -> float:
    """Huber's loss of the log ratios: squared below :data:`HUBER`, linear above."""
    off = np.abs(off)
    return float(np.sum(np.where(off < HUBER, off**2 / (2 * HUBER), off - HUBER / 2)))


def _refined(
    start: list[float],
    free: list[bool],
    times: Callable[[float, float], np.ndarray],
    measured: np.ndarray,
    rounds: int = 6,
) -> list[float]:
    """(launch, HBM fraction, tensor fraction) of least loss. The launch adds to every
    kernel's time, so for each pair of fractions (``times`` at no launch) the best launch is
    a one-dimensional search; the free fractions are searched in turn on their logarithms."""

    def best_launch(base: np.ndarray) -> tuple[float, float]:
        def loss(log_launch: float) -> float:
            return _huber(np.log((base + math.exp(log_launch)) / measured))

        # the range a hardware file's launch may take: 10 ns to 1 ms
        launch = math.exp(minimum(loss, math.log(1e-8), math.log(1e-3)))
        return launch, loss(math.log(launch))

    fractions = list(start[1:])
    for _ in range(rounds if any(free[1:]) else 0):
        before = list(fractions)
        for i in (0, 1):
            if not free[i + 1]:
                continue

            def loss(log_value: float, i: int = i) -> float:
                trial = list(fractions)
                trial[i] = math.exp(log_value)
                return best_launch(times(*trial))[1]

            fractions[i] = math.exp(minimum(loss, math.log(1e-5), 0.0))
        if all(abs(f / b - 1) < 1e-5 for f, b in zip(fractions, before, strict=True)):
            break  # settled
    launch, _ = best_launch(times(*fractions))
    return [launch, *fractions]


def fit_profile(
    kernels: list[KernelEstimate],
    measured: list[tuple[str, float]],
    times: KernelTimes,
    spec: HardwareSpec,
) -> ProfileFit:
    """The launch time and achievable fractions of ``spec`` whose realistic kernel times
    (``times``) best match ``measured`` (the profiled ops), in log ratio, over the
    kernels matched to them in order; ``kernels`` are the first guess's references
    (:func:`kernel_timer`). A fraction with fewer than :data:`MIN_KERNELS` kernels bound by
    it keeps the file's value."""
    matched_times, _ = align(kernels, measured)
    pairs = [(i, t) for i, t in enumerate(matched_times) if t is not None and t > 0]
    if not pairs:
        raise ProfileError(
            "no profiled op matched a predicted kernel: profile the same step (model, regime, "
            "batch and length) that is traced here, run eagerly"
        )
    notes = []
    if len(measured) > 1.5 * len(kernels):
        notes.append(
            f"the profile holds {len(measured)} ops for the {len(kernels)} kernels of one "
            "step: only those matching in order were used (profile one step)"
        )
    memory, tensor, counts = _first_guess(kernels, matched_times)
    kept = [
        spec.launch_overhead_s.value if spec.launch_overhead_s else 1e-6,
        spec.achievable_hbm_fraction.value if spec.achievable_hbm_fraction else 1.0,
        spec.achievable_tensor_fraction.value if spec.achievable_tensor_fraction else 1.0,
    ]
    start = [
        max(memory.intercept_s if memory else kept[0], 1e-9),
        min(1.0 / memory.slope, 1.0) if memory else kept[1],
        min(1.0 / tensor.slope, 1.0) if tensor else kept[2],
    ]
    free = [True, counts[0] >= MIN_KERNELS, counts[1] >= MIN_KERNELS]
    for is_free, what in zip(free[1:], ("HBM", "tensor"), strict=True):
        if not is_free:
            notes.append(
                f"fewer than {MIN_KERNELS} {what}-bound kernels matched: its fraction is kept"
            )
    index, measured_s = [i for i, _ in pairs], np.array([t for _, t in pairs])

    def unlaunched(hbm: float, tensor: float) -> np.ndarray:
        return np.array(times(0.0, hbm, tensor))[index]

    launch, hbm, tensor_fraction = _refined(start, free, unlaunched, measured_s)
    for value, what, is_free in ((hbm, "HBM", free[1]), (tensor_fraction, "tensor", free[2])):
        if is_free and value >= 0.999:
            notes.append(f"the {what}-bound kernels reach the file's whole peak: capped at 1")
        elif is_free and value <= 1.001e-5:
            notes.append(f"the {what} fraction reached the search's floor (1e-5): check the match")
    if not 1.001e-8 < launch < 0.999e-3:
        notes.append(
            f"the launch time reached the search's limit ({launch:.0e} s): check the match"
        )
    ratios = np.array(times(launch, hbm, tensor_fraction))[index] / measured_s
    q1, q3 = np.percentile(ratios, [25, 75])
    return ProfileFit(
        len(pairs),
        len(measured),
        len(kernels),
        counts[0],
        counts[1],
        launch,
        hbm if free[1] else None,
        tensor_fraction if free[2] else None,
        tuple(notes),
        (float(q1), float(q3)),
    )


def calibrated_accelerator(spec: HardwareSpec, fitted: ProfileFit, name: str, source: str) -> str:
    """The accelerator's TOML with the fitted figures (those not fitted keep their line)."""
    figures: dict[tuple[str, str], Fitted] = {}
    how = (
        f"{source}: the realistic mode's times of {fitted.matched} matched kernels fitted to "
        "the profile (least Huber loss of log predicted / measured)"
    )
    for key, value in (
        ("launch_overhead_s", fitted.launch_s),
        ("achievable_hbm_fraction", fitted.hbm_fraction),
        ("achievable_tensor_fraction", fitted.tensor_fraction),
    ):
        if value is not None:
            figures[("", key)] = Fitted(value, how)
    text = rewrite(Path(spec.path).read_text(), name, f"{spec.display_name} (calibrated)", figures)
    return checked(text, figures, spec.path, cluster=False)

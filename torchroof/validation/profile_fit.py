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
peak the kernels reach (``achievable_hbm_fraction``, ``achievable_tensor_fraction``); and
one class's own efficiency, the share of the tensor peak the fused attention kernel
reaches, forward and backward (``[attention_tensor_fraction]``, under the name of the
kernel eager PyTorch's ``scaled_dot_product_attention`` runs on a GPU: the ``eager``
runtime profile's ``attention_kernel``, FlashAttention-2). The step's kernels are planned
once and timed in the realistic mode with candidate figures, and
the figures kept are those whose times best match the profiled ones: the least sum of
``|log(predicted / measured)|`` (Huber's loss, squared below 5%: P. J. Huber, "Robust
estimation of a location parameter", Ann. Math. Statist. 35, 1964) (a ratio's error, so
small kernels weigh as much as large ones and a kernel predicted 3x too slow as much as one
3x too fast; a sum of absolute values, so a few kernels the figures cannot explain do not
drag the rest), by coordinate descent on the figures' logarithms (a coarse grid, then
golden-section search). The first guess is two straight lines: each kernel bound by HBM
taken to run in ``L + t0 / f_hbm`` and each bound by the tensor units in ``L + t0 /
f_tensor``, with ``t0`` its realistic time at both fractions 1 and no launch. A fraction
with too few kernels bound by it keeps the file's value. Fused attention is timed at its
own share of the peak, not the tensor fraction: its first guess is a third line, through
the attention kernels of each direction timed at share 1. An estimate reads the attention
share only where its runtime launches that kernel (``--runtime eager``, ``hf-trainer``,
``torchtune``, ``deepspeed``: FlashAttention-2); a runtime profile's launch time, where an
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
from torchroof.hardware.runtime import get_runtime
from torchroof.hardware.toml_checks import Figure
from torchroof.pricing.price import plan_kernels, time_kernels
from torchroof.progress import silenced
from torchroof.records.trace import Trace
from torchroof.report.estimate import KernelEstimate
from torchroof.timing.runtime import StepRuntime
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


def _events(path: str | Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ProfileError(f"{path}: not a readable Chrome trace JSON: {error}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError(f"{path}: no traceEvents list (export with prof.export_chrome_trace)")
    return events


def _device_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in device]


@dataclass(frozen=True)
class DeviceIdle:
    """A GPU trace's time from its first kernel's start to its last kernel's end, and the
    part of it no kernel ran (seconds): the GPU waiting on the host."""

    span_s: float
    idle_s: float

    def line(self) -> str:
        share = self.idle_s / self.span_s if self.span_s else 0.0
        return (
            f"GPU idle between kernels: {self.idle_s * 1e3:.3f} ms of the "
            f"{self.span_s * 1e3:.3f} ms from the first kernel to the last ({share:.0%}): time "
            "the GPU waited on the host, which the fitted per-kernel figures do not hold (a "
            "runtime profile's host_overhead_s per step is where it goes)"
        )


def device_idle(path: str | Path) -> DeviceIdle | None:
    """How long a GPU trace's device sat idle between its first and last kernel (the union
    of the kernels' intervals over every stream taken from the span); None for a CPU trace
    or a CSV."""
    if str(path).endswith(".csv"):
        return None
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _device_events(_events(path))
    )
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    last = max(stop for _, stop in spans)
    for begin, stop in spans[1:]:
        if begin > end:  # a gap: the merged run so far is done
            busy += end - start
            start, end = begin, stop
        else:
            end = max(end, stop)
    busy += end - start
    span = last - spans[0][0]
    return DeviceIdle(span * 1e-6, (span - busy) * 1e-6)


def chrome_trace_ops(path: str | Path, names: set[str]) -> list[tuple[str, float]]:
    """The top-most profiled ops whose op torchroof prices as a kernel (``names``,
    normalised), in start order, each with its time in seconds: its kernels' device time on
    a GPU trace, its own time on a CPU one."""
    events = _events(path)
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
    kernels = _device_events(events)
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


DIRECTIONS = ("forward", "backward")


def eager_attention_kernel() -> str:
    """The fused attention kernel an eager PyTorch step runs on a GPU: the ``eager`` runtime
    profile's ``attention_kernel`` (``scaled_dot_product_attention``'s flash backend)."""
    return str(get_runtime("eager").setting("attention_kernel"))


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
    attention_kernel: str = ""  # the fused attention kernel whose shares were fitted
    attention: tuple[float | None, float | None] = (None, None)  # its share, per direction
    attention_kernels: tuple[int, int] = (0, 0)  # matched compute-bound ones, per direction

    def lines(self) -> list[str]:
        def show(value: float | None, text: str) -> str:
            return text.format(value) if value is not None else "not fitted"

        attention = [
            f"fused attention ({self.attention_kernel}) {direction} share of the tensor peak: "
            f"{show(share, '{:.3f}')} ({count} compute-bound kernels matched)"
            for direction, share, count in zip(
                DIRECTIONS, self.attention, self.attention_kernels, strict=True
            )
            if count
        ]
        return [
            f"matched {self.matched} of {self.predicted} predicted kernels to {self.profiled} "
            f"profiled ops: {self.memory_kernels} memory-bound, {self.tensor_kernels} bound by "
            "the tensor units",
            f"launch per kernel: {show(self.launch_s and self.launch_s * 1e6, '{:.2f} us')}",
            f"achievable HBM fraction: {show(self.hbm_fraction, '{:.3f}')}",
            f"achievable tensor fraction: {show(self.tensor_fraction, '{:.3f}')}",
            *attention,
            f"fitted / measured kernel time: middle half {self.middle[0]:.2f}-{self.middle[1]:.2f}",
            *(f"note: {n}" for n in self.notes),
        ]


Shares = tuple[float | None, float | None]
"""The fused attention kernel's share of the tensor peak, forward and backward (None: the
file's)."""


def _with_shares(spec: HardwareSpec, kernel: str, shares: Shares, source: str) -> HardwareSpec:
    held = dict(spec.attention_tensor_fraction)
    for direction, share in zip(DIRECTIONS, shares, strict=True):
        if share is not None:
            held[f"{kernel}_{direction}"] = Figure(share, source)
    return replace(spec, attention_tensor_fraction=held)


def unit_spec(spec: HardwareSpec, kernel: str = "") -> HardwareSpec:
    """``spec`` with both achievable fractions at 1, and ``kernel``'s attention shares (the
    first guess's reference times; priced with ``launch=False``)."""
    one = Figure(1.0, "the fit's reference")
    unit = replace(spec, achievable_hbm_fraction=one, achievable_tensor_fraction=one)
    return _with_shares(unit, kernel, (1.0, 1.0), "the fit's reference") if kernel else unit


def with_figures(
    spec: HardwareSpec,
    launch_s: float,
    hbm: float,
    tensor: float,
    kernel: str = "",
    shares: Shares = (None, None),
) -> HardwareSpec:
    """``spec`` with the figures the fit sets (an attention share of None: the file's)."""
    changed = replace(
        spec,
        launch_overhead_s=Figure(launch_s, "fitted"),
        achievable_hbm_fraction=Figure(hbm, "fitted"),
        achievable_tensor_fraction=Figure(tensor, "fitted"),
    )
    return _with_shares(changed, kernel, shares, "fitted")


KernelTimes = Callable[..., list[float]]
"""Every kernel's realistic time with the launch, HBM fraction and tensor fraction given,
and optionally the attention kernel's shares forward and backward (None: the file's)."""


def kernel_timer(trace: Trace, spec: HardwareSpec) -> tuple[list[KernelEstimate], KernelTimes]:
    """The step's eager kernels timed on :func:`unit_spec` without launches (the first
    guess's reference), and a function that times them all again with other figures (the
    kernels are planned once; only their times are made again). Fused attention is timed
    as :func:`eager_attention_kernel`, at its share of the peak where the file lists one."""
    pricing = PricingOptions(mode="realistic", fusion="eager")
    plan = plan_kernels(trace, pricing)
    kernel = eager_attention_kernel()
    runtime = StepRuntime(attention_kernel=kernel)  # nothing else: the file's figures
    unit, *_ = time_kernels(
        plan.kernels,
        plan.roles,
        unit_spec(spec, kernel),
        None,
        replace(pricing, launch=False),
        runtime,
    )

    def times(
        launch_s: float,
        hbm: float,
        tensor: float,
        forward: float | None = None,
        backward: float | None = None,
    ) -> list[float]:
        changed = with_figures(spec, launch_s, hbm, tensor, kernel, (forward, backward))
        with silenced():  # one timing of hundreds in the fit's stage
            timed, *_ = time_kernels(plan.kernels, plan.roles, changed, None, pricing, runtime)
        return [k.time_s for k in timed]

    return unit, times


def _attention(kernel: KernelEstimate) -> int | None:
    """0 for a fused attention kernel forward, 1 backward, else None."""
    name = normalise(kernel.name)
    return {"sdpa": 0, "sdpa_backward": 1}.get(name)


def _tensor_bound(kernel: KernelEstimate) -> bool:
    return kernel.unit == "tensor" and kernel.bound == "compute" and _attention(kernel) is None


def _first_guess(
    kernels: list[KernelEstimate], times: list[float | None]
) -> tuple[list[Line | None], list[int]]:
    """Lines through (t0, measured) for the HBM-bound kernels, the tensor-bound ones, and
    the compute-bound fused attention forward and backward, and how many matched kernels
    each holds."""
    classes: list[tuple[list[float], list[float]]] = [([], []) for _ in range(4)]
    for kernel, t in zip(kernels, times, strict=True):
        if t is None or t <= 0 or kernel.communication:
            continue
        direction = _attention(kernel)
        if direction is not None and kernel.bound == "compute":
            chosen: int | None = 2 + direction
        else:
            chosen = 1 if _tensor_bound(kernel) else 0 if kernel.bound == "memory" else None
        if chosen is not None:
            classes[chosen][0].append(kernel.time_s)
            classes[chosen][1].append(t)
    return [fit_line(*c) for c in classes], [len(c[0]) for c in classes]


def _huber(off: np.ndarray) -> float:
    """Huber's loss of the log ratios: squared below :data:`HUBER`, linear above."""
    off = np.abs(off)
    return float(np.sum(np.where(off < HUBER, off**2 / (2 * HUBER), off - HUBER / 2)))


def _refined(
    start: list[float | None],
    free: list[bool],
    times: Callable[..., np.ndarray],
    measured: np.ndarray,
    rounds: int = 6,
) -> list[float | None]:
    """(launch, HBM fraction, tensor fraction, attention shares forward and backward) of
    least loss. The launch adds to every kernel's time, so for each set of fractions
    (``times`` at no launch) the best launch is a one-dimensional search; the free
    fractions are searched in turn on their logarithms (the others stay as given)."""

    def best_launch(base: np.ndarray) -> tuple[float, float]:
        def loss(log_launch: float) -> float:
            return _huber(np.log((base + math.exp(log_launch)) / measured))

        # the range a hardware file's launch may take: 10 ns to 1 ms
        launch = math.exp(minimum(loss, math.log(1e-8), math.log(1e-3)))
        return launch, loss(math.log(launch))

    fractions = list(start[1:])
    searched = [i for i, is_free in enumerate(free[1:]) if is_free]
    for _ in range(rounds if searched else 0):
        before = list(fractions)
        for i in searched:

            def loss(log_value: float, i: int = i) -> float:
                trial = list(fractions)
                trial[i] = math.exp(log_value)
                return best_launch(times(*trial))[1]

            fractions[i] = math.exp(minimum(loss, math.log(1e-5), 0.0))
        if all(abs(fractions[i] / before[i] - 1) < 1e-5 for i in searched):  # type: ignore[operator]
            break  # settled
    launch, _ = best_launch(times(*fractions))
    return [launch, *fractions]


FIGURES = ("HBM", "tensor", "forward attention", "backward attention")


def _notes(
    measured: int, predicted: int, counts: list[int], free: list[bool], fitted: list[float | None]
) -> list[str]:
    """What the fit could not do, or did only at a search's limit."""
    notes = []
    if measured > 1.5 * predicted:
        notes.append(
            f"the profile holds {measured} ops for the {predicted} kernels of one "
            "step: only those matching in order were used (profile one step)"
        )
    for count, is_free, what in zip(counts, free[1:], FIGURES, strict=True):
        attention = what.endswith("attention")
        if not is_free and (count or not attention):  # no attention at all is no news
            kept = "the file's share" if attention else "its fraction"
            notes.append(f"fewer than {MIN_KERNELS} {what}-bound kernels matched: {kept} is kept")
    for value, what, is_free in zip(fitted[1:], FIGURES, free[1:], strict=True):
        if is_free and value is not None and value >= 0.999:
            notes.append(f"the {what}-bound kernels reach the file's whole peak: capped at 1")
        elif is_free and value is not None and value <= 1.001e-5:
            notes.append(f"the {what} fraction reached the search's floor (1e-5): check the match")
    launch = fitted[0]
    if launch is not None and not 1.001e-8 < launch < 0.999e-3:
        notes.append(
            f"the launch time reached the search's limit ({launch:.0e} s): check the match"
        )
    return notes


def fit_profile(
    kernels: list[KernelEstimate],
    measured: list[tuple[str, float]],
    times: KernelTimes,
    spec: HardwareSpec,
) -> ProfileFit:
    """The launch time, achievable fractions and fused attention shares of ``spec`` whose
    realistic kernel times (``times``) best match ``measured`` (the profiled ops), in log
    ratio, over the kernels matched to them in order; ``kernels`` are the first guess's
    references (:func:`kernel_timer`). A figure with fewer than :data:`MIN_KERNELS`
    kernels bound by it keeps the file's value."""
    matched_times, _ = align(kernels, measured)
    pairs = [(i, t) for i, t in enumerate(matched_times) if t is not None and t > 0]
    if not pairs:
        raise ProfileError(
            "no profiled op matched a predicted kernel: profile the same step (model, regime, "
            "batch and length) that is traced here, run eagerly"
        )
    lines, counts = _first_guess(kernels, matched_times)
    kernel = eager_attention_kernel()
    kept_launch = spec.launch_overhead_s.value if spec.launch_overhead_s else 1e-6
    kept: list[float | None] = [
        spec.achievable_hbm_fraction.value if spec.achievable_hbm_fraction else 1.0,
        spec.achievable_tensor_fraction.value if spec.achievable_tensor_fraction else 1.0,
        *(spec.attention_share(kernel, backward) for backward in (False, True)),
    ]
    start: list[float | None] = [max(lines[0].intercept_s if lines[0] else kept_launch, 1e-9)]
    start += [min(1 / line.slope, 1.0) if line else k for line, k in zip(lines, kept, strict=True)]
    free = [True, *(count >= MIN_KERNELS for count in counts)]
    start = [
        1.0 if value is None and is_free else value
        for value, is_free in zip(start, free, strict=True)
    ]
    index, measured_s = [i for i, _ in pairs], np.array([t for _, t in pairs])

    def unlaunched(*fractions: float | None) -> np.ndarray:
        return np.array(times(0.0, *fractions))[index]

    fitted = _refined(start, free, unlaunched, measured_s)
    ratios = np.array(times(*fitted))[index] / measured_s
    q1, q3 = np.percentile(ratios, [25, 75])
    launch, hbm, tensor_fraction, forward, backward = fitted
    return ProfileFit(
        len(pairs),
        len(measured),
        len(kernels),
        counts[0],
        counts[1],
        launch,
        hbm if free[1] else None,
        tensor_fraction if free[2] else None,
        tuple(_notes(len(measured), len(kernels), counts, free, fitted)),
        (float(q1), float(q3)),
        kernel,
        (forward if free[3] else None, backward if free[4] else None),
        (counts[2], counts[3]),
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
    for direction, share in zip(DIRECTIONS, fitted.attention, strict=True):
        if share is not None:
            key = f"{fitted.attention_kernel}_{direction}"
            figures[("attention_tensor_fraction", key)] = Fitted(share, how)
    text = rewrite(Path(spec.path).read_text(), name, f"{spec.display_name} (calibrated)", figures)
    return checked(text, figures, spec.path, cluster=False)

"""An accelerator file fitted to the user's own profile of a real step: the bandwidth and
tensor rate its kernels reach, the fixed time each kernel costs, and the fused attention
kernel's own share of the peak.

The profile's ops (:mod:`torchroof.validation.profile_files`) are matched to torchroof's
predicted kernels of the same step, in order, the way ``torchroof validate`` matches them
(:func:`torchroof.validation.profiling.align`).

The fit sets the three figures the realistic mode reads for every kernel: the launch time
per kernel (written as ``launch_overhead_s`` and as ``eager_launch_s``, which an estimate
under a runtime takes for its eager launches in place of the runtime's figure, measured on
another machine) and the shares of the HBM bandwidth and of the tensor peak the kernels
reach (``achievable_hbm_fraction``, ``achievable_tensor_fraction``); and one class's own
efficiency, the share of the tensor peak the fused attention kernel reaches, forward and
backward (``[attention_tensor_fraction]``, under the name of the kernel eager PyTorch's
``scaled_dot_product_attention`` runs on a GPU in fp16 and bf16: the ``eager`` runtime
profile's ``attention_kernel``, FlashAttention-2). The step's kernels are planned once and
timed as an estimate under ``--runtime eager`` times them, with candidate figures, and the
figures kept are those whose times best match the profiled ones: the least sum of
``|log(predicted / measured)|`` (Huber's loss, squared below 5%: P. J. Huber, "Robust
estimation of a location parameter", Ann. Math. Statist. 35, 1964) (a ratio's error, so
small kernels weigh as much as large ones and a kernel predicted 3x too slow as much as one
3x too fast; a sum of absolute values, so a few kernels the figures cannot explain do not
drag the rest), by coordinate descent on the figures' logarithms (a coarse grid, then
golden-section search). The first guess is straight lines: each kernel bound by HBM taken
to run in ``L + t0 / f_hbm``, each bound by the tensor units in ``L + t0 / f_tensor``, and
each compute-bound fused attention kernel in ``L + t0 / share``, with ``t0`` its realistic
time at fractions and shares 1 and no launch. A figure with too few kernels bound by it
keeps the file's value. An estimate reads the attention shares only where its runtime
launches that kernel (``--runtime eager``, ``hf-trainer``, ``torchtune``, ``deepspeed``:
FlashAttention-2); without a runtime, realistic mode times attention at the tensor
fraction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from torchroof.config import PricingOptions
from torchroof.hardware import HardwareSpec
from torchroof.hardware.runtime import get_runtime
from torchroof.hardware.toml_checks import Figure
from torchroof.pricing.price import plan_kernels, time_kernels
from torchroof.pricing.runtime import timing_of
from torchroof.progress import silenced
from torchroof.records.trace import Trace
from torchroof.report.estimate import KernelEstimate
from torchroof.validation.calibrated_files import Fitted, checked, rewrite
from torchroof.validation.profile_files import ProfileError
from torchroof.validation.profiling import align, normalise
from torchroof.validation.search import minimum

HUBER = 0.05
"""Below this log ratio (about 5%) a kernel's error counts squared, above it linearly."""

MIN_KERNELS = 3
"""The fewest matched kernels of a class that a fraction is fitted from."""


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


EAGER = "eager"
"""The runtime profile of an eager PyTorch step, what a profile fitted here ran."""


def eager_attention_kernel() -> str:
    """The fused attention kernel an eager PyTorch step runs on a GPU: the ``eager`` runtime
    profile's ``attention_kernel`` (``scaled_dot_product_attention``'s flash backend)."""
    return str(get_runtime(EAGER).setting("attention_kernel"))


SHARE_DTYPES = ("float16", "bfloat16")
"""The dtypes FlashAttention runs (Dao, "FlashAttention-2", 2023: fp16 and bf16): fused
attention in another (fp32, on the memory-efficient kernel) fits no share of it."""


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
    """``spec`` with the figures the fit sets: the launch as both ``launch_overhead_s`` and
    ``eager_launch_s`` (an estimate under a runtime launching eagerly takes it in place of
    the runtime's), the fractions, and ``kernel``'s shares (None: the file's)."""
    changed = replace(
        spec,
        launch_overhead_s=Figure(launch_s, "fitted"),
        eager_launch_s=Figure(launch_s, "fitted"),
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
    kernels are planned once; only their times are made again), each as an estimate under
    ``--runtime eager`` on the file with those figures times it: fused attention as the
    runtime's kernel, at its share of the peak where the file lists one, and every launch
    the file's ``eager_launch_s``, which the fit sets with the launch."""
    pricing = PricingOptions(mode="realistic", fusion="eager")
    plan = plan_kernels(trace, pricing)
    runtime = timing_of(replace(pricing, runtime=EAGER), None)  # as --runtime eager times it
    kernel = runtime.attention_kernel
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
    the compute-bound fused attention forward and backward in fp16 or bf16, and how many
    matched kernels each holds."""
    classes: list[tuple[list[float], list[float]]] = [([], []) for _ in range(4)]
    for kernel, t in zip(kernels, times, strict=True):
        if t is None or t <= 0 or kernel.communication:
            continue
        direction = _attention(kernel)
        if direction is not None and kernel.bound == "compute":
            # a share of FlashAttention's is fitted only from kernels it runs
            chosen: int | None = 2 + direction if kernel.dtype in SHARE_DTYPES else None
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
    measured: int,
    predicted: int,
    counts: list[int],
    free: list[bool],
    fitted: list[float | None],
    kept_shares: list[float | None],
) -> list[str]:
    """What the fit could not do, or did only at a search's limit."""
    notes = []
    if measured > 1.5 * predicted:
        notes.append(
            f"the profile holds {measured} ops for the {predicted} kernels of one "
            "step: only those matching in order were used (profile one step)"
        )
    for i, (count, is_free, what) in enumerate(zip(counts, free[1:], FIGURES, strict=True)):
        if is_free:
            continue
        if i < 2:
            notes.append(
                f"fewer than {MIN_KERNELS} {what}-bound kernels matched: its fraction is kept"
            )
        elif count:  # no attention at all is no news
            kept = (
                "the file's share is kept"
                if kept_shares[i - 2] is not None
                else "the file lists no share: such attention is timed at the tensor fraction"
            )
            notes.append(
                f"fewer than {MIN_KERNELS} compute-bound {what} kernels in fp16 or bf16 "
                f"matched: {kept}"
            )
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
    notes = _notes(len(measured), len(kernels), counts, free, fitted, kept[2:])
    other = {k.dtype for k, t in zip(kernels, matched_times, strict=True) if t and _attention(k)
             is not None and k.bound == "compute" and k.dtype not in SHARE_DTYPES}  # fmt: skip
    if other:
        notes.append(
            f"fused attention in {', '.join(sorted(other))} fits no share: FlashAttention runs "
            "fp16 and bf16 only (PyTorch runs other dtypes on another kernel)"
        )
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
        tuple(notes),
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
        ("eager_launch_s", fitted.launch_s),
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

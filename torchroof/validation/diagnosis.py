"""Roofline diagnosis: why a kernel measured slower than its prediction.

The questions, in order (the ceilings of Williams, Waterman & Patterson 2009, read with the
NVIDIA Nsight Compute Profiling Guide's counters): are the tensor cores being used at all; is
HBM actually saturated (against STREAM on the same machine, not the spec sheet); is there
enough parallel work in flight (Little's law, docs/concepts/littles-law.md); are the kernels
too small; is reuse happening where assumed; is the work quantised badly. The order is
deliberate: each question is cheaper to check than the next, and each can fully explain a
result. Each question here is answered from what was measured for the kernel —
its time t, W and Q and the waves and bytes in flight of its prediction, the STREAM
bandwidth and launch overhead calibrated on the machine — and says whether it explains the
gap: whether the time it accounts for reaches the measured time. What a machine cannot
answer (no latency figure, no hardware byte counters) is said, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchroof.hardware import HardwareSpec
from torchroof.report.estimate import KernelEstimate
from torchroof.timing.roofline import LATENCY_LABEL_SHARE

# A prediction within 80% of the measured time is at the roof; a question explains the gap
# when the time it accounts for reaches 80% of the measured time: a kernel at 80% of STREAM
# is saturated (coalesced streaming typically lands near 85% of published beta, a typical
# measured figure, and STREAM itself is such a stream). A prediction more than 1 / 0.8 = 1.25x the
# measured time is above the roof: the kernel ran faster than its floor, so its W, its Q or
# the ceiling it was priced on is wrong for it.
REACHED = 0.8
ABOVE = 1 / REACHED
# Compute ceilings (Williams et al. 2009): a matmul is called off its MMA pipe only when the line
# it was priced on is at least this many times the vector line it ran at, so timing noise
# between two nearby lines is never read as the wrong pipe.
PIPE_MARGIN = 2.0
# Are the kernels too small? Any kernel with a predicted time under ~20 us is partly
# measuring its own launch; so is one predicted at a few launches.
SMALL_KERNEL_S = 20e-6
SMALL_LAUNCHES = 5
# Wave quantisation (NVIDIA, Matrix Multiplication Background): a grid whose waves keep the
# SMs less than this busy is flagged (two waves of 140 tiles on 132 SMs: 53%).
WAVE_EFFICIENCY_FLAG = 0.75
NEEDS_COUNTERS = "not measured (needs dram__bytes from ncu)"


# --- numbers as text ---------------------------------------------------------------------


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _rate(value: float, unit: str) -> str:
    if value >= 1e12:
        return f"{value / 1e12:.3g} T{unit}/s"
    return f"{value / 1e9:.3g} G{unit}/s"


def _bytes(count: float) -> str:
    if count >= 1e6:
        return f"{count / 1e6:.3g} MB"
    return f"{count / 1e3:.3g} KB"


# --- diagnosis -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    """One of the diagnosis questions: what it is called, and what its answer is called when it
    explains the gap."""

    topic: str
    text: str
    finding: str


# The questions, in order
QUESTIONS = (
    Question("pipe", "Are the tensor cores being used at all?", "wrong pipe"),
    Question("hbm", "Is HBM actually saturated?", "HBM saturated"),
    Question("in flight", "Is there enough parallel work in flight?", "too little in flight"),
    Question("size", "Are the kernels too small?", "too small"),
    Question("reuse", "Is reuse happening where you assumed?", "re-reads"),
    Question("waves", "Is the work quantised badly?", "wave quantisation"),
)
# every label a diagnosis can carry, in the order a summary counts them
LABELS = ("at the roof", "above the roof", *(q.finding for q in QUESTIONS), "unexplained")


@dataclass(frozen=True)
class Answer:
    """One question answered for one kernel; ``known`` is False where this machine or its
    files cannot answer it (no latency figure, no hardware counters)."""

    question: str
    answer: str
    explains: bool
    known: bool = True


@dataclass(frozen=True)
class MachineFigures:
    """What a kernel is diagnosed against: the spec it was priced on, and what was measured
    on the machine that ran it (None / 0 where nothing was measured)."""

    spec: HardwareSpec
    copy_bytes_per_s: float | None = None  # STREAM copy, measured here
    triad_bytes_per_s: float | None = None  # STREAM triad, measured here
    launch_overhead_s: float = 0.0  # one kernel's launch, measured (else the spec's)
    # the smallest kernel (one element) as the profiler times it: the fixed cost (dispatch,
    # output allocation, the profiler's record) inside every profiled kernel time
    smallest_kernel_s: float = 0.0

    def stream(self) -> tuple[str, float] | None:
        """The better STREAM figure measured here and its name."""
        figures = [
            (name, value)
            for name, value in (("copy", self.copy_bytes_per_s), ("triad", self.triad_bytes_per_s))
            if value
        ]
        return max(figures, key=lambda item: item[1]) if figures else None

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """STREAM where measured, else the spec's beta."""
        stream = self.stream()
        return stream[1] if stream else self.spec.hbm_bytes_per_s.value


@dataclass(frozen=True)
class Diagnosis:
    """The six diagnosis questions answered for one kernel, in order."""

    predicted_s: float
    measured_s: float
    answers: tuple[Answer, ...]

    @property
    def ratio(self) -> float:
        """predicted / measured (1.0 = the roof is reached)."""
        return self.predicted_s / self.measured_s

    @property
    def at_roof(self) -> bool:
        """Within the 80% rule both ways: REACHED <= predicted / measured <= 1 / REACHED."""
        return REACHED <= self.ratio <= ABOVE

    @property
    def above_roof(self) -> bool:
        """Predicted more than 1.25x the measured time: faster than the floor."""
        return self.ratio > ABOVE

    @property
    def explained_by(self) -> int | None:
        """Index of the first question that explains the gap (None: none does, or no gap
        to explain: at or above the roof)."""
        if self.at_roof or self.above_roof:
            return None
        return next((i for i, a in enumerate(self.answers) if a.explains), None)

    @property
    def asked(self) -> tuple[Answer, ...]:
        """The questions asked before stopping: up to the first that explains the gap."""
        first = self.explained_by
        return self.answers if first is None else self.answers[: first + 1]

    @property
    def label(self) -> str:
        """A few words (one of :data:`LABELS`): ``at the roof``, ``above the roof``, a
        finding (``too small``) or ``unexplained``."""
        if self.at_roof:
            return "at the roof"
        if self.above_roof:
            return "above the roof"
        first = self.explained_by
        return QUESTIONS[first].finding if first is not None else "unexplained"

    @property
    def verdict(self) -> str:
        """One line: the label and why."""
        if self.at_roof:
            return f"at the roof: predicted / measured {self.ratio:.2f}"
        if self.above_roof:
            return (
                f"above the roof: predicted {self.ratio:.2f}x the measured time; W, Q or the "
                "ceiling is wrong for this kernel"
            )
        first = self.explained_by
        if first is not None:
            return f"{QUESTIONS[first].finding}: {self.answers[first].answer}"
        unknown = [q.topic for q, a in zip(QUESTIONS, self.answers, strict=True) if not a.known]
        tail = f" (not known here: {', '.join(unknown)})" if unknown else ""
        return f"unexplained: below both roofs at {self.ratio:.2f} of the prediction{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "verdict": self.verdict,
            "questions": [
                {
                    "topic": q.topic,
                    "question": a.question,
                    "answer": a.answer,
                    "explains": a.explains,
                    "known": a.known,
                }
                for q, a in zip(QUESTIONS, self.answers, strict=True)
            ],
        }


def _pipe(kernel: KernelEstimate, measured_s: float, machine: MachineFigures) -> Answer:
    """Compute ceilings (Williams et al. 2009): asked only of a matmul the prediction calls
    compute-bound (a memory-bound one's pipe does not set its time), against the fp32
    vector line only where that line is a figure of the file, not derived (the no-FMA
    half and a 1/4-of-elementwise SFU are not measured). It is on the wrong pipe when it
    was priced on an MMA line at least PIPE_MARGIN x that vector line, ran at no more than
    the vector line and within 80% of it, and its bytes do not hold it there."""
    question = QUESTIONS[0].text
    if not kernel.flops:
        return Answer(question, "no FLOPs to run on any pipe", False)
    rate = kernel.flops / measured_s
    priced = kernel.peak_flops_per_s
    if kernel.unit != "tensor":
        text = f"not a matmul ({kernel.unit} kernel): {_rate(rate, 'FLOP')} measured"
        if 0 < priced < math.inf:
            text += f", {rate / priced:.0%} of the {_rate(priced, 'FLOP')} it was priced on"
        return Answer(question, text, False)
    if kernel.bound != "compute":
        return Answer(
            question,
            f"not asked: predicted memory-bound (Q/beta {_time(kernel.memory_s)} >= W/pi "
            f"{_time(kernel.compute_s)}), so its pipe does not set its time",
            False,
        )
    figure = machine.spec.vector_flops_per_s.get("fp32")
    if figure is None or figure.approximate:
        return Answer(
            question,
            f"not measured: {_rate(rate, 'FLOP')} measured, but {machine.spec.name} has no "
            "measured fp32 vector line to compare it with (derived or absent)",
            False,
            known=False,
        )
    vector = figure.value
    if priced < PIPE_MARGIN * vector:
        return Answer(
            question,
            f"cannot tell: priced on {_rate(priced, 'FLOP')}, only {priced / vector:.1f}x the "
            f"fp32 vector line ({_rate(vector, 'FLOP')}), under the {PIPE_MARGIN:g}x a clear "
            f"call needs; {_rate(rate, 'FLOP')} measured",
            False,
        )
    where = f"{_rate(rate, 'FLOP')} measured, {rate / vector:.0%} of the fp32 vector (FMA) line"
    if rate > vector:
        return Answer(
            question,
            f"yes: {_rate(rate, 'FLOP')} measured, above the fp32 vector line "
            f"({_rate(vector, 'FLOP')})",
            False,
        )
    pipe_s = kernel.flops / vector
    memory_s = kernel.bytes / machine.bandwidth_bytes_per_s
    # on that line, and not held there by its bytes (then the next question answers it)
    if pipe_s >= REACHED * measured_s and memory_s < REACHED * measured_s:
        return Answer(
            question,
            f"no: {where}, a pipe without MMA, {priced / vector:.1f}x under the "
            f"{_rate(priced, 'FLOP')} it was priced on",
            True,
        )
    return Answer(question, f"not evidently: {where}, below it but not on it", False)


def _hbm(kernel: KernelEstimate, measured_s: float, machine: MachineFigures) -> Answer:
    """Q/t against STREAM measured on this machine, not against the spec sheet. Q is the
    analytic (compulsory) Q, so Q/t is a lower bound on the bandwidth reached."""
    question = QUESTIONS[1].text
    if not kernel.bytes:
        return Answer(question, "no bytes moved", False)
    reached = kernel.bytes / measured_s
    spec_bw = machine.spec.hbm_bytes_per_s.value
    of_spec = f"{reached / spec_bw:.0%} of the spec's {_rate(spec_bw, 'B')}"
    stream = machine.stream()
    if stream is None:
        text = f"not known: no STREAM figure measured (Q/t = {_rate(reached, 'B')}, {of_spec})"
        return Answer(question, text, False, known=False)
    name, value = stream
    share = reached / value
    text = f"Q/t = {_rate(reached, 'B')} is {share:.0%} of STREAM {name} ({_rate(value, 'B')}), "
    if share < REACHED:
        return Answer(question, f"no: {text}{of_spec}", False)
    cause = (
        "the gap is the spec's bandwidth over STREAM's, not the kernel"
        if value < spec_bw
        else "as fast as this machine streams"
    )
    return Answer(question, f"yes: {text}{of_spec}: {cause}", True)


def _in_flight(kernel: KernelEstimate, measured_s: float, machine: MachineFigures) -> Answer:
    """Little's law (Little 1961; Volkov 2016): bytes in flight against beta x latency; with
    fewer, the bytes move at C / latency."""
    question = QUESTIONS[2].text
    latency = machine.spec.memory_latency_s
    if latency is None:
        return Answer(
            question, f"not known: no memory_latency_s in {machine.spec.name}", False, False
        )
    if not kernel.bytes:
        return Answer(question, "no bytes moved", False)
    carried = kernel.in_flight_bytes
    if carried <= 0:
        return Answer(
            question, "not known: the prediction carries no bytes in flight", False, False
        )
    beta = machine.spec.hbm_bytes_per_s.value
    needed = beta * latency.value
    need = f"beta x latency = {_rate(beta, 'B')} x {latency.value * 1e9:.0f} ns = {_bytes(needed)}"
    if carried >= LATENCY_LABEL_SHARE * needed:
        return Answer(question, f"yes: {_bytes(carried)} in flight, {need}", False)
    shelf_s = kernel.bytes * latency.value / carried
    text = (
        f"no: {_bytes(carried)} in flight < {need}; at C / latency its {_bytes(kernel.bytes)} "
        f"take {_time(shelf_s)}, {shelf_s / measured_s:.0%} of the measured {_time(measured_s)}"
    )
    return Answer(question, text, shelf_s >= REACHED * measured_s)


def _too_small(kernel: KernelEstimate, measured_s: float, machine: MachineFigures) -> Answer:
    """Are the kernels too small? Predicted under ~20 us or a few launches. The
    launch explains the gap when predicted + launch reaches 80% of the measured time (the
    rule every question follows); a small kernel short of that is answered, not explained.
    The launch is the larger of the one measured and the smallest kernel as profiled (a
    profiled time carries that fixed cost too)."""
    question = QUESTIONS[3].text
    body_s = kernel.time_s - kernel.overhead_s  # the prediction without its launch
    launch_s = max(machine.launch_overhead_s, machine.smallest_kernel_s)
    what = "launch" if launch_s == machine.launch_overhead_s else "smallest profiled kernel"
    small = body_s < SMALL_KERNEL_S or body_s < SMALL_LAUNCHES * launch_s
    if not small:
        limit = max(SMALL_KERNEL_S, SMALL_LAUNCHES * launch_s)
        return Answer(question, f"no: predicted {_time(body_s)} >= {_time(limit)}", False)
    if not launch_s:
        text = f"small (predicted {_time(body_s)} < 20 us) but no launch overhead is known"
        return Answer(question, text, False, known=False)
    with_launch = body_s + launch_s
    text = (
        f"predicted {_time(body_s)} + {what} {_time(launch_s)} = {_time(with_launch)}, "
        f"{with_launch / measured_s:.0%} of the measured {_time(measured_s)}"
    )
    if with_launch >= REACHED * measured_s:
        return Answer(question, f"yes: {text}", True)
    return Answer(question, f"small, but {text}", False)


def _reuse(
    kernel: KernelEstimate,
    measured_s: float,
    machine: MachineFigures,
    measured_bytes: float | None,
) -> Answer:
    """Measured Q against analytic Q: re-reads explain the gap when the measured bytes at
    STREAM take the measured time. Only hardware counters measure Q; never guessed."""
    question = QUESTIONS[4].text
    if measured_bytes is None:
        return Answer(question, NEEDS_COUNTERS, False, known=False)
    beta = machine.bandwidth_bytes_per_s
    moved_s = measured_bytes / beta
    gap = measured_bytes / kernel.bytes if kernel.bytes else float("inf")
    text = (
        f"measured Q {_bytes(measured_bytes)} = {gap:.2f}x the analytic {_bytes(kernel.bytes)}; "
        f"at {_rate(beta, 'B')} they take {moved_s / measured_s:.0%} of the measured time"
    )
    explains = measured_bytes > kernel.bytes and moved_s >= REACHED * measured_s
    return Answer(question, ("no: " if not explains else "re-read: ") + text, explains)


def _waves(kernel: KernelEstimate, measured_s: float, machine: MachineFigures) -> Answer:
    """Is the work quantised badly? The prediction's waves over the SMs; W/pi
    stretched by the busy share explains the gap when it reaches the measured time."""
    question = QUESTIONS[5].text
    if not kernel.waves:
        return Answer(question, "not a tiled kernel: no waves counted", False)
    efficiency = kernel.wave_efficiency
    grid = f"{kernel.waves} wave{'s' if kernel.waves > 1 else ''}"
    grid += f" of {kernel.tile} tiles" if kernel.tile else ""
    if efficiency >= WAVE_EFFICIENCY_FLAG:
        return Answer(question, f"no: {grid}, {efficiency:.0%} busy", False)
    compute_s = kernel.flops / kernel.peak_flops_per_s if kernel.flops else 0.0
    stretched_s = compute_s / efficiency
    text = (
        f"{grid}, {efficiency:.0%} busy: W/pi {_time(compute_s)} stretches to "
        f"{_time(stretched_s)}, {stretched_s / measured_s:.0%} of the measured "
        f"{_time(measured_s)}"
    )
    explains = stretched_s >= REACHED * measured_s
    return Answer(question, ("yes: " if explains else "partly: ") + text, explains)


def diagnose(
    kernel: KernelEstimate,
    measured_s: float,
    machine: MachineFigures,
    measured_bytes: float | None = None,
) -> Diagnosis:
    """The diagnosis questions, in order, for one kernel measured at ``measured_s`` (W, Q, the
    waves and the bytes in flight from its prediction ``kernel``; ``measured_bytes`` only
    from hardware counters). Every question is answered; :attr:`Diagnosis.verdict` stops at
    the first that explains the gap."""
    answers = (
        _pipe(kernel, measured_s, machine),
        _hbm(kernel, measured_s, machine),
        _in_flight(kernel, measured_s, machine),
        _too_small(kernel, measured_s, machine),
        _reuse(kernel, measured_s, machine, measured_bytes),
        _waves(kernel, measured_s, machine),
    )
    return Diagnosis(kernel.time_s, measured_s, answers)

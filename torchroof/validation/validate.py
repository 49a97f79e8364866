"""Predicted versus measured: run a model step for real, profile it, and set every measured
kernel beside the kernel torchroof predicted for it.

seed 000 "Performance diagnosis": W and Q are counted analytically, t is timed with warm-up;
the distance between the prediction and the measurement is the diagnosis. Every measured
kernel is put through the seed's questions in order (torchroof.validation.diagnosis); the first that
explains its gap is its verdict.

Reproducibility: the ceilings and the step are measured together. Each repeat calibrates
(a short STREAM, matmul and launch measurement) and then times the step at once, so both see
the same load; each repeat is predicted with its own calibration and the ratio is reported
as the median and the spread over the repeats. With a fixed hardware file only the step is
repeated.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from torchroof import progress
from torchroof.api import trace
from torchroof.config.options import TIMING_MODES, Workload
from torchroof.hardware import Figure, HardwareSpec, get
from torchroof.hardware.spec import parse as parse_spec
from torchroof.hardware.toml_checks import HardwareSpecError, read_toml
from torchroof.pricing.price import estimate_trace
from torchroof.quiet import drop_native_lines, quiet_imports, quiet_trace
from torchroof.records.trace import layer_key
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.validation.calibrate import Calibration, calibrate
from torchroof.validation.diagnosis import LABELS, QUESTIONS, Diagnosis, MachineFigures, diagnose
from torchroof.workloads import regime as find_regime

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A model small enough to run for real on a CPU in well under a second per step.
CPU_OVERRIDES = {
    "num_hidden_layers": 4,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
}

# A smoke-test size: seconds for all three regimes on two CPU cores.
TINY_OVERRIDES = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
}

# The calibration each repeat runs before its step: STREAM past the caches a step uses, the
# matmul sizes that reach the CPU's rate, a cache-resident elementwise operand, the launch.
SHORT_CALIBRATION: dict[str, dict[str, Any]] = {
    "cpu": {
        "stream_bytes": 128 * 2**20,
        "matmul_sizes": (512, 1024),
        "elementwise_bytes": 2**20,
    },
    "cuda": {"matmul_sizes": (4096,)},
}


def normalise(name: str) -> str:
    """``aten.mm.default`` / ``aten::mm`` -> ``mm``; every SDPA flavour -> ``sdpa``."""
    core = name.removeprefix("aten::").removeprefix("aten.")
    core = core.split(".")[0]
    if "scaled_dot_product" in core or "flash_attention" in core:
        return "sdpa_backward" if "backward" in core else "sdpa"
    return core


# --- repeats -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """The median of a few repeats and their range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.low:.2f}..{self.high:.2f})"

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Repeat:
    """One calibration and the step timed right after it, predicted with that calibration."""

    measured_s: float  # median wall time of the step's timed runs
    predicted_s: dict[str, float]  # timing mode -> the step's predicted time
    calibration: Calibration | None = None  # None: a fixed hardware file

    def ratio(self, mode: str) -> float:
        """predicted / measured in ``mode``."""
        return self.predicted_s[mode] / self.measured_s


C = TypeVar("C")
M = TypeVar("M")


def interleave(
    repeats: int, calibrate_once: Callable[[], C], time_step: Callable[[], M]
) -> list[tuple[C, M]]:
    """Calibrate, then time the step at once, ``repeats`` times: each measurement of the step
    has ceilings measured under the same load."""
    runs = []
    for _ in range(repeats):
        calibration = calibrate_once()
        runs.append((calibration, time_step()))
    return runs


# --- the result ----------------------------------------------------------------------------


@dataclass
class KernelComparison:
    index: int  # predicted kernel index
    name: str
    module: str
    phase: str
    bound: str
    boundary: str
    predicted_s: float  # in the validation's mode
    roofline_s: float
    realistic_s: float
    measured_s: float | None
    diagnosis: Diagnosis | None = None

    @property
    def ratio(self) -> float | None:
        """predicted / measured (1.0 = the roofline is reached)."""
        return self.predicted_s / self.measured_s if self.measured_s else None

    @property
    def label(self) -> str:
        return self.diagnosis.label if self.diagnosis else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "module": self.module,
            "phase": self.phase,
            "bound": self.bound,
            "boundary": self.boundary,
            "predicted_s": self.predicted_s,
            "roofline_s": self.roofline_s,
            "realistic_s": self.realistic_s,
            "measured_s": self.measured_s,
            "ratio": self.ratio,
            "diagnosis": self.diagnosis.to_dict() if self.diagnosis else None,
        }


@dataclass
class Validation:
    """Per-kernel and per-layer predicted / measured, and the step's ratio over repeats."""

    model: str
    regime: str
    device: str
    hardware: str
    mode: str  # the timing mode of the per-kernel table and the headline ratio
    kernels: list[KernelComparison]  # the median repeat's predictions, median measurements
    unmatched_measured: list[tuple[str, float]]  # measured kernels no prediction claimed
    repeats: list[Repeat]
    settings: dict[str, Any] = field(default_factory=dict)

    def ratio(self, mode: str | None = None) -> Spread:
        """predicted / measured over the repeats, in ``mode`` (default: the validation's)."""
        return Spread.of([r.ratio(mode or self.mode) for r in self.repeats])

    def predicted(self, mode: str | None = None) -> Spread:
        return Spread.of([r.predicted_s[mode or self.mode] for r in self.repeats])

    def measured(self) -> Spread:
        return Spread.of([r.measured_s for r in self.repeats])

    @property
    def measured_total_s(self) -> float:
        return self.measured().median

    @property
    def predicted_total_s(self) -> float:
        return self.predicted().median

    @property
    def total_ratio(self) -> float:
        """The median over the repeats of predicted / measured."""
        return self.ratio().median

    @property
    def matched_measured_s(self) -> float:
        return sum(k.measured_s or 0.0 for k in self.kernels)

    def layers(self) -> list[tuple[str, float, float]]:
        predicted: dict[str, float] = defaultdict(float)
        measured: dict[str, float] = defaultdict(float)
        for k in self.kernels:
            key = layer_key(k.module, k.phase)
            predicted[key] += k.predicted_s
            measured[key] += k.measured_s or 0.0
        return [(key, predicted[key], measured[key]) for key in predicted]

    def table(self, top: int = 15) -> str:
        from tabulate import tabulate

        rows = [
            [name, f"{p * 1e3:.3f}", f"{m * 1e3:.3f}", f"{p / m:.2f}" if m else "-"]
            for name, p, m in self.layers()
        ]
        rows.append(
            [
                f"total (wall; ms: medians of {len(self.repeats)} repeats, "
                "pred/meas: median of their ratios)",
                f"{self.predicted_total_s * 1e3:.3f}",
                f"{self.measured_total_s * 1e3:.3f}",
                str(self.ratio()),
            ]
        )
        layer_table = tabulate(
            rows,
            headers=["layer", "predicted ms", "measured ms", "pred/meas"],
            disable_numparse=True,
        )
        worst = sorted(
            (k for k in self.kernels if k.measured_s),
            key=lambda k: k.measured_s or 0.0,
            reverse=True,
        )[:top]
        kernel_rows = [
            [
                k.index,
                k.name.removeprefix("aten."),
                k.module,
                k.boundary or k.bound,
                f"{k.predicted_s * 1e6:.1f}",
                f"{(k.measured_s or 0) * 1e6:.1f}",
                f"{k.ratio:.2f}" if k.ratio else "-",
                k.label,
            ]
            for k in worst
        ]
        kernel_table = tabulate(
            kernel_rows,
            headers=["#", "op", "module", "binds", "pred us", "meas us", "pred/meas", "diagnosis"],
            disable_numparse=True,
        )
        return f"{layer_table}\n\nslowest measured kernels ({self.mode}):\n{kernel_table}"

    def summary(self) -> str:
        covered = self.matched_measured_s / max(
            self.matched_measured_s + sum(t for _, t in self.unmatched_measured), 1e-12
        )
        calibrated = any(r.calibration is not None for r in self.repeats)
        how = "each calibrated just before its step" if calibrated else "fixed hardware file"
        lines = [
            f"{self.model} {self.regime} on {self.device} against {self.hardware}, "
            f"{len(self.repeats)} repeats ({how}); median (min..max) over the repeats:",
            f"  measured   {self.measured_total_s * 1e3:.3f} ms "
            f"({self.measured().low * 1e3:.3f}..{self.measured().high * 1e3:.3f})",
        ]
        for mode in TIMING_MODES:
            lines.append(
                f"  {mode:<10} predicted {self.predicted(mode).median * 1e3:.3f} ms, "
                f"predicted/measured {self.ratio(mode)}"
            )
        lines.append(
            "  predicted/measured is the median of the per-repeat ratios (each repeat's "
            "prediction over its own measurement), not the median predicted over the median "
            "measured"
        )
        lines.append(
            f"kernel mapping: {len([k for k in self.kernels if k.measured_s])} of "
            f"{len(self.kernels)} predicted kernels matched, {100 * covered:.1f}% of measured "
            f"kernel time"
        )
        diagnosed = [k.diagnosis for k in self.kernels if k.diagnosis]
        counts = Counter(d.label for d in diagnosed)
        if counts:
            lines.append(
                f"diagnosis ({self.mode} vs measured; the diagnostic questions in order, the "
                "first that explains): "
                + ", ".join(f"{counts[label]} {label}" for label in LABELS if counts[label])
            )
            unknown = {
                q.topic: a.answer
                for d in diagnosed
                for q, a in zip(QUESTIONS, d.answers, strict=True)
                if not a.known
            }
            lines += [f"  {topic}: {answer}" for topic, answer in unknown.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "regime": self.regime,
            "device": self.device,
            "hardware": self.hardware,
            "mode": self.mode,
            "settings": self.settings,
            "predicted_total_s": self.predicted_total_s,
            "measured_total_s": self.measured_total_s,
            "total_ratio": self.total_ratio,
            "ratios": {mode: self.ratio(mode).to_dict() for mode in TIMING_MODES},
            "repeats": [
                {
                    "measured_s": r.measured_s,
                    "predicted_s": r.predicted_s,
                    "ratio": {mode: r.ratio(mode) for mode in TIMING_MODES},
                    "calibration": r.calibration.to_dict() if r.calibration else None,
                }
                for r in self.repeats
            ],
            "layers": [
                {"layer": n, "predicted_s": p, "measured_s": m} for n, p, m in self.layers()
            ],
            "kernels": [k.to_dict() for k in self.kernels],
            "unmatched_measured": self.unmatched_measured,
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


# --- running the step ----------------------------------------------------------------------


def _event_s(event: Any, device: str) -> float:
    """An op's time: on the CPU its CPU time; on a GPU its kernels' device time (the CPU
    time of an asynchronous launch is the launch only)."""
    if device == "cpu":
        return event.cpu_time_total * 1e-6
    return getattr(event, "device_time_total", event.cpu_time_total) * 1e-6


def _smallest_kernel_s(device: str, count: int = 100) -> float:
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


def _measured_kernels(
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


def _align(
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


def _build(model: str, overrides: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from torchroof.models.sources import load_config

    config = load_config(model)
    for key, value in overrides.items():
        if hasattr(config, key) or key == "head_dim":
            setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False).to(device)


def _median_of_all(values: Sequence[float | None]) -> float | None:
    """The median of a kernel's times over the repeats; None unless every repeat has one."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def _measured_table(spec: HardwareSpec) -> dict[str, Any]:
    """The ``[measured]`` table of a calibrated TOML ({} for a datasheet spec)."""
    if not spec.path or not Path(spec.path).is_file():
        return {}
    return dict(read_toml(Path(spec.path), HardwareSpecError).get("measured", {}))


def _spec_of(calibration: Calibration, name: str) -> HardwareSpec:
    """The hardware spec ``torchroof calibrate`` would write for ``calibration``."""
    return parse_spec(tomllib.loads(calibration.to_toml(name)), f"<calibration {name}>")


def _machine(
    spec: HardwareSpec,
    calibration: Calibration | None,
    launch_overhead_s: float | None,
    smallest_kernel_s: float = 0.0,
) -> MachineFigures:
    """The figures a repeat is predicted and diagnosed with. The launch: the one given, else
    the file's figure, else an older calibrated file's ``[measured]`` entry; realistic mode
    charges it (the spec carries it as its ``launch_overhead_s``)."""
    if calibration is not None:
        copy, triad = calibration.copy_bytes_per_s, calibration.triad_bytes_per_s
        known = calibration.launch_overhead_s
    else:
        table = _measured_table(spec)
        copy, triad = table.get("copy_bytes_per_s"), table.get("triad_bytes_per_s")
        figure = spec.launch_overhead_s
        known = figure.value if figure else float(table.get("launch_overhead_s", 0.0))
    launch = known if launch_overhead_s is None else launch_overhead_s
    current = spec.launch_overhead_s.value if spec.launch_overhead_s else None
    if launch > 0 and current != launch:
        spec = replace(spec, launch_overhead_s=Figure(launch, "measured by torchroof validate"))
    return MachineFigures(spec, copy, triad, launch, smallest_kernel_s)


def validate(
    model: str = "llama-3-8b",
    regime: str = "prefill",
    *,
    device: str = "cpu",
    hardware: str | Path | HardwareSpec | None = None,
    batch: int = 1,
    seq: int = 256,
    overrides: dict[str, Any] | None = None,
    warmup: int = 2,
    iterations: int = 3,
    repeats: int = 3,
    mode: str = "roofline",
    launch_overhead_s: float | None = None,
    threads: int | None = None,
) -> Validation:
    """Run one step of ``model`` for real on ``device`` and compare with the prediction.

    ``regime`` is prefill (B x seq tokens), decode (one token against a static cache of seq
    tokens) or train (forward, loss, backward, AdamW). ``overrides`` shrink the config to a
    size that runs on the device (default on CPU: 4 layers, d = 512).

    Each of ``repeats`` calibrates the device (:data:`SHORT_CALIBRATION`) and at once times
    ``iterations`` steps (their median) and profiles one; each is predicted with its own
    calibration, in both timing modes (the pure roofline and the realistic mode, which adds
    the launch and the waves), and the ratio is the median over the repeats with its
    spread. ``hardware`` fixes the ceilings instead (a calibrated TOML or a datasheet
    spec): then only the step is repeated. ``mode`` chooses the prediction the per-kernel
    table, the diagnosis and :attr:`Validation.total_ratio` use. ``launch_overhead_s``
    replaces the measured launch. ``threads`` sets torch's CPU threads for the run (and
    restores them): on a CPU other work shares, fewer threads than cores avoid the stalls
    of a parallel region waiting for a descheduled thread.
    """
    # transformers' and torchao's notes on what torchroof does are not the user's concern
    with _torch_threads(threads), quiet_imports(), quiet_trace(), progress.current().ending():
        result = _validate(
            model,
            regime,
            device=device,
            hardware=hardware,
            batch=batch,
            seq=seq,
            overrides=overrides,
            warmup=warmup,
            iterations=iterations,
            repeats=repeats,
            mode=mode,
            launch_overhead_s=launch_overhead_s,
        )
    result.settings["threads"] = torch.get_num_threads() if threads is None else threads
    return result


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``threads`` for the block (None: left as they are)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _validate(
    model: str,
    regime: str,
    *,
    device: str,
    hardware: str | Path | HardwareSpec | None,
    batch: int,
    seq: int,
    overrides: dict[str, Any] | None,
    warmup: int,
    iterations: int,
    repeats: int,
    mode: str,
    launch_overhead_s: float | None,
) -> Validation:
    """validate()'s body, under the threads it chose."""
    from torch.profiler import ProfilerActivity, profile

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device is available here; use --device cpu")
    if mode not in TIMING_MODES:
        raise ValueError(f"mode is one of {', '.join(TIMING_MODES)}, got {mode!r}")
    if repeats < 1 or iterations < 1:
        raise ValueError(f"repeats and iterations are at least 1, got {repeats}, {iterations}")
    fixed = get(hardware) if hardware is not None else None
    overrides = dict(CPU_OVERRIDES if device == "cpu" else {}) | dict(overrides or {})
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    report = progress.current()
    report.begin(f"building the model with real weights on {device}")
    net = _build(model, overrides, device, dtype)
    workload = Workload(regime, batch=batch, seq=seq)  # decode: a cache of seq tokens
    # warm-up, the traced step, and per repeat: one step to re-warm after the calibration,
    # the timed steps and the profiled one (decode sizes its static cache for all of them)
    steps = warmup + 1 + repeats * (iterations + 2)
    step = find_regime(regime).real_step(net, workload, device, steps)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    report.begin(f"warming up ({warmup} steps)")
    for _ in range(warmup):
        step()
    sync()
    with trace() as recorded:  # the prediction is made from the very step that is timed
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])

    def calibrate_once() -> Calibration | None:
        if fixed is not None:
            return None
        report.begin(f"measuring the {device}'s ceilings")
        return calibrate(device, **SHORT_CALIBRATION.get(device.split(":")[0], {}))

    def time_step() -> tuple[float, list[Any], float]:
        report.begin(f"timing {iterations} step{'s' if iterations > 1 else ''} and profiling one")
        step()  # the calibration's arrays evicted the model from the caches
        sync()
        walls = []
        for _ in range(iterations):
            start = time.perf_counter()
            step()
            sync()
            walls.append(time.perf_counter() - start)
        with drop_native_lines(), profile(activities=activities) as prof:  # kineto's start/stop
            step()
            sync()
        return statistics.median(walls), list(prof.events()), _smallest_kernel_s(device)

    runs = interleave(repeats, calibrate_once, time_step)

    name = f"{device.replace(':', '-')}-measured"
    machines: list[MachineFigures] = []
    estimates: list[dict[str, Estimate]] = []
    report.begin(f"predicting the step {'once' if fixed else f'for each of {repeats} repeats'}")
    for calibration, (_, _, smallest_s) in runs:
        if calibration is None and estimates:  # a fixed file: one prediction for every repeat
            machines.append(replace(machines[-1], smallest_kernel_s=smallest_s))
            estimates.append(estimates[-1])
            continue
        spec = fixed if calibration is None else _spec_of(calibration, name)
        machine = _machine(spec, calibration, launch_overhead_s, smallest_s)
        machines.append(machine)
        with progress.silenced():  # one stage for every repeat's pricing
            estimates.append(
                {
                    m: estimate_trace(recorded, machine.spec, fusion="eager", mode=m)
                    for m in TIMING_MODES
                }
            )
    done = [
        Repeat(wall, {m: est[m].time_s for m in TIMING_MODES}, calibration)
        for (calibration, (wall, _, _)), est in zip(runs, estimates, strict=True)
    ]

    predicted = estimates[0][mode].kernels
    names = {normalise(k.name) for k in predicted}
    per_run: list[list[float | None]] = []
    unmatched: list[tuple[str, float]] = []
    for _, (_, events, _) in runs:
        times, unmatched = _align(predicted, _measured_kernels(events, names, device))
        per_run.append(times)
    per_kernel = [_median_of_all(ts) for ts in zip(*per_run, strict=True)]

    # the kernel table and the diagnosis: the repeat whose ratio is the median
    order = sorted(range(len(done)), key=lambda r: done[r].ratio(mode))
    middle = order[(len(order) - 1) // 2]
    chosen, machine = estimates[middle], machines[middle]
    comparisons = [
        KernelComparison(
            index=k.index,
            name=k.name,
            module=k.module,
            phase=k.phase,
            bound=k.bound,
            boundary=k.boundary,
            predicted_s=k.time_s,
            roofline_s=pure.time_s,
            realistic_s=real.time_s,
            measured_s=m,
            diagnosis=diagnose(k, m, machine) if m else None,
        )
        for k, pure, real, m in zip(
            chosen[mode].kernels,
            chosen["roofline"].kernels,
            chosen["realistic"].kernels,
            per_kernel,
            strict=True,
        )
    ]
    stream = machine.stream()
    return Validation(
        model=model,
        regime=regime,
        device=device,
        hardware=fixed.name if fixed is not None else name,
        mode=mode,
        kernels=comparisons,
        unmatched_measured=unmatched,
        repeats=done,
        settings={
            "batch": batch,
            "seq": seq,
            "overrides": overrides,
            "dtype": str(dtype),
            "warmup": warmup,
            "iterations": iterations,
            "repeats": repeats,
            "median_repeat": middle,
            "launch_overhead_s": machine.launch_overhead_s,
            "smallest_kernel_s": machine.smallest_kernel_s,
            "stream": {"name": stream[0], "bytes_per_s": stream[1]} if stream else None,
        },
    )

"""Predicted versus measured: run a model step for real, profile it, and set every measured
kernel beside the kernel torchroof predicted for it.

Roofline diagnosis: W and Q are counted analytically, t is timed with warm-up;
the distance between the prediction and the measurement is the diagnosis. Every measured
kernel is put through the diagnosis questions in order (torchroof.validation.diagnosis); the
first that explains its gap is its verdict.

Reproducibility: the ceilings and the step are measured together. Each repeat calibrates
(a short STREAM, matmul and launch measurement) and then times the step at once, so both see
the same load; each repeat is predicted with its own calibration and the ratio is reported
as the median and the spread over the repeats. With a fixed hardware file only the step is
repeated.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from torchroof import progress
from torchroof.api import estimate_trace, trace
from torchroof.config import KERNEL_TIMING_MODES, Workload
from torchroof.hardware import Figure, HardwareSpec, get
from torchroof.hardware.spec import parse as parse_spec
from torchroof.hardware.toml_checks import HardwareSpecError, read_toml
from torchroof.quiet import drop_native_lines, quiet_imports, quiet_trace
from torchroof.records.trace import Trace
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.validation.calibrate import Calibration, calibrate
from torchroof.validation.diagnosis import MachineFigures, diagnose
from torchroof.validation.profiling import (
    align,
    measured_kernels,
    median_of_all,
    normalise,
    smallest_kernel_s,
)
from torchroof.validation.results import KernelComparison, Repeat, Validation
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


def _build(model: str, overrides: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from torchroof.models.sources import load_config

    config = load_config(model)
    for key, value in overrides.items():
        if hasattr(config, key) or key == "head_dim":
            setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False).to(device)


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
    copy: float | None
    triad: float | None
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
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device is available here; use --device cpu")
    if mode not in KERNEL_TIMING_MODES:
        raise ValueError(f"mode is one of {', '.join(KERNEL_TIMING_MODES)}, got {mode!r}")
    if repeats < 1 or iterations < 1:
        raise ValueError(f"repeats and iterations are at least 1, got {repeats}, {iterations}")
    fixed = get(hardware) if hardware is not None else None
    overrides = dict(CPU_OVERRIDES if device == "cpu" else {}) | dict(overrides or {})
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    progress.current().begin(f"building the model with real weights on {device}")
    net = _build(model, overrides, device, dtype)
    workload = Workload(regime, batch=batch, seq=seq)  # decode: a cache of seq tokens
    # warm-up, the traced step, and per repeat: one step to re-warm after the calibration,
    # the timed steps and the profiled one (decode sizes its static cache for all of them)
    steps = warmup + 1 + repeats * (iterations + 2)
    step = find_regime(regime).real_step(net, workload, device, steps)
    recorded = _warm_and_trace(step, device, warmup)
    runs = _run_repeats(step, device, fixed, repeats, iterations)
    name = f"{device.replace(':', '-')}-measured"
    machines, estimates = _predict(runs, recorded, fixed, name, launch_overhead_s, repeats)
    done = [
        Repeat(wall, {m: est[m].time_s for m in KERNEL_TIMING_MODES}, calibration)
        for (calibration, (wall, _, _)), est in zip(runs, estimates, strict=True)
    ]
    per_kernel, unmatched = _measured_per_kernel(estimates[0][mode].kernels, runs, device)
    # the kernel table and the diagnosis: the repeat whose ratio is the median
    order = sorted(range(len(done)), key=lambda r: done[r].ratio(mode))
    middle = order[(len(order) - 1) // 2]
    machine = machines[middle]
    stream = machine.stream()
    return Validation(
        model=model,
        regime=regime,
        device=device,
        hardware=fixed.name if fixed is not None else name,
        mode=mode,
        kernels=_comparisons(estimates[middle], machine, mode, per_kernel),
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


# one repeat: (its calibration, or None with a fixed file; (median wall s, profiler events,
# the smallest kernel's profiled s))
Run = tuple[Calibration | None, tuple[float, list[Any], float]]


def _sync(device: str) -> Callable[[], Any]:
    """What waits for the device's queued work (nothing on the CPU)."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _warm_and_trace(step: Callable[[], Any], device: str, warmup: int) -> Trace:
    """Warm the step up, then trace one run of it: the prediction is made from the very step
    that is timed."""
    sync = _sync(device)
    progress.current().begin(f"warming up ({warmup} steps)")
    for _ in range(warmup):
        step()
    sync()
    with trace() as recorded:
        step()
    return recorded


def _run_repeats(
    step: Callable[[], Any],
    device: str,
    fixed: HardwareSpec | None,
    repeats: int,
    iterations: int,
) -> list[Run]:
    """Each repeat: calibrate (unless the hardware is fixed), then time and profile the step."""
    from torch.profiler import ProfilerActivity, profile

    report = progress.current()
    sync = _sync(device)
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
        return statistics.median(walls), list(prof.events()), smallest_kernel_s(device)

    return interleave(repeats, calibrate_once, time_step)


def _predict(
    runs: list[Run],
    recorded: Trace,
    fixed: HardwareSpec | None,
    name: str,
    launch_overhead_s: float | None,
    repeats: int,
) -> tuple[list[MachineFigures], list[dict[str, Estimate]]]:
    """Each repeat's machine figures and its estimate in every timing mode (with a fixed
    file, one prediction serves every repeat)."""
    machines: list[MachineFigures] = []
    estimates: list[dict[str, Estimate]] = []
    progress.current().begin(
        f"predicting the step {'once' if fixed else f'for each of {repeats} repeats'}"
    )
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
                    for m in KERNEL_TIMING_MODES
                }
            )
    return machines, estimates


def _measured_per_kernel(
    predicted: list[KernelEstimate], runs: list[Run], device: str
) -> tuple[list[float | None], list[tuple[str, float]]]:
    """Each predicted kernel's measured time (the median over the repeats, None unless every
    repeat has one) and the last repeat's measured kernels no prediction claimed."""
    names = {normalise(k.name) for k in predicted}
    per_run: list[list[float | None]] = []
    unmatched: list[tuple[str, float]] = []
    for _, (_, events, _) in runs:
        times, unmatched = align(predicted, measured_kernels(events, names, device))
        per_run.append(times)
    per_kernel = [median_of_all(ts) for ts in zip(*per_run, strict=True)]
    return per_kernel, unmatched


def _comparisons(
    chosen: dict[str, Estimate],
    machine: MachineFigures,
    mode: str,
    per_kernel: list[float | None],
) -> list[KernelComparison]:
    """Each kernel of the median repeat: predicted in both modes, measured, diagnosed."""
    return [
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

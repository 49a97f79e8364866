"""Predicted versus measured: run a model step for real, profile it, and set every measured
kernel beside the kernel torchroof predicted for it.

seed 000 "Performance diagnosis": W is counted analytically, t is timed with warm-up; the
distance between the prediction and the measurement is the diagnosis. Kernels far below
their roof are classified with the seed's questions, cheapest first: too small to hide the
launch, then the ceiling, then latency / parallelism.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchroof.api import trace
from torchroof.hardware import HardwareSpec, get
from torchroof.options import Workload
from torchroof.pipeline import estimate_trace
from torchroof.records import layer_key
from torchroof.report import Estimate, KernelEstimate
from torchroof.workloads import regime as find_regime

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

FAR_BELOW = 3.0  # measured / predicted above this is diagnosed


def normalise(name: str) -> str:
    """``aten.mm.default`` / ``aten::mm`` -> ``mm``; every SDPA flavour -> ``sdpa``."""
    core = name.removeprefix("aten::").removeprefix("aten.")
    core = core.split(".")[0]
    if "scaled_dot_product" in core or "flash_attention" in core:
        return "sdpa_backward" if "backward" in core else "sdpa"
    return core


@dataclass
class KernelComparison:
    index: int  # predicted kernel index
    name: str
    module: str
    phase: str
    bound: str
    predicted_s: float
    measured_s: float | None
    diagnosis: str = ""

    @property
    def ratio(self) -> float | None:
        """predicted / measured (1.0 = the roofline is reached)."""
        return self.predicted_s / self.measured_s if self.measured_s else None


@dataclass
class Validation:
    """Per-kernel and per-layer predicted / measured, and the total ratio."""

    model: str
    regime: str
    device: str
    hardware: str
    kernels: list[KernelComparison]
    unmatched_measured: list[tuple[str, float]]  # measured kernels no prediction claimed
    measured_total_s: float  # wall time of the step
    predicted_total_s: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def total_ratio(self) -> float:
        return self.predicted_total_s / self.measured_total_s

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
                "total (wall)",
                f"{self.predicted_total_s * 1e3:.3f}",
                f"{self.measured_total_s * 1e3:.3f}",
                f"{self.total_ratio:.2f}",
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
                k.bound,
                f"{k.predicted_s * 1e6:.1f}",
                f"{(k.measured_s or 0) * 1e6:.1f}",
                f"{k.ratio:.2f}" if k.ratio else "-",
                k.diagnosis,
            ]
            for k in worst
        ]
        kernel_table = tabulate(
            kernel_rows,
            headers=["#", "op", "module", "bound", "pred us", "meas us", "pred/meas", "diagnosis"],
            disable_numparse=True,
        )
        return f"{layer_table}\n\nslowest measured kernels:\n{kernel_table}"

    def summary(self) -> str:
        covered = self.matched_measured_s / max(
            self.matched_measured_s + sum(t for _, t in self.unmatched_measured), 1e-12
        )
        diagnosed = defaultdict(int)
        for k in self.kernels:
            if k.diagnosis:
                diagnosed[k.diagnosis.split(":")[0]] += 1
        lines = [
            f"{self.model} {self.regime} on {self.device} against {self.hardware}: "
            f"predicted {self.predicted_total_s * 1e3:.3f} ms, "
            f"measured {self.measured_total_s * 1e3:.3f} ms, ratio {self.total_ratio:.2f}",
            f"kernel mapping: {len([k for k in self.kernels if k.measured_s])} of "
            f"{len(self.kernels)} predicted kernels matched, {100 * covered:.1f}% of measured "
            f"kernel time",
        ]
        lines += [f"diagnosis: {n} kernels {what}" for what, n in sorted(diagnosed.items())]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "regime": self.regime,
            "device": self.device,
            "hardware": self.hardware,
            "settings": self.settings,
            "predicted_total_s": self.predicted_total_s,
            "measured_total_s": self.measured_total_s,
            "total_ratio": self.total_ratio,
            "layers": [
                {"layer": n, "predicted_s": p, "measured_s": m} for n, p, m in self.layers()
            ],
            "kernels": [{**asdict(k), "ratio": k.ratio} for k in self.kernels],
            "unmatched_measured": self.unmatched_measured,
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def diagnose(kernel: KernelEstimate, measured_s: float, launch_overhead_s: float) -> str:
    """seed 000's questions, in order, for a kernel far below its roof."""
    if measured_s < FAR_BELOW * kernel.time_s:
        return ""
    if kernel.time_s < 5 * max(launch_overhead_s, 1e-6) or measured_s < 20e-6:
        return "too small: launch overhead and fixed costs dominate"
    if kernel.bound == "compute":
        return "below the compute roof: wrong ceiling (unit, dtype) or low efficiency"
    return "below the bandwidth roof: latency-bound or not enough parallel work, or re-reads"


def _measured_kernels(events: list[Any], names: set[str]) -> list[tuple[str, float]]:
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
            chosen.append((key, event.cpu_time_total * 1e-6))
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

    from torchroof.models import load_config

    config = load_config(model)
    for key, value in overrides.items():
        if hasattr(config, key) or key == "head_dim":
            setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


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
    launch_overhead_s: float | None = None,
) -> Validation:
    """Run one step of ``model`` for real on ``device`` and compare with the prediction.

    ``regime`` is prefill (B x seq tokens), decode (one token against a static cache of seq
    tokens) or train (forward, loss, backward, AdamW). ``overrides`` shrink the config to a
    size that runs on the device (default on CPU: 4 layers, d = 512). ``hardware`` is a
    measured TOML (``torchroof calibrate``); without one the device is calibrated first.
    """
    from torch.profiler import ProfilerActivity, profile

    from torchroof.calibrate import calibrate

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device is available here; use --device cpu")
    if hardware is None:
        measured = calibrate(device)
        spec_file = Path(f".torchroof-{device.replace(':', '-')}.toml")
        spec_file.write_text(measured.to_toml(f"{device}-measured"))
        hardware, launch_overhead_s = str(spec_file), measured.launch_overhead_s
    spec = get(hardware)
    if launch_overhead_s is None:
        launch_overhead_s = _measured_overhead(spec)
    overrides = dict(CPU_OVERRIDES if device == "cpu" else {}) | dict(overrides or {})
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    net = _build(model, overrides, device, dtype)
    workload = Workload(regime, batch=batch, seq=seq)  # decode: a cache of seq tokens
    step = find_regime(regime).real_step(net, workload, device, warmup + iterations + 1)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    with trace() as recorded:  # the prediction is made from the very step that is timed
        step()
    est: Estimate = estimate_trace(
        recorded, spec, fusion="eager", launch_overhead_s=launch_overhead_s
    )
    names = {normalise(k.name) for k in est.kernels}
    runs: list[list[float | None]] = []
    walls: list[float] = []
    unmatched: list[tuple[str, float]] = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    for _ in range(iterations):
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            step()
            sync()
            walls.append(time.perf_counter() - start)
        measured = _measured_kernels(list(prof.events()), names)
        times, unmatched = _align(est.kernels, measured)
        runs.append(times)
    per_kernel = [
        statistics.median(ts) if all(t is not None for t in ts) else None
        for ts in zip(*runs, strict=True)
    ]
    comparisons = [
        KernelComparison(
            index=k.index,
            name=k.name,
            module=k.module,
            phase=k.phase,
            bound=k.bound,
            predicted_s=k.time_s,
            measured_s=m,
            diagnosis=diagnose(k, m, launch_overhead_s) if m else "",
        )
        for k, m in zip(est.kernels, per_kernel, strict=True)
    ]
    return Validation(
        model=model,
        regime=regime,
        device=device,
        hardware=spec.name,
        kernels=comparisons,
        unmatched_measured=unmatched,
        measured_total_s=statistics.median(walls),
        predicted_total_s=est.time_s,
        settings={
            "batch": batch,
            "seq": seq,
            "overrides": overrides,
            "launch_overhead_s": launch_overhead_s,
            "dtype": str(dtype),
        },
    )


def _measured_overhead(spec: HardwareSpec) -> float:
    """The launch overhead a measured TOML recorded (0 for a datasheet spec)."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    if not spec.path:
        return 0.0
    with open(spec.path, "rb") as handle:
        data = tomllib.load(handle)
    return float(data.get("measured", {}).get("launch_overhead_s", 0.0))

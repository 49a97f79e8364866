"""What a validation returns: the repeats, each kernel predicted beside measured, tables, JSON."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchroof.config import KERNEL_TIMING_MODES
from torchroof.records.ops import layer_key
from torchroof.validation.calibrate import Calibration
from torchroof.validation.diagnosis import LABELS, QUESTIONS, Diagnosis


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
        for mode in KERNEL_TIMING_MODES:
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
            "ratios": {mode: self.ratio(mode).to_dict() for mode in KERNEL_TIMING_MODES},
            "repeats": [
                {
                    "measured_s": r.measured_s,
                    "predicted_s": r.predicted_s,
                    "ratio": {mode: r.ratio(mode) for mode in KERNEL_TIMING_MODES},
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

"""The estimate: timed kernels, totals, per-layer budget, and its renderings.

seed 000 Lab 4 "the transformer layer budget": every operator with its own W, Q, intensity
and roofline time; rows sum as if kernels ran back to back.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from torchroof.memory import MemoryFootprint
from torchroof.records import PHASES, TOP_LEVEL, layer_key

# Byte categories, in the order reports show them.
CATEGORIES = ("weights", "activations", "kv_cache", "gradients", "optimizer_state")
CATEGORY_LABELS = {
    "weights": "weights",
    "activations": "activations",
    "kv_cache": "KV",
    "gradients": "grads",
    "optimizer_state": "opt state",
}

ESTIMATE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class KernelEstimate:
    """One kernel as priced and timed: plain data, so an estimate round-trips through JSON."""

    index: int  # position in launch order
    name: str  # aten overload of the kernel's lead op
    ops: tuple[str, ...]  # member ops' overload names
    module: str
    phase: str
    flops: int
    bytes_read: int
    bytes_written: int
    unit: str
    dtype: str
    counted: bool
    peak_flops_per_s: float
    compute_s: float
    memory_s: float
    time_s: float
    bound: str
    read_by: dict[str, int] = field(default_factory=dict)  # bytes read, by category
    written_by: dict[str, int] = field(default_factory=dict)  # bytes written, by category
    flags: tuple[str, ...] = ()  # warnings, e.g. a fused group past the on-chip budget

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def traffic(self) -> dict[str, int]:
        """Bytes read and written, by category."""
        total = dict(self.read_by)
        for category, size in self.written_by.items():
            total[category] = total.get(category, 0) + size
        return total

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ops"] = list(self.ops)
        data["flags"] = list(self.flags)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelEstimate:
        return cls(**{**data, "ops": tuple(data["ops"]), "flags": tuple(data.get("flags", ()))})


@dataclass
class LayerRow:
    """Kernels grouped under one module (a transformer block by default)."""

    name: str
    kernels: int = 0
    flops: int = 0
    bytes: int = 0
    time_s: float = 0.0
    memory_bound_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    traffic: dict[str, int] = field(default_factory=dict)

    def add(self, kernel: KernelEstimate) -> None:
        self.kernels += 1
        self.flops += kernel.flops
        self.bytes += kernel.bytes
        self.time_s += kernel.time_s
        self.phase_s[kernel.phase] = self.phase_s.get(kernel.phase, 0.0) + kernel.time_s
        if kernel.bound == "memory":
            self.memory_bound_s += kernel.time_s
        for category, size in kernel.traffic.items():
            self.traffic[category] = self.traffic.get(category, 0) + size

    def merge(self, other: LayerRow) -> None:
        """Add another row's totals into this one."""
        self.kernels += other.kernels
        self.flops += other.flops
        self.bytes += other.bytes
        self.time_s += other.time_s
        self.memory_bound_s += other.memory_bound_s
        for phase, seconds in other.phase_s.items():
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        for category, size in other.traffic.items():
            self.traffic[category] = self.traffic.get(category, 0) + size

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    @property
    def bound(self) -> str:
        """The pipe most of this row's time waits on."""
        return "memory" if self.memory_bound_s * 2 >= self.time_s else "compute"


def _block_index(name: str) -> tuple[str, int] | None:
    head, _, tail = name.rpartition(".")
    return (head, int(tail)) if head and tail.isdigit() else None


def collapse_repeats(rows: list[LayerRow]) -> list[LayerRow]:
    """Merge runs of consecutive identical blocks (``model.layers.0`` ... ``.31`` with equal
    kernels, FLOPs and bytes) into one summed row named ``model.layers.0-31 (x32)``."""
    merged: list[LayerRow] = []
    run: list[LayerRow] = []

    def flush() -> None:
        if len(run) > 1:
            first, last = _block_index(run[0].name), _block_index(run[-1].name)
            total = LayerRow(f"{first[0]}.{first[1]}-{last[1]} (x{len(run)})")
            for row in run:
                total.merge(row)
            merged.append(total)
        else:
            merged.extend(run)
        run.clear()

    for row in rows:
        index = _block_index(row.name)
        if run:
            prev = run[-1]
            prev_index = _block_index(prev.name)
            same = (
                index is not None
                and prev_index is not None
                and index == (prev_index[0], prev_index[1] + 1)
                and (row.kernels, row.flops, row.bytes) == (prev.kernels, prev.flops, prev.bytes)
            )
            if not same:
                flush()
        if index is None:
            merged.append(row)
        else:
            run.append(row)
    flush()
    return merged


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _by_block(rows: list[LayerRow], collapse: bool) -> dict[str, LayerRow]:
    """Rows keyed by name; with ``collapse``, every numbered block of a stack is summed into
    one ``model.layers.* (xN)`` row, so two estimates line up whatever their kernels."""
    if not collapse:
        return {r.name: r for r in rows}
    merged: dict[str, LayerRow] = {}
    counts: dict[str, int] = {}
    for row in rows:
        index = _block_index(row.name)
        key = f"{index[0]}.*" if index else row.name
        if key not in merged:
            merged[key] = LayerRow(key)
            counts[key] = 0
        merged[key].merge(row)
        counts[key] += 1
    for key, row in merged.items():
        if counts[key] > 1:
            row.name = f"{key} (x{counts[key]})"
    return {row.name: row for row in merged.values()}


def _members(ops: tuple[str, ...], limit: int = 6) -> str:
    """A fused kernel's member ops, short: ``_to_copy, pow, mean, add, rsqrt, mul +2``."""
    if len(ops) == 1:
        return ""
    names = [op.split(".")[1] for op in ops]
    more = f" +{len(names) - limit}" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after else "-"


def _intensity(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.2f}"


@dataclass
class Estimate:
    """A step priced on one accelerator. Internal units: FLOPs, bytes, seconds."""

    hardware: str
    hardware_display: str
    hbm_bytes_per_s: float
    reference_peak_flops_per_s: float  # the dense tensor peak MFU is measured against
    reference_dtype: str
    kernels: list[KernelEstimate]
    op_count: int
    uncounted: dict[str, int]
    assumptions: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    memory: MemoryFootprint | None = None

    # -- totals ---------------------------------------------------------------------------
    @property
    def time_s(self) -> float:
        return sum(k.time_s for k in self.kernels)

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: W / (T · pi_tensor) for the dominant matmul dtype."""
        time_s = self.time_s
        return self.flops / (time_s * self.reference_peak_flops_per_s) if time_s else 0.0

    @property
    def memory_bound_share(self) -> float:
        """Share of the step's time spent in memory-bound kernels."""
        time_s = self.time_s
        memory_s = sum(k.time_s for k in self.kernels if k.bound == "memory")
        return memory_s / time_s if time_s else 0.0

    def phase_time_s(self, phase: str) -> float:
        return sum(k.time_s for k in self.kernels if k.phase == phase)

    def traffic(self) -> dict[str, int]:
        """HBM bytes by category (weights, activations, kv_cache, gradients,
        optimizer_state) over the whole step."""
        total: dict[str, int] = {}
        for kernel in self.kernels:
            for category, size in kernel.traffic.items():
                total[category] = total.get(category, 0) + size
        return total

    # -- workload figures -----------------------------------------------------------------
    @property
    def workload(self) -> dict[str, Any]:
        return self.metadata.get("workload", {})

    @property
    def tokens_per_s(self) -> float:
        """Tokens the step processes per second (decode: B / step time)."""
        tokens = self.metadata.get("tokens", 0)
        return tokens / self.time_s if self.time_s and tokens else 0.0

    @property
    def kv_bytes_read(self) -> int:
        """KV-cache bytes read by the step (seed 000: decode reads the whole cache)."""
        return sum(k.read_by.get("kv_cache", 0) for k in self.kernels)

    @property
    def weight_bytes_read(self) -> int:
        return sum(k.read_by.get("weights", 0) for k in self.kernels)

    @property
    def ridge_batch(self) -> float:
        """B*: the batch at which the weight GEMMs reach the ridge (seed 000: B* = s·I*/2,
        295 for bf16 on an H100) — this step's batch times how far below the ridge its
        weight matmuls sit."""
        batch = int(self.workload.get("batch", 1))
        weight_flops = sum(
            k.flops for k in self.kernels if k.unit == "tensor" and k.read_by.get("weights")
        )
        ridge = self.reference_peak_flops_per_s / self.hbm_bytes_per_s
        if not weight_flops:
            return float("inf")
        return batch * ridge / (weight_flops / self.weight_bytes_read)

    @property
    def kv_crossover_batch(self) -> float:
        """Batch at which KV-cache reads overtake weight reads (seed 000: B_cross =
        s·P / KV bytes per sequence), scaled from this step's batch."""
        batch = int(self.workload.get("batch", 1))
        per_sequence = self.kv_bytes_read / batch
        return self.weight_bytes_read / per_sequence if per_sequence else float("inf")

    # -- grouping -------------------------------------------------------------------------
    def rows(self, depth: int | None = None) -> list[LayerRow]:
        """Per-layer budget rows in execution order (first appearance)."""
        rows: dict[str, LayerRow] = {}
        for kernel in self.kernels:
            key = layer_key(kernel.module, kernel.phase, depth)
            row = rows.get(key)
            if row is None:
                row = rows[key] = LayerRow(key)
            row.add(kernel)
        return list(rows.values())

    # -- rendering ------------------------------------------------------------------------
    def table(
        self, depth: int | None = None, collapse: bool = False, tablefmt: str = "simple"
    ) -> str:
        """The per-layer time budget (seed 000 Lab 4). ``collapse`` sums runs of identical
        consecutive blocks into one row."""
        phases = [p for p in PHASES if self.phase_time_s(p) > 0]
        split = len(phases) > 1
        step_traffic = self.traffic()
        categories = [c for c in CATEGORIES if step_traffic.get(c)]
        headers = ["layer", "kernels", "GFLOP", "MB", "FLOP/B", "time ms"]
        if split:
            headers += [f"{p} ms" for p in phases]
        if len(categories) > 1:
            headers += [f"{CATEGORY_LABELS[c]} MB" for c in categories]
        else:
            categories = []
        headers += ["share %", "bound"]
        total = self.time_s or 1.0
        body = []
        rows = self.rows(depth)
        for row in collapse_repeats(rows) if collapse else rows:
            line: list[Any] = [
                row.name,
                row.kernels,
                f"{row.flops / 1e9:.3f}",
                f"{row.bytes / 1e6:.2f}",
                _intensity(row.intensity),
                _ms(row.time_s),
            ]
            if split:
                line += [_ms(row.phase_s.get(p, 0.0)) for p in phases]
            line += [f"{row.traffic.get(c, 0) / 1e6:.2f}" for c in categories]
            line += [f"{100 * row.time_s / total:.1f}", row.bound]
            body.append(line)
        footer: list[Any] = [
            "total",
            len(self.kernels),
            f"{self.flops / 1e9:.3f}",
            f"{self.bytes / 1e6:.2f}",
            _intensity(self.flops / self.bytes if self.bytes else float("inf")),
            _ms(self.time_s),
        ]
        if split:
            footer += [_ms(self.phase_time_s(p)) for p in phases]
        footer += [f"{step_traffic.get(c, 0) / 1e6:.2f}" for c in categories]
        footer += ["100.0", f"{100 * self.memory_bound_share:.0f}% mem"]
        body.append(footer)
        return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)

    def kernel_table(self, top: int = 20, tablefmt: str = "simple") -> str:
        """The ``top`` kernels by time."""
        ranked = sorted(self.kernels, key=lambda k: k.time_s, reverse=True)[:top]
        body = [
            [
                k.index,
                k.name.removeprefix("aten."),
                k.module or TOP_LEVEL,
                k.phase,
                f"{k.flops / 1e9:.3f}",
                f"{k.bytes / 1e6:.2f}",
                _intensity(k.intensity),
                f"{k.time_s * 1e6:.1f}",
                k.bound,
                _members(k.ops) + (" [!] " + k.flags[0] if k.flags else ""),
            ]
            for k in ranked
        ]
        headers = [
            "#",
            "op",
            "module",
            "phase",
            "GFLOP",
            "MB",
            "FLOP/B",
            "time us",
            "bound",
            "members",
        ]
        return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)

    @property
    def label(self) -> str:
        """Short name of how this estimate was made (hardware and kernel policies)."""
        parts = [self.hardware, str(self.options.get("fusion", "eager"))]
        for key, default in (("loss", "materialized"), ("attention", "flash")):
            value = self.options.get(key, default)
            if value != default:
                parts.append(f"{key}={value}")
        if self.options.get("epilogue"):
            parts.append("epilogue")
        return " ".join(parts)

    def compare(
        self,
        other: Estimate,
        depth: int | None = None,
        collapse: bool = True,
        tablefmt: str = "simple",
    ) -> str:
        """Per-layer time and bytes of two estimates side by side, with the speed-up
        (``self`` / ``other``), in the spirit of seed 000's fusion bench (Lab 3)."""
        mine = _by_block(self.rows(depth), collapse)
        theirs = _by_block(other.rows(depth), collapse)
        names = list(mine) + [n for n in theirs if n not in mine]
        a, b = self.label, other.label
        headers = [
            "layer",
            f"{a} ms",
            f"{b} ms",
            "speed-up",
            f"{a} MB",
            f"{b} MB",
            f"{a} kernels",
            f"{b} kernels",
        ]
        empty = LayerRow("")
        body = []
        for name in names:
            x, y = mine.get(name, empty), theirs.get(name, empty)
            body.append(
                [
                    name,
                    _ms(x.time_s),
                    _ms(y.time_s),
                    _ratio(x.time_s, y.time_s),
                    f"{x.bytes / 1e6:.2f}",
                    f"{y.bytes / 1e6:.2f}",
                    x.kernels,
                    y.kernels,
                ]
            )
        body.append(
            [
                "total",
                _ms(self.time_s),
                _ms(other.time_s),
                _ratio(self.time_s, other.time_s),
                f"{self.bytes / 1e6:.2f}",
                f"{other.bytes / 1e6:.2f}",
                len(self.kernels),
                len(other.kernels),
            ]
        )
        return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)

    def coverage_line(self) -> str:
        if not self.uncounted:
            return f"coverage: {self.op_count} ops, all priced by a rule"
        names = ", ".join(f"{n} x{c}" for n, c in sorted(self.uncounted.items()))
        count = sum(self.uncounted.values())
        return (
            f"coverage: {self.op_count} ops, {count} without a rule "
            f"(charged their input+output bytes only): {names}"
        )

    def summary(self) -> str:
        lines = [
            f"hardware: {self.hardware_display} ({self.hardware}), "
            f"HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s, "
            f"{self.reference_dtype} peak {self.reference_peak_flops_per_s / 1e12:.0f} TFLOP/s",
            f"step time: {_ms(self.time_s)} ms over {len(self.kernels)} kernels",
        ]
        phases = [p for p in PHASES if self.phase_time_s(p) > 0]
        if len(phases) > 1:
            lines.append(
                "by phase: " + ", ".join(f"{p} {_ms(self.phase_time_s(p))} ms" for p in phases)
            )
        lines += [
            f"work: {self.flops / 1e12:.3f} TFLOP, traffic: {self.bytes / 1e9:.3f} GB, "
            f"intensity {_intensity(self.flops / self.bytes if self.bytes else float('inf'))} "
            "FLOP/B",
            f"MFU: {100 * self.mfu:.1f}%, time memory-bound: {100 * self.memory_bound_share:.0f}%",
        ]
        traffic = self.traffic()
        if traffic:
            lines.append(
                "traffic: "
                + ", ".join(
                    f"{CATEGORY_LABELS[c]} {traffic[c] / 1e9:.3f} GB"
                    for c in CATEGORIES
                    if c in traffic
                )
            )
        if self.tokens_per_s:
            lines.append(f"throughput: {self.tokens_per_s:,.1f} tokens/s")
        if self.workload.get("regime") == "decode":
            lines.append(
                f"decode: weights read {self.weight_bytes_read / 1e9:.2f} GB, KV read "
                f"{self.kv_bytes_read / 1e9:.3f} GB per step ({self.workload.get('cache')} "
                f"cache); KV reads overtake weight reads at batch "
                f"{self.kv_crossover_batch:.0f}"
            )
        if self.memory is not None:
            lines.append(self.memory.line())
            if self.workload.get("regime") == "decode":
                lines.append(
                    f"largest decode batch that fits at context {self.workload.get('context')}: "
                    f"{self.memory.max_batch}"
                )
        flagged = [k for k in self.kernels if k.flags]
        if flagged:
            lines.append(
                f"on-chip pressure: {len(flagged)} fused kernels exceed the on-chip budget "
                f"(e.g. #{flagged[0].index} {flagged[0].module}: {flagged[0].flags[0]})"
            )
        lines.append(self.coverage_line())
        lines += [f"assumption: {a}" for a in self.assumptions]
        return "\n".join(lines)

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "torchroof-estimate",
            "version": ESTIMATE_FORMAT_VERSION,
            "hardware": self.hardware,
            "hardware_display": self.hardware_display,
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "reference_peak_flops_per_s": self.reference_peak_flops_per_s,
            "reference_dtype": self.reference_dtype,
            "op_count": self.op_count,
            "uncounted": self.uncounted,
            "assumptions": self.assumptions,
            "options": self.options,
            "metadata": self.metadata,
            "memory": self.memory.to_dict() if self.memory else None,
            "totals": {
                "time_s": self.time_s,
                "flops": self.flops,
                "bytes": self.bytes,
                "mfu": self.mfu,
                "memory_bound_share": self.memory_bound_share,
                "tokens_per_s": self.tokens_per_s,
                "traffic": self.traffic(),
            },
            "kernels": [k.to_json() for k in self.kernels],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Estimate:
        if data.get("format") != "torchroof-estimate":
            raise ValueError("not a torchroof estimate (missing format marker)")
        if data.get("version") != ESTIMATE_FORMAT_VERSION:
            raise ValueError(f"estimate format version {data.get('version')} is not supported")
        return cls(
            hardware=data["hardware"],
            hardware_display=data["hardware_display"],
            hbm_bytes_per_s=data["hbm_bytes_per_s"],
            reference_peak_flops_per_s=data["reference_peak_flops_per_s"],
            reference_dtype=data["reference_dtype"],
            kernels=[KernelEstimate.from_json(k) for k in data["kernels"]],
            op_count=data["op_count"],
            uncounted=data["uncounted"],
            assumptions=data["assumptions"],
            options=data["options"],
            metadata=data["metadata"],
            memory=MemoryFootprint(**data["memory"]) if data.get("memory") else None,
        )

    def to_json(self, path: str | Path | None = None) -> str:
        """The estimate as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> Estimate:
        """Read an estimate from a JSON file path or a JSON string."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        return cls.from_dict(json.loads(text))

    def to_csv(self, path: str | Path) -> None:
        """One row per kernel."""
        columns = [
            "index",
            "name",
            "module",
            "phase",
            "flops",
            "bytes_read",
            "bytes_written",
            "unit",
            "dtype",
            "counted",
            "compute_s",
            "memory_s",
            "time_s",
            "bound",
        ]
        with Path(path).open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(columns)
            for kernel in self.kernels:
                writer.writerow([getattr(kernel, c) for c in columns])

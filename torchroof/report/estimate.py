"""The estimate as data: timed kernels, their totals, the per-layer rows, and its
serialised form. What it implies lives in torchroof.report.analysis; how it is shown (text
tables, JSON and CSV files, the Chrome trace, plots, the interactive HTML page) in
torchroof.render: ``text.summary(est)``, ``text.layer_table(est)``, ``files.write(est, path)``,
``html.estimate_html(est, path)``. This module imports no renderer.

The per-layer time budget: every operator with its own W, Q, intensity and roofline time;
rows sum as if kernels ran back to back.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from torchroof.config import PricingOptions, Workload
from torchroof.config.checks import unknown_fields
from torchroof.records.facts import StepFacts
from torchroof.records.ops import PHASES, block_index, layer_key, stack_key
from torchroof.report import analysis
from torchroof.report.checks import EstimateFileError, estimate_problems
from torchroof.report.kinds import Boundary, KernelBound, Link, Stream, Unit
from torchroof.report.memory import MemoryFootprint
from torchroof.report.pipeline_step import PipelineStep

__all__ = [
    "ESTIMATE_FORMAT_VERSION",
    "Estimate",
    "KernelEstimate",
    "LayerRow",
    "collapse_repeats",
    "layer_key",
    "merge_stacks",
]

# 2: kernels carry the hierarchical roofline's fields (boundary, level_bytes, tile, waves,
# wave_efficiency, in_flight_bytes, overhead_s) and the estimate its per-layer rows; a
# version-1 file reads with those at their defaults. 3: scheduled kernels carry the kernels
# they wait for (waits_on); an older file's schedule cannot be re-laid (torchroof.render.html).
# 4: fields added after 3, among them a kernel's pipelined_with (the GEMM a collective runs
# beside) and lane (its communication stream), and the estimate's host_overhead_s,
# offload_exposed_s and fp16_accumulate; a reader of format 3 would refuse them by name, so
# it now says the version instead, and a version-3 file reads with them at their defaults.
# 5: the pricing options' cuda_graphs (every step launched eagerly when false); a version-4
# file reads with it at its default, true. 6: a pipeline's rank rows carry their memory and
# its floor (memory_bytes, floor_bytes); a version-5 file reads with them at 0.
ESTIMATE_FORMAT_VERSION = 6
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6)


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
    unit: Unit
    dtype: str
    counted: bool
    peak_flops_per_s: float
    compute_s: float
    memory_s: float
    time_s: float
    bound: KernelBound
    read_by: dict[str, int] = field(default_factory=dict)  # bytes read, by category
    written_by: dict[str, int] = field(default_factory=dict)  # bytes written, by category
    flags: tuple[str, ...] = ()  # warnings, e.g. a fused group past the on-chip budget
    # A multi-GPU step (torchroof.pricing.price.time_collective, torchroof.timing.streams); the
    # defaults are a single-GPU kernel's, so estimates saved before these fields load.
    link: Link = ""  # a collective's boundary: nvlink / xgmi / network / hierarchical / none
    wire_by_link: dict[str, int] = field(default_factory=dict)  # bytes one rank sends, by link
    network_s: float = 0.0  # a collective's alpha + wire bytes / beta
    stream: Stream = "compute"  # "communication" for collectives and the copies feeding them
    start_s: float | None = None  # on the step's schedule; None when nothing was laid
    exposed_s: float = 0.0  # communication kernels: compute-stream idle time charged to it
    first_op: int = -1  # the trace index of its first op (-1: not known)
    latency_s: float = 0.0  # a collective's alpha (per-message latency) within network_s
    # The hierarchical roofline and realistic mode (torchroof.timing.roofline): which term binds
    # (compute / hbm / l2 / smem / registers / latency), bytes at each boundary, a GEMM's
    # tile, its waves over the SMs, the bytes it keeps in flight and the launch in time_s.
    boundary: Boundary = ""
    level_bytes: dict[str, float] = field(default_factory=dict)
    tile: str = ""
    waves: int = 0
    wave_efficiency: float = 1.0
    in_flight_bytes: float = 0.0
    overhead_s: float = 0.0
    # the earlier kernels (by index) on the other stream whose end this one waits for on
    # the step's schedule (torchroof.timing.streams.waits); () off the schedule; None: not
    # recorded (read from a file older than format 3)
    waits_on: tuple[int, ...] | None = ()
    # the kernel on the other stream it runs in chunks beside (a tensor-parallel all-gather
    # and the GEMM reading it, a GEMM and the reduce-scatter of its output:
    # torchroof.timing.tp_overlap); None: none
    pipelined_with: int | None = None
    # a communication kernel's stream (torchroof.timing.streams.lane_of): "intra-node" or
    # "network", the link its collective crosses; "" for a compute kernel, or one laid
    # before collectives had a stream per link (one communication stream)
    lane: str = ""

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def communication(self) -> bool:
        """Runs on the communication stream (a collective, or a copy feeding one)."""
        return self.stream == "communication" or self.unit == "network"

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends over every link."""
        return sum(self.wire_by_link.values())

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
        data["waits_on"] = None if self.waits_on is None else list(self.waits_on)
        if self.pipelined_with is None:  # files from before it stay as they were
            del data["pipelined_with"]
        if not self.lane:
            del data["lane"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelEstimate:
        return cls(
            **{
                **data,
                "ops": tuple(data["ops"]),
                "flags": tuple(data.get("flags", ())),
                "waits_on": None if data.get("waits_on") is None else tuple(data["waits_on"]),
            }
        )


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
    # communication kernels' time the compute stream waited on, and the rest (overlapped)
    exposed_communication_s: float = 0.0
    hidden_communication_s: float = 0.0
    link_s: dict[str, float] = field(default_factory=dict)  # collectives' time per link

    def add(self, kernel: KernelEstimate) -> None:
        self.kernels += 1
        self.flops += kernel.flops
        self.bytes += kernel.bytes
        self.time_s += kernel.time_s
        self.phase_s[kernel.phase] = self.phase_s.get(kernel.phase, 0.0) + kernel.time_s
        if kernel.communication:
            self.exposed_communication_s += kernel.exposed_s
            self.hidden_communication_s += kernel.time_s - kernel.exposed_s
            if kernel.link:
                self.link_s[kernel.link] = self.link_s.get(kernel.link, 0.0) + kernel.time_s
        elif kernel.bound == "memory":
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
        self.exposed_communication_s += other.exposed_communication_s
        self.hidden_communication_s += other.hidden_communication_s
        for phase, seconds in other.phase_s.items():
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        for link, seconds in other.link_s.items():
            self.link_s[link] = self.link_s.get(link, 0.0) + seconds
        for category, size in other.traffic.items():
            self.traffic[category] = self.traffic.get(category, 0) + size

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    @property
    def communication_s(self) -> float:
        """Time of the row's communication kernels, exposed or not."""
        return self.exposed_communication_s + self.hidden_communication_s

    @property
    def memory_bound_share(self) -> float:
        """Share of the row's time in memory-bound kernels ("time memory-bound")."""
        return self.memory_bound_s / self.time_s if self.time_s else 0.0

    def mfu(self, peak_flops_per_s: float) -> float:
        """The row's W / (T · pi) against ``peak_flops_per_s`` ("MFU (this layer)")."""
        return self.flops / (self.time_s * peak_flops_per_s) if self.time_s else 0.0

    @property
    def bound(self) -> str:
        """The pipe that holds most of this row's kernel time: memory (memory-bound compute
        kernels), the network (its communication kernels) or compute; a tie goes to memory."""
        if not self.communication_s:
            return "memory" if self.memory_bound_s * 2 >= self.time_s else "compute"
        compute_s = self.time_s - self.memory_bound_s - self.communication_s
        if self.memory_bound_s >= max(self.communication_s, compute_s):
            return "memory"
        return "network" if self.communication_s >= compute_s else "compute"

    @property
    def boundary(self) -> str:
        """The bound with the boundary it is at: ``network (nvlink)`` names the link that
        carries most of the row's communication time; other bounds as :attr:`bound`."""
        bound = self.bound
        if bound != "network" or not self.link_s:
            return bound
        return f"network ({max(self.link_s, key=self.link_s.__getitem__)})"


def collapse_repeats(rows: list[LayerRow]) -> list[LayerRow]:
    """Merge runs of consecutive identical blocks (``model.layers.0`` ... ``.31`` with equal
    kernels, FLOPs and bytes) into one summed row named ``model.layers.0-31 (x32)``."""
    merged: list[LayerRow] = []
    run: list[LayerRow] = []

    def flush() -> None:
        if len(run) > 1:
            first, last = block_index(run[0].name), block_index(run[-1].name)
            assert first is not None and last is not None  # only numbered blocks make a run
            total = LayerRow(f"{first[0]}.{first[1]}-{last[1]} (x{len(run)})")
            for row in run:
                total.merge(row)
            merged.append(total)
        else:
            merged.extend(run)
        run.clear()

    for row in rows:
        index = block_index(row.name)
        if run:
            prev = run[-1]
            prev_index = block_index(prev.name)
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


def merge_stacks(rows: list[LayerRow]) -> list[LayerRow]:
    """Sum every numbered block of a stack into one ``model.layers.* (xN)`` row, wherever the
    blocks sit, so two estimates line up whatever their kernels; other rows pass through."""
    merged: dict[str, LayerRow] = {}
    counts: dict[str, int] = {}
    for row in rows:
        key = stack_key(row.name)
        if key not in merged:
            merged[key] = LayerRow(key)
            counts[key] = 0
        merged[key].merge(row)
        counts[key] += 1
    for key, row in merged.items():
        if counts[key] > 1:
            row.name = f"{key} (x{counts[key]})"
    return list(merged.values())


@dataclass
class Estimate:
    """A step priced on one accelerator, or on one rank of a cluster (``cluster``: its name;
    None for one GPU). Internal units: FLOPs, bytes, seconds."""

    hardware: str
    hardware_display: str
    hbm_bytes_per_s: float
    reference_peak_flops_per_s: float  # the dense tensor peak MFU is measured against
    reference_dtype: str
    kernels: list[KernelEstimate]
    op_count: int
    uncounted: dict[str, int]
    assumptions: list[str] = field(default_factory=list)
    options: PricingOptions = field(default_factory=PricingOptions)  # how it was priced
    facts: StepFacts = field(default_factory=StepFacts)  # what the traced step was
    memory: MemoryFootprint | None = None
    cluster: str | None = None
    link_ridges: dict[str, float] = field(default_factory=dict)  # FLOP/B, per cluster link
    step_time_s: float | None = None  # the step schedule's, when the step communicates
    pipeline: PipelineStep | None = (
        None  # a pipelined step's schedule (torchroof.parallel.pipeline.price)
    )
    # host time per step the GPU waits on under the runtime (realistic mode: a serving
    # engine's scheduling, sampling and detokenisation), added to the step time
    host_overhead_s: float = 0.0
    # activation offload (torchroof.pricing.offload): its copies' time not hidden behind the
    # layers' compute, added to the step time
    offload_exposed_s: float = 0.0
    # its fp16 matmuls accumulate in fp16 (a runtime profile's fp16_accumulate): a part that
    # lists a faster rate for that (a GeForce card) times them there; the HTML report's
    # ceilings follow, on whichever part it re-prices the step
    fp16_accumulate: bool = False
    # the calibrated mode's factor on the realistic times: the median measured / realistic of
    # the published runs like the step (torchroof.accuracy.expected.correction), already in
    # every time of the step (:meth:`calibrated`); 1 otherwise
    correction: float = 1.0

    # -- totals ---------------------------------------------------------------------------
    @property
    def time_s(self) -> float:
        """The step time: the schedule's last end when the step has collectives
        (torchroof.timing.streams), else the kernels' times summed (they run back to back);
        plus the runtime's host time per step and the exposed time of activation offload."""
        added = self.host_overhead_s + self.offload_exposed_s
        if self.step_time_s is not None:
            return self.step_time_s + added
        return analysis.added(k.time_s for k in self.kernels) + added

    def calibrated(self, factor: float) -> Estimate:
        """The step with every time of its schedule times ``factor`` (the calibrated mode):
        each kernel's time, start and exposed time, the schedule's end, the host and offload
        time; a uniform factor keeps the schedule's order, so every share (by phase, layer,
        memory-bound, exposed communication) is the realistic mode's. The kernels' roofline
        terms (compute, memory, network, launch) stay as the realistic mode timed them."""
        if factor == 1.0:
            return self

        def scaled(value: float | None) -> float | None:
            return None if value is None else value * factor

        kernels = []
        for k in self.kernels:
            # a shallow copy with three fields set: dataclasses.replace would run __init__
            # over every field, 10 ms against 2.7 for Llama-3-8B decode's 581 kernels
            copied = copy.copy(k)
            vars(copied).update(
                time_s=k.time_s * factor, start_s=scaled(k.start_s), exposed_s=k.exposed_s * factor
            )
            kernels.append(copied)
        return replace(
            self,
            kernels=kernels,
            step_time_s=scaled(self.step_time_s),
            host_overhead_s=self.host_overhead_s * factor,
            offload_exposed_s=self.offload_exposed_s * factor,
            correction=self.correction * factor,
        )

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    def phase_time_s(self, phase: str) -> float:
        return analysis.added(k.time_s for k in self.kernels if k.phase == phase)

    def traffic(self) -> dict[str, int]:
        """HBM bytes by category (weights, activations, kv_cache, gradients,
        optimizer_state) over the whole step."""
        total: dict[str, int] = {}
        for kernel in self.kernels:
            for category, size in kernel.traffic.items():
                total[category] = total.get(category, 0) + size
        return total

    @property
    def workload(self) -> Workload | None:
        """The step's Workload (None for a step traced by hand)."""
        return self.facts.workload

    @property
    def metadata(self) -> dict[str, Any]:
        """The step's facts as saved (only the fields that are set)."""
        return self.facts.to_dict()

    # -- grouping -------------------------------------------------------------------------
    def rows(self, depth: int | None = None, collapse: bool = False) -> list[LayerRow]:
        """Per-layer budget rows in execution order (first appearance); ``collapse`` sums
        runs of identical consecutive blocks (:func:`collapse_repeats`)."""
        rows: dict[str, LayerRow] = {}
        for kernel in self.kernels:
            key = layer_key(kernel.module, kernel.phase, depth)
            row = rows.get(key)
            if row is None:
                row = rows[key] = LayerRow(key)
            row.add(kernel)
        return collapse_repeats(list(rows.values())) if collapse else list(rows.values())

    def stack_rows(self, depth: int | None = None) -> list[LayerRow]:
        """Per-layer rows with each stack of blocks summed into one (:func:`merge_stacks`)."""
        return merge_stacks(self.rows(depth))

    # -- derived figures: torchroof.report.analysis ----------------------------------------------
    @property
    def mfu(self) -> float:
        return analysis.mfu(self)

    @property
    def memory_bound_share(self) -> float:
        return analysis.memory_bound_share(self)

    @property
    def tokens_per_s(self) -> float:
        return analysis.tokens_per_s(self)

    @property
    def kv_bytes_read(self) -> int:
        return analysis.kv_bytes_read(self)

    @property
    def weight_bytes_read(self) -> int:
        return analysis.weight_bytes_read(self)

    @property
    def ridge_batch(self) -> float:
        return analysis.ridge_batch(self)

    @property
    def kv_crossover_batch(self) -> float:
        return analysis.kv_crossover_batch(self)

    def communication(self) -> analysis.Communication:
        return analysis.communication(self)

    def network_intensity(self) -> dict[str, analysis.LinkIntensity]:
        return analysis.network_intensity(self)

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
            "options": self.options.to_dict(),
            "metadata": self.facts.to_dict(),
            "memory": self.memory.to_dict() if self.memory else None,
            "cluster": self.cluster,
            "link_ridges": self.link_ridges,
            "step_time_s": self.step_time_s,
            "host_overhead_s": self.host_overhead_s,
            "offload_exposed_s": self.offload_exposed_s,
            **({"fp16_accumulate": True} if self.fp16_accumulate else {}),
            **({"correction": self.correction} if self.correction != 1.0 else {}),
            "pipeline": self.pipeline.to_dict() if self.pipeline else None,
            "totals": {
                "time_s": self.time_s,
                "flops": self.flops,
                "bytes": self.bytes,
                "mfu": self.mfu,
                "memory_bound_share": self.memory_bound_share,
                "tokens_per_s": self.tokens_per_s,
                "traffic": self.traffic(),
            },
            "layers": [
                {
                    "name": row.name,
                    "kernels": row.kernels,
                    "flops": row.flops,
                    "bytes": row.bytes,
                    "time_s": row.time_s,
                    "mfu": row.mfu(self.reference_peak_flops_per_s),
                    "memory_bound_share": row.memory_bound_share,
                    "bound": row.boundary,
                }
                for row in self.rows()
            ],
            "kernels": [k.to_json() for k in self.kernels],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Estimate:
        if data.get("format") != "torchroof-estimate":
            raise ValueError("not a torchroof estimate (missing format marker)")
        if data.get("version") not in READABLE_FORMAT_VERSIONS:
            raise ValueError(f"estimate format version {data.get('version')} is not supported")
        if problems := estimate_problems(data, KernelEstimate):
            raise EstimateFileError(problems)
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
            options=_pricing_options(data["options"]),
            facts=StepFacts.from_dict(data["metadata"]),
            memory=MemoryFootprint(**data["memory"]) if data.get("memory") else None,
            cluster=data.get("cluster"),
            link_ridges=data.get("link_ridges", {}),
            step_time_s=data.get("step_time_s"),
            host_overhead_s=data.get("host_overhead_s", 0.0),
            offload_exposed_s=data.get("offload_exposed_s", 0.0),
            fp16_accumulate=data.get("fp16_accumulate") is True,
            correction=data.get("correction", 1.0),
            pipeline=PipelineStep.from_dict(data["pipeline"]) if data.get("pipeline") else None,
        )

    @classmethod
    def from_json(cls, source: str | Path) -> Estimate:
        """Read an estimate from a JSON file path or a JSON string."""
        text = str(source)
        where = "estimate"
        if not text.lstrip().startswith("{"):
            where = f"estimate {source}"
            try:
                text = Path(source).read_text()
            except OSError as error:
                raise ValueError(f"{where}: cannot read it: {error.strerror or error}") from None
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{where}: not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a torchroof estimate (not a JSON object)")
        try:
            return cls.from_dict(data)
        except EstimateFileError as error:
            raise EstimateFileError(error.problems, where) from None
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def _pricing_options(saved: dict[str, Any]) -> PricingOptions:
    """The PricingOptions an estimate file holds, rebuilt (and so re-checked); a field this
    torchroof does not know is refused by name."""
    if unknown := unknown_fields(PricingOptions, saved):
        raise ValueError(f"the saved pricing options have fields this torchroof lacks: {unknown}")
    return PricingOptions(**saved)

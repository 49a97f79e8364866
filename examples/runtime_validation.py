"""Every measured run priced with the runtime that ran it: pure roofline and realistic mode.

Each run of ``examples/validation/*_runs.json`` names the software that ran it
(``runtime``: torchtitan, megatron-te, vllm, trtllm, gpt-fast, ...; ``unknown`` where the
source does not say). This script asks torchroof for each run it can express exactly as
the single-GPU, multi-GPU and quantised validation scripts ask (the same requests, the same
units), but with ``runtime=`` that profile: its kernels, its launches, its host time per
step and its small all-reduces (a run whose runtime is unknown is priced as those scripts
price it). The kernel microbenchmarks (GEMMs, attention, streams, launches) run no
runtime and are priced as they are. It prints one row per run and the medians of the
ratios by kind (train, prefill, decode, kernel) and by runtime; ``--write`` stores them in
``examples/validation/runtime_predictions.json`` and ``--markdown PAGE`` writes the tables
into a docs page from that file (no pricing).

ratio = predicted time / measured time for the same work (< 1: torchroof predicts faster).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import torchroof

HERE = Path(__file__).resolve().parent
PREDICTIONS_JSON = HERE / "validation" / "runtime_predictions.json"
RUNTIME_RUNS_JSON = HERE / "validation" / "runtime_runs.json"
UNKNOWN = "unknown"
KINDS = ("train", "prefill", "decode", "kernel")


if str(HERE) not in sys.path:  # the other validation scripts, beside this one
    sys.path.insert(0, str(HERE))

import single_gpu_validation as sgv  # noqa: E402  (after the path above)

qv = sgv.qv
mgv = qv.mgv


@dataclass(frozen=True)
class Asked:
    """One run as asked: its request (phases and unit), its runtime, the pricing keywords
    beyond the runtime, and which file it came from."""

    run: dict[str, Any]
    request: Any  # multi_gpu_validation.Request
    runtime: str
    extra: Mapping[str, Any]
    source: str
    # the run with the other KV cache dtype, where the source does not publish it: priced
    # instead when the request's own cache cannot fit the GPU (the run ran, so it fit)
    alternative: Any = None

    @property
    def kind(self) -> str:
        return str(self.run.get("kind") or self.run["regime"])


def _with_runtime(request: Any, runtime: str) -> Any:
    """The request with every phase priced under ``runtime`` (unknown: as it was)."""
    if runtime == UNKNOWN:
        return request
    phases = tuple(replace(p, runtime=runtime) for p in request.phases)
    return replace(request, phases=phases, eager=())


def asked_runs() -> list[Asked]:
    """Every run the three validation scripts express, with its runtime."""
    out = []
    for run in mgv.load_data()["runs"]:
        choice = mgv.CHOICES.get(run["id"])
        if choice is not None:
            req = _with_runtime(mgv.request(run, choice), run["runtime"])
            out.append(Asked(run, req, run["runtime"], {}, "multi-GPU"))
    for run in sgv.load_runs():
        if run["kind"] in sgv.KERNELS or run["id"] in sgv.NOT_PREDICTED:
            continue
        asked = sgv.model_request(run)
        if asked is not None:
            req = _with_runtime(asked.request, run["runtime"])
            out.append(Asked(run, req, run["runtime"], dict(asked.pricing), "single-GPU"))
    for run in qv.load_runs():
        choice = qv.choose(run)
        if isinstance(choice, str):
            continue
        req = _with_runtime(qv.request(run, choice), run["runtime"])
        other = choice.alternative_kv
        alt = _with_runtime(qv.request(run, choice, other), run["runtime"]) if other else None
        out.append(Asked(run, req, run["runtime"], {}, "quantised", alt))
    for run in runtime_runs():
        asked = new_request(run)
        if not isinstance(asked, str):
            req = _with_runtime(asked, run["runtime"])
            offload = run.get("activation_offload_layers")  # Megatron's cpu_offloading
            extra = {"offload_activations": offload} if offload else {}
            out.append(Asked(run, req, run["runtime"], extra, "runtime"))
    return out


def not_predicted() -> list[list[str]]:
    """The collected runs torchroof cannot express yet, with the reason."""
    rows = []
    for run in runtime_runs():
        reason = new_request(run)
        if isinstance(reason, str):
            rows.append([run["id"], run["runtime"], _measured(run), reason])
    return rows


# -- runtime_runs.json: the runs collected with their runtime ------------------------------

FP8_TRAIN = (
    "Transformer Engine's fp8 current scaling priced as torchao's Float8 tensorwise recipe (per-"
    "tensor scales computed from the tensor being cast, the same recipe); Megatron's DDP as "
    "HSDP replicas (gradient all-reduce), its distributed optimizer and recompute not stated"
)
MEGATRON_FSDP = "Megatron FSDP priced as FSDP2 over the same ranks"
BF16_REDUCE = (
    "gradients reduced in bf16, as the performance recipe sets (grad_reduce_in_fp32=False)"
)
NOT_PREDICTED_NEW = {
    "hfblog-a100x4-granite7b-deepspeed-zero3-bs8": "Granite-7B: no shipped config",
    "hfblog-a100x4-granite7b-fsdp-fullshard-bs8": "Granite-7B: no shipped config",
    "trtllm090-l40sx4-mixtral-tp4-ttft-bs1-in2048-fp8": "no L40S cluster ships; fp8 with TP 4",
}


def _train_new(run: dict[str, Any]) -> Any:
    """A collected training run as multi_gpu_validation asks one: rank 0's step of
    ``micro_batch`` sequences, ``grad_accum`` micro-batches, tokens/s per GPU."""
    par = run["parallelism"]
    workload: dict[str, Any] = {
        "batch": run["micro_batch"],
        "seq": run["seq_len"],
        "tp": par["tp"],
        "fsdp": par["dp_shard"],
        "dp": par["dp_replicate"],
        "microbatches": run["grad_accum"],
        "precision": "mixed",
        "quant": "fp8" if "fp8" in run["precision"].lower() else "none",
    }
    if par["tp"] > 1:
        workload["sequence_parallel"] = True  # Megatron's TP always runs sequence parallel
    if par.get("pp", 1) > 1:
        workload.update(pp=par["pp"], pp_schedule=par["pp_schedule"])
        workload["virtual_stages"] = par.get("virtual_stages") or 1
    if par.get("ep", 1) > 1:
        workload["ep"] = par["ep"]
    cp = par.get("cp", 1)
    if cp > 1:  # Transformer Engine's ring priced as torch's (the same K/V bytes)
        workload["cp"] = cp
    if run.get("grad_reduce_dtype"):  # the recipe's grad_reduce_in_fp32 (run["inferred"])
        workload["reduce_dtype"] = run["grad_reduce_dtype"]
    phase = mgv.Phase(
        "train step", run["model"]["torchroof_config"], {}, "train", run["hardware"],
        workload, "fused", 1.0,
    )  # fmt: skip
    pp = par.get("pp", 1)
    # a pipeline's pp x tp x cp ranks share one replica's tokens
    tokens = run["micro_batch"] * run["seq_len"] * run["grad_accum"] / (par["tp"] * pp * cp)
    notes = [FP8_TRAIN] + ([MEGATRON_FSDP] if par["dp_shard"] > 1 else [])
    if cp > 1:
        notes.append(mgv.CP_RING)
    if run.get("grad_reduce_dtype") == "bf16":
        notes.append(BF16_REDUCE)
    figure = mgv.Figure(run["measured"]["unit"], work=tokens)
    return mgv.Request(run["id"], (phase,), figure, "; ".join(notes))


def _serve_new(run: dict[str, Any]) -> Any:
    """A collected serving run: time to first token (a prefill), a decode step's latency, or
    a static batch's output tokens/s per GPU (its prefill, then a decode step per further
    token at the first and last context, as quant_validation asks TensorRT-LLM's)."""
    tp = run["parallelism"]["tp"]
    model = run["model"]["torchroof_config"]
    # TensorRT-LLM's fp16 builds; transformers' grouped-GEMM experts take bf16 only, which
    # has the same bytes and the same tensor peak
    fp16 = run["runtime"] == "trtllm" and "mixtral" not in model
    workload = {"tp": tp, "dtype": "fp16" if fp16 else "bf16"}
    workload.update(quant=run["quant"], kv_dtype=run["kv_dtype"])
    unit = run["measured"]["unit"]
    batch, prompt, new = run["batch"], run["prompt_tokens"], run["generated_tokens"]

    def phase(regime: str, weight: float, **sizes: Any) -> Any:
        label = "prefill" if regime == "prefill" else f"decode step (context {sizes['context']})"
        return mgv.Phase(
            label, model, {}, regime, run["hardware"], {**workload, **sizes}, "fused", weight
        )

    if new == 1:  # time to first token
        phases = (phase("prefill", 1.0, batch=batch, seq=prompt),)
        return mgv.Request(run["id"], phases, mgv.Figure(unit, seconds_per_unit=1e-3), "")
    if unit.startswith("s, median decode step"):
        phases = (phase("decode", 1.0, batch=batch, context=prompt + new // 2),)
        return mgv.Request(run["id"], phases, mgv.Figure(unit), "")
    steps = new - 1
    contexts = [prompt, prompt + steps - 1]
    generate = (
        phase("prefill", 1.0, batch=batch, seq=prompt),
        *(phase("decode", steps / 2, batch=batch, context=c) for c in contexts),
    )
    if unit.startswith("s, end-to-end latency"):  # one batch's prefill and decode steps
        return mgv.Request(run["id"], generate, mgv.Figure(unit), "vLLM's latency benchmark")
    figure = mgv.Figure(unit, work=batch * new / tp)  # output tokens per GPU
    return mgv.Request(
        run["id"], generate, figure, "TensorRT-LLM's static batch (gptSessionBenchmark)"
    )


def new_request(run: dict[str, Any]) -> Any:
    """The request for a run of runtime_runs.json, or the reason it is not predicted."""
    if run["id"] in NOT_PREDICTED_NEW:
        return NOT_PREDICTED_NEW[run["id"]]
    if run["regime"] == "train":
        return _train_new(run)
    return _serve_new(run)


def runtime_runs() -> list[dict[str, Any]]:
    return list(json.loads(RUNTIME_RUNS_JSON.read_text())["runs"])


GIB = 2**30


@dataclass(frozen=True)
class Priced:
    """One step priced in both modes, and its footprint per GPU against the capacity."""

    pure_s: float
    realistic_s: float
    memory_bytes: int
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class Row:
    """A run's measured time and both predictions of it under its runtime."""

    run_id: str
    kind: str
    runtime: str
    hardware: str
    measured: str
    measured_s: float
    pure_s: float
    realistic_s: float
    source: str
    memory_gib: float | None = None  # the largest step's footprint per GPU (None: kernels)
    capacity_gib: float | None = None
    reading: str = ""  # a reading of the run chosen here that its source does not state
    published_memory_gib: float | None = None  # the peak memory the source reports

    @property
    def fits(self) -> bool | None:
        """The footprint fits the GPU's memory (None: not estimated, a kernel)."""
        if self.memory_gib is None or self.capacity_gib is None:
            return None
        return self.memory_gib <= self.capacity_gib

    @property
    def pure_ratio(self) -> float:
        return self.pure_s / self.measured_s

    @property
    def realistic_ratio(self) -> float:
        return self.realistic_s / self.measured_s

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "kind": self.kind,
            "runtime": self.runtime,
            "hardware": self.hardware,
            "measured": self.measured,
            "measured_s": self.measured_s,
            "pure_s": self.pure_s,
            "realistic_s": self.realistic_s,
            "pure_ratio": self.pure_ratio,
            "realistic_ratio": self.realistic_ratio,
            "memory_gib": self.memory_gib,
            "capacity_gib": self.capacity_gib,
            "fits": self.fits,
            "source": self.source,
            **({"reading": self.reading} if self.reading else {}),
            **(
                {"published_memory_gib": self.published_memory_gib}
                if self.published_memory_gib is not None
                else {}
            ),
        }


class Pricer:
    """Traces each distinct step once (keeping the last trace) and prices it in both modes."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._trace: Any = None

    def __call__(self, phase: Any, extra: Mapping[str, Any]) -> Priced:
        if phase.trace_key != self._key:
            model: Any = phase.model
            if phase.overrides:
                model = mgv.load_config(phase.model)
                for name, value in phase.overrides.items():
                    setattr(model, name, value)
            self._trace = None
            self._trace = torchroof.trace_model(model, phase.regime, **phase.traced)
            self._key = phase.trace_key
        pricing = {**phase.pricing(), **extra}
        pure, real = (
            self._trace.estimate(phase.hardware, mode=mode, **pricing)
            for mode in ("roofline", "realistic")
        )
        memory = real.memory
        return Priced(pure.time_s, real.time_s, memory.total_bytes, memory.capacity_bytes)


def price(asked: list[Asked], progress: Callable[[str], None] = print) -> list[Row]:
    """Every asked run priced in both modes; phases grouped by trace, each traced once."""
    by_trace: dict[str, list[tuple[Any, Mapping[str, Any]]]] = defaultdict(list)
    for a in asked:
        for request in (a.request, a.alternative):
            for phase in request.phases if request is not None else ():
                by_trace[phase.trace_key].append((phase, a.extra))
    priced: dict[str, Priced] = {}
    pricer = Pricer()
    for group in by_trace.values():
        for phase, extra in group:
            key = f"{phase.key}|{json.dumps(dict(extra), sort_keys=True)}"
            if key not in priced:
                progress(f"  {phase.model} {phase.label} on {phase.hardware} ({phase.runtime})")
                priced[key] = pricer(phase, extra)

    def steps_of(request: Any, extra: Mapping[str, Any]) -> list[tuple[float, Priced]]:
        keys = [f"{p.key}|{json.dumps(dict(extra), sort_keys=True)}" for p in request.phases]
        return [(p.weight, priced[k]) for p, k in zip(request.phases, keys, strict=True)]

    def largest(steps: list[tuple[float, Priced]]) -> Priced:
        return max((step for _, step in steps), key=lambda step: step.memory_bytes)

    rows = []
    for a in asked:
        steps, reading = steps_of(a.request, a.extra), ""
        if a.alternative is not None and not largest(steps).fits:
            other = steps_of(a.alternative, a.extra)
            if largest(other).fits:
                kv = a.alternative.phases[0].workload.get("kv_dtype")
                steps, reading = other, f"{kv} KV cache: not published, and the model's dtype "
                reading += "would not fit the GPU"
        pure = sum(weight * step.pure_s for weight, step in steps)
        real = sum(weight * step.realistic_s for weight, step in steps)
        measured_s = a.request.figure.seconds(a.run["measured"]["value"])
        hardware = a.request.phases[0].hardware
        most = largest(steps)
        rows.append(
            Row(a.run["id"], a.kind, a.runtime, hardware, _measured(a.run), measured_s, pure, real,
                a.source, most.memory_bytes / GIB, most.capacity_bytes / GIB, reading,
                published_memory_gib(a.run))
        )  # fmt: skip
    return rows


PUBLISHED_MEMORY = {
    "peak_memory_gib": GIB,  # torchtitan's logged peak (GiB)
    "peak_memory_active_GiB": GIB,  # torchtune's peak active memory
    "peak_memory_GB": 1e9,  # torchao's benchmarks print GB (10^9 B)
}


def published_memory_gib(run: Mapping[str, Any]) -> float | None:
    """The peak memory per GPU a run's source reports, in GiB (None: not reported)."""
    also = run["measured"].get("also") or {}
    for key, unit in PUBLISHED_MEMORY.items():
        if key in also:
            return float(also[key]) * unit / GIB
    text = also.get("peak_memory_per_gpu")  # torchtune's README tables: "16.2 GiB"
    if isinstance(text, str) and text.endswith(" GiB"):
        return float(text.removesuffix(" GiB"))
    return None


def kernel_rows(progress: Callable[[str], None] = print) -> list[Row]:
    """The kernel microbenchmarks, priced as single_gpu_validation prices them."""
    rows = []
    for run in sgv.load_runs():
        if run["kind"] not in sgv.KERNELS or run["id"] in sgv.NOT_PREDICTED:
            continue
        progress(f"  {run['id']}")
        r = sgv.kernel_row(run)
        rows.append(
            Row(r.run_id, "kernel", "none", r.hardware, r.measured, r.measured_s, r.pure_s,
                r.realistic_s, "single-GPU")
        )  # fmt: skip
    return rows


def _measured(run: dict[str, Any]) -> str:
    return f"{run['measured']['value']:g} {run['measured']['unit'].split(' (')[0]}"


def medians(rows: Iterable[Row], by: Callable[[Row], str]) -> dict[str, dict[str, Any]]:
    """Per group: how many runs, the pure and realistic medians, the realistic quartiles."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        groups[by(row)].append(row)
    out = {}
    for name, group in sorted(groups.items()):
        real = sorted(r.realistic_ratio for r in group)
        pure = sorted(r.pure_ratio for r in group)
        quartiles = statistics.quantiles(real, n=4) if len(real) > 1 else [real[0]] * 3
        out[name] = {
            "runs": len(group),
            "pure_median": statistics.median(pure),
            "pure_max": pure[-1],
            "realistic_median": statistics.median(real),
            "realistic_quartiles": [quartiles[0], quartiles[2]],
            "realistic_range": [real[0], real[-1]],
        }
    return out


HEADERS = ["run", "kind", "runtime", "hardware", "measured", "pure", "realistic", "memory GiB"]
GROUP_HEADERS = ["", "runs", "pure median", "pure max", "realistic median", "middle half", "range"]


def table_rows(rows: Iterable[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            r["run"], r["kind"], r["runtime"], r["hardware"], r["measured"],
            f"{r['pure_ratio']:.2f}", f"{r['realistic_ratio']:.2f}", _memory(r),
        ]
        for r in rows
    ]  # fmt: skip


def _memory(row: Mapping[str, Any]) -> str:
    """``61.2 of 80 (fits)``; a dash for a kernel, whose memory is not estimated."""
    if row.get("memory_gib") is None:
        return "-"
    verdict = "fits" if row["fits"] else "does NOT fit"
    reading = f"; {row['reading']}" if row.get("reading") else ""
    return f"{row['memory_gib']:.1f} of {row['capacity_gib']:.0f} ({verdict}{reading})"


def group_rows(groups: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    return [
        [
            name, str(g["runs"]), f"{g['pure_median']:.2f}", f"{g['pure_max']:.2f}",
            f"{g['realistic_median']:.2f}",
            f"{g['realistic_quartiles'][0]:.2f}-{g['realistic_quartiles'][1]:.2f}",
            f"{g['realistic_range'][0]:.2f}-{g['realistic_range'][1]:.2f}",
        ]
        for name, g in groups.items()
    ]  # fmt: skip


def stored(rows: list[Row]) -> dict[str, Any]:
    return {
        "description": "runtime_validation.py: every predicted run under its runtime profile, "
        "pure and realistic (ratio = predicted / measured time)",
        "versions": {"torch": torch.__version__, "torchroof": torchroof.__version__},
        "by_kind": medians(rows, lambda r: r.kind),
        "by_runtime": medians(rows, lambda r: r.runtime),
        "predictions": [r.to_json() for r in rows],
    }


def markdown_tables(data: Mapping[str, Any]) -> dict[str, str]:
    """The docs page's tables (runtime-kinds, runtime-runtimes, runtime-runs from ``data``,
    the stored predictions; runtime-not-predicted from the collected runs)."""
    return {
        "runtime-kinds": mgv.markdown(group_rows(data["by_kind"]), ["kind", *GROUP_HEADERS[1:]]),
        "runtime-runtimes": mgv.markdown(
            group_rows(data["by_runtime"]), ["runtime", *GROUP_HEADERS[1:]]
        ),
        "runtime-runs": mgv.markdown(table_rows(data["predictions"]), HEADERS),
        "runtime-not-predicted": mgv.markdown(
            not_predicted(), ["not predicted", "runtime", "measured", "why"]
        ),
    }


def main() -> None:
    parser = mgv.run_parser(__doc__, PREDICTIONS_JSON)
    parser.add_argument(
        "--markdown",
        metavar="PAGE",
        help="write this script's tables, from the checked-in predictions (no pricing), into "
        "the docs page PAGE (docs/validation/runtimes.md)",
    )
    args = parser.parse_args()
    if args.markdown:
        import validation_markdown

        tables = markdown_tables(json.loads(PREDICTIONS_JSON.read_text()))
        validation_markdown.write_page(args.markdown, tables, Path(__file__).name)
        return
    asked = asked_runs()
    ids = {a.run["id"] for a in asked}
    mgv.check_runs(parser, args, ids, HERE / "validation")
    mgv.quiet()
    start = time.perf_counter()
    report, stage = mgv.stage_lines(args)
    chosen = [a for a in asked if not args.run or a.run["id"] in args.run]
    rows = price(chosen, progress=stage)
    if not args.run:
        rows += kernel_rows(progress=stage)
    report.end()
    data = stored(rows)
    print(mgv.markdown(table_rows(data["predictions"]), HEADERS))
    print()
    print(mgv.markdown(group_rows(data["by_kind"]), ["kind", *GROUP_HEADERS[1:]]))
    print()
    print(mgv.markdown(group_rows(data["by_runtime"]), ["runtime", *GROUP_HEADERS[1:]]))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.write:
        PREDICTIONS_JSON.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {PREDICTIONS_JSON}")


if __name__ == "__main__":
    main()

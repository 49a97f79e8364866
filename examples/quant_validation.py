"""Predict published quantised runs with torchroof and set each prediction, and each
quantised run's speedup over its unquantised baseline, beside the measurement.

The runs are ``examples/validation/quant_runs.json`` (sources: ``MULTI_GPU_SOURCES.md``,
"Quantised runs"). :func:`choose` maps each run to a torchroof request (the
judgement calls, one family of runs at a time) or gives the reason torchroof cannot express
it. Nothing is fitted. Steps, figures and ratios are those of ``multi_gpu_validation.py``,
imported from its path.

    python examples/quant_validation.py            # tables and a summary (~6 min)
    python examples/quant_validation.py --write    # also refresh quant_predictions.json
    python examples/quant_validation.py --run torchao-h100-llama31-8b-decode-bs1-int4wo-64

Conventions:

- ratio = predicted / measured time for the same work (< 1: torchroof predicts faster).
- speedup = the baseline's time / the quantised run's time for the same work, measured and
  predicted (for a rate: value / baseline value). The runs' ``baseline_id`` names the pairs.
- A batch-1 generate call (gpt-fast, torchao's generate.py): the prefill of the 6-token
  prompt (5 + BOS), then 199 decode steps, each reading the whole 206-slot static cache
  (prompt + 200 new tokens); tokens/s = 200 / time.
- TensorRT-LLM's static batch (gptSessionBenchmark): a prefill of B x in tokens, then out - 1
  decode steps whose cache grows from in to in + out - 2 tokens, priced as the mean of the
  first and the last; output tokens/s = B x out / time. Time to first token = one prefill.
- Training: one FSDP-8 step of one 8,192-token sequence per GPU; tokens/s per GPU = 8,192 /
  step time.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from torchroof.hardware import get_cluster
from torchroof.hardware.cluster import UnknownClusterError

from torchroof.models.sources import load_config

HERE = Path(__file__).resolve().parent
RUNS_JSON = HERE / "validation" / "quant_runs.json"
PREDICTIONS_JSON = HERE / "validation" / "quant_predictions.json"
GB = 1e9


def _load_multi_gpu_validation() -> ModuleType:
    """examples/multi_gpu_validation.py, loaded from its path (examples are not a package);
    registered under its name so its dataclasses resolve their module."""
    name = "multi_gpu_validation"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "multi_gpu_validation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mgv = _load_multi_gpu_validation()
Phase, Figure, Request, Prediction = mgv.Phase, mgv.Figure, mgv.Request, mgv.Prediction
StepTimes = mgv.StepTimes

# -- what each run is, in torchroof's terms ------------------------------------------------

LLAMA2_7B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,  # multi-head attention: no GQA
    "vocab_size": 32000,
    "num_hidden_layers": 32,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}
LLAMA2_7B_NOTE = (
    "Llama-2-7B = llama-3-8b with 11008 intermediate, 32 KV heads (no GQA), vocab 32000, "
    "4096 positions, rope_theta 1e4"
)
LLAMA2_70B: Mapping[str, Any] = mgv.LLAMA2_70B  # vocab 32000, 4096 positions
LLAMA2_70B_NOTE: str = mgv.LLAMA2_NOTE

GENERATE = (
    "compiled decode (fusion 'fused'; the prefill is not compiled, priced fused too); each "
    "decode step reads the whole 206-slot static cache (context 205)"
)
GPT_FAST_A100 = (
    "the 330 W A100 (README: ~1700 GB/s achievable) priced on a100-sxm at full clocks; "
    "gpt-fast quantises the LM head too, torchroof keeps it in bf16"
)
TORCHAO_GPU = (
    "the README's 'A100-80GB' / 'H100' priced as SXM parts; torchao's generate.py quantises "
    "the LM head too, torchroof keeps it in bf16"
)
INT4_GROUP = "int4 group {group} (torchroof's int4-weight prices group 128: fewer scale bytes)"
FLOAT8DQ_ROW = (
    "the README's 'float8dq (Per Row)' row read as per-row scales (its label; benchmarks.sh "
    "at the same commit runs the per-tensor flag)"
)
TRT = (
    "TensorRT engine priced with fused kernels; its LM head kept in fp16 (TensorRT-LLM's "
    "default, as torchroof)"
)
TRT_FP8 = (
    "TensorRT-LLM's static per-tensor fp8 scales (calibrated offline) priced as torchao's "
    "dynamic per-tensor recipe (adds the activations' amax reductions)"
)
TRT_STATIC = (
    "static batch: prefill of B x in, then out - 1 decode steps, each priced as the mean of "
    "the first and the last step's cache"
)
TRT_V061 = "v0.6.1 batch sizes above the printed build's --max_batch_size 64 (v0.5 commands)"
KV_UNKNOWN = (
    "KV cache dtype not published: priced in fp16 (the model's); in parentheses the ratio "
    "with an fp8 KV cache"
)
BEYOND = "priced beyond Llama-2's 4096 positions (as the run)"
TRAIN = (
    "torchtitan's per-op selective AC (checkpoint_policy 'selective'); "
    f"compiled (fusion 'fused'); {mgv.FP32_REDUCE}"
)
TRAIN_H100 = "'8xH100' (variant not stated) priced on dgx-h100 (SXM, 700 W)"
TRAIN_MI300X = "priced on nd-mi300x-v5 (8x MI300X 192 GB, xGMI full mesh)"
FP8_ALL_GATHER = (
    "torchroof's FSDP all-gathers bf16 weights (the run all-gathers fp8 with precomputed scales)"
)
MI300X_CLUSTER = "nd-mi300x-v5"

SPEEDUP_ONLY = "a speedup only (FP8 over FP16): no absolute figure to predict"
VLLM = (
    "vLLM offline throughput: the scheduler's concurrency (max_num_seqs, token budget, "
    "chunked prefill) is not published, so the steps cannot be laid out"
)
QUANT_TP = (
    "TP {tp}: each rank quantises its tensor-parallel shards (gpt-fast quantises the whole "
    "checkpoint, then shards the codes and scales)"
)
MOE_EXPERTS = (
    "gpt-fast's int8 covers the stacked expert weights, and so does torchroof's "
    "(torchroof/quant/packed_experts.py: one grouped GEMM per projection reads the int8 codes)"
)


@dataclass(frozen=True)
class Choice:
    """What a run's entry does not say in torchroof's terms. Sizes (batch, lengths, degrees)
    are read from the entry itself."""

    kind: str  # generate (batch-1 gpt-fast style), ttft, throughput (static batch), train
    hardware: str  # a spec name (one GPU) or a cluster (training)
    model: str
    overrides: Mapping[str, Any]
    note: str
    dtype: str = "bf16"  # prefill / decode
    kv_dtype: str = "model"
    alternative_kv: str | None = None  # KV dtype not published: also priced with this one
    workload: Mapping[str, Any] = field(default_factory=dict)  # other Workload knobs


def model_of(run: dict[str, Any]) -> tuple[str, Mapping[str, Any], str]:
    """(shipped config, config overrides, note): Llama-2 models are llama-3 configs with
    Llama-2's fields (multi_gpu_validation's LLAMA2_70B for 70B)."""
    hf_id = run["model"]["hf_id"]
    if "Llama-2-7b" in hf_id:
        return "llama-3-8b", LLAMA2_7B, LLAMA2_7B_NOTE
    if "Llama-2-70b" in hf_id:
        return "llama-3-70b", LLAMA2_70B, LLAMA2_70B_NOTE
    config = run["model"]["torchroof_config"]
    if config is None:
        raise ValueError(f"{run['id']}: no shipped config for {hf_id}")
    return config, {}, ""


def _int4_group(run: dict[str, Any]) -> int:
    """The run's int4 group size from its id (``int4-g32``, ``int4wo-64``)."""
    match = re.search(r"int4(?:wo)?-g?(\d+)", run["id"])
    if match is None:
        raise ValueError(f"{run['id']}: int4 run without a group size in its id")
    return int(match.group(1))


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _shipped_cluster(name: str) -> bool:
    try:
        get_cluster(name)
    except UnknownClusterError:
        return False
    return True


def choose(run: dict[str, Any]) -> Choice | str:
    """The request choices for ``run``, or the reason it is not predicted."""
    rid, par = run["id"], run["parallelism"]
    if run["measured"]["unit"].startswith("speedup"):
        return SPEEDUP_ONLY
    if rid.startswith("torchao-vllm-"):
        return VLLM
    moe = "mixtral" in (run["model"]["torchroof_config"] or "")
    tp = par["tp"]
    if run["gpu_count"] > 1 and run["regime"] != "train" and not rid.startswith("gptfast-"):
        raise ValueError(f"{rid}: a multi-GPU serving run without a rule")
    model, overrides, model_note = model_of(run)
    quant_notes = []
    if run["quant"] == "int4-weight":
        quant_notes.append(INT4_GROUP.format(group=_int4_group(run)))
    if rid.endswith("float8dq-row"):
        quant_notes.append(FLOAT8DQ_ROW)
    if run["regime"] == "train":
        cluster = run["torchroof_request"]["hardware"]
        if not _shipped_cluster(cluster):
            return f"no {cluster} cluster ships in hardware/clusters"
        gpu = TRAIN_MI300X if cluster == MI300X_CLUSTER else TRAIN_H100
        gather = FP8_ALL_GATHER if "fsdp_float8_all_gather" in run["quant_detail"] else ""
        return Choice("train", cluster, model, overrides, _join(TRAIN, gpu, gather))
    if rid.startswith(("gptfast-", "torchao-")):
        where = GPT_FAST_A100 if rid.startswith("gptfast-") else TORCHAO_GPU
        shards = QUANT_TP.format(tp=tp) if tp > 1 and run["quant"] != "none" else ""
        note = _join(model_note, GENERATE, where, *quant_notes, MOE_EXPERTS if moe else "", shards)
        if tp > 1:  # a tensor-parallel generate: rank 0 of tp on the run's cluster
            cluster = run["torchroof_request"]["hardware"]
            return Choice("generate", cluster, model, overrides, note, workload={"tp": tp})
        return Choice("generate", run["hardware"], model, overrides, note)
    if not rid.startswith("trtllm"):
        raise ValueError(f"{rid}: no rule for this source")
    dtype = "fp16"  # TensorRT-LLM's --dtype float16 builds
    kv = run["kv_dtype"]
    fp8 = TRT_FP8 if run["quant"] == "fp8" else ""
    if run["regime"] == "prefill":
        note = _join(model_note, TRT, fp8)
        kv_dtype = "fp8" if kv == "fp8" else "model"
        return Choice("ttft", run["hardware"], model, overrides, note, dtype, kv_dtype)
    unknown = kv == "unknown"
    beyond = run["prompt_tokens"] + run["generated_tokens"] > _positions(model, overrides)
    note = _join(
        model_note,
        TRT,
        fp8,
        TRT_STATIC,
        TRT_V061 if rid.startswith("trtllm061-") and run["batch"] > 64 else "",
        KV_UNKNOWN if unknown else "",
        BEYOND if beyond else "",
    )
    return Choice(
        "throughput",
        run["hardware"],
        model,
        overrides,
        note,
        dtype,
        kv_dtype="fp8" if kv == "fp8" else "model",
        alternative_kv="fp8" if unknown else None,
        workload={"allow_beyond_max_positions": True} if beyond else {},
    )


def _positions(model: str, overrides: Mapping[str, Any]) -> int:
    if "max_position_embeddings" in overrides:
        return int(overrides["max_position_embeddings"])
    return int(load_config(model).max_position_embeddings)


# -- requests --------------------------------------------------------------------------------

BOS = 1  # gpt-fast and torchao's generate.py encode the prompt with bos=True


def _phase(
    run: dict[str, Any], choice: Choice, regime: str, weight: float, kv_dtype: str, **sizes: Any
) -> Phase:
    label = {"train": "train step", "prefill": "prefill"}.get(regime, "decode step")
    if regime == "decode":
        label += f" (context {sizes['context']})"
    workload: dict[str, Any] = {"tp": 1, **sizes, "quant": run["quant"]}
    if regime == "train":
        workload.update(precision="mixed", checkpointing=True, checkpoint_policy="selective")
    else:
        workload.update(dtype=choice.dtype, kv_dtype=kv_dtype)
    workload.update(choice.workload)
    return Phase(
        label=label,
        model=choice.model,
        overrides=dict(choice.overrides),
        regime=regime,
        hardware=choice.hardware,
        workload=workload,
        fusion="fused",
        weight=weight,
    )


def request(run: dict[str, Any], choice: Choice, kv_dtype: str | None = None) -> Request:
    """The priced steps for ``run`` and how they become its measured figure (see the module
    docstring); ``kv_dtype`` replaces the choice's KV cache dtype."""
    kv = kv_dtype or choice.kv_dtype
    unit = run["measured"]["unit"]
    if choice.kind == "train":
        par = run["parallelism"]
        sizes = {"batch": run["batch"], "seq": run["seq_len"], "fsdp": par["dp_shard"]}
        sizes.update(dp=par["dp_replicate"], microbatches=1)
        phases = (_phase(run, choice, "train", 1.0, kv, **sizes),)
        tokens_per_gpu = run["batch"] * run["seq_len"]  # tp 1: a rank's own tokens
        return Request(run["id"], phases, Figure(unit, work=tokens_per_gpu), choice.note)
    batch, prompt = run["batch"], run["prompt_tokens"]
    if choice.kind == "ttft":
        phases = (_phase(run, choice, "prefill", 1.0, kv, batch=batch, seq=prompt),)
        return Request(run["id"], phases, Figure(unit, seconds_per_unit=1e-3), choice.note)
    new = run["generated_tokens"]
    steps = new - 1  # the prefill yields the first new token
    if choice.kind == "generate":
        prompt += BOS
        # a step holding `context` tokens writes the next slot and reads them all: the last
        # slot of the prompt + new static cache is context + 1
        contexts = [prompt + new - 1]
    else:  # the k-th decode step holds prompt + k - 1 tokens, k = 1 .. steps
        contexts = [prompt, prompt + steps - 1]
    prefill = _phase(run, choice, "prefill", 1.0, kv, batch=batch, seq=prompt)
    decodes = tuple(
        _phase(run, choice, "decode", steps / len(contexts), kv, batch=batch, context=c)
        for c in contexts
    )
    figure = Figure(unit, work=batch * new)  # one GPU: tokens per GPU = tokens
    return Request(run["id"], (prefill, *decodes), figure, choice.note)


# -- prediction --------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantPrediction:
    """A run's prediction; where its KV cache dtype is not published, also the prediction
    with the alternative dtype."""

    run: dict[str, Any]
    choice: Choice
    main: Prediction
    alternative: Prediction | None = None


@dataclass(frozen=True)
class Speedup:
    """A quantised run against its baseline (the same work on the same GPU)."""

    quantised: QuantPrediction
    baseline: QuantPrediction

    @property
    def measured(self) -> float:
        return self.baseline.main.measured_s / self.quantised.main.measured_s

    @property
    def predicted(self) -> float:
        return self.baseline.main.predicted_s / self.quantised.main.predicted_s


def predict(
    runs: Iterable[dict[str, Any]],
    progress: Callable[[str], None] = print,
    price_phase: Callable[[Phase], StepTimes] | None = None,
) -> list[QuantPrediction]:
    """Every mapped run of ``runs`` predicted. Phases are priced grouped by trace (the
    Pricer keeps its last trace), so each distinct step is traced once, whatever hardware
    or runs share it."""
    price_phase = price_phase or mgv.Pricer()
    requests: list[tuple[dict[str, Any], Choice, Request, Request | None]] = []
    for run in runs:
        choice = choose(run)
        if isinstance(choice, str):
            continue
        alt = choice.alternative_kv
        requests.append(
            (run, choice, request(run, choice), request(run, choice, alt) if alt else None)
        )
    by_trace: dict[str, dict[str, Phase]] = {}
    for _, _, req, alt in requests:
        for phase in (*req.phases, *(alt.phases if alt else ())):
            by_trace.setdefault(phase.trace_key, {}).setdefault(phase.key, phase)
    priced: dict[str, StepTimes] = {}
    for group in by_trace.values():
        for phase in group.values():
            w = phase.workload
            kv = f", {w['kv_dtype']} KV" if w.get("kv_dtype", "model") != "model" else ""
            progress(f"  {phase.model} {phase.label}, {w['quant']}{kv} on {phase.hardware}")
            priced[phase.key] = price_phase(phase)

    def prediction(run: dict[str, Any], req: Request) -> Prediction:
        steps = tuple(priced[p.key] for p in req.phases)
        return Prediction(req, run["measured"]["value"], steps)

    return [
        QuantPrediction(run, choice, prediction(run, req), alt and prediction(run, alt))
        for run, choice, req, alt in requests
    ]


def speedups(predictions: list[QuantPrediction]) -> list[Speedup]:
    """Each predicted run whose baseline is predicted too."""
    by_id = {p.run["id"]: p for p in predictions}
    return [
        Speedup(p, by_id[p.run["baseline_id"]])
        for p in predictions
        if p.run.get("baseline_id") in by_id
    ]


# -- rendering -------------------------------------------------------------------------------


def _quant(run: dict[str, Any], req: Request) -> str:
    """``fp8 + fp8 KV``: the recipe and the KV cache dtype priced."""
    kv = req.phases[0].workload.get("kv_dtype", "model")
    return run["quant"] + (f" + {kv} KV" if kv != "model" else "")


def _fits(p: Prediction) -> str:
    """`` (does not fit: 152 / 141 GB)`` for a step over the GPU's memory, else ``""``."""
    over = [s for s in p.steps if s.fits is False]
    if not over:
        return ""
    worst = max(over, key=lambda s: s.memory_bytes or 0)
    return f" (does not fit: {worst.memory_bytes / GB:.0f} / {worst.capacity_bytes / GB:.0f} GB)"


def _ratio(p: QuantPrediction) -> str:
    text = f"{p.main.ratio:.2f}{_fits(p.main)}"
    if p.alternative is not None:
        text += f" ({p.choice.alternative_kv} KV {p.alternative.ratio:.2f}{_fits(p.alternative)})"
    return text


PREDICTION_HEADERS = ["run", "hardware (priced on)", "quant", "measured", "predicted", "ratio"]


def prediction_rows(predictions: list[QuantPrediction]) -> list[list[str]]:
    return [
        [
            p.run["id"],
            f"{mgv._short_gpu(p.run)} ({p.choice.hardware})",
            _quant(p.run, p.main.request),
            f"{mgv._number(p.main.measured)} {mgv._unit(p.main.request.figure.unit)}",
            mgv._number(p.main.predicted),
            _ratio(p),
        ]
        for p in predictions
    ]


SPEEDUP_HEADERS = [
    "quantised run",
    "baseline",
    "quant",
    "measured speedup",
    "torchroof speedup",
    "torchroof / measured",
]


def speedup_rows(pairs: list[Speedup]) -> list[list[str]]:
    return [
        [
            s.quantised.run["id"],
            s.baseline.run["id"],
            f"{s.baseline.run['quant']} -> {s.quantised.run['quant']}",
            f"{s.measured:.2f}x",
            f"{s.predicted:.2f}x",
            f"{s.predicted / s.measured:.2f}",
        ]
        for s in pairs
    ]


NOT_PREDICTED_HEADERS = ["not predicted", "hardware", "quant", "measured", "why"]


def not_predicted_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for run in runs:
        reason = choose(run)
        if isinstance(reason, str):
            measured = run["measured"]
            rows.append(
                [
                    run["id"],
                    f"{mgv._short_gpu(run)} ({mgv.parallelism(run)})",
                    run["quant"],
                    f"{mgv._number(measured['value'])} {mgv._unit(measured['unit'])}",
                    reason,
                ]
            )
    return rows


def summary(predictions: list[QuantPrediction], pairs: list[Speedup]) -> str:
    line = mgv.summary([p.main.ratio for p in predictions])
    if pairs:
        within = [s.predicted / s.measured for s in pairs]
        line += (
            f"; {len(pairs)} speedups: torchroof / measured median "
            f"{statistics.median(within):.2f}, range {min(within):.2f}-{max(within):.2f}"
        )
    return line


# -- the checked-in file ---------------------------------------------------------------------


def _request_json(req: Request) -> list[dict[str, Any]]:
    return [
        {
            "label": ph.label,
            "weight": ph.weight,
            "model": ph.model,
            "config_overrides": dict(ph.overrides),
            "regime": ph.regime,
            "hardware": ph.hardware,
            "fusion": ph.fusion,
            **ph.workload,
        }
        for ph in req.phases
    ]


def _figures_json(p: Prediction) -> dict[str, Any]:
    return {
        "predicted": p.predicted,
        "measured_s": p.measured_s,
        "predicted_s": p.predicted_s,
        "ratio": p.ratio,
        "fits": p.fits,
        "steps": [mgv._step_json(ph, s) for ph, s in zip(p.request.phases, p.steps, strict=True)],
    }


def prediction_json(p: QuantPrediction, pairs: Mapping[str, Speedup]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": p.run["id"],
        "quant": p.run["quant"],
        "request": _request_json(p.main.request),
        "note": p.main.request.note,
        "unit": p.main.request.figure.unit,
        "measured": p.main.measured,
        **_figures_json(p.main),
    }
    if p.alternative is not None:
        entry["alternative_kv"] = {
            "kv_dtype": p.choice.alternative_kv,
            "request": _request_json(p.alternative.request),
            **_figures_json(p.alternative),
        }
    pair = pairs.get(p.run["id"])
    if pair is not None:
        entry["speedup"] = {
            "baseline_id": pair.baseline.run["id"],
            "measured": pair.measured,
            "predicted": pair.predicted,
        }
    return entry


def write(path: Path, runs: list[dict[str, Any]], predictions: list[QuantPrediction]) -> None:
    pairs = speedups(predictions)
    ratios = [p.main.ratio for p in predictions]
    within = [s.predicted / s.measured for s in pairs]
    by_run = {s.quantised.run["id"]: s for s in pairs}
    out = {
        "description": "torchroof's predictions of examples/validation/quant_runs.json, "
        "written by examples/quant_validation.py --write. ratio = predicted / measured time "
        "(< 1: torchroof predicts faster); speedup = baseline time / quantised time.",
        "versions": mgv.versions(),
        "summary": {
            **mgv.ratio_summary(ratios),
            "speedups": len(pairs),
            "median_speedup_ratio": statistics.median(within) if within else None,
        },
        "runs": [prediction_json(p, by_run) for p in predictions],
        "not_predicted": [
            {"id": run["id"], "reason": reason}
            for run in runs
            if isinstance(reason := choose(run), str)
        ],
    }
    path.write_text(json.dumps(out, indent=1) + "\n")


def load_runs() -> list[dict[str, Any]]:
    return json.loads(RUNS_JSON.read_text())["runs"]


def main() -> None:
    parser = mgv.run_parser(__doc__, PREDICTIONS_JSON)
    parser.add_argument(
        "--markdown",
        metavar="PAGE",
        help="write this script's tables, from the checked-in predictions (no pricing), into "
        "the docs page PAGE (docs/validation/quantised.md)",
    )
    args = parser.parse_args()
    if args.markdown:
        import validation_markdown

        tables = validation_markdown.quant_tables()
        validation_markdown.write_page(args.markdown, tables, Path(__file__).name)
        return
    runs = load_runs()
    by_id = {r["id"]: r for r in runs}
    mgv.check_runs(parser, args, by_id, RUNS_JSON)
    mgv.quiet()
    start = time.perf_counter()
    chosen = [by_id[rid] for rid in args.run] if args.run else runs
    print("pricing ...")
    report, stage = mgv.stage_lines(args)
    predictions = predict(chosen, progress=stage)
    report.end()
    pairs = speedups(predictions)
    print()
    print(mgv.markdown(prediction_rows(predictions), PREDICTION_HEADERS))
    if pairs:
        print()
        print(mgv.markdown(speedup_rows(pairs), SPEEDUP_HEADERS))
    if not args.run:
        print()
        print(mgv.markdown(not_predicted_rows(runs), NOT_PREDICTED_HEADERS))
    if predictions:
        print()
        print(summary(predictions, pairs))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.write:
        write(PREDICTIONS_JSON, runs, predictions)
        print(f"wrote {PREDICTIONS_JSON}")


if __name__ == "__main__":
    main()

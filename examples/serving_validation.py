"""Published serving measurements, each simulated request by request with the deployment,
the requests and the engine that measured it (``torchroof.serve``).

Every run of ``examples/validation/serving_runs.json`` gives a model, the GPUs and tensor
parallel size, a fixed input and output length, the number of requests, the request rate
(or every request at once) and what was measured: mean TTFT, mean inter-token latency,
requests and tokens per second. This script serves the same requests in the simulation
(realistic mode, the runtime that ran them; arrivals at a finite rate drawn as Poisson from
random state 0), prints predicted over measured for each figure, and with ``--write``
stores the predictions in ``examples/validation/serving_predictions.json``;
``--markdown PAGE`` writes the tables into a docs page from that file (no simulation).
``--run ID`` serves one run. Runs of one deployment share their priced steps.

ratio = predicted / measured for each figure (< 1 for a latency: torchroof predicts
faster; < 1 for a throughput: torchroof predicts less).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torchroof
from torchroof.serving import EngineConfig, Request, StepTimer, simulate

HERE = Path(__file__).resolve().parent
RUNS_JSON = HERE / "validation" / "serving_runs.json"
PREDICTIONS_JSON = HERE / "validation" / "serving_predictions.json"
PRICING = {"mode": "realistic", "runtime": "trtllm"}
# TensorRT-LLM's build and runtime defaults where the source states none: 256 sequences,
# 8192 tokens a step, 90% of the free memory for the KV cache; prompts of a few hundred
# tokens run whole beside the decodes (in-flight batching)
ENGINE = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
FIGURES = (
    ("mean_ttft_ms", "mean TTFT"),
    ("mean_itl_ms", "mean ITL"),
    ("requests_per_s", "requests/s"),
    ("output_tokens_per_s", "output tokens/s"),
)


def load_runs() -> list[dict[str, Any]]:
    return list(json.loads(RUNS_JSON.read_text())["runs"])


def requests_of(run: dict[str, Any]) -> list[Request]:
    """The run's requests: its fixed lengths, Poisson arrivals at its rate from random
    state 0, or every request at time 0."""
    if run["rate"] is None:
        return [
            Request(i, run["input_len"], run["output_len"], 0.0) for i in range(run["requests"])
        ]
    from torchroof.serving.requests import Arrivals, Lengths, make_requests

    return make_requests(
        run["requests"],
        Lengths.parse(run["input_len"], "input_len"),
        Lengths.parse(run["output_len"], "output_len"),
        Arrivals("poisson", rate=float(run["rate"])),
        0,
    )


def predict(run: dict[str, Any], timers: dict[tuple[str, str, int], StepTimer]) -> dict[str, float]:
    """The run's figures, simulated (a deployment's timer shared by its runs)."""
    key = (run["model"], run["hardware"], run["tp"])
    timer = timers.get(key)
    if timer is None:
        prepared = torchroof.prepare(run["model"], "decode", context=128, tp=run["tp"])
        timer = timers[key] = StepTimer(prepared, run["hardware"], **PRICING)
    summary = simulate(timer, requests_of(run), engine=ENGINE).summary()
    return {
        "mean_ttft_ms": summary["ttft_s"]["mean"] * 1e3,
        "mean_itl_ms": summary["itl_s"]["mean"] * 1e3,
        "requests_per_s": summary["request_throughput_per_s"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "total_tokens_per_s": summary["total_tokens_per_s"],
        "preemptions": summary["preemptions"],
    }


def rows(runs: list[dict[str, Any]], predictions: dict[str, dict[str, float]]) -> list[list[Any]]:
    out = []
    for run in runs:
        predicted, measured = predictions[run["id"]], run["measured"]
        rate = "all at once" if run["rate"] is None else f"{run['rate']:g}/s"
        out.append(
            [run["id"], f"{run['input_len']}/{run['output_len']}", rate]
            + [f"{predicted[k] / measured[k]:.2f}" for k, _ in FIGURES]
        )
    return out


def medians(
    runs: list[dict[str, Any]], predictions: dict[str, dict[str, float]]
) -> list[list[Any]]:
    """Per figure: the median ratio, the middle half and the range, over every run and
    over the runs below the deployment's saturation (a finite rate of at most 16/s)."""
    out = []
    for key, label in FIGURES:
        for subset, chosen in (
            ("every run", runs),
            ("rate <= 16/s", [r for r in runs if r["rate"] is not None and r["rate"] <= 16]),
        ):
            ratios = sorted(predictions[r["id"]][key] / r["measured"][key] for r in chosen)
            q = statistics.quantiles(ratios, n=4)
            out.append(
                [
                    label,
                    subset,
                    len(ratios),
                    f"{statistics.median(ratios):.2f}",
                    f"{q[0]:.2f}-{q[2]:.2f}",
                    f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
                ]
            )
    return out


def markdown_tables(predictions: dict[str, dict[str, float]]) -> dict[str, str]:
    """The page's tables from the stored predictions: the medians, then every run."""
    from tabulate import tabulate

    runs = load_runs()
    return {
        "serving-medians": tabulate(
            medians(runs, predictions),
            headers=["figure", "runs", "n", "median", "middle half", "range"],
            tablefmt="github",
        ),
        "serving-runs": tabulate(
            rows(runs, predictions),
            headers=["run", "input/output", "rate", *(label for _, label in FIGURES)],
            tablefmt="github",
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="store the predictions")
    parser.add_argument("--markdown", metavar="PAGE", type=Path, help="tables into a page")
    parser.add_argument("--run", metavar="ID", help="one run only")
    args = parser.parse_args(argv)
    if args.markdown:
        import validation_markdown

        stored = json.loads(PREDICTIONS_JSON.read_text())["predictions"]
        validation_markdown.write_page(
            args.markdown, markdown_tables(stored), "serving_validation.py"
        )
        return 0
    runs = [r for r in load_runs() if args.run in (None, r["id"])]
    if not runs:
        raise SystemExit(f"no run {args.run!r}")
    timers: dict[tuple[str, str, int], StepTimer] = {}
    predictions = {}
    for n, run in enumerate(runs, 1):
        print(f"[{n}/{len(runs)}] {run['id']}", file=sys.stderr)
        predictions[run["id"]] = predict(run, timers)
    for row in rows(runs, predictions):
        print("  ".join(str(c) for c in row))
    if args.write and args.run is None:
        PREDICTIONS_JSON.write_text(
            json.dumps({"pricing": PRICING, "predictions": predictions}, indent=1, sort_keys=True)
            + "\n"
        )
        print(f"wrote {PREDICTIONS_JSON}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

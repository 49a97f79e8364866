"""The expected range on every estimate: fitted on the measured runs, checked on each source
left out.

The runtime validation (``examples/runtime_validation.py --write``) prices every published
measured run under the software that ran it and stores measured and predicted times in
``examples/validation/runtime_predictions.json``. This script joins each row to its run's
source (one publication or benchmark repository) and features, fits the spread of measured /
predicted by kind of step (:mod:`torchroof.accuracy.fit`), evaluates it leaving one source
out at a time, and prints the evaluation. ``--write`` stores the runs, the fit and the
evaluation in ``torchroof/accuracy/measured_runs.json`` (what an installed torchroof reads)
and the tables in ``docs/validation/expected-ranges.md``; ``--features`` compares further
splits (runtime, accelerator family, GPU count, quantisation, step length) under the same
evaluation. No pricing: it runs in about a second.

correction = measured time / predicted time: what the estimate must be multiplied by.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tabulate import tabulate
from torchroof.hardware.cluster import get_cluster, is_cluster

from torchroof.accuracy import fit
from torchroof.accuracy.measured import KIND_NAMES, MODES, MeasuredRun

HERE = Path(__file__).resolve().parent
VALIDATION = HERE / "validation"
PREDICTIONS = VALIDATION / "runtime_predictions.json"
RUN_FILES = ("single_gpu_runs", "multi_gpu_runs", "pp_ep_runs", "quant_runs", "runtime_runs")
SERVING_RUNS = VALIDATION / "serving_runs.json"
SHIPPED = HERE.parent / "torchroof" / "accuracy" / "measured_runs.json"

FAMILIES = {  # a GPU spec name's first word -> its architecture
    "a100": "Ampere",
    "a10g": "Ampere",
    "h100": "Hopper",
    "h200": "Hopper",
    "b200": "Blackwell",
    "l4": "Ada",
    "l40s": "Ada",
    "rtx": "Ada",
    "mi300x": "CDNA 3",
}


NEMO_DOCS = "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/"
SAME_DOCUMENT = {  # a document published under two addresses -> the one source it is
    NEMO_DOCS + "performance_summary.html": "NVIDIA/NeMo",  # its docs/source/performance/...
}


def source_of(run: Mapping[str, Any]) -> str:
    """The publication or repository a run came from: a repository's owner/name, else the
    document's address (one document published twice counts once: SAME_DOCUMENT)."""
    source = run["source"]
    found = source if isinstance(source, str) else source.get("repo") or source.get("url")
    found = str(found or source["title"])
    return SAME_DOCUMENT.get(found, found)


def quant_of(run: Mapping[str, Any]) -> str:
    """The run's quantisation recipe: its ``quant`` field, else fp8 where its precision
    says so (a training recipe), else none."""
    if run.get("quant"):
        return str(run["quant"])
    return "fp8" if "fp8" in str(run.get("precision", "")).lower() else "none"


def accelerator_of(hardware: str) -> str:
    """The GPU spec a run was priced on (a cluster's accelerator)."""
    return get_cluster(hardware).accelerator.name if is_cluster(hardware) else hardware


def measured_runs() -> list[MeasuredRun]:
    """Every priced row of the runtime validation, with its run's source and features."""
    runs: dict[str, Mapping[str, Any]] = {}
    for name in RUN_FILES:
        for run in json.loads((VALIDATION / f"{name}.json").read_text())["runs"]:
            runs[run["id"]] = run
    out = []
    for row in json.loads(PREDICTIONS.read_text())["predictions"]:
        run = runs[row["run"]]
        out.append(
            MeasuredRun(
                run=row["run"],
                source=source_of(run),
                kind=row["kind"],
                benchmark=str(run["kind"]) if row["kind"] == "kernel" else "",
                runtime=row["runtime"],
                accelerator=accelerator_of(row["hardware"]),
                hardware=row["hardware"],
                gpus=int(run.get("gpu_count") or 1),
                quant=quant_of(run),
                measured_s=row["measured_s"],
                roofline_s=row["pure_s"],
                realistic_s=row["realistic_s"],
            )
        )
    return out


def serving_runs() -> dict[str, Any]:
    """How many published serving runs the simulator is checked against, and each source's
    title with its count of them (``examples/serving_validation.py``). No range is fitted
    for a served run: refused here once they would make a group (:data:`fit.MIN_RUNS` runs,
    no source holding more than half), so the statement ``serve`` prints stays true."""
    data = json.loads(SERVING_RUNS.read_text())
    counts = Counter(run["source"] for run in data["runs"])
    total = sum(counts.values())
    if total >= fit.MIN_RUNS and max(counts.values()) <= fit.MAX_SOURCE_SHARE * total:
        raise SystemExit(
            f"{SERVING_RUNS.name}: {total} runs from {len(counts)} sources would make a group: "
            "fit a range for served runs before shipping them"
        )
    titles = {key: data["sources"][key]["title"].split(",")[0] for key in counts}
    return {"runs": total, "sources": {titles[key]: n for key, n in sorted(counts.items())}}


def shipped(runs: list[MeasuredRun]) -> dict[str, Any]:
    """What ``measured_runs.json`` holds: the runs, the fit on all of them and the
    leave-one-source-out evaluation."""
    return {
        "description": (
            "Published measured runs priced by torchroof (examples/runtime_validation.py), "
            "the spread of measured / predicted time by kind of step fitted on them, and that "
            "fit evaluated leaving one source out at a time. Written by "
            "examples/expected_ranges.py --write."
        ),
        "runs": [r.to_dict() for r in runs],
        "fit": fit.fit(runs),
        "evaluation": fit.evaluation(runs),
        "serving": serving_runs(),
    }


# -- the tables ------------------------------------------------------------------------------


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def fit_table(data: Mapping[str, Any]) -> str:
    """Each group's runs and spread, in both modes."""
    rows = []
    for name, group in data["fit"].items():
        row = [name, group["runs"], group["sources"]]
        for mode in MODES:
            s = group[mode]
            row += [f"{s['low']:.2f}", f"{s['median']:.2f}", f"{s['high']:.2f}"]
        rows.append(row)
    headers = ["compared with", "runs", "sources"]
    for mode in ("pure roofline", "realistic"):
        headers += [f"{mode}: low", "median", "high"]
    return tabulate(rows, headers, tablefmt="github", disable_numparse=True)


def evaluation_table(evaluation: Mapping[str, Any]) -> str:
    """Each kind's leave-one-source-out coverage, width and calibrated error."""
    rows = []
    for kind, e in evaluation.items():
        if not e["ranged"]:
            rows.append([KIND_NAMES[kind], e["runs"], e["sources"], "none"] + ["-"] * 6)
            continue
        q1, q3 = e["calibrated_quartiles"]
        compared = ", ".join(f"{group} ({n})" for group, n in e["compared"].items())
        rows.append(
            [KIND_NAMES[kind], e["runs"], e["sources"], compared]
            + [_pct(e["inside"][m]) for m in MODES]
            + [f"{e['width'][m]:.2f}" for m in MODES]
            + [f"{e['calibrated_median']:.2f}", f"{q1:.2f}-{q3:.2f}"]
        )
    headers = [
        "kind", "runs", "sources", "compared with (runs)", "inside (pure)", "inside (realistic)",
        "width (pure)", "width (realistic)", "calibrated: median", "middle half",
    ]  # fmt: skip
    return tabulate(rows, headers, tablefmt="github", disable_numparse=True)


def _family(run: MeasuredRun) -> str:
    return FAMILIES.get(run.accelerator.split("-")[0], "other")


FEATURES: dict[str, Callable[[MeasuredRun], str]] = {
    "runtime": lambda r: r.runtime,
    "accelerator family": _family,
    "one GPU or several": lambda r: "one" if r.gpus == 1 else "several",
    "quantisation": lambda r: r.quant,
    "step under or over 1 s (realistic)": lambda r: "under" if r.realistic_s < 1 else "over",
    "kind of kernel": lambda r: r.benchmark,
}


def features_table(runs: list[MeasuredRun]) -> str:
    """Realistic-mode coverage, width and calibrated spread with each further split, beside
    the kind alone."""
    rows = []
    for name, split in {"kind alone": None, **FEATURES}.items():
        for kind, e in fit.evaluation(runs, split).items():
            if e["ranged"]:
                q1, q3 = e["calibrated_quartiles"]
                rows.append(
                    [name, KIND_NAMES[kind], _pct(e["inside"]["realistic"]),
                     f"{e['width']['realistic']:.2f}", f"{e['calibrated_median']:.2f}",
                     f"{q1:.2f}-{q3:.2f}"]
                )  # fmt: skip
    headers = ["grouped by", "kind", "inside", "width", "calibrated: median", "middle half"]
    return tabulate(rows, headers, tablefmt="github", disable_numparse=True)


def shipped_file() -> dict[str, Any]:
    """``measured_runs.json`` as checked in."""
    data: dict[str, Any] = json.loads(SHIPPED.read_text())
    return data


def tables(data: Mapping[str, Any]) -> dict[str, str]:
    """The docs page's tables, from the shipped file's contents."""
    runs = [MeasuredRun(**row) for row in data["runs"]]
    return {
        "expected-fit": fit_table(data),
        "expected-evaluation": evaluation_table(data["evaluation"]),
        "expected-features": features_table(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"store the fit in {SHIPPED.name}")
    parser.add_argument(
        "--markdown",
        metavar="PAGE",
        help="write the tables, from the checked-in fit, into the docs page PAGE "
        "(docs/validation/expected-ranges.md)",
    )
    parser.add_argument(
        "--features", action="store_true", help="compare further splits under the evaluation"
    )
    args = parser.parse_args()
    if args.markdown:
        import validation_markdown

        validation_markdown.write_page(args.markdown, tables(shipped_file()), Path(__file__).name)
        return
    runs = measured_runs()
    data = shipped(runs)
    print(fit_table(data))
    print()
    print(evaluation_table(data["evaluation"]))
    if args.features:
        print()
        print(features_table(runs))
    if args.write:
        SHIPPED.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {SHIPPED}")


if __name__ == "__main__":
    main()

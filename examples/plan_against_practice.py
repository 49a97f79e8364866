"""Where each published multi-GPU training layout ranks in torchroof's own plan search, and
what torchroof predicts its best plan gains over it.

For each training run that ``multi_gpu_validation.py`` predicts (its model, cluster,
recompute, precision and other choices: :data:`multi_gpu_validation.CHOICES`), the search
(:func:`torchroof.planning.plan_training`) runs on the same model, GPU count, global batch
and sequence, over the published layout's neighbourhood: tensor parallel 1, 2, 4 or 8
(sequence parallel as the run has it; torchtitan's with tp > 1 where the run has no tp),
the data ranks all sharded (FSDP) or all replicated (DDP) and, where the run is HSDP,
every shard x replicate split, and the run's context and pipeline sizes, schedule,
micro-batch size and recompute. The published layout is one of the plans; its rank is
among the plans that fit the GPU's memory, by step time (every plan trains the same tokens
a step): one more than the fitting plans strictly faster. Runs the search cannot take (a
layout torchroof refuses, micro-batches that would each be traced) are listed with why.

    python examples/plan_against_practice.py            # the table, from the checked-in file
    python examples/plan_against_practice.py --write --jobs 2   # search again (about 35
                                                        # minutes on 2 cores), refresh it
    python examples/plan_against_practice.py --run ID   # search one run again, print it
                                                        # (with --write: into the file)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "validation" / "plan_against_practice.json"
if str(HERE) not in sys.path:  # the validation script beside this one
    sys.path.insert(0, str(HERE))

import multi_gpu_validation as mgv  # noqa: E402  (after the path above)

from torchroof.config import DEFAULT_VIRTUAL_STAGES, Workload  # noqa: E402
from torchroof.config.choices import INTERLEAVED, SINGLE_STAGE  # noqa: E402
from torchroof.config.errors import OptionError  # noqa: E402
from torchroof.planning import TrainingLayout, plan_training  # noqa: E402
from torchroof.planning.space import check_layout  # noqa: E402
from torchroof.workloads.microbatches import (  # noqa: E402
    alike_microbatches,
    alike_middle_microbatches,
)

MAX_TRACED = 8
"""Micro-batches a plan may trace one by one: a run whose micro-batches cannot be copied
and has more is not searched (each plan would take tens of minutes here)."""
DESCRIPTION = "Where each published multi-GPU training layout ranks in torchroof's plan search"
SIZE_ORDER = {"llama-3-8b": 0, "llama-3-70b": 1, "llama-3.1-405b": 2, "deepseek-v3": 3}
"""Runs searched smallest model first (the cheapest searches)."""
TP_SIZES = (1, 2, 4, 8)
"""Tensor-parallel sizes searched beside the run's: one node's GPUs or fewer."""
HEADERS = [
    "run",
    "GPUs",
    "published layout",
    "published step (s)",
    "rank",
    "torchroof's best",
    "best step (s)",
    "predicted gain",
]


def published(workload: dict[str, Any]) -> tuple[TrainingLayout, dict[str, Any]]:
    """The run's layout in the search's terms, as the search enumerates it (sequence
    parallel only with tp > 1; the stages a pipeline rank holds as its schedule runs
    them), and the step's other workload fields."""
    fields = {name: value for name, value in workload.items() if value is not None}
    if fields.pop("checkpointing", False):
        recompute = fields.pop("checkpoint_policy", "full")
    else:
        recompute = "none"
        fields.pop("checkpoint_policy", None)
    names = set(TrainingLayout.__dataclass_fields__) - {"recompute"}
    sizes = {name: fields.pop(name) for name in list(fields) if name in names}
    sizes["sequence_parallel"] = sizes.get("sequence_parallel", False) and sizes.get("tp", 1) > 1
    if sizes.get("pp", 1) > 1:
        schedule = sizes.get("pp_schedule") or TrainingLayout.pp_schedule
        stages = sizes.get("virtual_stages", DEFAULT_VIRTUAL_STAGES)
        sizes["virtual_stages"] = (
            1 if schedule in SINGLE_STAGE else (stages if schedule in INTERLEAVED else 2)
        )
    return TrainingLayout(**sizes, recompute=recompute), fields


def neighbourhood(layout: TrainingLayout, gpus: int, llama: bool) -> dict[str, Any]:
    """The space searched around ``layout`` (:class:`torchroof.planning.TrainingSpace`
    fields): the tp sizes, the data ranks' two pure splits and the run's, the rest as run;
    the tp sizes of a run without tp with torchtitan's sequence parallel where the model
    takes it (``llama``: laid out as transformers' Llama)."""
    space: dict[str, Any] = {
        "tp": tuple(sorted({*[tp for tp in TP_SIZES if gpus % tp == 0], layout.tp})),
        "sequence_parallel": (layout.sequence_parallel or (layout.tp == 1 and llama),),
        "cp": (layout.cp,),
        "pp": (layout.pp,),
        "ep": (layout.ep,),
        "zero": (0,) if layout.zero == 0 else (0, layout.zero),
        "hsdp": layout.fsdp > 1 and layout.dp > 1,
        "micro_batch": (layout.batch,),
        "recompute": (layout.recompute,),
    }
    if layout.pp > 1:
        space["schedules"] = (layout.pp_schedule,)
        space["virtual_stages"] = (max(layout.virtual_stages, 1),)
    return space


def search(run: dict[str, Any], choice: Any, jobs: int = 1) -> dict[str, Any]:
    """The run's search: its published plan, rank and the best plan, as one row."""
    phase = mgv.request(run, choice).phases[0]
    seq = phase.workload["seq"]
    layout, fields = published({k: v for k, v in phase.workload.items() if k != "seq"})
    model = mgv.load_config(phase.model)
    for name, value in phase.overrides.items():
        setattr(model, name, value)
    gpus = run["gpu_count"]
    step = Workload(regime="train", seq=seq, **fields, **layout.knobs())
    copied = alike_microbatches(step) or alike_middle_microbatches(step)
    if layout.pp == 1 and layout.microbatches > MAX_TRACED and not copied:
        raise OptionError(
            f"each of its {layout.microbatches} micro-batches would be traced (they do not "
            "each run the same program: deferred gradient sync or a precision but mixed), "
            "for every plan"
        )
    problem = check_layout(model, layout, seq, phase.model, fields)
    if problem:
        raise OptionError(f"torchroof refuses the published layout: {problem}")
    space = neighbourhood(layout, gpus, model.model_type == "llama")
    start = time.perf_counter()
    plans = plan_training(
        model,
        gpus,
        phase.hardware,
        seq=seq,
        global_batch=layout.global_batch,
        space=space,
        max_plans=10_000,
        jobs=jobs,
        shallow=False,  # every plan priced whole: the published one is the validation's step
        **fields,
        **phase.pricing(),
    )
    seconds = time.perf_counter() - start
    row: dict[str, Any] = {
        "id": run["id"],
        "model": phase.model,
        "gpus": gpus,
        "hardware": phase.hardware,
        "seq": seq,
        "global_batch": layout.global_batch,
        "space": {k: list(v) if isinstance(v, tuple) else v for k, v in space.items()},
        "published": layout.label(),
        "fitting": len(plans.ranked),
        "over_memory": len(plans.over_memory),
        "pruned_by_memory": plans.pruned,
        "failed": dict(plans.failed),
        "search_s": round(seconds, 1),
    }
    found = [p for p in (*plans.ranked, *plans.over_memory) if p.layout == layout]
    if not found:  # taken by the checks: pruned by its memory floor, or failed
        why = "; ".join(plans.failed) or "its weights and optimizer state exceed the memory"
        row["published_status"] = f"not priced: {why}"
    else:
        mine = found[0]
        row["published_step_s"] = mine.step_time_s
        row["published_memory_gib"] = round(mine.memory_bytes / 2**30, 1)
        if mine.fits:  # ties share a rank
            row["rank"] = 1 + sum(p.step_time_s < mine.step_time_s for p in plans.ranked)
        else:
            row["published_status"] = "over the GPU's memory as torchroof prices it"
    if plans.ranked:
        best = plans.ranked[0]
        row["best"] = best.layout.label()
        row["best_step_s"] = best.step_time_s
        row["best_memory_gib"] = round(best.memory_bytes / 2**30, 1)
        if "rank" in row:  # a gain over a plan that fits
            row["gain"] = row["published_step_s"] / best.step_time_s - 1
    return row


def table_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    """One table row a run, as the docs show it."""
    rows = []
    for row in results:
        if "rank" in row:
            rank = f"{row['rank']} of {row['fitting']}"
        else:
            rank = row.get("published_status", "")
        gain = f"{row['gain']:+.1%}" if "gain" in row else "-"
        rows.append(
            [
                row["id"],
                row["gpus"],
                row["published"],
                _seconds(row.get("published_step_s")),
                rank,
                row.get("best", "-" if row["published"] == "-" else "none fits"),
                _seconds(row.get("best_step_s")),
                gain,
            ]
        )
    return rows


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(results: list[dict[str, Any]]) -> str:
    return tabulate(table_rows(results), HEADERS, tablefmt="github")


def training_runs() -> list[tuple[dict[str, Any], Any]]:
    """Every training run multi_gpu_validation.py predicts, with its choices, the smallest
    models first."""
    runs = [
        (run, mgv.CHOICES[run["id"]])
        for run in mgv.load_data()["runs"]
        if run["regime"] == "train" and run["id"] in mgv.CHOICES
    ]
    return sorted(runs, key=lambda pair: SIZE_ORDER.get(pair[0]["model"]["torchroof_config"], 9))


def main() -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--write", action="store_true", help=f"refresh {RESULTS_JSON.name}")
    parser.add_argument("--run", action="append", default=[], help="only this run id (repeat)")
    parser.add_argument("--jobs", type=int, default=1, help="processes pricing the plans")
    args = parser.parse_args()
    mgv.quiet()
    runs = training_runs()
    known = {run["id"] for run, _ in runs}
    unknown = [rid for rid in args.run if rid not in known]
    if unknown:
        parser.error(f"unknown training run {', '.join(unknown)}")
    if not args.write and not args.run:
        data = json.loads(RESULTS_JSON.read_text())
        print(markdown(data["runs"]))
        return
    results = []
    for run, choice in runs:
        if args.run and run["id"] not in args.run:
            continue
        print(f"searching {run['id']} ...", file=sys.stderr, flush=True)
        try:
            row = search(run, choice, args.jobs)
        except (OptionError, ValueError) as error:
            row = {"id": run["id"], "gpus": run["gpu_count"], "published": "-"}
            row["published_status"] = f"not searched: {str(error).splitlines()[0]}"
        print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
        results.append(row)
        if args.write:  # after each run: a long search keeps what it found so far
            _write(results, [run["id"] for run, _ in runs])
    print(markdown(results))
    if args.write:
        print(f"wrote {RESULTS_JSON}", file=sys.stderr)


def _write(results: list[dict[str, Any]], order: list[str]) -> None:
    """``results`` into the file, replacing the rows of the runs they are (``--run``
    searches those again, the others kept), in the runs' order."""
    rows = {}
    if RESULTS_JSON.exists():
        rows = {row["id"]: row for row in json.loads(RESULTS_JSON.read_text())["runs"]}
    rows.update({row["id"]: row for row in results})
    out = {
        "description": DESCRIPTION,
        "runs": [rows[rid] for rid in order if rid in rows],
    }
    RESULTS_JSON.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Every causal-LM architecture the installed transformers defines, traced on meta.

For each architecture: its default config (no download), the model built on meta at full
depth, and each regime run through torchroof; one row per architecture and regime with
ok / error (the exception's first line), the number of ops, the uncounted ops by name, and
the time taken. Usable as a benchmark script: ``python -m torchroof.validation.zoo`` or
``torchroof zoo``.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from torchroof import progress as progress_report
from torchroof.api import estimate_trace
from torchroof.config import Workload
from torchroof.config.errors import first_line
from torchroof.quiet import quiet_imports, quiet_trace
from torchroof.workloads import regime as find_regime
from torchroof.workloads import run_workload

# Small workloads: full depth, few tokens. Meta makes the size of each op irrelevant.
ZOO_WORKLOADS = {
    "prefill": Workload("prefill", batch=1, seq=32),
    "decode": Workload("decode", batch=1, context=32),
    # bf16 throughout, as examples/zoo.json was written (the zoo asks whether a model
    # traces and is fully priced, which the precision does not change)
    "train": Workload("train", batch=1, seq=32, precision="bf16"),
}


def zoo_workload(config: Any, regime: str) -> Workload:
    """The regime's zoo workload, at the one training length a model accepts when its
    config fixes it: Reformer's axial position embeddings train only on sequences of
    exactly prod(axial_pos_shape) tokens (4096 by default)."""
    workload = ZOO_WORKLOADS[regime]
    axial = getattr(config, "axial_pos_shape", None)
    if find_regime(workload.regime).trains and axial and getattr(config, "axial_pos_embds", 0):
        return replace(workload, seq=math.prod(axial))
    return workload


@dataclass
class ZooRow:
    architecture: str
    regime: str
    ok: bool
    error: str = ""
    ops: int = 0
    uncounted: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    cache: str = ""  # the cache an inference step used (static, model, encoder-decoder, none)


def architectures() -> list[str]:
    """model_type names with a causal-LM class in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_one(architecture: str, regime: str) -> ZooRow:
    from torchroof.models.completions import default_config

    start = time.perf_counter()
    try:
        with warnings.catch_warnings(), quiet_imports(), quiet_trace():
            warnings.simplefilter("ignore")  # no user code runs here, only shipped models
            config = default_config(architecture)
            trace = _traced(config, zoo_workload(config, regime))
            est = estimate_trace(trace, "h100-sxm")
        return ZooRow(
            architecture,
            regime,
            True,
            "",
            est.op_count,
            dict(est.uncounted),
            time.perf_counter() - start,
            trace.facts.cache,
        )
    except Exception as error:  # noqa: BLE001 - every failure becomes a row
        return ZooRow(
            architecture, regime, False, first_line(error), seconds=time.perf_counter() - start
        )


@dataclass
class ReplayCheck:
    """A zoo step traced copying repeated layers, held to the trace that ran them all."""

    difference: str  # "" when the two traces and their estimates agree
    uncounted: dict[str, int]  # ops of the copied trace no rule prices
    cache: str  # the cache the inference step used
    repeated_layers: str  # how the layers were traced (the estimate's metadata)


def _traced(config: Any, workload: Workload) -> Any:
    """The zoo step on a model built from ``config``, running every layer again where a
    copied layer's backward could not be copied (as :func:`torchroof.api.trace_workload`)."""
    from torchroof.models.sources import build_model
    from torchroof.workloads.repeated import copied_or_every_layer

    return copied_or_every_layer(
        workload,
        lambda: run_workload(build_model(config, "bf16"), workload),
        lambda full: run_workload(build_model(config, "bf16"), full),
    )


def replay_check(
    architecture: str,
    regime: str,
    price_both: bool = False,
    plan: Mapping[str, int] | None = None,
) -> ReplayCheck:
    """Trace the zoo step twice, once running every layer (``full_trace``) and once copying
    repeated layers (:mod:`torchroof.capture.replay`), and hold the second to the first op
    for op (:func:`torchroof.records.equality.first_difference`: names, shapes, arguments,
    module paths, phases, storages and their roles); the copied trace is priced, and with
    ``price_both`` the full one too, their estimates compared; with ``plan`` (``{"fsdp": 2}``)
    the step runs across GPUs, priced on a DGX H100."""
    from torchroof.models.completions import default_config
    from torchroof.models.sources import build_model
    from torchroof.records.equality import first_difference

    with warnings.catch_warnings(), quiet_imports(), quiet_trace():
        warnings.simplefilter("ignore")  # no user code runs here, only shipped models
        config = default_config(architecture)
        sizes: dict[str, Any] = dict(plan or {})  # parallel sizes: Workload fields
        workload = replace(zoo_workload(config, regime), **sizes)
        full = run_workload(build_model(config, "bf16"), replace(workload, full_trace=True))
        copied = _traced(config, workload)
        difference = first_difference(full, copied)
        estimates = [
            estimate_trace(t, "dgx-h100" if plan else "h100-sxm")  # a cluster across GPUs
            for t in ((full, copied) if price_both else (copied,))
        ]
    priced = [e.to_dict() for e in estimates]
    for data in priced:
        data["metadata"].pop("repeated_layers", None)
        data["metadata"].get("workload", {}).pop("full_trace", None)
    if not difference and priced[0] != priced[-1]:
        keys = [k for k in priced[0] if priced[0][k] != priced[-1].get(k)]
        difference = f"the estimates differ in {', '.join(keys)}"
    return ReplayCheck(
        difference, dict(estimates[-1].uncounted), copied.facts.cache, copied.facts.repeated_layers
    )


def run_architecture(architecture: str, regimes: Sequence[str]) -> list[ZooRow]:
    return [run_one(architecture, regime) for regime in regimes]


def _run_in_worker(architecture: str, regimes: Sequence[str]) -> list[ZooRow]:
    import torch

    torch.set_num_threads(1)  # one core per worker: tracing on meta is single-threaded
    return run_architecture(architecture, regimes)


def run_zoo(
    archs: Iterable[str] | None = None,
    regimes: Sequence[str] = ("prefill", "decode", "train"),
    progress: Callable[[ZooRow], None] = lambda row: None,
    jobs: int = 1,
) -> list[ZooRow]:
    """Rows in architecture order; ``jobs`` worker processes trace architectures in
    parallel (each architecture's regimes stay in one process)."""
    names = list(archs or architectures())
    report = progress_report.current()
    if jobs <= 1:
        rows = []
        for index, arch in enumerate(names, 1):
            report.point(index, len(names), arch, noun="architecture")
            with progress_report.silenced():  # one line per architecture, not per stage
                traced = run_architecture(arch, regimes)
            for row in traced:
                rows.append(row)
                progress(row)
        return rows
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    results: dict[str, list[ZooRow]] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {arch: pool.submit(_run_in_worker, arch, tuple(regimes)) for arch in names}
        for index, arch in enumerate(names, 1):
            report.point(index, len(names), arch, noun="architecture")
            results[arch] = futures[arch].result()
            for row in results[arch]:
                progress(row)
    return [row for arch in names for row in results[arch]]


def summary(rows: list[ZooRow]) -> dict[str, Any]:
    archs = sorted({r.architecture for r in rows})
    regimes = sorted({r.regime for r in rows})
    by_arch: dict[str, list[ZooRow]] = {a: [] for a in archs}
    for r in rows:
        by_arch[r.architecture].append(r)
    all_ok = [a for a, rs in by_arch.items() if all(r.ok for r in rs)]
    clean = [a for a in all_ok if all(not r.uncounted for r in by_arch[a])]
    return {
        "architectures": len(archs),
        "regimes": regimes,
        "all_regimes_ok": len(all_ok),
        "all_regimes_ok_and_fully_priced": len(clean),
        "per_regime_ok": {g: sum(r.ok for r in rows if r.regime == g) for g in regimes},
        "seconds": sum(r.seconds for r in rows),
    }


def to_json(rows: list[ZooRow], path: str | Path, **run: Any) -> None:
    """The summary (plus how the run was made: wall time, workers, versions) and the rows."""
    import platform

    import torch
    import transformers

    environment = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpus": __import__("os").cpu_count(),
        **run,
    }
    Path(path).write_text(
        json.dumps(
            {"summary": summary(rows), "run": environment, "rows": [asdict(r) for r in rows]},
            indent=1,
        )
    )


def table(rows: list[ZooRow]) -> str:
    from tabulate import tabulate

    body = [
        [
            r.architecture,
            r.regime,
            "ok" if r.ok else "error",
            r.ops,
            ", ".join(f"{k} x{v}" for k, v in r.uncounted.items()),
            f"{r.seconds:.1f}",
            r.cache,
            r.error[:100],
        ]
        for r in rows
    ]
    return tabulate(
        body,
        headers=["architecture", "regime", "status", "ops", "uncounted", "s", "cache", "error"],
        disable_numparse=True,
    )


def print_row(row: ZooRow) -> None:
    status = "ok " if row.ok else "ERR"
    extra = row.error[:90] if not row.ok else ""
    if row.uncounted:
        extra += f" uncounted {row.uncounted}"
    print(
        f"{row.architecture:32s} {row.regime:8s} {status} {row.seconds:5.1f}s {extra}", flush=True
    )


def run_and_report(
    archs: Iterable[str] | None,
    regimes: Sequence[str],
    jobs: int,
    json_path: str | Path | None = None,
    show_table: bool = False,
) -> list[ZooRow]:
    """Run the zoo printing a line per row, then the summary and the wall time (and the
    table, and the JSON with how the run was made): the CLI's and the script's job."""
    start = time.perf_counter()
    rows = run_zoo(archs, regimes, progress=print_row, jobs=jobs)
    wall = time.perf_counter() - start
    if show_table:
        print(table(rows))
    print(json.dumps(summary(rows), indent=1))
    print(f"wall time {wall / 60:.1f} min with {jobs} worker(s)")
    if json_path:
        to_json(rows, json_path, wall_seconds=wall, jobs=jobs)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m torchroof.validation.zoo [OUT.json] [--jobs N] [--arch NAME ...]``: the benchmark
    script form; prints a row per architecture and regime, the summary and the wall time."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m torchroof.validation.zoo")
    parser.add_argument("out", nargs="?", default="zoo.json")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--arch", action="append", default=None)
    args = parser.parse_args(argv)
    run_and_report(args.arch, tuple(ZOO_WORKLOADS), args.jobs, args.out)


if __name__ == "__main__":  # pragma: no cover
    main()


@dataclass
class RepeatedKernelsCheck:
    """A zoo step's kernels built once per repeated period against grouping every op."""

    periods: int  # periods of the run built once (0: no run, grouped whole)
    length: int  # ops in one period
    kernels: int  # kernels of the step under the default policy
    built_once: list[str]  # the policies under which the run's kernels were built once
    differences: list[str]  # the policies under which the two kernel lists differ


def repeated_kernels_check(architecture: str, regime: str) -> RepeatedKernelsCheck:
    """Trace the zoo step copying repeated layers and group it twice under the fused,
    eager and epilogue policies: once building the repeated periods' kernels once
    (:func:`torchroof.kernels.repeats.repeated_kernels`), once op by op
    (:func:`torchroof.kernels.fusion.build_kernels`); the kernels must be equal."""
    from torchroof.config import PricingOptions
    from torchroof.kernels.fusion import build_kernels
    from torchroof.kernels.repeats import repeated_kernels, repeated_run
    from torchroof.models.completions import default_config

    with warnings.catch_warnings(), quiet_imports(), quiet_trace():
        warnings.simplefilter("ignore")  # no user code runs here, only shipped models
        config = default_config(architecture)
        trace = _traced(config, zoo_workload(config, regime))
    run = repeated_run(trace.ops, trace.copies)
    differences, built_once = [], []
    kernels = 0
    for name, options in (
        ("fused", PricingOptions()),
        ("eager", PricingOptions(fusion="eager")),
        ("epilogue", PricingOptions(epilogue=True)),
    ):
        policy, roles = options.kernels_only(), dict(trace.roles)
        whole = build_kernels(trace.ops, policy, roles)
        once = repeated_kernels(trace.ops, trace.copies, policy, roles)
        kernels = kernels or len(whole[0])
        if once is not None:
            built_once.append(name)
            if once != whole:
                differences.append(name)
    periods = run.periods if run is not None else 0
    return RepeatedKernelsCheck(periods, run.length if run else 0, kernels, built_once, differences)

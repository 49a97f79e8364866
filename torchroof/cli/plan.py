"""``torchroof plan``: the fastest training layouts of a model on N GPUs, or with
``--serve`` the serving layouts on up to N GPUs that meet latency targets at a load
(:mod:`torchroof.cli.plan_serve`), ranked, with why every family left out was left out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tabulate import tabulate

from torchroof.cli.common import Subparsers, add_quiet, positive_int, writable, wrote
from torchroof.cli.plan_serve import (
    SERVING_REGIMES,
    add_serving_flags,
    check_flags,
    pricing_flags,
    ranks_shown,
    run_serving,
)
from torchroof.config.choices import OPTIMIZERS, PRECISIONS, TIMING_MODES
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.parallel.pipeline.workers import worker_cap
from torchroof.planning.emit import EMITTERS, emit_training
from torchroof.planning.layouts import RECOMPUTE
from torchroof.planning.reports import best_plan_html, check_front_plot, front_plot
from torchroof.planning.search import DEFAULT_MAX_PLANS, TrainingPlans, plan_training
from torchroof.pricing.hardware import resolve_hardware
from torchroof.render.files import check_html_path

DEFAULT_CLUSTER = "dgx-h100"
TORCHTITAN_NAMES = {
    "llama-3-8b": ("llama3", "8B"),
    "llama-3-70b": ("llama3", "70B"),
    "llama-3.1-405b": ("llama3", "405B"),
}
"""Shipped models torchtitan trains by its own name and flavor (pytorch/torchtitan,
torchtitan/models/llama3/__init__.py: llama3_configs)."""


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes sizes like 1,2,4,8, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"takes sizes >= 1 like 1,2,4,8, got {text!r}")
    return sizes


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_parser(commands: Subparsers) -> None:
    """The ``plan`` command and its flags."""
    cmd = commands.add_parser(
        "plan",
        help="search the training layouts of a model on N GPUs, fastest first; with --serve, "
        "the fewest GPUs serving a load within latency targets",
        usage="%(prog)s [model] --gpus N (--global-batch B | --tokens-per-step K) [options]\n"
        "       %(prog)s [model] --serve (--rate R | --concurrency C) [--ttft-ms X] "
        "[--tpot-ms Y] [--gpus-max N] [options]",
    )
    cmd.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help=f"as for estimate (default {DEFAULT_MODEL})"
    )
    cmd.add_argument(
        "--regime", default="train", choices=("train", "serve"), help="serve: as --serve"
    )
    cmd.add_argument("--gpus", type=positive_int, help="GPUs to lay out (training)")
    cmd.add_argument(
        "--hardware", default=DEFAULT_CLUSTER, help=f"cluster (default {DEFAULT_CLUSTER})"
    )
    cmd.add_argument("--seq", type=positive_int, default=4096, help="tokens per sequence")
    batch = cmd.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=positive_int, help="sequences per optimizer step")
    batch.add_argument("--tokens-per-step", type=positive_int, help="tokens per optimizer step")
    _space_flags(cmd)
    cmd.add_argument("--precision", choices=PRECISIONS, default="mixed")
    cmd.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    cmd.add_argument("--mode", choices=TIMING_MODES, default="roofline")
    cmd.add_argument("--runtime", help="runtime profile (torchtitan, ...)")
    cmd.add_argument("--top", type=positive_int, default=10, help="plans shown (default 10)")
    cmd.add_argument(
        "--max-plans",
        type=positive_int,
        default=DEFAULT_MAX_PLANS,
        help=f"layouts priced at most (default {DEFAULT_MAX_PLANS}; each a trace or two)",
    )
    cmd.add_argument(
        "--jobs",
        type=positive_int,
        help="processes pricing training layouts (default: TORCHROOF_WORKERS, else one per CPU "
        "this process may use)",
    )
    cmd.add_argument(
        "--whole",
        action="store_true",
        help="price every layout at full depth (default: a layout of a model whose layers are "
        "all alike, from copies of it with 2 and 3 layers, a stage where pipelined; the best "
        "plan at full depth)",
    )
    cmd.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="price on the Ray cluster at ADDRESS ('local': one started here with --jobs "
        "CPUs; needs the torchroof[ray] extra)",
    )
    cmd.add_argument("--json", metavar="PATH", help="the ranked plans and every reason")
    cmd.add_argument(
        "--emit",
        choices=EMITTERS,
        help="write the best plan as torchtitan's job TOML or the torchrun line launching it "
        "(searches only layouts torchtitan runs: no ZeRO-1/2 over plain data parallel); "
        "with --serve, as the vllm or sglang command (vllm: a MoE model on one engine, "
        "its expert parallel spanning tp x data-parallel ranks)",
    )
    cmd.add_argument("-o", "--output", metavar="PATH", help="where --emit writes (default: print)")
    cmd.add_argument(
        "--plot", metavar="PATH", help="training: step time against memory, the front marked"
    )
    cmd.add_argument(
        "--html", metavar="PATH", help="training: the best plan's report (its step traced again)"
    )
    cmd.add_argument(
        "--titan-model",
        metavar="NAME",
        help="with --emit: torchtitan's model name and flavor, e.g. llama3:70B (default: "
        "known for the shipped Llama 3 configs)",
    )
    add_serving_flags(cmd, _sizes, _names)
    add_quiet(cmd)


def _space_flags(cmd: argparse.ArgumentParser) -> None:
    """The flags that narrow the training space."""
    for name in ("tp", "cp", "pp", "ep"):
        cmd.add_argument(
            f"--{name}", type=_sizes, metavar="1,2,4", help=f"{name} sizes to try (default all)"
        )
    cmd.add_argument(
        "--recompute",
        type=_names,
        default=RECOMPUTE,
        metavar=",".join(RECOMPUTE),
        help="activation recomputation to try (default all three)",
    )
    cmd.add_argument(
        "--schedules", type=_names, metavar="1f1b,...", help="pipeline schedules to try"
    )
    cmd.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="tensor parallel without SP only (not with --emit: torchtitan always applies SP)",
    )
    cmd.add_argument(
        "--no-hsdp", action="store_true", help="all-sharded or all-replicated data ranks only"
    )
    cmd.add_argument("--max-micro-batch", type=positive_int, default=8, help="(default 8)")
    cmd.add_argument(
        "--micro-batch",
        type=_sizes,
        metavar="1,2",
        help="micro-batch sizes to try, in sequences (default every divisor up to "
        "--max-micro-batch)",
    )


def run(args: argparse.Namespace) -> None:
    writable(args.json, args.output)
    check_flags(args)
    if args.serve or args.regime in SERVING_REGIMES:
        run_serving(args)
        return
    writable(args.plot, args.html)
    if args.plot:
        check_front_plot(args.plot)  # before any tracing
    if args.html:
        check_html_path(args.html)
    titan = _titan_names(args) if args.emit else None
    gpus_per_node = _gpus_per_node(args.hardware) if args.emit else 0
    space = _training_space(args, gpus_per_node)
    pricing = pricing_flags(args)
    plans = plan_training(
        args.model,
        args.gpus,
        args.hardware,
        seq=args.seq,
        global_batch=args.global_batch,
        tokens_per_step=args.tokens_per_step,
        space=space,
        max_plans=args.max_plans,
        jobs=args.jobs or worker_cap(),
        ray_address=args.ray,
        shallow=not args.whole,
        precision=args.precision,
        optimizer=args.optimizer,
        **pricing,
    )
    if not plans.ranked:
        raise ValueError(plans.nothing_fits())
    print(f"torchroof plan: {args.model} training on {args.gpus} GPUs of {args.hardware}")
    print(plans_text(plans, args.top))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(plans.to_dict(), handle, indent=2)
        wrote("plans", args.json)
    if args.plot:
        wrote("the plans' step time against memory", str(front_plot(plans, args.plot)))
    if args.html:
        workload = {"precision": args.precision, "optimizer": args.optimizer}
        best_plan_html(plans, args.model, args.hardware, args.seq, args.html, workload, pricing)
        wrote("the best plan's report", args.html)
    if args.emit:
        assert titan is not None
        text = emit_training(
            args.emit,
            plans.best.layout,
            model=titan[0],
            flavor=titan[1],
            seq=args.seq,
            gpus_per_node=gpus_per_node,
        )
        if args.output:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
            wrote(f"the best plan as {args.emit}", args.output)
        else:
            print(text)


def _training_space(args: argparse.Namespace, gpus_per_node: int) -> dict[str, Any]:
    """The training space the flags narrow; with --emit, only what torchtitan runs."""
    space: dict[str, Any] = {
        "recompute": args.recompute,
        "max_micro_batch": args.max_micro_batch,
        "hsdp": not args.no_hsdp,
    }
    for name in ("tp", "cp", "pp", "ep", "micro_batch"):
        if getattr(args, name) is not None:
            space[name] = getattr(args, name)
    if args.schedules is not None:
        space["schedules"] = args.schedules
    if args.no_sequence_parallel:
        space["sequence_parallel"] = (False,)
    if args.emit and args.no_sequence_parallel:
        raise ValueError(
            "--emit and --no-sequence-parallel conflict: torchtitan applies sequence parallel "
            "with every tensor-parallel degree"
        )
    if args.emit:  # what torchtitan runs: FSDP2 / HSDP (no ZeRO-1/2 over DDP), and
        space["zero"] = (0,)  # sequence parallel with every tensor-parallel degree
        space["sequence_parallel"] = (True,)
        if args.gpus % gpus_per_node and args.gpus > gpus_per_node:
            raise ValueError(
                f"--emit launches whole nodes: {args.gpus} GPUs do not fill nodes of "
                f"{gpus_per_node}"
            )
    return space


def _titan_names(args: argparse.Namespace) -> tuple[str, str]:
    """torchtitan's (model, flavor) for ``--emit``: ``--titan-model NAME:FLAVOR``, else the
    shipped model's."""
    if args.titan_model:
        name, sep, flavor = args.titan_model.partition(":")
        if not sep or not name or not flavor:
            raise ValueError(
                f"--titan-model takes NAME:FLAVOR (llama3:70B), got {args.titan_model!r}"
            )
        return name, flavor
    known = TORCHTITAN_NAMES.get(str(args.model))
    if known is None:
        raise ValueError(
            f"--emit {args.emit} needs torchtitan's name for {args.model}: give --titan-model "
            "NAME:FLAVOR (e.g. llama3:70B)"
        )
    return known


def _gpus_per_node(hardware: str) -> int:
    _, cluster = resolve_hardware(hardware)
    if cluster is None:
        raise ValueError(f"--emit launches on nodes: {hardware} is one accelerator, not a cluster")
    return cluster.gpus_per_node


def plans_text(plans: TrainingPlans, top: int) -> str:
    """The ranked table, then what was left out and why."""
    lines = []
    if plans.ranked:
        rows = [
            [
                rank,
                plan.layout.label(),
                f"{plan.step_time_s * 1e3:,.1f}",
                f"{plan.metrics['tokens_per_s_per_gpu']:,.0f}",
                f"{plan.metrics['mfu']:.1%}" if plan.metrics.get("mfu") is not None else "-",
                f"{plan.memory_bytes / 2**30:.2f}",
                f"{plan.metrics['exposed_communication_s'] * 1e3:,.1f}",
            ]
            for rank, plan in enumerate(plans.ranked[:top], 1)
        ]
        headers = ["#", "layout", "step ms", "tok/s/GPU", "MFU", "GiB/GPU", "exposed comm ms"]
        lines.append(tabulate(rows, headers=headers))
        front = [plans.ranked.index(p) + 1 for p in plans.pareto()]
        lines.append(
            "throughput vs memory front (none both faster and smaller): " + ranks_shown(front, top)
        )
    else:
        lines.append(plans.nothing_fits())  # what a caller of the API prints
    lines.append(
        f"{plans.enumerated:,} layouts run on this model; {plans.pruned:,} left out before "
        f"pricing (their weights and optimizer state alone exceed "
        f"{plans.capacity_bytes / 2**30:.0f} GiB); {len(plans.over_memory):,} priced over "
        "memory"
    )
    carried = sum(plan.carried for plan in [*plans.ranked, *plans.over_memory])
    if carried:
        again = plans.confirmed
        confirmed = f", {again} of the fastest priced again at full depth" if again else ""
        lines.append(
            f"{carried:,} priced from copies of the model with 2 and 3 layers (a stage, where "
            f"pipelined), carried to its full depth (their memory within a few percent)"
            f"{confirmed}"
        )
    elif plans.whole:
        lines.append(f"every layout priced at full depth: {plans.whole}")
    for reason, count in plans.rejected.most_common():
        lines.append(f"  refused ({count}x): {reason}")
    for reason, count in plans.failed.most_common():
        lines.append(f"  failed ({count}x): {reason}")
    return "\n".join(lines)

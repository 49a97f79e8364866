"""``torchroof plan --serve``: the serving layouts of a model on up to N GPUs, simulated at
one load, with the fewest GPUs that meet the latency targets first."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tabulate import tabulate

from torchroof.api import config_of
from torchroof.cli.common import positive_int, wrote
from torchroof.config.choices import KV_DTYPES, QUANTS
from torchroof.planning.emit import SERVING_EMITTERS, TRAINING_EMITTERS, emit_serving
from torchroof.planning.serving_search import ServingPlans, plan_serving
from torchroof.planning.space import model_facts

SERVING_REGIMES = ("serve",)
"""What ``--regime`` names the serving search (``--serve`` does too)."""
TRAINING_ONLY = (
    "gpus", "seq", "global_batch", "tokens_per_step", "cp", "pp", "ep", "recompute",
    "schedules", "no_sequence_parallel", "no_hsdp", "max_micro_batch", "precision",
    "optimizer", "titan_model", "plot", "html", "whole",
)  # fmt: skip
SERVING_ONLY = (
    "rate", "concurrency", "requests", "input_len", "output_len", "ttft_ms", "tpot_ms",
    "attainment", "gpus_max", "replicas", "dp", "max_num_seqs", "max_num_batched_tokens",
    "kv_dtype", "disaggregate", "quant", "random_state", "hf_model",
)  # fmt: skip


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def add_serving_flags(cmd: argparse.ArgumentParser, sizes: Any, names: Any) -> None:
    """The flags of ``--serve`` (``sizes`` and ``names`` parse comma-separated lists)."""
    srv = cmd.add_argument_group("serving search (with --serve)")
    srv.add_argument(
        "--serve",
        action="store_true",
        help="search serving layouts instead (--tp and --hardware apply too)",
    )
    srv.add_argument("--rate", type=_positive_float, help="requests per second (Poisson)")
    srv.add_argument("--concurrency", type=positive_int, help="closed-loop clients")
    srv.add_argument("--requests", type=positive_int, default=500, help="requests drawn (500)")
    srv.add_argument("--input-len", default="1024", help="prompt tokens, as serve takes them")
    srv.add_argument("--output-len", default="128", help="output tokens, as --input-len")
    srv.add_argument("--ttft-ms", type=_positive_float, help="time-to-first-token target")
    srv.add_argument("--tpot-ms", type=_positive_float, help="time-per-output-token target")
    srv.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests within targets (0.9)"
    )
    srv.add_argument("--gpus-max", type=positive_int, help="GPUs at most (default: one node)")
    srv.add_argument("--replicas", type=sizes, metavar="1,2", help="replicas to try (all)")
    srv.add_argument(
        "--dp",
        type=sizes,
        metavar="2,4,8",
        help="MoE: data-parallel attention ranks to try, each its own engine of tp GPUs, the "
        "experts over all dp x tp (default: with each tp, the largest group within a node "
        "and --gpus-max whose GPUs split the experts; 1: none)",
    )
    srv.add_argument("--max-num-seqs", type=sizes, metavar="64,128,256", help="to try")
    srv.add_argument("--max-num-batched-tokens", type=sizes, metavar="2048,8192", help="to try")
    srv.add_argument(
        "--kv-dtype", type=names, metavar=",".join(KV_DTYPES), help="KV dtypes to try (model)"
    )
    srv.add_argument(
        "--disaggregate", type=names, metavar="1P1D,...", help="xPyD deployments to try too"
    )
    srv.add_argument("--quant", choices=QUANTS, default="none", help="quantised linear layers")
    srv.add_argument("--random-state", type=int, default=0, help="requests drawn from it (0)")
    srv.add_argument(
        "--hf-model",
        metavar="ID",
        help="with --emit vllm|sglang: the id or path the engine loads (default: the model)",
    )


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, the other search's flags and an emitter of the other kind."""
    given: set[str] = getattr(args, "given", set())
    serving = args.serve or args.regime in SERVING_REGIMES
    wrong = [name for name in (TRAINING_ONLY if serving else SERVING_ONLY) if name in given]
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        raise ValueError(
            f"{flags} {'is' if len(wrong) == 1 else 'are'} for the "
            f"{'training' if serving else 'serving'} search: "
            + ("leave out --serve" if serving else "add --serve")
        )
    emitters = SERVING_EMITTERS if serving else TRAINING_EMITTERS
    if args.emit and args.emit not in emitters:
        raise ValueError(
            f"--emit {args.emit} writes a {'training' if serving else 'serving'} plan: with"
            f"{'' if serving else 'out'} --serve, --emit takes {' or '.join(emitters)}"
        )
    if args.serve and "regime" in given and args.regime not in SERVING_REGIMES:
        raise ValueError("--regime train and --serve conflict: give one")
    if serving and ((args.jobs or 1) > 1 or args.ray):
        raise ValueError(
            "--jobs and --ray price training layouts in other processes; the serving search "
            "simulates here"
        )
    if not serving and args.gpus is None:
        raise ValueError("torchroof plan needs --gpus N (training), or --serve (serving)")
    if not serving and args.global_batch is None and args.tokens_per_step is None:
        raise ValueError("give --global-batch or --tokens-per-step (training), or --serve")


def run_serving(args: argparse.Namespace) -> None:
    """Search, print the ranked table, and write --json and --emit."""
    space: dict[str, Any] = {}
    for name in ("tp", "replicas", "dp", "max_num_seqs", "max_num_batched_tokens", "kv_dtype"):
        if getattr(args, name) is not None:
            space[name] = getattr(args, name)
    if args.disaggregate:
        space["disaggregate"] = args.disaggregate
    pricing = pricing_flags(args)
    if args.emit == "vllm" and model_facts(config_of(args.model)).experts:
        # vLLM's expert parallel spans tp x its data-parallel ranks: one engine, or one
        # data-parallel attention group (its --data-parallel-size)
        space["replicas"] = (1,)
    plans = plan_serving(
        args.model,
        args.hardware,
        rate=args.rate,
        concurrency=args.concurrency,
        requests=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        ttft_s=args.ttft_ms / 1e3 if args.ttft_ms is not None else None,
        tpot_s=args.tpot_ms / 1e3 if args.tpot_ms is not None else None,
        attainment=args.attainment,
        gpus_max=args.gpus_max,
        space=space,
        random_state=args.random_state,
        max_plans=args.max_plans,
        quant=args.quant,
        **pricing,
    )
    if not plans.ranked:
        raise ValueError(plans.answer())
    print(
        f"torchroof plan: {args.model} serving {args.requests:,} requests {plans.load} on up "
        f"to {plans.gpus_max} GPUs of {args.hardware}"
    )
    print(serving_text(plans, args.top))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(plans.to_dict(), handle, indent=2)
        wrote("plans", args.json)
    if args.emit:
        best = plans.best  # no plan meeting the targets: its one line, as an error
        longest = max(r.input_len + r.output_len for r in best.result.requests)
        text = emit_serving(
            args.emit, best.layout, model=args.hf_model or str(args.model), max_model_len=longest
        )
        if args.output:
            Path(args.output).write_text(text, encoding="utf-8")
            wrote(f"the best plan as {args.emit}", args.output)
        else:
            print(text, end="")


def serving_text(plans: ServingPlans, top: int) -> str:
    """The ranked table, the answer, the fronts, then what was left out and why."""
    lines = []
    if plans.ranked:
        rows = [
            [
                rank,
                plan.label(),
                plan.gpus,
                "yes" if plan.meets else "no",
                f"{plan.attainment:.0%}",
                _ms(plan.figures["p50_ttft_s"]),
                _ms(plan.figures["p99_ttft_s"]),
                _ms(plan.figures["p50_tpot_s"]),
                _ms(plan.figures["p99_tpot_s"]),
                f"{plan.output_tokens_per_s_per_gpu:,.0f}",
                f"{plan.goodput_per_s_per_gpu:,.2f}",
            ]
            for rank, plan in enumerate(plans.ranked[:top], 1)
        ]
        headers = ["#", "layout", "GPUs", "meets", "within", "TTFT P50", "P99", "TPOT P50"]
        headers += ["P99", "out tok/s/GPU", "goodput/s/GPU"]
        lines.append(tabulate(rows, headers=headers))
        lines.append("(latencies in ms)")
        for latency in ("ttft", "tpot"):
            front = [plans.ranked.index(p) + 1 for p in plans.frontier(latency)]
            lines.append(
                f"lowest P99 {latency.upper()} for their throughput per GPU: "
                + ranks_shown(front, top)
            )
    lines.append(plans.answer())
    lines.append(f"{plans.enumerated:,} layouts enumerated; {len(plans.ranked):,} simulated")
    for reason, count in plans.rejected.most_common():
        lines.append(f"  refused ({count}x): {reason}")
    return "\n".join(lines)


def pricing_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The pricing options both searches take from the flags: the mode, and the runtime
    where given."""
    pricing: dict[str, Any] = {"mode": args.mode}
    if args.runtime:
        pricing["runtime"] = args.runtime
    return pricing


def ranks_shown(ranks: list[int], top: int) -> str:
    """A front's ranks as the table shows them (#1, #3), and how many fall below it."""
    shown = ", ".join(f"#{rank}" for rank in ranks if rank <= top)
    beyond = sum(rank > top for rank in ranks)
    return shown + (f" and {beyond} more below the top {top}" if beyond else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"

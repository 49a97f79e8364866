"""``torchroof serve``: a model served to a stream of requests, simulated request by
request (continuous batching over paged KV blocks), with its latencies and throughput."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from torchroof.cli.common import (
    Subparsers,
    add_quiet,
    base_settings,
    positive_int,
    workload_args,
    writable,
    wrote,
)
from torchroof.cli.serve_reports import (
    add_report_flags,
    check_reports,
    run_rates,
    search_reports,
    write_run_reports,
)
from torchroof.render.serving import rate_search_lines, serving_lines

SIDES = ("prefill", "decode")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def add_parser(commands: Subparsers) -> None:
    """The ``serve`` command and its flags."""
    srv = commands.add_parser(
        "serve",
        help="simulate serving a stream of requests: TTFT, TPOT, throughput, goodput",
        usage="%(prog)s [model] (--rate R | --concurrency C) [--requests N | --trace FILE] "
        "[options]",
    )
    workload_args(srv)
    _request_flags(srv)
    _engine_flags(srv)
    _speculative_flags(srv)
    _disaggregate_flags(srv)
    _target_flags(srv)
    out = srv.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="summary, engine, every request and step")
    out.add_argument("--csv", metavar="PATH", help="one row per request")
    add_report_flags(srv, out)
    add_quiet(srv)


def _request_flags(srv: argparse.ArgumentParser) -> None:
    load = srv.add_argument_group("requests")
    load.add_argument("--rate", type=_positive_float, help="requests per second (Poisson)")
    load.add_argument(
        "--concurrency", type=positive_int, help="closed-loop clients, each one request at a time"
    )
    load.add_argument("--requests", type=positive_int, default=1000, help="requests to draw (1000)")
    load.add_argument(
        "--trace",
        metavar="FILE",
        help="requests from a JSONL or CSV file (input_len, output_len, optional arrival_s, "
        "prefix_group, prefix_len)",
    )
    load.add_argument(
        "--input-len",
        default="1024",
        help="prompt tokens: N, uniform:LO,HI, normal:MEAN,SD, lognormal:MEDIAN,SIGMA or "
        "zipf:A,MAX (1024)",
    )
    load.add_argument("--output-len", default="128", help="output tokens, as --input-len (128)")
    load.add_argument(
        "--prefix-groups",
        type=positive_int,
        metavar="G",
        help="each prompt starts with one of G shared prefixes, chosen at random",
    )
    load.add_argument(
        "--prefix-len",
        type=positive_int,
        metavar="P",
        help="tokens of each shared prefix, before the prompt's own --input-len tokens",
    )
    load.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier (1)",
    )
    load.add_argument(
        "--random-state",
        type=int,
        default=0,
        help="the random state the requests are drawn from (0)",
    )


def _engine_flags(srv: argparse.ArgumentParser) -> None:
    eng = srv.add_argument_group("engine")
    eng.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="engines behind a router (with --dp N --ep N x tp on a MoE model: the "
        "data-parallel ranks, stepping in lock-step groups of N)",
    )
    eng.add_argument("--router", default="round-robin", help="round-robin or least-loaded")
    eng.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    eng.add_argument("--max-num-seqs", type=positive_int, default=256, help="running requests")
    eng.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=8192, help="tokens per step"
    )
    eng.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="run prompts whole, in steps of their own",
    )
    eng.add_argument(
        "--preemption-mode",
        default="recompute",
        help="recompute a preempted request, or swap its KV to host memory (recompute)",
    )
    eng.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        metavar="GIB",
        help="host memory per GPU for swapped KV, with --preemption-mode swap (4)",
    )
    eng.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="never reuse the cached KV blocks of shared prompt prefixes",
    )
    eng.add_argument(
        "--gpu-memory-utilization",
        type=_positive_float,
        default=0.9,
        help="share of GPU memory the engine takes (0.9)",
    )
    eng.add_argument(
        "--interpolate-above",
        type=positive_int,
        metavar="N",
        help="price steps of more than N tokens between grid sizes 1/16 apart (faster; "
        "exact on the pure roofline, up to 8.5%% off in realistic mode); default: every "
        "size priced",
    )


def _speculative_flags(srv: argparse.ArgumentParser) -> None:
    spec = srv.add_argument_group("speculative decoding")
    spec.add_argument(
        "--draft",
        metavar="MODEL",
        help="a draft model proposing tokens (as the model is given), or eagle or mtp: a "
        "one-layer head on the served model's hidden states",
    )
    spec.add_argument(
        "--speculative-tokens", type=positive_int, default=3, help="tokens drafted per step (3)"
    )
    spec.add_argument(
        "--acceptance",
        metavar="RATE",
        help="the share of drafts accepted (0.7), or one rate per drafted position as the "
        "engine's metrics report them (0.8,0.6,0.4)",
    )
    spec.add_argument("--draft-tp", type=positive_int, help="the draft's tensor parallel size")


def _prefixes(args: argparse.Namespace) -> Any:
    """``--prefix-groups`` and ``--prefix-len`` as a
    :class:`~torchroof.serving.requests.Prefixes` (both or neither)."""
    from torchroof.serving.requests import Prefixes

    if args.prefix_groups is None and args.prefix_len is None:
        return None
    if args.prefix_groups is None or args.prefix_len is None:
        raise ValueError("shared prefixes need both --prefix-groups and --prefix-len")
    return Prefixes(args.prefix_groups, args.prefix_len)


def _speculative(args: argparse.Namespace, given: set[str]) -> Any:
    """The ``--draft`` flags as a :class:`~torchroof.serving.speculative.Speculative`."""
    from torchroof.serving.speculative import Speculative

    if args.draft is None:
        extra = sorted({"speculative_tokens", "acceptance", "draft_tp"} & given)
        if extra:
            named = ", ".join("--" + e.replace("_", "-") for e in extra)
            verb = "describes" if len(extra) == 1 else "describe"
            raise ValueError(f"{named} {verb} a draft model: give --draft too")
        return None
    if args.acceptance is None:
        raise ValueError(
            "--draft needs --acceptance: the share of drafted tokens the target accepts "
            "(a rate such as 0.7, or one per position such as 0.8,0.6,0.4)"
        )
    return Speculative(args.draft, args.acceptance, args.speculative_tokens, args.draft_tp)


def _disaggregate_flags(srv: argparse.ArgumentParser) -> None:
    pd = srv.add_argument_group("disaggregated prefill and decode")
    pd.add_argument(
        "--disaggregate",
        metavar="xPyD",
        help="x prefill and y decode instances of the cluster (1P2D), each request's KV "
        "cache sent from its prefill instance to its decode instance",
    )
    for side in SIDES:
        for knob, what in (("tp", "tensor"), ("ep", "expert")):
            pd.add_argument(
                f"--{side}-{knob}",
                type=positive_int,
                help=f"{what}-parallel ranks of each {side} instance (default --{knob})",
            )


def _sides(args: argparse.Namespace) -> dict[str, Any]:
    """serve()'s disaggregate, prefill and decode from the flags (none without them)."""
    knobs = {
        side: {
            k: getattr(args, f"{side}_{k}") for k in ("tp", "ep") if getattr(args, f"{side}_{k}")
        }
        for side in SIDES
    }
    if args.disaggregate is None:
        if any(knobs.values()):
            raise ValueError("--prefill-* and --decode-* set the sides of --disaggregate: give it")
        return {}
    return {"disaggregate": args.disaggregate, **knobs}


def _target_flags(srv: argparse.ArgumentParser) -> None:
    slo = srv.add_argument_group("service-level objectives")
    slo.add_argument("--ttft-ms", type=_positive_float, help="time-to-first-token target")
    slo.add_argument("--tpot-ms", type=_positive_float, help="time-per-output-token target")
    slo.add_argument(
        "--sweep-rate",
        action="store_true",
        help="search the highest request rate at which --attainment of the requests meet "
        "the targets (instead of --rate or --concurrency)",
    )
    slo.add_argument(
        "--attainment",
        type=_positive_float,
        default=0.9,
        help="share of requests that must meet the targets (0.9)",
    )


def run(args: argparse.Namespace) -> None:
    from torchroof.serving.scheduler import EngineConfig
    from torchroof.serving.serve import serve

    writable(args.json, args.csv, args.plot, args.html)
    check_reports(args)
    given: set[str] = getattr(args, "given", set())
    if "swap_space" in given and args.preemption_mode != "swap":
        raise ValueError("--swap-space is the host memory of --preemption-mode swap: give both")
    if "attainment" in given and not args.sweep_rate:
        raise ValueError("--attainment is the share a --sweep-rate search asks for: give both")
    drawn = sorted({"requests", "input_len", "output_len", "prefix_groups", "prefix_len"} & given)
    if args.trace and drawn:
        raise ValueError(
            f"--trace gives the requests and their lengths: "
            f"{', '.join('--' + d.replace('_', '-') for d in drawn)} is not taken with it"
        )
    settings = base_settings(args)
    hardware = settings.pop("hardware")
    engine = EngineConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=not args.no_chunked_prefill,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_caching=not args.no_prefix_caching,
        preemption=args.preemption_mode,
        swap_space_gib=args.swap_space,
    )
    deployment = {  # what serve() and highest_rate() take alike
        "requests": args.trace if args.trace else args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefixes": _prefixes(args),
        "burstiness": args.burstiness,
        "random_state": args.random_state,
        "engine": engine,
        "replicas": args.replicas,
        "router": args.router,
        "speculative": _speculative(args, given),
        "exact_up_to": args.interpolate_above,
        **settings,
    }
    sides = _sides(args)
    ttft = args.ttft_ms / 1e3 if args.ttft_ms else None
    tpot = args.tpot_ms / 1e3 if args.tpot_ms else None
    if args.sweep_rate:
        if sides:
            raise ValueError("--sweep-rate does not search a --disaggregate deployment yet")
        _sweep(args, deployment, hardware, ttft, tpot)
        return
    if args.rates is not None:
        if sides:
            raise ValueError("--rates does not serve a --disaggregate deployment yet")
        run_rates(args, deployment, hardware, ttft, tpot)
        return
    result = serve(
        args.model, hardware, rate=args.rate, concurrency=args.concurrency, **deployment, **sides
    )
    print("\n".join(serving_lines(result.summary(ttft, tpot), result.engine)))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(ttft, tpot), indent=1) + "\n")
        wrote("the run", args.json)
    if args.csv:
        rows = result.to_dict(ttft, tpot)["requests"]
        with Path(args.csv).open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        wrote("one row per request", args.csv)
    write_run_reports(args, result, ttft, tpot)


def _sweep(
    args: argparse.Namespace,
    deployment: dict[str, Any],
    hardware: str,
    ttft: float | None,
    tpot: float | None,
) -> None:
    """``--sweep-rate``: the highest rate within the targets, each rate tried."""
    from torchroof.serving.serve import highest_rate

    if args.rate is not None or args.concurrency is not None:
        raise ValueError("--sweep-rate searches the rate: --rate and --concurrency are not taken")
    if args.csv:
        raise ValueError(
            "--csv writes one row per request of one run: use --json with --sweep-rate"
        )
    found = highest_rate(
        args.model,
        hardware,
        ttft_s=ttft,
        tpot_s=tpot,
        attainment=args.attainment,
        **deployment,
    )
    data = found.to_dict()
    print("\n".join(rate_search_lines(data)))
    try:
        search_reports(args, found, data)  # the knee into data, then the plot and page
    finally:  # the search's JSON whatever a picture does
        if args.json:
            Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
            wrote("the search", args.json)

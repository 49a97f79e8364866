"""The ``torchroof`` command: a thin layer over the Python API that prints its objects."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tabulate import tabulate

from torchroof.api import Trace, check_quant_hardware, trace_workload
from torchroof.capture.mode import OpBudgetExceeded
from torchroof.config.errors import OptionError
from torchroof.config.options import (
    REGIMES,
    PricingOptions,
    Workload,
    add_flags,
    flag_group,
    from_flags,
)
from torchroof.hardware import (
    ClusterSpec,
    Figure,
    HardwareSpec,
    UnknownHardwareError,
    UnsupportedDtypeError,
    available,
    available_clusters,
    distinct_boundaries,
    get,
    get_cluster,
    is_cluster,
)
from torchroof.models.sources import DEFAULT_MODEL, UnknownModelError, shipped_models
from torchroof.parallel.pipeline.price import NOT_SAVED
from torchroof.pricing.price import estimate_trace
from torchroof.progress import current as current_progress
from torchroof.progress import reporting
from torchroof.render.files import SWEEP_OUTPUTS, output_format, sweep_output, write, write_sweep
from torchroof.report.compare import SWEEP_KEYS
from torchroof.workloads import regime

DEFAULT_HARDWARE = "h100-sxm"
# estimate's --fusion also takes two policies, comma-separated, to compare them
_FUSION_PAIR = {
    "choices": None,
    "type": str,
    "help": "kernel policy: eager or fused (default fused); two, comma-separated, are compared",
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class UsageError(ValueError):
    """A command line argparse refused: reported as one line, like every bad input."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchroof",
        description="Roofline time budgets for PyTorch models, traced on the meta device.",
    )
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)

    est = commands.add_parser(
        "estimate",
        help="per-layer time budget of a model step",
        usage="%(prog)s [model] [options]",
    )
    est.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"shipped config name, config.json or model dir (default {DEFAULT_MODEL})",
    )
    step = flag_group(est, "workload")
    step.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"accelerator or cluster name, alias or TOML path (default {DEFAULT_HARDWARE})",
    )
    step.add_argument("--from-trace", metavar="PATH", help="re-estimate a saved trace JSON")
    add_flags(est, Workload)
    add_flags(est, PricingOptions, fusion=_FUSION_PAIR)
    shown = flag_group(est, "output")
    shown.add_argument(
        "--depth",
        type=_positive_int,
        default=None,
        help="group rows by the first N module-path components (default: blocks)",
    )
    shown.add_argument(
        "--all-layers",
        action="store_true",
        help="one row per block even when consecutive blocks are identical",
    )
    shown.add_argument(
        "--kernels", type=int, default=10, help="also list the N slowest kernels (default 10)"
    )
    shown.add_argument("--save-trace", metavar="PATH", help="write the trace as JSON")
    shown.add_argument("--json", metavar="PATH", help="write the estimate as JSON")
    shown.add_argument("--csv", metavar="PATH", help="write one row per kernel as CSV")
    shown.add_argument("--plot-roofline", metavar="PATH", help="roofline plot (.png/.svg/.pdf)")
    shown.add_argument("--plot-layers", metavar="PATH", help="per-layer time (.png/.svg/.pdf)")
    shown.add_argument("--timeline", metavar="PATH", help="Chrome/Perfetto trace JSON")
    shown.add_argument("--html", metavar="PATH", help="the interactive report, one offline file")
    _add_quiet(est)

    cmp = commands.add_parser(
        "compare",
        help="variants side by side (--vary KEY=V1,V2,...)",
        usage="%(prog)s [model] --vary KEY=V1,V2 [options]",
    )
    _workload_args(cmp)
    cmp.add_argument(
        "--vary",
        action="append",
        required=True,
        metavar="KEY=V1,V2",
        help="estimate argument or config field to vary; repeatable",
    )
    cmp.add_argument("--layers", action="store_true", help="also per-layer deltas vs the first")
    cmp.add_argument("--html", metavar="PATH", help="the variants side by side, interactive")
    _add_quiet(cmp)

    swp = commands.add_parser(
        "sweep",
        help="step time and tokens/s against batch/context/seq",
        usage="%(prog)s [model] [--over KEY] [--values V1,V2,...] [options]",
    )
    _workload_args(swp)
    swp.add_argument("--over", choices=SWEEP_KEYS, default="batch")
    swp.add_argument(
        "--values", default="1,2,4,8,16,32,64,128,256,512", help="comma-separated sizes"
    )
    swp.add_argument("--csv", metavar="PATH")
    swp.add_argument("--plot", metavar="PATH", help="curve (.png, .svg or .pdf)")
    swp.add_argument("--html", metavar="PATH", help="the curves and every point, interactive")
    _add_quiet(swp)

    cal = commands.add_parser("calibrate", help="measure this device's ceilings -> TOML")
    cal.add_argument("--device", default="cpu", help="cpu or cuda")
    cal.add_argument("-o", "--output", default=None, help="TOML path (default: print it)")
    cal.add_argument("--name", default=None, help="spec name (default: <device>-measured)")
    _add_quiet(cal)

    val = commands.add_parser("validate", help="predicted vs measured for a real step")
    val.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    val.add_argument("--regime", choices=REGIMES, default="prefill")
    val.add_argument("--device", default="cpu")
    val.add_argument(
        "--hardware",
        default=None,
        help="fixed hardware TOML (default: calibrate just before each repeat of the step)",
    )
    val.add_argument(
        "--mode",
        choices=PricingOptions.__dataclass_fields__["mode"].metadata["choices"],
        default="roofline",
        help="prediction for the kernel table and diagnosis (both modes' ratios are printed)",
    )
    val.add_argument(
        "--repeats", type=_positive_int, default=3, help="calibrate + time the step, N times"
    )
    val.add_argument(
        "--iterations", type=_positive_int, default=3, help="timed steps per repeat (median)"
    )
    val.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    val.add_argument("--batch", type=_positive_int, default=1)
    val.add_argument(
        "--seq",
        type=_positive_int,
        default=256,
        help="tokens per sequence; for decode, the cache's context",
    )
    val.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        help="override num_hidden_layers (CPU default 4)",
    )
    val.add_argument(
        "--hidden", type=_positive_int, default=None, help="override hidden_size (CPU default 512)"
    )
    val.add_argument("--json", metavar="PATH")
    _add_quiet(val)

    zoo = commands.add_parser("zoo", help="trace every causal-LM architecture in transformers")
    zoo.add_argument("--regimes", default="prefill,decode,train")
    zoo.add_argument("--arch", action="append", default=None, help="one architecture; repeatable")
    zoo.add_argument("--json", metavar="PATH", default=None)
    zoo.add_argument(
        "--jobs", type=_positive_int, default=os.cpu_count() or 1, help="worker processes"
    )
    zoo.add_argument("--table", action="store_true", help="print every row as a table")
    _add_quiet(zoo)

    roof = commands.add_parser(
        "roofline", help="roofline explorer: attainable FLOP/s at an intensity, at any boundary"
    )
    roof.add_argument("--hardware", default=DEFAULT_HARDWARE)
    roof.add_argument("--dtype", default="bf16")
    point = roof.add_mutually_exclusive_group(required=True)
    point.add_argument("--intensity", type=float, help="FLOP per byte crossing the boundary")
    point.add_argument("--preset", help="a common kernel's intensity (--preset list names them)")
    roof.add_argument(
        "--boundary",
        default="hbm",
        help="the boundary its bytes cross: registers, smem, l2, hbm, nvlink, pcie, network or "
        "<cluster>:<link> (default hbm)",
    )
    roof.add_argument(
        "--pipe", default=None, help="ceiling: a dtype's tensor core, fp32-fma, fp32-no-fma, sfu"
    )
    roof.add_argument("--plot", metavar="PATH", help="the roofline with the point (.png, .svg)")

    gemm = commands.add_parser(
        "gemm", help="GEMM workbench: a tiled matmul's intensity and bound at each memory level"
    )
    gemm.add_argument("m", type=_positive_int)
    gemm.add_argument("n", type=_positive_int)
    gemm.add_argument("k", type=_positive_int)
    gemm.add_argument("--dtype", default="bf16")
    gemm.add_argument("--tile", default="128", help="T (square) or T_mxT_n, e.g. 256x128")
    gemm.add_argument("--l2-absorption", type=float, default=0.85)
    gemm.add_argument("--hardware", default=DEFAULT_HARDWARE)
    gemm.add_argument(
        "--local-budget-kib",
        type=float,
        default=None,
        help="on-chip budget (> 0) for the tile fit check and CTAs per SM (default: the "
        "hardware's shared memory per SM)",
    )
    gemm.add_argument("--plot", metavar="PATH", help="the GEMM at every boundary (.png, .svg)")

    fuse = commands.add_parser(
        "fusion-bench", help="fusion bench: an elementwise chain, its kernel boundaries toggled"
    )
    fuse.add_argument("--tokens", type=_positive_int, default=65536)
    fuse.add_argument("--d-model", type=_positive_int, default=8192)
    fuse.add_argument("--dtype", default="bf16")
    fuse.add_argument("--hardware", default=DEFAULT_HARDWARE)
    fuse.add_argument(
        "--boundaries",
        default="split",
        help="5 digits, one per boundary after residual add, RMSNorm, scale, SiLU, multiply "
        "(1 = written to HBM); 'split' = 11111, 'fused' = 00000",
    )

    lab = commands.add_parser(
        "lab", help="IO bounds: flash attention's and chunked cross-entropy's bytes"
    )
    labs = lab.add_subparsers(dest="lab", parser_class=_Parser, required=True)
    flash = labs.add_parser("flash", help="naive / tiled / compulsory attention intensity")
    flash.add_argument("--seq", type=_positive_int, default=4096)
    flash.add_argument("--head-dim", type=_positive_int, default=128)
    flash.add_argument("--block-rows", type=_positive_int, default=128)
    flash.add_argument("--dtype", default="bf16")
    ce = labs.add_parser("cross-entropy", help="peak logits memory, materialised vs chunked")
    ce.add_argument("--tokens", type=_positive_int, default=8192)
    ce.add_argument("--vocab", type=_positive_int, default=100_000)
    ce.add_argument("--chunk", type=_positive_int, default=1024)
    ce.add_argument("--d-model", type=_positive_int, default=4096)
    ce.add_argument("--dtype", default="bf16")
    ce.add_argument("--hardware", default=DEFAULT_HARDWARE)

    hw = commands.add_parser("hardware", help="list accelerators and their ridge points")
    hw.add_argument(
        "name",
        nargs="?",
        help="show one accelerator's or cluster's figures and sources (a cluster: its link ridges)",
    )

    commands.add_parser("models", help="list the shipped model configs")
    return parser


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="do not show progress (by default each stage and its time goes to stderr)",
    )


def _workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"shipped config name, config.json or model dir (default {DEFAULT_MODEL})",
    )
    flag_group(parser, "workload").add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"accelerator or cluster name, alias or TOML path (default {DEFAULT_HARDWARE})",
    )
    add_flags(parser, Workload)
    add_flags(parser, PricingOptions)


def _base_settings(args: argparse.Namespace) -> dict:
    """Every knob as parsed: the hardware, the workload's fields, the pricing fields."""
    return {
        "hardware": args.hardware,
        **from_flags(args, Workload),
        **from_flags(args, PricingOptions),
    }


def _compare(args: argparse.Namespace) -> None:
    from torchroof.render.files import check_html_path
    from torchroof.report.compare import compare, parse_value

    if args.html:
        _writable(args.html)
        check_html_path(args.html)  # before any tracing
    vary: dict[str, list] = {}
    for item in args.vary:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--vary takes KEY=V1,V2,..., got {item!r}")
        if key.strip() in vary:
            raise ValueError(
                f"--vary {key.strip()} is given twice; give all its values in one: "
                f"--vary {key.strip()}=V1,V2,..."
            )
        vary[key.strip()] = [parse_value(key.strip(), v) for v in values.split(",") if v.strip()]
    result = compare(args.model, vary, **_base_settings(args))
    print(f"torchroof compare: {args.model} {args.regime}")
    print(result.table())
    if args.layers:
        print()
        print(result.layer_deltas())
    if args.html:
        result.to_html(args.html)
        _wrote("the interactive comparison (HTML)", args.html)


def _sweep(args: argparse.Namespace) -> None:
    from torchroof.report.compare import sweep

    flags = (("csv", args.csv), ("plot", args.plot), ("html", args.html))
    outputs = [(kind, path) for kind, path in flags if path]
    _writable(*(path for _, path in outputs))
    for kind, path in outputs:
        sweep_output(path, kind)  # a plot named .jpg fails before any work
    values = [int(v) for v in args.values.split(",") if v.strip()]
    base = _base_settings(args)
    base.pop(args.over, None)
    result = sweep(args.model, args.over, values, **base)
    print(f"torchroof sweep: {args.model} {args.regime} over {args.over}")
    print(result.table())
    workload = Workload(**result.points[0].estimate.workload)  # as traced (seq resolved)
    for line in regime(args.regime).sweep_summary(result, args.over, workload):
        print(line)
    for kind, path in outputs:
        write_sweep(result, path, kind)
        _wrote(SWEEP_OUTPUTS[kind], path)


def _calibrate(args: argparse.Namespace) -> None:
    from torchroof.validation.calibrate import calibrate

    result = calibrate(args.device, progress=lambda m: current_progress().begin(f"measuring {m}"))
    text = result.to_toml(args.name or f"{args.device.replace(':', '-')}-measured")
    print("\n".join(result.lines()))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text)


def _validate(args: argparse.Namespace) -> None:
    from torchroof.validation.validate import validate

    overrides = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.hidden:
        overrides["hidden_size"] = args.hidden
    result = validate(
        args.model,
        args.regime,
        device=args.device,
        hardware=args.hardware,
        batch=args.batch,
        seq=args.seq,
        overrides=overrides,
        iterations=args.iterations,
        repeats=args.repeats,
        mode=args.mode,
        threads=args.threads,
    )
    print(result.table())
    print()
    print(result.summary())
    if args.json:
        result.to_json(args.json)


def _zoo(args: argparse.Namespace) -> None:

    from torchroof.validation import zoo

    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = [r for r in regimes if r not in zoo.ZOO_WORKLOADS]
    if unknown:
        raise ValueError(f"unknown regimes {unknown}; choose from {sorted(zoo.ZOO_WORKLOADS)}")
    zoo.run_and_report(args.arch, regimes, args.jobs, args.json, show_table=args.table)


def _check_plot(path: str | None) -> None:
    """Refuse a plot path with an unknown suffix before anything is computed."""
    if path:
        from torchroof.render.plots import check_plot_path

        check_plot_path(path)


def _roofline(args: argparse.Namespace) -> None:
    from torchroof.labs.explore import PRESETS, roofline_point

    if args.preset == "list":
        for name, preset in PRESETS.items():
            print(f"{name}: {preset.arithmetic} ({preset.seed})")
        return
    _check_plot(args.plot)
    reading = roofline_point(
        args.hardware,
        args.dtype,
        args.intensity,
        boundary=args.boundary,
        pipe=args.pipe,
        preset=args.preset,
    )
    print("\n".join(reading.lines()))
    if args.plot:
        from torchroof.labs.plots import roofline_lab_plot

        _wrote("roofline", str(roofline_lab_plot(reading, args.plot)))


def _gemm(args: argparse.Namespace) -> None:
    from torchroof.labs.explore import gemm_workbench

    _check_plot(args.plot)
    reading = gemm_workbench(
        args.m,
        args.n,
        args.k,
        dtype=args.dtype,
        tile=args.tile,
        l2_absorption=args.l2_absorption,
        hardware=args.hardware,
        local_budget_bytes=(
            None if args.local_budget_kib is None else args.local_budget_kib * 1024
        ),
    )
    print("\n".join(reading.lines()))
    if args.plot:
        from torchroof.labs.plots import gemm_lab_plot

        _wrote("GEMM roofline", str(gemm_lab_plot(reading, args.plot)))


def _fusion_bench(args: argparse.Namespace) -> None:
    from torchroof.labs.fusion_bench import fusion_bench, parse_boundaries

    bench = fusion_bench(
        args.tokens, args.d_model, args.dtype, args.hardware, parse_boundaries(args.boundaries)
    )
    print("\n".join(bench.lines()))


def _lab(args: argparse.Namespace) -> None:
    from torchroof.labs.io_bounds import attention_bounds, chunked_cross_entropy

    if args.lab == "flash":
        reading = attention_bounds(args.seq, args.head_dim, args.block_rows, args.dtype)
    else:
        reading = chunked_cross_entropy(
            args.tokens,
            args.vocab,
            args.chunk,
            d_model=args.d_model,
            dtype=args.dtype,
            hardware=args.hardware,
        )
    print("\n".join(reading.lines()))


def _workload_label(model: str, w: Workload) -> str:
    quant = f", quant {w.quant}" if w.quant != "none" else ""
    return regime(w.regime).label(model, w) + quant


def _writable(*paths: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done (a bad path
    used to fail after the whole table had printed)."""
    named = [path for path in paths if path]
    resolved = [Path(path).resolve() for path in named]
    for n, path in enumerate(resolved):
        if path in resolved[:n]:
            raise ValueError(
                f"two outputs to one path, {named[n]}: the second would overwrite the first; "
                "give each output its own path"
            )
    for path in paths:
        if not path:
            continue
        target = Path(path)
        folder = target.parent if str(target.parent) else Path(".")
        if target.is_dir():
            raise ValueError(f"cannot write {path}: it is a folder")
        if not folder.is_dir():
            raise ValueError(f"cannot write {path}: no folder {folder}")
        if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
            raise ValueError(f"cannot write {path}: permission denied")


def _wrote(what: str, path: str) -> None:
    print(f"torchroof: wrote {what} to {path}", file=sys.stderr)


def _estimate_outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(kind, path) of each estimate file the flags ask for, in the order they are written;
    the kind (torchroof.render.files.FORMATS) is the flag's, whatever the file's suffix."""
    flags = (
        ("estimate", args.json),
        ("csv", args.csv),
        ("timeline", args.timeline),
        ("roofline", args.plot_roofline),
        ("layers", args.plot_layers),
        ("html", args.html),
    )
    return [(kind, path) for kind, path in flags if path]


def _check_pricing(args: argparse.Namespace) -> None:
    """Build each pricing policy --fusion names and resolve --hardware, so a knob out of
    range or an unknown accelerator is refused before the model is traced."""
    from torchroof.pricing.price import resolve_hardware

    policies = [p.strip() for p in args.fusion.split(",") if p.strip()]
    if not 1 <= len(policies) <= 2:
        raise ValueError(f"--fusion takes one policy or two to compare, got {args.fusion!r}")
    pricing = from_flags(args, PricingOptions)
    for policy in policies:
        PricingOptions(**{**pricing, "fusion": policy})
    resolve_hardware(args.hardware)


def _refuse_workload_flags(args: argparse.Namespace) -> None:
    """--from-trace prices the step the trace recorded: a MODEL argument or a workload flag
    (--batch, --regime, --quant, --tp, ...) would be silently ignored, so it is refused."""
    from dataclasses import fields

    given = [
        "--" + f.name.replace("_", "-")
        for f in fields(Workload)
        if hasattr(args, f.name) and getattr(args, f.name) != f.default
    ]
    if args.model != DEFAULT_MODEL:
        given.insert(0, f"the model {args.model!r}")
    if given:
        raise OptionError(
            f"--from-trace: a trace's workload is fixed when it is traced; {', '.join(given)} "
            "cannot change it (trace again without --from-trace)"
        )


def _estimate(args: argparse.Namespace) -> None:
    outputs = _estimate_outputs(args)
    _writable(args.save_trace, *(path for _, path in outputs))
    for kind, path in outputs:
        output_format(path, kind)  # a plot named .jpg fails before any work
    _check_pricing(args)  # a bad pricing knob or hardware fails before any tracing
    if args.from_trace:
        _refuse_workload_flags(args)
        trace = Trace.load(args.from_trace)
        label = f"trace {args.from_trace}"
    else:
        workload = Workload(**from_flags(args, Workload))
        check_quant_hardware(workload.quant, args.hardware)  # a bad name fails before tracing
        if args.save_trace and workload.pp > 1:
            raise OptionError(NOT_SAVED)
        trace = trace_workload(args.model, workload)
        trace.facts.dtype = workload.dtype
        # the workload as traced: seq left out is resolved against the model's maximum
        label = _workload_label(args.model, Workload(**trace.facts.workload))
    if args.save_trace:
        trace.save(args.save_trace)
        _wrote("the trace", args.save_trace)
    policies = [p.strip() for p in args.fusion.split(",") if p.strip()]
    if not 1 <= len(policies) <= 2:
        raise ValueError(f"--fusion takes one policy or two to compare, got {args.fusion!r}")
    pricing = from_flags(args, PricingOptions)
    estimates = [
        estimate_trace(trace, args.hardware, PricingOptions(**{**pricing, "fusion": policy}))
        for policy in policies
    ]
    est = estimates[-1]
    print(f"torchroof estimate: {label}")
    if len(estimates) == 2:
        print(estimates[0].compare(estimates[1], depth=args.depth, collapse=not args.all_layers))
        print()
    print(est.table(depth=args.depth, collapse=not args.all_layers))
    print()
    print(est.summary())
    if args.kernels > 0:
        print()
        print(est.kernel_table(top=args.kernels))
    for kind, path in outputs:
        if kind == "html" and len(estimates) == 2:  # both policies, side by side
            from torchroof.report.compare import Comparison, Variant

            variants = [
                Variant(f"fusion={policy}", {"fusion": policy}, e)
                for policy, e in zip(policies, estimates, strict=True)
            ]
            Comparison(variants).to_html(path)
        elif kind == "html":
            est.to_html(path, depth=args.depth, collapse=not args.all_layers)
        else:
            write(est, path, kind, depth=args.depth)
        _wrote(output_format(path, kind).description, path)


def _print_figures(figures: dict[str, Figure]) -> None:
    rows = [
        [key, f"{fig.value:.4g}", "yes" if fig.approximate else "", fig.source]
        for key, fig in figures.items()
    ]
    print(tabulate(rows, headers=["figure", "value", "approx", "source"], disable_numparse=True))


def _print_cluster(cluster: ClusterSpec) -> None:
    """A cluster, its links and their ridges (seed 000 "The next wall": I* = pi / beta_link)."""
    accelerator = cluster.accelerator
    print(f"{cluster.display_name} ({cluster.name}); aliases: {', '.join(cluster.aliases)}")
    most = f"; at most {cluster.max_nodes} nodes" if cluster.max_nodes else ""
    node = f"{cluster.gpus_per_node} x {accelerator.display_name} ({accelerator.name})"
    print(f"{node} per node{most}")
    dtypes = [d for d in ("bf16", "fp8") if d in accelerator.tensor_flops_per_s]
    ridges = {dtype: cluster.link_ridges(dtype) for dtype in dtypes}
    rows = []
    for key, link in cluster.links().items():
        achieved = link.achieved_bytes_per_s if link.achieved_fraction else None
        latency = link.latency_s
        rows.append(
            [
                key,
                link.name,
                f"{link.line_bytes_per_s.value / 1e9:.0f}",
                f"{achieved / 1e9:.0f}" if achieved else "-",
                f"{latency.value * 1e6:.1f}" if latency else "-",
                *(f"{ridges[dtype][key]:,.1f}" for dtype in dtypes),
            ]
        )
    headers = ["link", "name", "line GB/s", "achieved GB/s", "alpha us"]
    headers += [f"I* {dtype}" for dtype in dtypes]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    print("(GB/s per GPU per direction; I* = FLOPs per byte crossing the link at line rate)")
    nvls = cluster.intra_node.nvls_all_reduce_bus_bytes_per_s
    if nvls is not None:
        print(f"in-switch all-reduce (NVLS): {nvls.value / 1e9:.0f} GB/s bus bandwidth")
    _print_figures(cluster.figures())


def _print_boundaries(spec: HardwareSpec) -> None:
    """seed 000 Table 4: each boundary's bandwidth, ridge pi_bf16 / beta, capacity and what
    it limits; on-chip rows are approximate aggregates (marked ~)."""
    dtype = "bf16" if "bf16" in spec.tensor_flops_per_s else next(iter(spec.tensor_flops_per_s))
    peak = spec.tensor_peak(dtype)
    rows = []
    for boundary in distinct_boundaries(spec):
        rate = boundary.bytes_per_s
        shown = f"{rate / 1e12:.2f} TB/s" if rate >= 1e12 else f"{rate / 1e9:.0f} GB/s"
        capacity = boundary.capacity_bytes
        if capacity is None:
            held = "-"
        elif boundary.name == "shared memory":
            held = f"{capacity / 1024:.0f} KiB / SM"
        else:
            held = (
                f"{capacity / 2**20:.0f} MiB" if capacity < 2**30 else f"{capacity / 2**30:.0f} GiB"
            )
        approx = "~" if boundary.figure.approximate else ""
        rows.append(
            [boundary.name, approx + shown, f"{boundary.ridge(peak):,.0f}", held, boundary.limits]
        )
    print(
        f"Memory boundaries, innermost first (ridge = pi_{dtype} / beta; "
        "~ an approximate aggregate):"
    )
    print(
        tabulate(
            rows,
            headers=["boundary", "beta", f"ridge I* {dtype}", "capacity", "what it limits"],
            disable_numparse=True,
        )
    )


def _unknown_hardware_or_cluster(name: str) -> UnknownHardwareError:
    """The error for a name that is neither an accelerator nor a cluster, with the closest
    of both and every known name."""
    accelerators = [spec.name for spec in available()]
    clusters = [cluster.name for cluster in available_clusters()]
    known = accelerators + clusters
    known += [alias for spec in [*available(), *available_clusters()] for alias in spec.aliases]
    close = difflib.get_close_matches(name.strip().lower(), known, n=4, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UnknownHardwareError(
        f"unknown accelerator or cluster {name!r}{hint} (accelerators: "
        f"{', '.join(accelerators)}; clusters: {', '.join(clusters)})"
    )


def _hardware(args: argparse.Namespace) -> None:
    if args.name and is_cluster(args.name):
        _print_cluster(get_cluster(args.name))
        return
    if args.name:
        try:
            spec = get(args.name)
        except UnknownHardwareError as error:
            if Path(args.name).suffix == ".toml":
                raise
            raise _unknown_hardware_or_cluster(args.name) from error
        print(f"{spec.display_name} ({spec.name}); aliases: {', '.join(spec.aliases)}")
        _print_figures(spec.figures())
        print()
        _print_boundaries(spec)
        return
    rows = []
    for spec in available():
        ridges = []
        for dtype in ("bf16", "fp8", "fp32"):
            try:
                ridges.append(f"{spec.ridge(dtype):.0f}")
            except UnsupportedDtypeError:
                ridges.append("-")
        fp8 = spec.tensor_flops_per_s.get("fp8")
        rows.append(
            [
                spec.name,
                f"{spec.hbm_bytes_per_s.value / 1e12:.2f}",
                f"{spec.hbm_capacity_bytes.value / 2**30:.0f}",
                f"{spec.tensor_peak('bf16') / 1e12:.0f}",
                f"{fp8.value / 1e12:.0f}" if fp8 else "-",
                f"{spec.vector_peak('fp32') / 1e12:.1f}",
                *ridges,
            ]
        )
    headers = [
        "name",
        "HBM TB/s",
        "GiB",
        "bf16 TF/s",
        "fp8 TF/s",
        "fp32 TF/s",
        "I* bf16",
        "I* fp8",
        "I* fp32",
    ]
    print(tabulate(rows, headers=headers, disable_numparse=True))


def _models(_args: argparse.Namespace) -> None:
    from torchroof.models.sources import shipped_config_dict

    rows = [
        [name, shipped_config_dict(name)["model_type"], shipped_config_dict(name)["_source"]]
        for name in shipped_models()
    ]
    print(tabulate(rows, headers=["name", "model_type", "source"]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as error:
        print(f"torchroof: error: {error}", file=sys.stderr)
        return 2
    handlers = {
        "estimate": _estimate,
        "hardware": _hardware,
        "models": _models,
        "compare": _compare,
        "sweep": _sweep,
        "roofline": _roofline,
        "zoo": _zoo,
        "calibrate": _calibrate,
        "validate": _validate,
        "gemm": _gemm,
        "fusion-bench": _fusion_bench,
        "lab": _lab,
    }
    if args.command is None:
        parser.print_help()
        return 0
    try:  # long commands show their progress on stderr unless --quiet
        with reporting(not getattr(args, "quiet", True)):
            handlers[args.command](args)
    except (
        UnknownHardwareError,
        UnknownModelError,
        UnsupportedDtypeError,
        ValueError,
        FileNotFoundError,
        ImportError,
        OpBudgetExceeded,
    ) as error:
        print(f"torchroof: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

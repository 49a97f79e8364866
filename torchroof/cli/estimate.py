"""``torchroof estimate``: the per-layer time budget of one model step, or of a saved trace."""

from __future__ import annotations

import argparse

from torchroof.api import (
    PipelineTrace,
    Trace,
    check_quant_hardware,
    estimate_trace,
    trace_workload,
)
from torchroof.cli.common import (
    DEFAULT_HARDWARE,
    Subparsers,
    add_quiet,
    positive_int,
    pricing_settings,
    workload_settings,
    writable,
    wrote,
)
from torchroof.config import PricingOptions, Workload, add_flags, flag_group
from torchroof.config.errors import OptionError
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.parallel.pipeline.price import NOT_SAVED
from torchroof.records.trace import Trace as RecordedTrace
from torchroof.render.files import estimate_json, output_format, write
from torchroof.render.text import comparison_table, kernel_table, layer_table, summary
from torchroof.workloads import regime

FUSION_PAIR = {
    "choices": None,
    "type": str,
    "help": "kernel policy: eager or fused (default fused); two, comma-separated, are compared",
}


def add_parser(commands: Subparsers) -> None:
    """The ``estimate`` command and its flags."""
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
    add_flags(est, PricingOptions, fusion=FUSION_PAIR)
    shown = flag_group(est, "output")
    shown.add_argument(
        "--depth",
        type=positive_int,
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
    shown.add_argument(
        "--sensitivity",
        action="store_true",
        help="also price the step with each hardware figure and uncertain assumption 10%% "
        "lower and higher, one at a time, and list what moves the step time most (--json "
        "holds the table under 'sensitivity')",
    )
    add_quiet(est)


def _workload_label(model: str, w: Workload) -> str:
    quant = f", quant {w.quant}" if w.quant != "none" else ""
    return regime(w.regime).label(model, w) + quant


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


def _policies(args: argparse.Namespace) -> list[str]:
    """The one or two fusion policies --fusion names; without --fusion, the runtime's
    (--runtime) or the default."""
    if "fusion" not in getattr(args, "given", {"fusion"}):
        return [pricing_settings(args)["fusion"]]
    policies = [p.strip() for p in args.fusion.split(",") if p.strip()]
    if not 1 <= len(policies) <= 2:
        raise ValueError(f"--fusion takes one policy or two to compare, got {args.fusion!r}")
    return policies


def _check_pricing(args: argparse.Namespace) -> None:
    """Build each pricing policy --fusion names and resolve --hardware, so a knob out of
    range or an unknown accelerator is refused before the model is traced."""
    from torchroof.pricing.hardware import resolve_hardware
    from torchroof.pricing.runtime import check_runtime_regime

    policies = _policies(args)
    pricing = pricing_settings(args)
    for policy in policies:
        PricingOptions(**{**pricing, "fusion": policy})
    resolve_hardware(args.hardware)
    if not args.from_trace:
        check_runtime_regime(PricingOptions(runtime=pricing["runtime"]), args.regime)


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


def run(args: argparse.Namespace) -> None:
    outputs = _estimate_outputs(args)
    writable(args.save_trace, *(path for _, path in outputs))
    for kind, path in outputs:
        output_format(path, kind)  # a plot named .jpg fails before any work
    _check_pricing(args)  # a bad pricing knob or hardware fails before any tracing
    trace: RecordedTrace | PipelineTrace  # Trace.load gives the recorded class
    if args.from_trace:
        _refuse_workload_flags(args)
        trace = Trace.load(args.from_trace)
        label = f"trace {args.from_trace}"
    else:
        workload = Workload(**workload_settings(args))
        check_quant_hardware(workload.quant, args.hardware)  # a bad name fails before tracing
        if args.save_trace and workload.pp > 1:
            raise OptionError(NOT_SAVED)
        trace = trace_workload(args.model, workload)
        trace.facts.dtype = workload.dtype
        # the workload as traced: seq left out is resolved against the model's maximum
        label = _workload_label(args.model, trace.facts.workload or workload)
    if args.save_trace:
        trace.save(args.save_trace)
        wrote("the trace", args.save_trace)
    policies = _policies(args)
    pricing = pricing_settings(args)
    estimates = [
        estimate_trace(trace, args.hardware, PricingOptions(**{**pricing, "fusion": policy}))
        for policy in policies
    ]
    est = estimates[-1]
    print(f"torchroof estimate: {label}")
    if len(estimates) == 2:
        print(
            comparison_table(
                estimates[0], estimates[1], depth=args.depth, collapse=not args.all_layers
            )
        )
        print()
    print(layer_table(est, depth=args.depth, collapse=not args.all_layers))
    print()
    print(summary(est))
    if args.kernels > 0:
        print()
        print(kernel_table(est, top=args.kernels))
    moved = None
    if args.sensitivity:
        from torchroof.sensitivity import sensitivity

        print()
        chosen = PricingOptions(**{**pricing, "fusion": policies[-1]})
        moved = sensitivity(trace, args.hardware, chosen)
        print("\n".join(moved.lines()))
    for kind, path in outputs:
        if kind == "html" and len(estimates) == 2:  # both policies, side by side
            from torchroof.render.html import comparison_html
            from torchroof.report.compare import Comparison, Variant

            variants = [
                Variant(f"fusion={policy}", {"fusion": policy}, e)
                for policy, e in zip(policies, estimates, strict=True)
            ]
            comparison_html(Comparison(variants), path)
        elif kind == "html":
            from torchroof.render.html import estimate_html

            estimate_html(est, path, depth=args.depth, collapse=not args.all_layers)
        elif kind == "estimate" and moved is not None:  # the table beside the estimate's fields
            estimate_json(est, path, {"sensitivity": moved.to_dict()})
        else:
            write(est, path, kind, depth=args.depth)
        wrote(output_format(path, kind).description, path)

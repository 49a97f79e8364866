"""``torchroof calibrate``: measure this device's ceilings, or fit an accelerator file to a
profile of a real step (``--from-profile``) or a cluster file to nccl-tests output
(``--from-nccl-tests``), and write it as TOML."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchroof.cli.common import Subparsers, add_quiet, workload_settings
from torchroof.config import Workload, add_flags
from torchroof.config.errors import OptionError
from torchroof.progress import current as current_progress


def add_parser(commands: Subparsers) -> None:
    """The ``calibrate`` command and its flags."""
    cal = commands.add_parser(
        "calibrate",
        help="measure this device's ceilings, or fit a hardware file to a profile or "
        "nccl-tests output -> TOML",
    )
    cal.add_argument("--device", default="cpu", help="cpu or cuda (measuring this device)")
    cal.add_argument("-o", "--output", default=None, help="TOML path (default: print it)")
    cal.add_argument("--name", default=None, help="spec name (default: <device>-measured)")
    fitted = cal.add_argument_group("fitting a file to measurements")
    fitted.add_argument(
        "--from-profile",
        metavar="TRACE",
        help="a PyTorch profiler Chrome trace (.json) or per-op CSV of one eager step of "
        "--model with the workload flags: fits --hardware's launch time and achievable "
        "fractions",
    )
    fitted.add_argument(
        "--from-nccl-tests",
        metavar="LOG",
        nargs="+",
        help="nccl-tests output (all_reduce_perf, all_gather_perf, reduce_scatter_perf, "
        "alltoall_perf): fits the links of the --hardware cluster (alpha, bus bandwidth)",
    )
    fitted.add_argument("--hardware", default=None, help="the accelerator or cluster to fit")
    fitted.add_argument("--model", default=None, help="--from-profile: the profiled model")
    fitted.add_argument(
        "--collective",
        default=None,
        help="--from-nccl-tests: the test's collective where the log does not name it",
    )
    fitted.add_argument(
        "--accelerator",
        default=None,
        help="--from-nccl-tests: the accelerator file the cluster names instead of its own "
        "(e.g. one written by --from-profile)",
    )
    add_flags(cal, Workload)
    add_quiet(cal)


def run(args: argparse.Namespace) -> None:
    if args.from_profile and args.from_nccl_tests:
        raise OptionError("--from-profile fits an accelerator, --from-nccl-tests a cluster: one")
    from dataclasses import fields

    workload_flags = sorted(
        "--" + f.name.replace("_", "-") for f in fields(Workload) if f.name in args.given
    )
    if workload_flags and not args.from_profile:
        raise OptionError(
            f"{', '.join(workload_flags)} describe the profiled step: give them with --from-profile"
        )
    if args.from_profile or args.from_nccl_tests:
        if not args.hardware:
            raise OptionError("give --hardware: the accelerator or cluster file to fit")
        text, lines, name = _profile(args) if args.from_profile else _nccl_tests(args)
    else:
        from torchroof.validation.calibrate import calibrate

        progress = lambda m: current_progress().begin(f"measuring {m}")  # noqa: E731
        result = calibrate(args.device, progress=progress)
        name = args.name or f"{args.device.replace(':', '-')}-measured"
        text, lines = result.to_toml(name), result.lines()
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: use it as --hardware {args.output}")
    else:
        print(text)


def _profile(args: argparse.Namespace) -> tuple[str, list[str], str]:
    from torchroof.api import estimate_trace, trace_workload
    from torchroof.pricing.hardware import resolve_hardware
    from torchroof.records.trace import Trace
    from torchroof.validation.profile_fit import (
        calibrated_accelerator,
        fit_profile,
        profiled_ops,
    )
    from torchroof.validation.profiling import normalise

    if not args.model:
        raise OptionError("--from-profile: give --model, the model the profile ran")
    spec, cluster = resolve_hardware(args.hardware)
    if cluster is not None:
        raise OptionError("--from-profile fits one accelerator: give its name, not a cluster's")
    if not Path(args.from_profile).is_file():
        raise OptionError(f"--from-profile: no such file: {args.from_profile}")
    workload = Workload(**workload_settings(args))
    if workload.parallel_plan.world > 1:
        raise OptionError(
            "--from-profile fits one accelerator: profile a step on one GPU (no --tp, --fsdp, "
            "--dp, --cp, --ep or --pp)"
        )
    trace = trace_workload(args.model, workload)
    assert isinstance(trace, Trace)  # pp = 1: one trace
    predicted = estimate_trace(trace, spec, fusion="eager")
    names = {normalise(k.name) for k in predicted.kernels}
    fitted = fit_profile(predicted, profiled_ops(args.from_profile, names), spec)
    name = args.name or f"{spec.name}-calibrated"
    source = f"torchroof calibrate --from-profile {Path(args.from_profile).name}"
    return calibrated_accelerator(spec, fitted, name, source), fitted.lines(), name


def _nccl_tests(args: argparse.Namespace) -> tuple[str, list[str], str]:
    from torchroof.pricing.hardware import resolve_hardware
    from torchroof.validation.nccl_tests import calibrated_cluster, fit, parse

    _, cluster = resolve_hardware(args.hardware)
    if cluster is None:
        raise OptionError("--from-nccl-tests fits a cluster's links: give a cluster as --hardware")
    fits = []
    for log in args.from_nccl_tests:
        try:
            text = Path(log).read_text()
        except OSError as error:
            raise OptionError(f"--from-nccl-tests: cannot read {log}: {error.strerror}") from None
        fits.append(fit(parse(text, args.collective), cluster))
    links = [f.link for f in fits]
    if len(set(links)) < len(links):
        raise OptionError("--from-nccl-tests: two logs measure the same link; give one each")
    name = args.name or f"{cluster.name}-calibrated"
    source = "torchroof calibrate --from-nccl-tests"
    accelerator = str(Path(args.accelerator).resolve()) if args.accelerator else ""
    text = calibrated_cluster(cluster, fits, name, source, accelerator)
    return text, [line for f in fits for line in f.lines()], name

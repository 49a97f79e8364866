"""``torchroof calibrate``: measure this device's ceilings, or fit an accelerator file to a
profile of a real step (``--from-profile``) or a cluster file to nccl-tests output
(``--from-nccl-tests``), and write it as TOML."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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
        "--model with the workload flags: fits --hardware's launch time, achievable "
        "fractions and fused attention's share of the peak",
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
    _refuse_unused(args)
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


PROFILE, NCCL, DEVICE = "--from-profile", "--from-nccl-tests", "measuring this device"
OWN_FLAGS = {  # each flag that only some ways of calibrating read, and those ways
    "hardware": ("--hardware", (PROFILE, NCCL)),
    "model": ("--model", (PROFILE,)),
    "collective": ("--collective", (NCCL,)),
    "accelerator": ("--accelerator", (NCCL,)),
    "device": ("--device", (DEVICE,)),
}


def _refuse_unused(args: argparse.Namespace) -> None:
    """A flag the chosen way of calibrating would not read is refused, not ignored."""
    way = PROFILE if args.from_profile else NCCL if args.from_nccl_tests else DEVICE
    for dest, (flag, readers) in OWN_FLAGS.items():
        if dest in args.given and way not in readers:
            raise OptionError(f"{flag} is read only by {' or '.join(readers)}, not by {way}")


def _profile(args: argparse.Namespace) -> tuple[str, list[str], str]:
    from torchroof.api import trace_workload
    from torchroof.pricing.hardware import resolve_hardware
    from torchroof.records.trace import Trace
    from torchroof.validation.profile_files import read_profile
    from torchroof.validation.profile_fit import calibrated_accelerator, fit_profile, kernel_timer
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
    kernels, times = kernel_timer(trace, spec)  # the eager kernels, planned once
    names = {normalise(k.name) for k in kernels}
    profiled, idle = read_profile(args.from_profile, names)
    current_progress().begin(
        f"fitting the launch, fractions and attention shares to {len(profiled)} profiled ops"
    )
    fitted = fit_profile(kernels, profiled, times, spec)
    current_progress().end()
    name = args.name or f"{spec.name}-calibrated"
    source = f"torchroof calibrate --from-profile {Path(args.from_profile).name}"
    lines = fitted.lines() + ([idle.line()] if idle is not None else [])
    return calibrated_accelerator(spec, fitted, name, source), lines, name


def _accelerator_ref(given: str | None, cluster: Any) -> str:
    """What the written cluster names as its accelerator: ``given`` (a file, by its absolute
    path; a shipped name, as it is), else the cluster's own (a shipped name, or the
    absolute path of the file it named), so the file loads from wherever it is written."""
    from torchroof.hardware import get
    from torchroof.hardware.spec import UnknownHardwareError

    if given:
        if Path(given).is_file():
            return str(Path(given).resolve())
        try:
            return get(given).name
        except UnknownHardwareError:
            raise OptionError(f"--accelerator: no such accelerator or file: {given}") from None
    spec = cluster.accelerator
    try:
        if Path(get(spec.name).path).resolve() == Path(spec.path).resolve():
            return str(spec.name)
    except UnknownHardwareError:
        pass
    return str(Path(spec.path).resolve())


def _nccl_tests(args: argparse.Namespace) -> tuple[str, list[str], str]:
    from torchroof.pricing.hardware import resolve_hardware
    from torchroof.validation.nccl_tests import applied, calibrated_cluster, fit, parse

    _, cluster = resolve_hardware(args.hardware)
    if cluster is None:
        raise OptionError("--from-nccl-tests fits a cluster's links: give a cluster as --hardware")
    logs = []
    for path in args.from_nccl_tests:
        try:
            logs.append(parse(Path(path).read_text(), args.collective))
        except OSError as error:
            raise OptionError(f"--from-nccl-tests: cannot read {path}: {error.strerror}") from None
    fits, fitted = [], cluster
    # the in-node logs first: a run over nodes is then priced with the in-node figures fitted
    for log in sorted(logs, key=lambda log: log.nodes > 1):
        fits.append(fit(log, fitted))
        fitted = applied(fitted, fits[-1])
    figures = [(f.link, f.figure) for f in fits]
    if len(set(figures)) < len(figures):
        raise OptionError(
            "--from-nccl-tests: two logs fit the same figure of the same link; give one each"
        )
    name = args.name or f"{cluster.name}-calibrated"
    source = "torchroof calibrate --from-nccl-tests"
    accelerator = _accelerator_ref(args.accelerator, cluster)
    text = calibrated_cluster(cluster, fits, name, source, accelerator)
    return text, [line for f in fits for line in f.lines()], name

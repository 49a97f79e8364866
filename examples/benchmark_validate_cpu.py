"""Predicted versus measured on this machine's CPU: a small Llama-shaped model's prefill,
decode and training step, each repeat calibrated just before its step.

This is a benchmark, not a test: timings on a shared machine move by tens of percent between
runs, so nothing here passes or fails. What makes it reproducible is that the ceilings and
the step are measured together: every repeat runs a short calibration (STREAM, matmul,
launch) and times the step at once, is predicted with that calibration, and the ratio is
the median over the repeats with its range. The test suite keeps the deterministic half
(tests/test_validate.py: the prediction for a fixed calibration, exactly).

    python examples/benchmark_validate_cpu.py                 # tiny model, seq 64: seconds
    python examples/benchmark_validate_cpu.py --size cpu --seq 256 --iterations 5
    python examples/benchmark_validate_cpu.py --hardware my-cpu.toml   # fixed ceilings
    python examples/benchmark_validate_cpu.py --json validation.json

``--size tiny`` is ``torchroof.validation.validate.TINY_OVERRIDES`` (2 layers, d = 256); ``--size
cpu``
is validate's default CPU model (4 layers, d = 512), the README table's size. Every repeat
times the median of ``--iterations`` steps and profiles one more for the per-kernel view.
Both predictions are shown: the pure roofline (a floor) and the realistic mode (adds the
measured launch per kernel and the waves).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from tabulate import tabulate

from torchroof.validation.validate import CPU_OVERRIDES, TINY_OVERRIDES, validate

SIZES = {"tiny": TINY_OVERRIDES, "cpu": CPU_OVERRIDES}
REGIMES = ("prefill", "decode", "train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", help="config whose shape is shrunk")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seq", type=int, default=64, help="tokens (decode: cached context)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="calibrate + time, N times")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--hardware", default=None, help="a fixed hardware TOML: only the step is repeated"
    )
    parser.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    args = parser.parse_args()
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = sorted(set(regimes) - set(REGIMES))
    if unknown:
        parser.error(f"unknown regime {', '.join(unknown)}; choose from {', '.join(REGIMES)}")

    results = []
    for regime in regimes:
        print(f"{regime}: {args.repeats} repeats ...", flush=True)
        results.append(
            validate(
                args.model,
                regime,
                hardware=args.hardware,
                batch=args.batch,
                seq=args.seq,
                overrides=SIZES[args.size],
                warmup=args.warmup,
                iterations=args.iterations,
                repeats=args.repeats,
                threads=args.threads,
            )
        )

    rows = []
    for result in results:
        mapped = sum(1 for k in result.kernels if k.measured_s is not None)
        labels = Counter(k.label for k in result.kernels if k.diagnosis)
        rows.append(
            [
                result.regime,
                f"{result.predicted('roofline').median * 1e3:.3f}",
                f"{result.predicted('realistic').median * 1e3:.3f}",
                f"{result.measured().median * 1e3:.3f} "
                f"({result.measured().low * 1e3:.1f}..{result.measured().high * 1e3:.1f})",
                str(result.ratio("roofline")),
                str(result.ratio("realistic")),
                f"{mapped}/{len(result.kernels)}",
                ", ".join(f"{n} {label}" for label, n in labels.most_common(3)),
            ]
        )
    first = results[0]
    calibrations = [r.calibration for r in first.repeats if r.calibration is not None]
    print()
    if calibrations:
        middle = calibrations[len(calibrations) // 2]
        print(f"{first.regime}'s middle calibration:")
        print("\n".join(f"  {line}" for line in middle.lines()))
    else:
        print(f"fixed hardware file: {first.hardware}")
    print(
        f"{args.model} shrunk to --size {args.size}, batch {args.batch}, seq {args.seq}, "
        f"{first.settings['threads']} threads; {args.repeats} repeats x median of "
        f"{args.iterations} steps; ratio = predicted / measured, median (min..max)"
    )
    print(
        tabulate(
            rows,
            headers=[
                "step",
                "roofline ms",
                "realistic ms",
                "measured ms",
                "roofline ratio",
                "realistic ratio",
                "kernels mapped",
                "diagnosis (roofline; top 3)",
            ],
            disable_numparse=True,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"runs": [r.to_dict() for r in results]}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

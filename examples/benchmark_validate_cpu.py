"""Predicted versus measured on this machine's CPU: calibrate, then validate a small
Llama-shaped model's prefill, decode and training step.

This is a benchmark, not a test: timings on a shared machine move by tens of percent between
runs, so nothing here passes or fails. The test suite keeps the deterministic half
(tests/test_validate.py: the prediction for a fixed calibration, exactly).

    python examples/benchmark_validate_cpu.py                 # tiny model, seq 64: seconds
    python examples/benchmark_validate_cpu.py --size cpu --seq 256 --iterations 5
    python examples/benchmark_validate_cpu.py --json validation.json

``--size tiny`` is ``torchroof.validate.TINY_OVERRIDES`` (2 layers, d = 256); ``--size cpu``
is validate's default CPU model (4 layers, d = 512), the README table's size. Every step is
the median of ``--iterations`` profiled runs after ``--warmup`` runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tabulate import tabulate

from torchroof.calibrate import calibrate
from torchroof.validate import CPU_OVERRIDES, TINY_OVERRIDES, validate

SIZES = {"tiny": TINY_OVERRIDES, "cpu": CPU_OVERRIDES}
REGIMES = ("prefill", "decode", "train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b", help="config whose shape is shrunk")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seq", type=int, default=64, help="tokens (decode: cached context)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    args = parser.parse_args()
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = sorted(set(regimes) - set(REGIMES))
    if unknown:
        parser.error(f"unknown regime {', '.join(unknown)}; choose from {', '.join(REGIMES)}")

    print("calibrating cpu ...")
    measured = calibrate(
        "cpu",
        progress=lambda message: print(f"  {message}"),
        stream_bytes=128 * 2**20,
        matmul_sizes=(512, 1024),
    )
    print("\n".join(measured.lines()))
    with tempfile.TemporaryDirectory(prefix="torchroof-bench-") as folder:
        toml = Path(folder) / "cpu.toml"
        toml.write_text(measured.to_toml("cpu-measured"))
        results = [
            validate(
                args.model,
                regime,
                hardware=str(toml),
                batch=args.batch,
                seq=args.seq,
                overrides=SIZES[args.size],
                warmup=args.warmup,
                iterations=args.iterations,
                launch_overhead_s=measured.launch_overhead_s,
            )
            for regime in regimes
        ]

    rows = []
    for result in results:
        mapped = sum(1 for k in result.kernels if k.measured_s is not None)
        rows.append(
            [
                result.regime,
                f"{result.predicted_total_s * 1e3:.3f}",
                f"{result.measured_total_s * 1e3:.3f}",
                f"{result.total_ratio:.2f}",
                f"{mapped}/{len(result.kernels)}",
                sum(1 for k in result.kernels if k.diagnosis),
            ]
        )
    print()
    print(
        f"{args.model} shrunk to --size {args.size}, batch {args.batch}, seq {args.seq}, "
        f"median of {args.iterations}"
    )
    print(
        tabulate(
            rows,
            headers=[
                "step",
                "predicted ms",
                "measured ms",
                "predicted/measured",
                "kernels mapped",
                "diagnosed",
            ],
            disable_numparse=True,
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": measured.to_dict(), "runs": [r.to_dict() for r in results]}, indent=1
            )
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

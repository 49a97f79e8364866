"""What the expected range and the calibrated mode cost an estimate: pricing a traced step
in the realistic mode, against the same with its expected range made (as the summary, JSON
and HTML make it), and against the calibrated mode with its range, in the same run.

    python examples/benchmark_expected_range.py [--model llama-3-8b] [--repeats 5]

The target is at most 1.05 (5% slower) for both ratios. Every timing is the best of
``--repeats`` after one warm-up pricing (the kernel plan is cached by then, so the ratio is
of the pricing a user repeats, the part the range could slow).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torchroof
from torchroof.accuracy.expected import expected_range


def best_of(repeats: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trace = torchroof.trace_model(args.model, "decode", batch=8, seq=1024)
    trace.estimate(args.hardware, mode="realistic")  # warm: the kernel plan is kept

    def realistic() -> object:
        return trace.estimate(args.hardware, mode="realistic")

    def with_range() -> object:
        return expected_range(trace.estimate(args.hardware, mode="realistic"))

    def calibrated() -> object:
        return expected_range(trace.estimate(args.hardware, mode="calibrated"))

    base = best_of(args.repeats, realistic)
    ranged = best_of(args.repeats, with_range)
    corrected = best_of(args.repeats, calibrated)
    print(f"{args.model} decode step on {args.hardware}, best of {args.repeats}:")
    print(f"  realistic estimate                  {base * 1e3:8.1f} ms")
    print(
        f"  realistic estimate + expected range {ranged * 1e3:8.1f} ms  ratio {ranged / base:.3f}"
    )
    print(
        f"  calibrated estimate + range         {corrected * 1e3:8.1f} ms  "
        f"ratio {corrected / base:.3f}"
    )
    print("target: each ratio at most 1.05")


if __name__ == "__main__":
    main()

"""What simulating a serving deployment costs, against one ``torchroof estimate`` of the
same model's decode step measured in this run (the issue's target: 10,000 requests of a
Llama-3-70B at tensor parallel 8 within 3x the estimate).

Measured two ways, each run ``--repeat`` times, estimate and serve in turn, the median
printed:

- **in a warm process**: each call runs in its own process and is timed from after its
  imports: ``torchroof.estimate`` of the decode step (batch 8, context 1024, realistic,
  vLLM) on a DGX H100, the reference; ``torchroof.serve`` of ``--requests`` requests at
  ``--rate`` per second (input lengths uniform over 128..2048, outputs lognormal around
  256), the model prepared inside the timed part, token counts above
  ``--interpolate-above`` (64) priced between grid sizes; printed with the steps it
  simulated;
- **as whole commands**: ``torchroof estimate ...`` and ``torchroof serve ...`` with the
  same figures, timed from outside from start to exit (Python's start-up and imports
  included, as a user running them pays).

    python examples/benchmark_serve.py [--model llama-3-70b --tp 8 --hardware dgx-h100]
        [--requests 10000 --rate 20] [--interpolate-above 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PRICING = {"mode": "realistic", "runtime": "vllm"}
INPUT_LEN = "uniform:128,2048"
OUTPUT_LEN = "lognormal:256,0.5"


def _child(kind: str, args: argparse.Namespace) -> None:
    import torchroof

    knobs = {"tp": args.tp} if args.tp > 1 else {}
    start = time.perf_counter()
    if kind == "estimate":
        torchroof.estimate(
            args.model, "decode", hardware=args.hardware, batch=8, context=1024, **knobs, **PRICING
        )
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return
    result = torchroof.serve(
        args.model,
        args.hardware,
        rate=args.rate,
        requests=args.requests,
        input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        exact_up_to=args.interpolate_above or None,
        **knobs,
        **PRICING,
    )
    seconds = time.perf_counter() - start
    summary = result.summary()
    print(json.dumps({"seconds": seconds, "steps": summary["steps"]}))


def _warm(kind: str, args: argparse.Namespace) -> dict:
    """One call in its own process, timed inside it from after its imports."""
    command = [sys.executable, __file__, "--child", kind]
    for name in ("model", "tp", "hardware", "requests", "rate", "interpolate_above"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _command(kind: str, args: argparse.Namespace) -> list[str]:
    """The command line a user runs for ``kind``, with the benchmark's figures."""
    found = shutil.which("torchroof", path=str(Path(sys.executable).parent))
    program = [found] if found else [sys.executable, "-m", "torchroof"]
    common = ["--hardware", args.hardware, "--tp", str(args.tp), "--quiet"]
    common += ["--mode", PRICING["mode"], "--runtime", PRICING["runtime"]]
    if kind == "estimate":
        step = ["--regime", "decode", "--batch", "8", "--context", "1024"]
        return [*program, "estimate", args.model, *step, *common]
    load = ["--rate", str(args.rate), "--requests", str(args.requests)]
    load += ["--input-len", INPUT_LEN, "--output-len", OUTPUT_LEN]
    if args.interpolate_above:
        load += ["--interpolate-above", str(args.interpolate_above)]
    return [*program, "serve", args.model, *load, *common]


def _whole(kind: str, args: argparse.Namespace) -> float:
    """One whole command's wall time, from its start to its exit."""
    start = time.perf_counter()
    subprocess.run(_command(kind, args), check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--hardware", default="dgx-h100")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument(
        "--interpolate-above",
        type=int,
        default=64,
        help="token counts priced between grid sizes above this (0: every count priced)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, medians printed")
    parser.add_argument("--child", choices=["estimate", "serve"])
    args = parser.parse_args()
    if args.child:
        _child(args.child, args)
        return
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    warm: dict[str, list[float]] = {"estimate": [], "serve": []}
    whole: dict[str, list[float]] = {"estimate": [], "serve": []}
    steps = 0
    for _ in range(args.repeat):  # in turn, so that a drift in the machine's speed hits both
        warm["estimate"].append(_warm("estimate", args)["seconds"])
        served = _warm("serve", args)
        warm["serve"].append(served["seconds"])
        steps = served["steps"]
        for kind in ("estimate", "serve"):
            whole[kind].append(_whole(kind, args))
    median = {k: statistics.median(v) for k, v in warm.items()}
    commands = {k: statistics.median(v) for k, v in whole.items()}
    runs = f"median of {args.repeat}" if args.repeat > 1 else "one run"
    load = f"{args.requests:,} requests at {args.rate:g}/s ({steps:,} engine steps)"
    print(f"in a warm process ({runs} each, timed from after the imports):")
    print(f"  one estimate of the decode step: {median['estimate']:.2f} s (the reference)")
    print(
        f"  serving {load}: {median['serve']:.2f} s, "
        f"{median['serve'] / median['estimate']:.1f}x the estimate"
    )
    print(f"as whole commands ({runs} each, from start to exit):")
    print(f"  torchroof estimate: {commands['estimate']:.2f} s (the reference)")
    print(
        f"  torchroof serve: {commands['serve']:.2f} s, "
        f"{commands['serve'] / commands['estimate']:.1f}x the estimate"
    )


if __name__ == "__main__":
    main()

"""What tracing one rank of a parallel training step costs, against the single-GPU trace.

The target: tracing a Llama-3-70B training step at ``fsdp=8, tp=8`` (rank 0 of the
real FSDP2 + tensor-parallel program on a fake process group of 64 ranks) costs at most 3x
tracing the same step on one GPU. Each trace runs in its own process (so the peak RSS is
its own), interleaved with the other and repeated; medians and their ratio are printed.

    python examples/benchmark_parallel_trace.py [--seq 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PLANS = {"one GPU": {}, "fsdp=8, tp=8": {"fsdp": 8, "tp": 8}}


def _child(model: str, seq: int, plan: str) -> None:
    import resource
    import time

    import torchroof

    start = time.perf_counter()
    trace = torchroof.trace_model(model, "train", batch=1, seq=seq, precision="bf16", **PLANS[plan])
    elapsed = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"time_s": elapsed, "rss_bytes": rss, "ops": len(trace)}))


def _measure(model: str, seq: int, plan: str) -> dict:
    argv = ["--child", plan, "--model", model, "--seq", str(seq)]
    out = subprocess.run(
        [sys.executable, __file__, *argv], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=list(PLANS))
    args = parser.parse_args()
    if args.child:
        _child(args.model, args.seq, args.child)
        return
    runs: dict[str, list[dict]] = {plan: [] for plan in PLANS}
    for _ in range(args.repeats):
        for plan in PLANS:  # interleaved, so machine noise hits both alike
            runs[plan].append(_measure(args.model, args.seq, plan))
    print(f"{args.model} training step, batch 1 x {args.seq} tokens, median of {args.repeats}")
    times = {plan: statistics.median(r["time_s"] for r in rs) for plan, rs in runs.items()}
    for plan, rs in runs.items():
        rss = max(r["rss_bytes"] for r in rs)
        print(
            f"  {plan:13s} trace: {times[plan]:6.2f} s   peak RSS {rss / 2**20:6.0f} MiB"
            f"   ({rs[0]['ops']:,} ops)"
        )
    ratio = times["fsdp=8, tp=8"] / times["one GPU"]
    print(f"  ratio fsdp=8, tp=8 / one GPU: {ratio:.2f} (target <= 3)")


if __name__ == "__main__":
    main()

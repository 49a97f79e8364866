"""What would a fused runtime buy on this model? Eager vs fused kernels, side by side.

The fusion bench on a real model: the same trace priced with one kernel
per op (PyTorch eager) and with Inductor-style fused elementwise runs; FLOPs are identical,
only the bytes (and so the time) change.

    python examples/fusion_comparison.py [--model llama-3-8b] [--regime prefill|train]
                                         [--seq 4096] [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse

import torchroof
from torchroof.config import Workload
from torchroof.render import text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--regime", choices=["prefill", "train"], default="prefill")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hardware", default="h100-sxm")
    args = parser.parse_args()

    workload = Workload(args.regime, batch=1, seq=args.seq, precision="bf16")
    trace = torchroof.trace_workload(args.model, workload)
    eager = trace.estimate(args.hardware, fusion="eager")
    fused = trace.estimate(args.hardware, fusion="fused")
    print(f"{args.model} {args.regime}, 1 x {args.seq} tokens on {args.hardware}")
    print(text.comparison_table(eager, fused))
    print()
    for est in (eager, fused):
        print(
            f"{text.estimate_label(est):>16}: {est.time_s * 1e3:8.2f} ms, "
            f"{est.bytes / 1e9:8.2f} GB, "
            f"{est.flops / 1e12:8.3f} TFLOP, {len(est.kernels)} kernels, "
            f"{100 * est.memory_bound_share:.0f}% of time memory-bound"
        )
    print(
        f"fused / eager: W x{fused.flops / eager.flops:.3f}, Q x{fused.bytes / eager.bytes:.3f}, "
        f"speed-up {eager.time_s / fused.time_s:.2f}x"
    )
    if args.regime == "train":
        chunked = trace.estimate(args.hardware, fusion="fused", loss="chunked")
        print(
            f"+ chunked cross-entropy: {chunked.time_s * 1e3:.2f} ms, "
            f"{chunked.bytes / 1e9:.2f} GB ({(fused.bytes - chunked.bytes) / 1e9:.2f} GB less)"
        )


if __name__ == "__main__":
    main()

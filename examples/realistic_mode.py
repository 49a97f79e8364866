"""The pure roofline against the realistic mode on Llama-3-8B, one effect switched off at a
time (README "Beyond the floor"). Each step is traced once and priced seven times.

    python examples/realistic_mode.py                  # H100 SXM, ~2 min on 2 cores
    python examples/realistic_mode.py --hardware a100
"""

from __future__ import annotations

import argparse

import torchroof

CASES = (
    ("prefill, 1 x 4096", {"regime": "prefill", "seq": 4096}),
    ("decode, batch 1, context 4096", {"regime": "decode", "batch": 1, "context": 4096}),
    ("decode, batch 64, context 8192", {"regime": "decode", "batch": 64, "context": 8192}),
    ("train, 1 x 4096, mixed, AdamW", {"regime": "train", "seq": 4096, "precision": "mixed"}),
)
EFFECTS = ("on_chip", "waves", "latency_shelf", "achievable", "launch", "softmax_pipes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hardware", default="h100-sxm")
    args = parser.parse_args()
    headers = ["step", "pure ms", "realistic ms", "ratio", *(f"without {e}" for e in EFFECTS)]
    print("| " + " | ".join(headers) + " |")
    print("|---" * len(headers) + "|")
    for label, knobs in CASES:
        trace = torchroof.trace_model(args.model, **knobs)
        pure = trace.estimate(args.hardware).time_s
        real = trace.estimate(args.hardware, mode="realistic").time_s
        without = [
            trace.estimate(args.hardware, mode="realistic", **{effect: False}).time_s
            for effect in EFFECTS
        ]
        cells = [label, f"{pure * 1e3:.2f}", f"{real * 1e3:.2f}", f"{real / pure:.2f}"]
        cells += [f"{seconds * 1e3:.2f}" for seconds in without]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

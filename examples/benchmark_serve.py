"""What simulating a serving deployment costs, against one ``torchroof estimate`` of the
same model's decode step measured in this run (the issue's target: 10,000 requests of a
Llama-3-70B at tensor parallel 8 within 3x the estimate).

Each measurement runs in its own process, imports warm:

- ``estimate``: one ``torchroof.estimate`` of the decode step (batch 8, context 1024,
  realistic, vLLM) on a DGX H100: the reference;
- ``serve``: ``torchroof.serve`` of ``--requests`` requests at ``--rate`` per second
  (input lengths uniform over 128..2048, outputs lognormal around 256), the model
  prepared inside the timed part, token counts above ``--interpolate-above`` (64)
  priced between grid sizes; printed with the steps it simulated.

    python examples/benchmark_serve.py [--model llama-3-70b --tp 8 --hardware dgx-h100]
        [--requests 10000 --rate 20] [--interpolate-above 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PRICING = {"mode": "realistic", "runtime": "vllm"}


def _child(
    kind: str, model: str, tp: int, hardware: str, requests: int, rate: float, above: int
) -> None:
    import torchroof

    knobs = {"tp": tp} if tp > 1 else {}
    start = time.perf_counter()
    if kind == "estimate":
        torchroof.estimate(
            model, "decode", hardware=hardware, batch=8, context=1024, **knobs, **PRICING
        )
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return
    result = torchroof.serve(
        model,
        hardware,
        rate=rate,
        requests=requests,
        input_len="uniform:128,2048",
        output_len="lognormal:256,0.5",
        exact_up_to=above or None,
        **knobs,
        **PRICING,
    )
    seconds = time.perf_counter() - start
    summary = result.summary()
    print(
        json.dumps(
            {"seconds": seconds, "steps": summary["steps"], "p99_ttft_s": summary["ttft_s"]["p99"]}
        )
    )


def _run(kind: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--model",
        args.model,
        "--tp",
        str(args.tp),
        "--hardware",
        args.hardware,
        "--requests",
        str(args.requests),
        "--rate",
        str(args.rate),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
    parser.add_argument("--child", choices=["estimate", "serve"])
    args = parser.parse_args()
    if args.child:
        _child(
            args.child,
            args.model,
            args.tp,
            args.hardware,
            args.requests,
            args.rate,
            args.interpolate_above,
        )
        return
    reference = _run("estimate", args)["seconds"]
    served = _run("serve", args)
    print(f"one estimate of the decode step: {reference:.2f} s (the reference)")
    print(
        f"serving {args.requests:,} requests at {args.rate:g}/s ({served['steps']:,} engine "
        f"steps): {served['seconds']:.2f} s, {served['seconds'] / reference:.1f}x the estimate"
    )


if __name__ == "__main__":
    main()

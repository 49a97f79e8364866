"""Speed and memory of tracing + estimating, against FlopCounterMode on the same step.

Llama-3-70B-shaped, 4096 tokens, on meta. ``--regime forward``: one forward (target:
<= 1.5x FlopCounterMode's time, peak RSS < 1 GB). ``--regime train``: forward, loss,
backward and the AdamW step for torchroof, forward + backward for FlopCounterMode (target:
< 2x its time, peak RSS < 1.5 GB). Each measurement runs in its own process (so peak RSS is
that tool's alone) and is repeated; medians are printed with the ratio.

    python examples/benchmark_trace_speed.py [--regime forward|train] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def _child(tool: str, model_name: str, seq: int, regime: str) -> None:
    import resource
    import time

    import torch
    import transformers.masking_utils as masking

    from torchroof.models.sources import build_model, load_config

    # HF asks `.item()` whether position ids are packed; FlopCounterMode cannot answer it on
    # meta, so both tools are given the same "not packed" answer up front (no extra mode).
    masking.find_packed_sequence_indices = lambda position_ids: None
    model = build_model(load_config(model_name))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    kwargs = {"use_cache": False, "logits_to_keep": 1}
    start = time.perf_counter()
    if tool == "torchroof" and regime == "train":
        import torchroof

        est = torchroof.estimate(
            model, "train", batch=1, seq=seq, optimizer="adamw", precision="bf16"
        )
        flops, ops = est.flops, est.op_count
    elif tool == "torchroof":
        import torchroof

        with torch.no_grad(), torchroof.trace() as trace:
            model(ids, **kwargs)
        est = trace.estimate("h100-sxm")
        flops, ops = est.flops, len(trace)
    else:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            if regime == "train":
                model.train()
                model(ids, labels=ids).loss.backward()
            else:
                with torch.no_grad():
                    model(ids, **kwargs)
        flops, ops = counter.get_total_flops(), 0
    elapsed = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"time_s": elapsed, "rss_bytes": rss, "flops": flops, "ops": ops}))


def _measure(tool: str, model: str, seq: int, regime: str) -> dict:
    argv = ["--child", tool, "--model", model, "--seq", str(seq), "--regime", regime]
    out = subprocess.run(
        [sys.executable, __file__, *argv],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--regime", choices=["forward", "train"], default="forward")
    parser.add_argument("--child", choices=["torchroof", "flopcounter"])
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model, args.seq, args.regime)
        return
    runs: dict[str, list[dict]] = {"torchroof": [], "flopcounter": []}
    for _ in range(args.repeats):
        for tool in runs:  # interleaved, so machine noise hits both alike
            runs[tool].append(_measure(tool, args.model, args.seq, args.regime))
    ours = statistics.median(r["time_s"] for r in runs["torchroof"])
    ref = statistics.median(r["time_s"] for r in runs["flopcounter"])
    ours_rss = max(r["rss_bytes"] for r in runs["torchroof"])
    ref_rss = max(r["rss_bytes"] for r in runs["flopcounter"])
    step = "forward" if args.regime == "forward" else "training step (torchroof: + AdamW step)"
    print(f"{args.model} {step}, {args.seq} tokens on meta, median of {args.repeats} runs")
    first, ref_first = runs["torchroof"][0], runs["flopcounter"][0]
    print(
        f"  torchroof trace+estimate : {ours:6.2f} s   peak RSS {ours_rss / 2**20:6.0f} MiB"
        f"   ({first['ops']} ops, {first['flops'] / 1e12:.1f} TFLOP)"
    )
    print(
        f"  FlopCounterMode          : {ref:6.2f} s   peak RSS {ref_rss / 2**20:6.0f} MiB"
        f"   ({ref_first['flops'] / 1e12:.1f} TFLOP, attention not causal-halved)"
    )
    time_target, rss_target = (1.5, "1 GB") if args.regime == "forward" else (2.0, "1.5 GB")
    print(f"  time ratio torchroof / FlopCounterMode: {ours / ref:.2f} (target <= {time_target})")
    print(f"  torchroof peak RSS: {ours_rss / 2**30:.2f} GiB (target < {rss_target})")


if __name__ == "__main__":
    main()

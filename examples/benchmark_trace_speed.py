"""Speed and memory of tracing + estimating, against FlopCounterMode on the same forward.

Llama-3-70B-shaped forward, 4096 tokens, on meta. Each measurement runs in its own process
(so peak RSS is that tool's alone) and is repeated; medians are printed with the ratio.
Targets (issue 2): torchroof <= 1.5x FlopCounterMode's time, peak RSS < 1 GB.

    python examples/benchmark_trace_speed.py [--model llama-3-70b] [--seq 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def _child(tool: str, model_name: str, seq: int) -> None:
    import resource
    import time

    import torch
    import transformers.masking_utils as masking

    from torchroof.models import build_model, load_config

    # HF asks `.item()` whether position ids are packed; FlopCounterMode cannot answer it on
    # meta, so both tools are given the same "not packed" answer up front (no extra mode).
    masking.find_packed_sequence_indices = lambda position_ids: None
    model = build_model(load_config(model_name))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    kwargs = {"use_cache": False, "logits_to_keep": 1}
    start = time.perf_counter()
    if tool == "torchroof":
        import torchroof

        with torch.no_grad(), torchroof.trace() as trace:
            model(ids, **kwargs)
        est = trace.estimate("h100-sxm")
        flops, ops = est.flops, len(trace)
    else:
        from torch.utils.flop_counter import FlopCounterMode

        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(ids, **kwargs)
        flops, ops = counter.get_total_flops(), 0
    elapsed = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"time_s": elapsed, "rss_bytes": rss, "flops": flops, "ops": ops}))


def _measure(tool: str, model: str, seq: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", tool, "--model", model, "--seq", str(seq)],
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
    parser.add_argument("--child", choices=["torchroof", "flopcounter"])
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model, args.seq)
        return
    runs: dict[str, list[dict]] = {"torchroof": [], "flopcounter": []}
    for _ in range(args.repeats):
        for tool in runs:  # interleaved, so machine noise hits both alike
            runs[tool].append(_measure(tool, args.model, args.seq))
    ours = statistics.median(r["time_s"] for r in runs["torchroof"])
    ref = statistics.median(r["time_s"] for r in runs["flopcounter"])
    ours_rss = max(r["rss_bytes"] for r in runs["torchroof"])
    ref_rss = max(r["rss_bytes"] for r in runs["flopcounter"])
    print(f"{args.model} forward, {args.seq} tokens on meta, median of {args.repeats} runs")
    first, ref_first = runs["torchroof"][0], runs["flopcounter"][0]
    print(
        f"  torchroof trace+estimate : {ours:6.2f} s   peak RSS {ours_rss / 2**20:6.0f} MiB"
        f"   ({first['ops']} ops, {first['flops'] / 1e12:.1f} TFLOP)"
    )
    print(
        f"  FlopCounterMode          : {ref:6.2f} s   peak RSS {ref_rss / 2**20:6.0f} MiB"
        f"   ({ref_first['flops'] / 1e12:.1f} TFLOP, attention not causal-halved)"
    )
    print(f"  time ratio torchroof / FlopCounterMode: {ours / ref:.2f} (target <= 1.5)")
    print(f"  torchroof peak RSS: {ours_rss / 2**30:.2f} GiB (target < 1 GB)")


if __name__ == "__main__":
    main()

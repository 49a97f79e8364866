"""Trace once, price many: what an estimate and a batch x context grid of Llama-3-70B decode
cost, against FlopCounterMode's forward of the same model measured in the same run.

Each measurement runs in its own process (imports warm, the model built inside the timed
part for both tools) and is repeated; medians are printed with ratios:

- FlopCounterMode, one forward at ``--seq`` tokens (the reference);
- a prefill estimate at ``--seq`` tokens and a decode estimate (batch 8, context
  ``--seq``), each with every decoder layer run (``full_trace=True``) and with the repeated
  layers copied from one traced layer of each kind (the default);
- the same decode step priced again on another accelerator from the prepared model
  (``torchroof.prepare``): pricing only;
- a decode step at a new batch and context from a prepared model that already holds the
  step traced with its sizes as symbols: its trace made from the symbols, then priced;
- a training estimate (seq ``--seq``, AdamW, one H100) against FlopCounterMode's forward
  and backward of the same model, the model built inside the timed part for both;
- a decode grid of ``--batches`` x ``--contexts`` points (``torchroof.studies.sweep_grid``;
  1,000 points are ``--batches 40 --contexts 25``);
- a training estimate on 8 GPUs with FSDP (``fsdp=8``, seq ``--seq``, AdamW), every layer
  run against the layers copied;
- a training estimate of 8 micro-batches of one 8,192-token sequence on 256 GPUs (FSDP 32
  x TP 8 with sequence parallel, DGX H100), every micro-batch run (``full_trace=True``)
  against micro-batches copied after the third.

``--kinds`` measures some of these only (comma-separated names from ``KINDS``).

    python examples/benchmark_price_many.py [--batches 40 --contexts 25] [--repeats 3]
    python examples/benchmark_price_many.py --kinds fsdp-train-full,fsdp-train-copied
    python examples/benchmark_price_many.py --kinds microbatches-full,microbatches-copied \
        --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MODEL = "llama-3-70b"


def _child(kind: str, seq: int, batches: int, contexts: int) -> None:
    import time

    import torch
    import transformers.masking_utils as masking

    import torchroof
    from torchroof.models.sources import build_model, load_config
    from torchroof.studies import sweep_grid

    # FlopCounterMode cannot answer HF's packed-sequence .item() on meta: both tools get
    # the same "not packed" answer up front
    masking.find_packed_sequence_indices = lambda position_ids: None
    torchroof.estimate("gpt2", "decode", context=8)  # warm the imports and first-call caches
    start = time.perf_counter()
    points = 1
    if kind == "flopcounter":
        from torch.utils.flop_counter import FlopCounterMode

        model = build_model(load_config(MODEL))
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False), torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
    elif kind == "flopcounter-train":  # forward and backward, the model built in the time
        from torch.utils.flop_counter import FlopCounterMode

        model = build_model(load_config(MODEL))
        model.train()
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False):
            model(ids, labels=ids).loss.backward()
    elif kind == "train":  # forward, loss, backward and the AdamW step, built in the time
        model = build_model(load_config(MODEL))
        torchroof.estimate(model, "train", batch=1, seq=seq, optimizer="adamw", precision="bf16")
    elif kind in ("fsdp-train-full", "fsdp-train-copied"):
        torchroof.estimate(
            MODEL, "train", hardware="dgx-h100", batch=1, seq=seq, fsdp=8,
            full_trace=kind.endswith("full"),
        )  # fmt: skip
    elif kind in ("microbatches-full", "microbatches-copied"):
        torchroof.estimate(
            MODEL, "train", hardware="dgx-h100", batch=1, seq=8192, fsdp=32, tp=8,
            sequence_parallel=True, microbatches=8, full_trace=kind.endswith("full"),
        )  # fmt: skip
    elif kind in ("prefill-full", "prefill-copied"):
        torchroof.estimate(MODEL, "prefill", seq=seq, full_trace=kind.endswith("full"))
    elif kind in ("decode-full", "decode-copied"):
        torchroof.estimate(MODEL, "decode", batch=8, context=seq, full_trace=kind.endswith("full"))
    elif kind == "new-size":
        prepared = torchroof.prepare(MODEL, "decode", batch=8, context=seq)
        prepared.price("h100-sxm")
        prepared.price("h100-sxm", batch=9)  # the second size: traced on symbols
        start = time.perf_counter()  # a third size only
        prepared.price("h100-sxm", batch=12, context=seq // 2)
    elif kind == "repriced":
        prepared = torchroof.prepare(MODEL, "decode", batch=8, context=seq)
        prepared.price("h100-sxm")
        start = time.perf_counter()  # the second price only
        prepared.price("b200")
    else:
        batch_values = list(range(1, batches + 1))
        context_values = [256 * (i + 1) for i in range(contexts)]  # up to 6,400 for 25
        grid = sweep_grid(
            MODEL, {"batch": batch_values, "context": context_values}, regime="decode"
        )
        points = len(grid.points)
    elapsed = time.perf_counter() - start
    print(json.dumps({"time_s": elapsed, "points": points}))


def _measure(kind: str, args: argparse.Namespace) -> dict:
    argv = ["--child", kind, "--seq", str(args.seq)]
    argv += ["--batches", str(args.batches), "--contexts", str(args.contexts)]
    out = subprocess.run(
        [sys.executable, __file__, *argv], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


KINDS = (
    "flopcounter",
    "flopcounter-train",
    "train",
    "prefill-full",
    "prefill-copied",
    "decode-full",
    "decode-copied",
    "repriced",
    "new-size",
    "grid",
    "fsdp-train-full",
    "fsdp-train-copied",
    "microbatches-full",
    "microbatches-copied",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=40, help="batches 1, 2, ..., N")
    parser.add_argument("--contexts", type=int, default=25, help="contexts 256, 512, ...")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=KINDS)
    parser.add_argument("--kinds", default=",".join(KINDS), help="which to measure")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.seq, args.batches, args.contexts)
        return
    kinds = [kind for kind in KINDS if kind in args.kinds.split(",")]
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {', '.join(sorted(unknown))}; kinds are {', '.join(KINDS)}")
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        for kind in kinds:  # interleaved, so machine noise hits every kind alike
            if kind == "grid" and repeat:
                continue  # the grid is long: measured once
            runs[kind].append(_measure(kind, args))
    median = {kind: statistics.median(r["time_s"] for r in rs) for kind, rs in runs.items()}
    print(f"{MODEL} on meta, {args.seq} tokens, median of {args.repeats} runs (grid: one run)")
    ref = median.get("flopcounter")
    if ref is not None:
        print(f"  FlopCounterMode forward        : {ref:7.2f} s   (the reference, 1.00)")
    for kind, label in (
        ("prefill-full", "prefill, every layer run"),
        ("prefill-copied", "prefill, layers copied"),
        ("decode-full", "decode, every layer run"),
        ("decode-copied", "decode, layers copied"),
        ("repriced", "decode priced again (b200)"),
        ("new-size", "decode at a new batch, context"),
    ):
        if kind in median and ref is not None:
            print(
                f"  {label:31s}: {median[kind]:7.2f} s   {median[kind] / ref:5.2f}x the reference"
            )
    if "train" in median and "flopcounter-train" in median:
        train_ref = median["flopcounter-train"]
        print(
            f"  training estimate (AdamW, one H100): {median['train']:.2f} s against "
            f"FlopCounterMode's forward+backward {train_ref:.2f} s: "
            f"{median['train'] / train_ref:.2f}x (target <= 0.5x)"
        )
    for step, label, what in (
        ("prefill", "prefill", ("layers", "layer")),
        ("decode", "decode", ("layers", "layer")),
        ("fsdp-train", "training on 8 GPUs, fsdp=8", ("layers", "layer")),
        (
            "microbatches",
            "8 micro-batches of 8,192 tokens on 256 GPUs (fsdp 32 x tp 8)",
            ("micro-batches", "micro-batch"),
        ),
    ):
        if f"{step}-full" in median and f"{step}-copied" in median:
            full, copied = median[f"{step}-full"], median[f"{step}-copied"]
            print(
                f"  {label} with copied {what[0]} / every {what[1]} run: {copied:.2f} s / "
                f"{full:.2f} s = {copied / full:.2f}"
            )
    if "grid" in runs:
        grid = runs["grid"][0]
        per_point = grid["time_s"] / grid["points"]
        against = (
            f", {grid['time_s'] / ref:.1f}x the reference (1,000 points at this rate: "
            f"{1000 * per_point / ref:.0f}x; target <= 5x)"
            if ref is not None
            else ""
        )
        print(
            f"  decode grid, {grid['points']} points: {grid['time_s']:.1f} s, "
            f"{per_point:.2f} s a point{against}"
        )


if __name__ == "__main__":
    main()

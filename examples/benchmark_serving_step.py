"""What pricing an engine step costs: the mixed-step function (torchroof.serving.StepTimer)
against one ``torchroof.estimate`` of the same model's decode step, measured in this run.

A serving simulation prices one engine step per scheduler iteration, each mixing prefill
chunks and decodes at their own contexts; the step function must stay cheap beside the
estimate it is built from. This script prepares Llama-3-70B for decode at tensor parallel
8 on a DGX H100 (realistic mode, the vLLM runtime), then measures:

- one ``torchroof.estimate`` of the decode step (batch 8, context 1024): the reference;
- building the step timer and pricing its first steps (each new token count is one
  ``PreparedModel.price`` of a decode at that batch, kept for later steps);
- ``--steps`` steps drawn from ``--sizes`` distinct token counts (a decode batch of 32 to
  64 sequences at contexts 500–4000, some with a prefill chunk of 512 tokens), once every
  count is priced: the per-step cost a long simulation pays.

    python examples/benchmark_serving_step.py [--steps 20000] [--sizes 16]
"""

from __future__ import annotations

import argparse
import random
import time

import torchroof
from torchroof.serving import SequenceWork, StepTimer, prompt

MODEL, HARDWARE = "llama-3-70b", "dgx-h100"
PRICING = {"mode": "realistic", "runtime": "vllm"}


def steps(count: int, sizes: int, random_state: int = 0) -> list[list[SequenceWork]]:
    """``count`` engine steps with ``sizes`` distinct token counts (decode batches of
    32..32 + sizes/2 - 1, with or without a 512-token chunk)."""
    rng = random.Random(random_state)
    batches = [32 + i for i in range(max(1, sizes // 2))]
    out = []
    for _ in range(count):
        batch = rng.choice(batches)
        step = [SequenceWork(1, rng.randrange(500, 4000)) for _ in range(batch)]
        if rng.random() < 0.5:
            step.append(prompt(512, rng.randrange(0, 2048), last=rng.random() < 0.3))
        out.append(step)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--sizes", type=int, default=16)
    args = parser.parse_args()
    start = time.perf_counter()
    torchroof.estimate(MODEL, "decode", hardware=HARDWARE, tp=8, batch=8, context=1024, **PRICING)
    reference = time.perf_counter() - start
    work = steps(args.steps, args.sizes)
    prepared = torchroof.prepare(MODEL, "decode", tp=8, batch=8, context=1024)
    timer = StepTimer(prepared, HARDWARE, **PRICING)
    start = time.perf_counter()
    distinct = {}
    for step in work:
        key = (sum(w.new_tokens for w in step), sum(w.samples for w in step))
        if key not in distinct:
            distinct[key] = timer.time(step)
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for step in work:
        timer.time(step)
    priced = time.perf_counter() - start
    print(f"one estimate of the decode step (reference): {reference:.2f} s")
    print(
        f"first steps at {len(distinct)} distinct (tokens, sampled): {warm:.2f} s, "
        f"{warm / reference:.1f}x the estimate"
    )
    print(
        f"{len(work):,} steps once priced: {priced:.2f} s, {priced / len(work) * 1e6:.0f} us "
        f"a step, {priced / reference:.2f}x the estimate"
    )


if __name__ == "__main__":
    main()

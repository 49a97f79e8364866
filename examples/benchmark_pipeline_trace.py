"""How long a pipelined step takes to estimate: Llama-3.1-405B training at pp=8, tp=8,
fsdp=16 on 1,024 simulated GPUs (the first estimate in the process, so the imports it
makes are in its time), then the same step under the interleaved 1F1B schedule.

To hold one version against another, run this script of each, in turn, several times on
the same machine and compare the first figures pair by pair. The distinct stages are
traced side by side on a machine with several processors; ``TORCHROOF_WORKERS=1``
traces them in turn.

    python examples/benchmark_pipeline_trace.py
    TORCHROOF_WORKERS=1 python examples/benchmark_pipeline_trace.py
"""

from __future__ import annotations

import time

import torchroof

MODEL = "llama-3.1-405b"
COMMON = dict(
    hardware="dgx-h100",
    seq=8192,
    batch=1,
    tp=8,
    fsdp=16,
    precision="mixed",
    reshard_after_forward=False,  # torchtitan keeps a pipeline stage's parameters gathered
)


def timed(**knobs: object) -> tuple[float, torchroof.Estimate]:
    start = time.perf_counter()
    est = torchroof.estimate(MODEL, "train", **COMMON, **knobs)
    return time.perf_counter() - start, est


def main() -> None:
    piped_s, piped = timed(pp=8, microbatches=16)
    step = piped.pipeline
    print(
        f"{MODEL} train, pp 8 x tp 8 x fsdp 16 = 1,024 GPUs, 16 micro-batches: estimated in "
        f"{piped_s:.1f} s ({len({r.traced_as for r in step.stages})} distinct stages traced); "
        f"step {piped.time_s:.2f} s, bubble {100 * step.bubble_share:.1f}%"
    )
    for pp_schedule in ("interleaved-1f1b",):
        other_s, other = timed(pp=8, microbatches=16, pp_schedule=pp_schedule)
        print(
            f"  {pp_schedule} (2 stages per rank): {other_s:.1f} s to estimate; step "
            f"{other.time_s:.2f} s, bubble {100 * other.pipeline.bubble_share:.1f}%"
        )


if __name__ == "__main__":
    main()

"""What a serving run's plots draw, as numbers: each latency's empirical distribution and the
engine's state step by step.

- The empirical CDF of n values puts F(x_(i)) = i / n at the i-th smallest value x_(i)
  (the step function every serving benchmark's latency CDF draws; Wasserman, "All of
  Statistics", 2004, section 7.1). A long series may keep only some of its points: each
  kept point is still one of the exact (x_(i), i / n), the largest always among them.
- Per step, in order of start on each replica: the share of the replica's KV blocks in use
  once the step is scheduled (blocks used / KV blocks, vLLM's ``gpu_cache_usage_perc``
  metric), the prompt tokens and the decode tokens it processes (a verification's tokens
  count as decode), the sequences in it, and the preemptions so far (every replica's).

An axis is drawn on a log scale where its values span 10x or more (a CDF's latencies: 100x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchroof.config.errors import OptionError
from torchroof.serving.results import ServeResult

LOG_SPAN = 10.0
CDF_LOG_SPAN = 100.0
CDF_LATENCIES = (
    ("ttft_s", "time to first token"),
    ("tpot_s", "time per output token"),
    ("itl_s", "inter-token latency"),
    ("e2e_s", "end-to-end latency"),
)


def log_scale(values: Sequence[float] | np.ndarray, span: float = LOG_SPAN) -> bool:
    """Whether an axis over ``values`` is drawn on a log scale: its positive values span
    ``span`` times or more."""
    positive = np.asarray(values, dtype=float)
    positive = positive[positive > 0]
    return bool(positive.size) and float(positive.max() / positive.min()) >= span


def ecdf(values: np.ndarray, points: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(x, F): ``values`` sorted and each one's rank over their count, F(x_(i)) = i / n.
    With ``points``, at most that many of them: the ranks ceil(j n / points) for j = 1 ..
    points, so the largest value is always kept."""
    x = np.sort(np.asarray(values, dtype=float))
    n = x.size
    ranks = np.arange(1, n + 1)
    if points is not None:
        if isinstance(points, bool) or not isinstance(points, int) or points < 1:
            raise OptionError(f"points must be a whole number >= 1, got {points!r}")
        if n > points:
            # ceil(j n / points) in whole numbers: (j n + points - 1) // points
            ranks = (np.arange(1, points + 1) * n + points - 1) // points
    return x[ranks - 1], ranks / n if n else ranks.astype(float)


@dataclass(frozen=True)
class StepSeries:
    """The engine's steps as the plots draw them: columns of equal length, sorted by start
    (then by replica)."""

    start_s: np.ndarray
    replica: np.ndarray
    kv_share: np.ndarray  # blocks used / the replica's KV blocks, 0..1
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    sequences: np.ndarray
    preemptions: np.ndarray  # preemptions up to and including this step, every replica's

    def __len__(self) -> int:
        return len(self.start_s)

    def every(self, stride: int) -> StepSeries:
        """Every ``stride``-th step from the first (what a page of many steps keeps)."""
        return StepSeries(
            **{name: getattr(self, name)[::stride] for name in StepSeries.__dataclass_fields__}
        )


def replica_blocks(engine: dict[str, Any], replicas: np.ndarray) -> np.ndarray:
    """Each replica's KV blocks: the engine's, or with disaggregated prefill and decode
    its side's (prefill instances first)."""
    if "disaggregate" not in engine:
        return np.full(len(replicas), engine["kv_blocks"], dtype=float)
    first_decode = engine["decode"]["first_replica"]
    return np.where(
        replicas < first_decode, engine["prefill"]["kv_blocks"], engine["decode"]["kv_blocks"]
    ).astype(float)


def replica_name(engine: dict[str, Any], replica: int) -> str:
    """``replica 1``, or with disaggregated prefill and decode ``prefill 0``/``decode 1``."""
    if "disaggregate" not in engine:
        return f"replica {replica}"
    return f"{'prefill' if replica < engine['decode']['first_replica'] else 'decode'} {replica}"


def batches_shown(engine: dict[str, Any], series: StepSeries) -> tuple[np.ndarray, str]:
    """The steps a batch panel draws (the first replica's; the first decode instance's
    with disaggregated prefill and decode, where decodes and landed prompts meet) and
    what its title says of them."""
    if "disaggregate" in engine:
        first = engine["decode"]["first_replica"]
        return series.replica == first, " (the first decode instance's steps)"
    first = series.replica.min() if len(series) else 0
    many = engine.get("replicas", 1) > 1
    return series.replica == first, " (the first replica's steps)" if many else ""


def kv_title(engine: dict[str, Any], preempted: int) -> str:
    """The KV panel's title: the blocks per replica (per side's instance) and the
    preemptions."""
    if "disaggregate" in engine:
        blocks = (
            f"{engine['prefill']['kv_blocks']:,} blocks per prefill instance, "
            f"{engine['decode']['kv_blocks']:,} per decode instance"
        )
    else:
        blocks = f"{engine['kv_blocks']:,} blocks per replica"
    return f"KV cache: {blocks}, {preempted:,} preemptions"


def step_series(result: ServeResult) -> StepSeries:
    """``result``'s steps in order of start (each replica's own steps stay in their order),
    with the KV share, the prompt and decode tokens, and the preemptions so far."""
    steps = result.steps
    order = np.lexsort((steps.replica, steps.start_s))
    used = steps.blocks_used[order].astype(float)
    blocks = replica_blocks(result.engine, steps.replica[order])
    return StepSeries(
        start_s=steps.start_s[order],
        replica=steps.replica[order],
        kv_share=np.divide(used, blocks, out=np.zeros_like(used), where=blocks > 0),
        prefill_tokens=steps.prefill_tokens[order],
        decode_tokens=steps.tokens[order] - steps.prefill_tokens[order],
        sequences=steps.sequences[order],
        preemptions=np.cumsum(steps.preempted[order]),
    )

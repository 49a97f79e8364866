"""What a simulated serving run measured: per request, per token gap and per step, and the
figures a serving benchmark reports of them.

- TTFT: arrival to first token (queueing and the prompt's prefill included);
- TPOT: (end - first token) / (output tokens - 1), per request, for requests of 2+ tokens;
- ITL: every gap between successive tokens of a request (the engine's steps as a client
  streams them);
- end-to-end latency and queueing delay (arrival to first scheduled);
- request and token throughput over the run (first arrival to last finish), and goodput:
  the requests per second that met every SLO given (DistServe's definition, Zhong et al.
  2024).

Percentiles are numpy's (linear interpolation between order statistics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchroof.accuracy.expected import serving_range

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the engine served it (seconds from the run's start)."""

    index: int
    replica: int
    input_len: int
    output_len: int
    arrival_s: float
    admitted_s: float
    first_token_s: float
    finish_s: float
    preemptions: int
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.admitted_s - self.arrival_s


@dataclass(frozen=True)
class StepLog:
    """Every engine step, in order of start: columns of equal length."""

    start_s: np.ndarray
    time_s: np.ndarray
    replica: np.ndarray
    sequences: np.ndarray
    tokens: np.ndarray
    prefill_tokens: np.ndarray  # new tokens of prompt chunks (the rest are decodes)
    blocks_used: np.ndarray
    preempted: np.ndarray
    verifications: np.ndarray  # requests whose speculative drafts the step checked
    drafted: np.ndarray  # drafts those verifications checked
    accepted: np.ndarray  # of which accepted
    expected_accepted: np.ndarray  # their expected number accepted, from the rates
    queried_tokens: np.ndarray  # prompt tokens of the requests admitted (cache lookups)
    cached_tokens: np.ndarray  # of which found in the prefix cache
    swapped_out: np.ndarray  # requests whose KV the step copied to host memory
    swapped_in: np.ndarray  # requests whose KV it copied back
    swap_blocks: np.ndarray  # KV blocks those copies moved


@dataclass(frozen=True)
class ServeResult:
    """A simulated serving run: its requests, every inter-token gap, every step, and the
    engine it ran on."""

    requests: tuple[RequestRecord, ...]
    itl_s: np.ndarray
    steps: StepLog
    engine: dict[str, Any]  # the engine's knobs, KV blocks and the deployment

    @property
    def duration_s(self) -> float:
        """First arrival to last finish."""
        start = min(r.arrival_s for r in self.requests)
        return max(r.finish_s for r in self.requests) - start

    def latencies(self, name: str) -> np.ndarray:
        """Every value of one latency (``ttft_s``, ``tpot_s``, ``itl_s``, ``e2e_s``,
        ``queue_s``) in seconds."""
        if name == "itl_s":
            return self.itl_s
        if name not in LATENCIES:
            raise ValueError(f"unknown latency {name!r} (known: {', '.join(LATENCIES)})")
        values = [getattr(r, name) for r in self.requests]
        return np.array([v for v in values if v is not None], dtype=float)

    def summary(
        self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
    ) -> dict[str, Any]:
        """The run's figures: mean and P50/P90/P99 of each latency, throughput, goodput
        under the SLOs given (every request counts without any), preemptions."""
        out: dict[str, Any] = {"requests": len(self.requests), "duration_s": self.duration_s}
        for name in LATENCIES:
            values = self.latencies(name)
            stats = {"mean": float(values.mean()) if values.size else None}
            for p in PERCENTILES:
                stats[f"p{p}"] = float(np.percentile(values, p)) if values.size else None
            out[name] = stats
        duration = self.duration_s
        outputs = sum(r.output_len for r in self.requests)
        inputs = sum(r.input_len for r in self.requests)
        out["request_throughput_per_s"] = len(self.requests) / duration if duration else None
        out["output_tokens_per_s"] = outputs / duration if duration else None
        out["total_tokens_per_s"] = (inputs + outputs) / duration if duration else None
        good = [r for r in self.requests if _meets(r, ttft_slo_s, tpot_slo_s)]
        out["slo"] = {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s}
        out["requests_meeting_slo"] = len(good)
        out["goodput_per_s"] = len(good) / duration if duration else None
        out["preemptions"] = int(self.steps.preempted.sum())
        if any(r.cached_tokens for r in self.requests) or self.engine.get("prefix_groups"):
            queried, found = (
                int(self.steps.queried_tokens.sum()),
                int(self.steps.cached_tokens.sum()),
            )
            out["prefix_cache"] = {  # vLLM's prefix cache hit rate: tokens found / looked up
                "queried_tokens": queried,
                "cached_tokens": found,
                "hit_rate": found / queried if queried else 0.0,
            }
        if self.engine.get("preemption") == "swap":
            blocks = int(self.steps.swap_blocks.sum())
            out["swap"] = {  # swap preemption's copies, and their time in the steps
                "swapped_out": int(self.steps.swapped_out.sum()),
                "swapped_in": int(self.steps.swapped_in.sum()),
                "blocks_copied": blocks,
                "copy_time_s": blocks * self.engine["host_swap_s_per_block"],
            }
        verifications = int(self.steps.verifications.sum())
        if verifications:  # as vLLM's speculative decoding metrics report them
            drafted, accepted = int(self.steps.drafted.sum()), int(self.steps.accepted.sum())
            out["speculative"] = {
                "verifications": verifications,
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": accepted / drafted,
                "mean_acceptance_length": 1 + accepted / verifications,
                # what the rates give for the drafts each verification had (fewer than k
                # at a request's end or where the token budget cut them)
                "expected_acceptance_length": 1
                + float(self.steps.expected_accepted.sum()) / verifications,
            }
        out["expected"] = serving_range().to_dict()  # why no range is stated
        out["steps"] = len(self.steps.start_s)
        out["kv_blocks_peak_share"] = (
            float(self.steps.blocks_used.max()) / self.engine["kv_blocks"]
            if len(self.steps.blocks_used)
            else 0.0
        )
        return out

    def to_dict(
        self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
    ) -> dict[str, Any]:
        """The summary, the engine, each request and each step (JSON-ready)."""
        steps = self.steps
        return {
            "summary": self.summary(ttft_slo_s, tpot_slo_s),
            "engine": self.engine,
            "requests": [
                {
                    "index": r.index,
                    "replica": r.replica,
                    "input_len": r.input_len,
                    "output_len": r.output_len,
                    "arrival_s": r.arrival_s,
                    "ttft_s": r.ttft_s,
                    "tpot_s": r.tpot_s,
                    "e2e_s": r.e2e_s,
                    "queue_s": r.queue_s,
                    "preemptions": r.preemptions,
                    "cached_tokens": r.cached_tokens,
                }
                for r in self.requests
            ],
            "steps": {name: getattr(steps, name).tolist() for name in StepLog.__dataclass_fields__},
        }


def _meets(record: RequestRecord, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    if ttft_slo_s is not None and record.ttft_s > ttft_slo_s:
        return False
    tpot = record.tpot_s
    return tpot_slo_s is None or tpot is None or tpot <= tpot_slo_s

"""A disaggregated run's result: a :class:`~torchroof.serving.results.ServeResult` with
every request's KV-cache transfer, and the figures of them in its summary.

Per request: the bytes sent, the transfer's time on the link, and its wait from the end
of the prompt to the start of the transfer (for the decode instance's KV blocks, then for
the prefill instance's link). The summary gives each as a mean and a P99 (numpy's
percentiles), and the peak share of KV blocks in use on each side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchroof.serving.results import ServeResult

TRANSFER_FIGURES = ("bytes", "time_s", "wait_s")


@dataclass(frozen=True)
class TransferLog:
    """Every request's KV-cache transfer, in request order: columns of equal length.
    ``prefill`` and ``decode`` are the instances' replica numbers (prefill 0 to x - 1,
    decode x to x + y - 1)."""

    index: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    bytes: np.ndarray
    ready_s: np.ndarray  # the prompt's end: its first token sampled
    start_s: np.ndarray  # blocks reserved on the decode instance and the link free
    time_s: np.ndarray
    link: tuple[str, ...]  # the link of the slowest pair of ranks

    @property
    def wait_s(self) -> np.ndarray:
        return self.start_s - self.ready_s


@dataclass(frozen=True)
class DisaggregatedResult(ServeResult):
    """A run on prefill and decode instances: the served requests, gaps and steps as any
    run's, and each request's KV-cache transfer."""

    transfers: TransferLog

    def summary(
        self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
    ) -> dict[str, Any]:
        """The run's figures, the KV-cache transfers' bytes, time and wait (mean, P99),
        and the peak share of KV blocks in use, the larger side's and each side's."""
        out = super().summary(ttft_slo_s, tpot_slo_s)
        out["kv_transfer"] = {
            name: {
                "mean": float(np.mean(values)),
                "p99": float(np.percentile(values, 99)),
            }
            for name in TRANSFER_FIGURES
            for values in [getattr(self.transfers, name)]
            if len(values)
        }
        shares = {side: self._peak_share(side) for side in ("prefill", "decode")}
        out["kv_blocks_peak_share"] = max(shares.values())
        out["kv_blocks_peak_share_by_side"] = shares
        return out

    def to_dict(
        self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
    ) -> dict[str, Any]:
        """The run as any run's, and every request's transfer (JSON-ready)."""
        out = super().to_dict(ttft_slo_s, tpot_slo_s)
        t = self.transfers
        out["kv_transfers"] = [
            {
                "index": int(t.index[i]),
                "prefill": int(t.prefill[i]),
                "decode": int(t.decode[i]),
                "bytes": int(t.bytes[i]),
                "wait_s": float(t.wait_s[i]),
                "time_s": float(t.time_s[i]),
                "link": t.link[i],
            }
            for i in range(len(t.index))
        ]
        return out

    def _peak_share(self, side: str) -> float:
        """The most KV blocks one of ``side``'s instances held in a step, over its cache."""
        first = self.engine[side]["first_replica"]
        last = first + self.engine[side]["instances"]
        used = self.steps.blocks_used[(self.steps.replica >= first) & (self.steps.replica < last)]
        return float(used.max()) / self.engine[side]["kv_blocks"] if len(used) else 0.0

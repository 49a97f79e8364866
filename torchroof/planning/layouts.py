"""The layouts a plan search enumerates: how a training step or a serving deployment is
spread over GPUs, in torchroof's own knobs (:class:`torchroof.config.Workload`'s fields).

A training layout splits N GPUs into tensor (``tp``), context (``cp``), pipeline (``pp``)
and data ranks; the data ranks shard (``fsdp``, FSDP2 / ZeRO-3) and replicate (``dp``:
DDP, or HSDP's replicate dimension beside ``fsdp``), N = tp x cp x pp x fsdp x dp. Expert
parallel (``ep``) shards routed experts over ranks the other sizes already count
(torchtitan's and transformers' way), so it does not multiply N. A serving layout is one
engine's tensor/pipeline/expert sizes, its replicas and its scheduler's knobs, or a
disaggregated xPyD deployment of prefill and decode instances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchroof.serving.disaggregation import Layout

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none, torchtitan's selective per-op policy, or every decoder
layer's whole forward again in backward (torchtitan's ``activation_checkpoint.mode``)."""


@dataclass(frozen=True)
class TrainingLayout:
    """One way to train on ``gpus`` = tp x cp x pp x fsdp x dp GPUs."""

    tp: int = 1
    sequence_parallel: bool = False  # with tp > 1: norms and dropout on T / tp tokens
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1  # stages each pipeline rank holds (interleaved schedules)
    ep: int = 1
    fsdp: int = 1  # ranks each parameter is sharded over
    dp: int = 1  # replicas (DDP, or HSDP's replicate dimension with fsdp > 1)
    zero: int = 0  # with fsdp = 1 and dp > 1: the ZeRO stage (0 DDP, 1, 2)
    batch: int = 1  # sequences per data rank per micro-batch
    microbatches: int = 1
    recompute: str = "none"

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.fsdp * self.dp

    @property
    def data_ranks(self) -> int:
        """Ranks that each see their own sequences: fsdp x dp."""
        return self.fsdp * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences one optimizer step trains on."""
        return self.batch * self.microbatches * self.data_ranks

    def knobs(self) -> dict[str, Any]:
        """The workload fields :func:`torchroof.estimate` takes for this layout (regime
        ``train``); sizes of 1 and options off are left out."""
        out: dict[str, Any] = {"batch": self.batch}
        for name in ("tp", "cp", "pp", "ep", "fsdp", "dp", "microbatches"):
            if getattr(self, name) > 1:
                out[name] = getattr(self, name)
        if self.tp > 1 and self.sequence_parallel:
            out["sequence_parallel"] = True
        if self.zero:
            out["zero"] = self.zero
        if self.pp > 1:
            out["pp_schedule"] = self.pp_schedule
            if self.pp_schedule not in ("gpipe", "1f1b"):  # stages a rank holds, as given
                out["virtual_stages"] = self.virtual_stages
        if self.recompute != "none":
            out["checkpointing"] = True
            out["checkpoint_policy"] = self.recompute
        return out

    def label(self) -> str:
        """The layout in a line: ``fsdp 32 x tp 8 (sp), batch 1 x 4 micro-batches, selective
        recompute``."""
        sizes = []
        if self.fsdp > 1:
            sizes.append(f"fsdp {self.fsdp}")
        if self.dp > 1:
            sizes.append(f"dp {self.dp}" + (f" zero-{self.zero}" if self.zero else ""))
        if self.tp > 1:
            sizes.append(f"tp {self.tp}" + (" (sp)" if self.sequence_parallel else ""))
        if self.cp > 1:
            sizes.append(f"cp {self.cp}")
        if self.pp > 1:
            stages = f", v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            sizes.append(f"pp {self.pp} ({self.pp_schedule}{stages})")
        if self.ep > 1:
            sizes.append(f"ep {self.ep}")
        parts = [" x ".join(sizes) or "1 GPU"]
        parts.append(f"batch {self.batch} x {self.microbatches} micro-batches")
        if self.recompute != "none":
            parts.append(f"{self.recompute} recompute")
        return ", ".join(parts)


@dataclass(frozen=True)
class ServingLayout:
    """One way to serve: ``replicas`` engines of tp x pp GPUs each (expert parallel over
    ep of them, or, where ep = tp x replicas, over every replica's GPUs: data-parallel
    attention), with their scheduler's knobs; or, with ``disaggregate`` ("2P1D"), that
    many prefill and decode instances of ``prefill_tp`` and ``decode_tp`` GPUs."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    replicas: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    kv_dtype: str | None = None  # None: the model's dtype
    quant: str = "none"
    disaggregate: str | None = None
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def attention_dp(self) -> int:
        """The data-parallel attention ranks: ``replicas`` where the experts span every
        replica's GPUs (ep = tp x replicas, vLLM's ``--data-parallel-size`` with
        ``--enable-expert-parallel``), else 1 (independent engines)."""
        coupled = self.replicas > 1 and self.ep == self.tp * self.replicas
        return self.replicas if coupled and self.disaggregate is None else 1

    @property
    def gpus(self) -> int:
        if self.disaggregate is None:
            return self.tp * self.pp * self.replicas
        split = Layout.parse(self.disaggregate)
        return split.prefill * self.prefill_tp + split.decode * self.decode_tp

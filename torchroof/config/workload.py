"""What step to trace: :class:`Workload`, its knobs flat (the CLI's flags are generated from
its fields) and grouped into typed parts (:mod:`torchroof.config.parts`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from torchroof.config.choices import (
    CACHES,
    CHECKPOINT_POLICIES,
    DEFAULT_PP_SCHEDULE,
    DEFAULT_SEQ,  # 4096, or the model's maximum if shorter
    DEFAULT_VIRTUAL_STAGES,
    DTYPES,
    KV_DTYPES,
    MLA_DECODES,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    QUANTS,
    REDUCE_DTYPES,
    REGIME_FACTS,
    REGIMES,
)
from torchroof.config.flags import knob
from torchroof.config.limits import DEFAULT_MAX_OPS  # why 10M: see there
from torchroof.config.parallel_layout import Parallelism
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.config.parts import (
    DEFAULT_CACHE,
    DEFAULT_DTYPE,
    DEFAULT_MLA,
    CaptureLimits,
    Quantisation,
    StepShape,
    Training,
)


@dataclass(frozen=True)
class Workload:
    """What step to trace.

    ``precision`` (train only): ``bf16`` / ``fp16`` / ``fp32`` keep parameters, gradients
    and optimizer state in that dtype; ``mixed`` is bf16 compute with fp32 master weights,
    fp32 gradients and fp32 optimizer state, the bf16 weights rewritten by the optimizer
    (30 B/param for AdamW), the default, as most training stacks run.
    ``seq`` left out is :data:`DEFAULT_SEQ` (4096), or the model's maximum positions where
    that is shorter (GPT-2: 1024), resolved once the model's config is known
    (:func:`torchroof.api.resolve_seq`); ``context`` left out is ``seq``.

    Across GPUs the step is rank 0 of the real parallel program: ``tp`` ranks
    share each layer (the model's tensor-parallel plan), ``fsdp`` ranks share each
    parameter, ``dp`` replicas (HSDP with ``fsdp``) each hold their own data, ``cp`` ranks
    split each sequence (torch's ring attention exchanges their K/V). ``batch`` is
    the sequences one rank's replica processes per micro-batch; a training step runs
    ``microbatches`` of them before its one optimizer step.

    The fields are flat (``Workload(batch=8, tp=2)``, ``w.batch``); :attr:`shape`,
    :attr:`training`, :attr:`quantisation`, :attr:`plan` and :attr:`limits` group them
    into typed parts, each of which checks its own fields.
    """

    regime: str = knob("prefill", "the step: " + ", ".join(REGIMES), choices=REGIMES)
    batch: int = knob(
        1,
        "sequences per rank per micro-batch (the global batch is batch x dp x fsdp x "
        "microbatches; tp and cp ranks share their sequences)",
    )
    seq: int | None = knob(
        None,
        f"tokens per sequence (prefill, train; default {DEFAULT_SEQ}, or the model's maximum "
        "positions if shorter)",
    )
    context: int | None = knob(None, "tokens already in the KV cache (decode; default --seq)")
    cache: str = knob(
        DEFAULT_CACHE,
        "decode cache: static (in place) or dynamic (HF DynamicCache, cat)",
        choices=CACHES,
    )
    optimizer: str = knob("adamw", "train: the optimizer", choices=OPTIMIZERS)
    precision: str = knob(
        "mixed",
        "train: mixed (bf16 compute, fp32 master weights, gradients and state), or "
        "bf16/fp16/fp32 throughout",
        choices=PRECISIONS,
        group="precision",
    )
    reduce_dtype: str = knob(
        "fp32",
        "train with mixed precision over data-parallel ranks: the dtype gradients are reduced "
        "in (fp32: cast from bf16 first, torchtitan's and Megatron's default; bf16: half the "
        "bytes, and ZeRO-1's whole-gradient buffer in bf16, as Megatron-Bridge's "
        "grad_reduce_in_fp32=False)",
        choices=REDUCE_DTYPES,
        group="precision",
    )
    checkpointing: bool = knob(False, "train: activation checkpointing (recompute in backward)")
    checkpoint_policy: str = knob(
        "full",
        "train with --checkpointing: full (a checkpointed layer recomputes its whole forward) "
        "or selective (torchtitan's per-op policy: keeps matmul outputs but every second, "
        "attention's and reduce-scatters', recomputes the rest)",
        choices=CHECKPOINT_POLICIES,
    )
    checkpoint_every: int = knob(
        1,
        "train with --checkpointing: checkpoint every Nth decoder layer, the others keep their "
        "activations (torchtitan's selective layer policy checkpoints every 2nd)",
    )
    mla: str = knob(
        DEFAULT_MLA,
        "decode of latent-attention models (DeepSeek): absorbed (FlashMLA) or expanded",
        choices=MLA_DECODES,
    )
    dtype: str = knob(
        DEFAULT_DTYPE, "prefill/decode: the model's dtype", choices=DTYPES, group="precision"
    )
    quant: str = knob(
        "none",
        "quantised linear layers (torchroof.quant.recipes): fp8 / fp8-rowwise (train: torchao "
        "Float8; serve: fp8 activations and weights), int8-weight, fp8-weight, int4-weight, "
        "mxfp4-weight (weight-only, dequantised inside the GEMM), nvfp4 (fp4 tensor cores)",
        choices=QUANTS,
        group="precision",
    )
    kv_dtype: str = knob(
        "model",
        "prefill/decode: the KV cache's dtype (model: the model's; fp8 / int8: quantised "
        "on write, read by the attention kernel at 1 B per element)",
        choices=KV_DTYPES,
        group="precision",
    )
    allow_beyond_max_positions: bool = knob(
        False, "price sequences longer than the model's maximum positions (an assumption line)"
    )
    max_ops: int = knob(
        DEFAULT_MAX_OPS, "stop a trace past this many aten ops (a data-dependent loop on meta)"
    )
    full_trace: bool = knob(
        False,
        "run every decoder layer and every micro-batch on meta (default: one of each "
        "distinct kind runs and the others are its ops under their own names; the same "
        "trace, faster)",
    )
    tp: int = knob(
        1,
        "tensor-parallel ranks (the model's own TP plan); rank 0 is traced",
        group="parallelism",
    )
    sequence_parallel: bool = knob(
        False,
        "with --tp: tensor + sequence parallel (torchtitan's plan for the Llama layout, the "
        "model's own TP plan on the sequence otherwise; not MoE experts): norms on T/tp "
        "tokens, reduce-scatter + all-gather for each all-reduce, loss on vocab shards",
        group="parallelism",
    )
    fsdp: int = knob(
        1, "train: ranks each parameter is sharded over (FSDP2, ZeRO-3)", group="parallelism"
    )
    dp: int = knob(
        1,
        "data-parallel replicas (train: HSDP's replicate dimension with --fsdp; serving: "
        "each rank its own batch, e.g. attention beside --ep)",
        group="parallelism",
    )
    zero: int = knob(
        0,
        "train with --dp: what the data-parallel ranks shard (the ZeRO stage): 0 nothing "
        "(DDP: gradients all-reduced), 1 the optimizer state (ZeRO-1, Megatron's "
        "distributed optimizer: gradients reduce-scattered, parameters all-gathered, every "
        "gradient kept until then), 2 also the gradients (ZeRO-2), 3 also the parameters "
        "(ZeRO-3, as --fsdp); 1 and 2 keep parameters gathered through the step whatever "
        "reshard_after_forward says",
        group="parallelism",
    )
    ep: int = knob(
        1,
        "expert-parallel ranks: routed experts sharded over them, tokens sent to their "
        "experts' ranks by all-to-all (transformers' all_to_all dispatch); ep divides "
        "dp x fsdp x cp x tp and is a multiple of tp",
        group="parallelism",
    )
    cp: int = knob(
        1,
        "context-parallel ranks each sequence is split over (ring attention)",
        group="parallelism",
    )
    reshard_after_forward: bool = knob(
        True,
        "FSDP: free gathered parameters after forward, gather them again for backward",
        off="FSDP: keep parameters gathered in forward for backward (~ZeRO-2)",
        group="parallelism",
        runtime_sets=True,
    )
    microbatches: int = knob(
        1,
        "train: forward+backward passes of --batch sequences per optimizer step; with --pp "
        "also prefill/decode: micro-batches of --batch sequences through the pipeline",
        group="parallelism",
    )
    pp: int = knob(
        1,
        "pipeline stages (torch.distributed.pipelining's schedules); one trace per distinct stage",
        group="parallelism",
    )
    pp_schedule: str = knob(
        DEFAULT_PP_SCHEDULE,
        "with --pp: the schedule whose action order is laid out",
        choices=PIPELINE_SCHEDULES,
        group="parallelism",
    )
    virtual_stages: int = knob(
        DEFAULT_VIRTUAL_STAGES,
        "with --pp and an interleaved schedule: stages per rank (V schedules hold 2)",
        group="parallelism",
    )
    pp_split: str = knob(
        "",
        "with --pp: decoder layers per stage, e.g. 16,16,15,15 (default: an even split, the "
        "remainder to the first stages, as transformers splits)",
        group="parallelism",
    )
    defer_gradient_sync: bool = knob(
        False,
        "training with micro-batches over data ranks (FSDP, DDP, ZeRO): reduce gradients "
        "after the last one only (unsharded ones held until then)",
        off="reduce each micro-batch's gradients after its backward (torchtitan's way)",
        group="parallelism",
        runtime_sets=True,
    )

    def __post_init__(self) -> None:
        """Each part checks its own fields, in the order they have always been checked."""
        if self.context is None and self.seq is not None:
            object.__setattr__(self, "context", self.seq)
        shape, training, quantisation = self.shape, self.training, self.quantisation
        shape.validate()  # a known regime, positive sizes, a known cache
        training.validate()
        training.validate_checkpointing(shape.facts.trains)
        shape.validate_attention()
        quantisation.validate(shape.facts.trains, self.sequence_parallel and self.tp > 1)
        training.validate_dtype(self.dtype, shape.facts.trains)
        shape.validate_knobs()
        self.limits.validate()
        self.plan.validate(shape)
        training.validate_reduction(shape.facts.trains, self.parallel_plan.shards_data)

    # -- the typed parts ----------------------------------------------------------------------

    @property
    def shape(self) -> StepShape:
        """Which step, on how many sequences and tokens."""
        return StepShape(
            self.regime,
            self.batch,
            self.seq,
            self.context,
            self.cache,
            self.mla,
            self.allow_beyond_max_positions,
        )

    @property
    def training(self) -> Training:
        """How a step that trains updates its weights."""
        return Training(
            self.optimizer,
            self.precision,
            self.checkpointing,
            self.defer_gradient_sync,
            self.checkpoint_every,
            self.checkpoint_policy,
            self.reduce_dtype,
        )

    @property
    def quantisation(self) -> Quantisation:
        """The model's dtype, its recipe and the KV cache's dtype."""
        return Quantisation(self.dtype, self.quant, self.kv_dtype)

    @property
    def plan(self) -> Parallelism:
        """The parallel layout: ranks of each kind and how the program runs over them."""
        return Parallelism(
            tp=self.tp,
            sequence_parallel=self.sequence_parallel,
            fsdp=self.fsdp,
            dp=self.dp,
            zero=self.zero,
            ep=self.ep,
            cp=self.cp,
            reshard_after_forward=self.reshard_after_forward,
            microbatches=self.microbatches,
            pp=self.pp,
            pp_schedule=self.pp_schedule,
            virtual_stages=self.virtual_stages,
            pp_split=self.pp_split,
        )

    @property
    def limits(self) -> CaptureLimits:
        """How far the trace may run."""
        return CaptureLimits(self.max_ops, self.full_trace)

    # -- what the rest of torchroof reads ------------------------------------------------------

    @property
    def pipeline_split(self) -> tuple[int, ...]:
        """``pp_split`` as layer counts (empty: the even split)."""
        return self.plan.pipeline_split

    @property
    def parallel_plan(self) -> ParallelPlan:
        """The ranks the step's program spans (world = pp · dp · fsdp · cp · tp)."""
        return self.plan.mesh

    @property
    def trains(self) -> bool:
        """The step trains (forward, loss, backward, optimizer step): its regime says."""
        return REGIME_FACTS[self.regime].trains

    @property
    def reduces_mixed_gradients(self) -> bool:
        """The step reduces mixed-precision gradients over data ranks: where
        ``reduce_dtype`` chooses their dtype."""
        mixed = self.precision == "mixed"
        return self.trains and mixed and self.parallel_plan.shards_data

    @property
    def accumulates_whole_gradients(self) -> bool:
        """The traced program's own unsharded gradient accumulation (FSDP2 under
        ``set_requires_gradient_sync(False)``, reduced after the last micro-batch) is the
        step's whole gradient buffer: ZeRO-1 (Megatron's distributed optimizer's
        ``main_grad``), or DDP (zero 0 over dp > 1 with nothing sharded: torch DDP's
        ``param.grad`` under ``no_sync``, Megatron DDP's ``main_grad``) whose gradients are
        accumulated in the dtype the optimizer reads them in (a mixed-precision DDP
        reducing in bf16 also makes a whole fp32 copy for its optimizer: both are held)."""
        deferred = self.trains and self.defer_gradient_sync and self.microbatches > 1
        ddp = self.zero == 0 and self.dp > 1 and self.fsdp * self.cp == 1
        copied = self.precision == "mixed" and self.reduce_dtype == "bf16"
        return deferred and (self.zero == 1 or (ddp and not copied))

    @property
    def tokens(self) -> int:
        """Tokens processed by the step (decode: one per sequence). With ``seq`` left out,
        those of :data:`DEFAULT_SEQ`, before a model shorter than that shortens it
        (:func:`torchroof.api.resolve_seq`)."""
        resolved = self if self.seq is not None else replace(self, seq=DEFAULT_SEQ)
        return resolved.shape.tokens(resolved.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

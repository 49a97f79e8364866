"""The typed parts of a Workload: the step's shape, its training, its quantisation, its
parallel layout and its capture limits; each checks its own fields."""

from __future__ import annotations

from dataclasses import dataclass

from torchroof.config import choices
from torchroof.config.checks import choose, positive_int
from torchroof.config.errors import WorkloadError

# the defaults of the knobs only some steps read: Workload's fields take them from here, so
# the "a step that does not read it would ignore it" checks compare against the same value
DEFAULT_CACHE = "static"
DEFAULT_MLA = "absorbed"
DEFAULT_DTYPE = "bf16"


@dataclass(frozen=True)
class StepShape:
    """Which step runs and on how many tokens: the regime, sequences per rank, tokens per
    sequence, tokens already cached, the decode cache and latent attention's form."""

    regime: str
    batch: int
    seq: int | None
    context: int | None
    cache: str
    mla: str
    allow_beyond_max_positions: bool

    @property
    def facts(self) -> choices.RegimeFacts:
        """What the regime declares (it trains, the knobs it reads, its tokens)."""
        return choices.REGIME_FACTS[self.regime]

    def tokens(self, microbatches: int) -> int:
        """Tokens the step processes (``seq`` given)."""
        assert self.seq is not None
        return self.facts.tokens(self.batch, self.seq, microbatches)

    def validate(self) -> None:
        """A known regime, positive sizes and a known cache."""
        bad = WorkloadError
        choose("regime", self.regime, choices.REGIME_FACTS, bad)
        positive_int("batch", self.batch, bad)
        if self.seq is not None:  # None: DEFAULT_SEQ, or the model's maximum if shorter
            positive_int("seq", self.seq, bad)
        if self.context is not None:
            positive_int("context", self.context, bad)
        choose("cache", self.cache, choices.CACHES, bad)

    def validate_attention(self) -> None:
        """A known form of latent attention (checked after the training knobs, as always)."""
        choose("mla", self.mla, choices.MLA_DECODES, WorkloadError)

    def validate_knobs(self) -> None:
        """A knob set away from its default for a regime that never reads it (a KV cache
        for a training step, a latent-attention decode for a prefill) would be dropped
        silently: refused, naming what it needs. The training knobs (optimizer, precision)
        and those of a parallel degree (sequence parallel at tp=1) are left alone: one set
        of knobs is shared by the steps of a comparison."""
        defaults = {"cache": DEFAULT_CACHE, "mla": DEFAULT_MLA}
        for name in ("cache", "mla"):  # the knobs only some regimes read (Regime.knobs)
            value = getattr(self, name)
            if value != defaults[name] and name not in self.facts.knobs:
                readers = [r for r, facts in choices.REGIME_FACTS.items() if name in facts.knobs]
                raise WorkloadError(
                    f"{name}={value!r} applies to a {' or '.join(readers)} step (--regime); "
                    f"this {self.regime} step would ignore it"
                )


@dataclass(frozen=True)
class Training:
    """How a step that trains updates its weights: the optimizer, the precision its
    parameters, gradients and state are kept in, activation checkpointing, and whether FSDP
    defers its gradient reduction to the last micro-batch."""

    optimizer: str
    precision: str
    checkpointing: bool
    defer_gradient_sync: bool
    checkpoint_every: int = 1
    checkpoint_policy: str = "full"
    reduce_dtype: str = "fp32"

    def validate(self) -> None:
        """A known optimizer, precision and reduction dtype; a reduction dtype other than
        fp32 only where mixed precision chooses one (bf16, fp16 and fp32 training reduce
        their gradients in their own dtype)."""
        choose("optimizer", self.optimizer, choices.OPTIMIZERS, WorkloadError)
        choose("precision", self.precision, choices.PRECISIONS, WorkloadError)
        choose("reduce_dtype", self.reduce_dtype, choices.REDUCE_DTYPES, WorkloadError)
        if self.reduce_dtype != "fp32" and self.precision != "mixed":
            raise WorkloadError(
                f"reduce_dtype={self.reduce_dtype} chooses what mixed precision reduces its "
                f"gradients in; precision={self.precision} reduces them in "
                f"{self.precision}: give precision=mixed or leave reduce_dtype out"
            )

    def validate_reduction(self, trains: bool, data_ranks: bool) -> None:
        """A reduction dtype other than the default only on a training step over data
        ranks (nothing else reduces gradients)."""
        if self.reduce_dtype == "fp32":
            return
        if not trains:
            raise WorkloadError(
                f"reduce_dtype={self.reduce_dtype} chooses what a training step reduces its "
                "gradients in: give it with --regime train"
            )
        if not data_ranks:
            raise WorkloadError(
                f"reduce_dtype={self.reduce_dtype} chooses what gradients are reduced in "
                "over data-parallel ranks, and this step has none: give --fsdp, --dp or --cp"
            )

    def validate_checkpointing(self, trains: bool) -> None:
        """``checkpoint_every`` is a positive whole number and ``checkpoint_policy`` a known
        one, each other than its default only with checkpointing on in a training step
        (it would be ignored otherwise)."""
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise WorkloadError(f"checkpoint_every must be a positive integer, got {every!r}")
        policy = self.checkpoint_policy
        choose("checkpoint_policy", policy, choices.CHECKPOINT_POLICIES, WorkloadError)
        if policy != "full" and not (self.checkpointing and trains):
            raise WorkloadError(
                f"checkpoint_policy={policy} chooses what activation checkpointing "
                "recomputes: give it with checkpointing=True on a training step (CLI: "
                "--checkpointing --checkpoint-policy selective)"
            )
        if every != 1 and not (self.checkpointing and trains):
            raise WorkloadError(
                f"checkpoint_every={every} chooses which layers activation checkpointing "
                "recomputes: give it with checkpointing=True on a training step (CLI: "
                "--checkpointing --checkpoint-every N)"
            )

    def validate_dtype(self, dtype: str, trains: bool) -> None:
        """A training step computes in its precision's dtype; a dtype other than the default
        (or the precision's own) would be dropped silently: refused, naming the knob that
        does apply."""
        if not trains or dtype in (DEFAULT_DTYPE, self.precision):
            return
        raise WorkloadError(
            f"dtype={dtype} does not apply to a training step: it computes in its "
            f"precision's dtype (precision={self.precision}); use precision={dtype} "
            "(CLI: --precision)"
        )


@dataclass(frozen=True)
class Quantisation:
    """The model's dtype, the quantisation recipe of its linear layers and the KV cache's
    dtype."""

    dtype: str
    quant: str
    kv_dtype: str

    def validate(self, trains: bool, sequence_parallel: bool = False) -> None:
        """Known names, and a recipe the step can use (:meth:`validate_recipe`)."""
        bad = WorkloadError
        choose("dtype", self.dtype, choices.DTYPES, bad)
        choose("quant", self.quant, choices.quant_names(), bad)
        choose("kv_dtype", self.kv_dtype, choices.KV_DTYPES, bad)
        self.validate_recipe(trains, sequence_parallel)

    def validate_recipe(self, trains: bool, sequence_parallel: bool = False) -> None:
        """A recipe the step can use; a quantised KV cache only where a step keeps one. A
        serving recipe under tensor parallel quantises each rank's shards
        (:mod:`torchroof.parallel.quantised_shards`)."""
        quant = self.quant
        recipe_trains = choices.RECIPE_TRAINS.get(quant)
        if recipe_trains is not None and sequence_parallel and not trains:
            raise WorkloadError(
                f"quant={quant!r} with sequence parallel: a serving recipe quantises the "
                "shards of transformers' tensor-parallel plan, and sequence parallel runs "
                "torchtitan's instead; leave out --sequence-parallel"
            )
        if recipe_trains is not None and trains and not recipe_trains:
            training = ", ".join(name for name, t in choices.RECIPE_TRAINS.items() if t)
            raise WorkloadError(
                f"quant={quant!r} is a serving recipe (weights stored narrow, no gradients "
                f"through them); a training step takes {training}"
            )
        if self.kv_dtype != "model" and trains:
            raise WorkloadError(
                f"kv_dtype={self.kv_dtype!r}: a training step keeps no KV cache (prefill and "
                "decode do)"
            )


@dataclass(frozen=True)
class CaptureLimits:
    """How far a trace may run before capture stops it."""

    max_ops: int
    full_trace: bool = False  # every repeated layer and micro-batch run, none copied

    def validate(self) -> None:
        positive_int("max_ops", self.max_ops, WorkloadError)

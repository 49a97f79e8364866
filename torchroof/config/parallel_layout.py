"""The parallel part of a Workload: the ranks of each kind, how FSDP and the pipeline run,
and the checks of which of them compose (and with which steps)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchroof.config import choices
from torchroof.config.checks import positive_int
from torchroof.config.errors import WorkloadError
from torchroof.config.limits import MAX_WORLD_SIZE
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.config.parts import StepShape


@dataclass(frozen=True)
class Parallelism:
    """The ranks one step spans and how its program runs over them: tensor (and sequence)
    parallel, FSDP / HSDP with its resharding, data replicas, experts, context, and pipeline
    stages with their schedule, micro-batches and layer split."""

    tp: int
    sequence_parallel: bool
    fsdp: int
    dp: int
    zero: int
    ep: int
    cp: int
    reshard_after_forward: bool
    microbatches: int
    pp: int
    pp_schedule: str
    virtual_stages: int
    pp_split: str

    @property
    def mesh(self) -> ParallelPlan:
        """The ranks the step's program spans (world = pp · dp · fsdp · cp · tp). ZeRO
        1 to 3 over the dp ranks runs FSDP2 over them (:attr:`reshards_after_forward`)."""
        given = self.given_mesh
        return replace(given, dp=1, fsdp=self.dp) if self.zero else given

    @property
    def given_mesh(self) -> ParallelPlan:
        """The ranks as given (dp replicas under ZeRO), for what a user reads."""
        return ParallelPlan(
            pp=self.pp, dp=self.dp, fsdp=self.fsdp, cp=self.cp, tp=self.tp, ep=self.ep
        )

    @property
    def reshards_after_forward(self) -> bool:
        """FSDP2 frees a unit's gathered parameters after its forward. ZeRO-1 and ZeRO-2 keep
        every parameter whole through the step: FSDP2 keeps them gathered from the forward's
        all-gather to the end of backward (``reshard_after_forward=False``, what PyTorch's
        FSDP calls SHARD_GRAD_OP, its ZeRO-2), and across micro-batches to the last one's
        backward (``set_reshard_after_backward(False)`` before the others): one all-gather
        a step, as DeepSpeed's ZeRO-1/2 and Megatron's distributed optimizer run them."""
        return self.reshard_after_forward and self.zero not in (1, 2)

    @property
    def pipeline_split(self) -> tuple[int, ...]:
        """``pp_split`` as layer counts (empty: the even split)."""
        if not self.pp_split:
            return ()
        try:
            counts = tuple(int(part) for part in self.pp_split.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            raise WorkloadError(
                f"pp_split must list each stage's decoder layers as positive integers "
                f"(16,16,15,15), got {self.pp_split!r}"
            )
        return counts

    def validate(self, shape: StepShape) -> None:
        """Every size a positive integer; sharding parameters over data (fsdp) and
        micro-batches of an optimizer step are training concepts: an inference step takes
        tp, cp, pp (micro-batches through the pipeline), dp replicas (each its own batch)
        and ep; context parallel as :meth:`_check_context_parallel` allows."""
        for name in choices.PARALLEL_SIZES:
            positive_int(name, getattr(self, name), WorkloadError)
        world = self.tp * self.dp * self.fsdp * self.cp * self.pp
        if world > MAX_WORLD_SIZE:
            raise WorkloadError(
                f"tp x dp x fsdp x cp x pp = {world:,} GPUs is above the world-size budget "
                f"of {MAX_WORLD_SIZE:,} (torchroof.config.limits.MAX_WORLD_SIZE)"
            )
        if self.cp > 1:
            self._check_context_parallel(shape)
        if self.pp > 1:
            self._check_pipeline(shape)
        else:
            self._check_no_pipeline()
        if self.ep > 1:
            self._check_expert_parallel()
        if self.zero:
            self._check_zero(shape)
        if not shape.facts.trains:
            self._check_inference_sizes(shape)

    def _check_zero(self, shape: StepShape) -> None:
        """ZeRO stages shard training state over the dp replicas: 0 to 3, with dp > 1 and
        no --fsdp (which is ZeRO-3 over its own ranks already)."""
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise WorkloadError(f"zero is a ZeRO stage, 0, 1, 2 or 3, got {self.zero!r}")
        if not shape.facts.trains:
            raise WorkloadError(
                f"zero={self.zero} shards training state (optimizer, gradients, parameters); "
                f"a {shape.regime} step has none: leave zero at 0"
            )
        if self.dp < 2:
            raise WorkloadError(
                f"zero={self.zero} shards over the data-parallel ranks: give dp > 1 (--dp N)"
            )
        if self.fsdp > 1:
            raise WorkloadError(
                f"zero={self.zero} shards over dp={self.dp}, and fsdp={self.fsdp} already "
                "shards parameters, gradients and optimizer state (ZeRO-3) over its ranks: "
                "give one (HSDP is --dp with --fsdp and zero 0)"
            )

    def _check_no_pipeline(self) -> None:
        """The knobs that shape a pipeline, given with none."""
        given = {
            "pp_schedule": self.pp_schedule != choices.DEFAULT_PP_SCHEDULE,
            "virtual_stages": self.virtual_stages != choices.DEFAULT_VIRTUAL_STAGES,
            "pp_split": bool(self.pp_split),
        }
        if any(given.values()):
            names = ", ".join(name for name, set_ in given.items() if set_)
            raise WorkloadError(f"{names} shape a pipeline: give pp > 1 with them")

    def _check_inference_sizes(self, shape: StepShape) -> None:
        """Sizes only a step that trains can have above 1."""
        for name in choices.TRAINING_SIZES:
            if name == "microbatches" and self.pp > 1:
                continue  # micro-batches through an inference pipeline
            if getattr(self, name) > 1:
                trains = ", ".join(r for r, facts in choices.REGIME_FACTS.items() if facts.trains)
                raise WorkloadError(
                    f"{name}={getattr(self, name)} applies to a step that trains "
                    f"({trains}); a {shape.regime} step takes tp, cp, pp (with micro-"
                    "batches), dp replicas and ep"
                )

    def _check_expert_parallel(self) -> None:
        """EP groups are consecutive ranks of one stage holding different tokens (dp, fsdp,
        and cp: each cp rank holds its own share of the sequences) or the same ones (tp): ep
        must be a multiple of tp and divide dp x fsdp x cp x tp (transformers'
        DistributedConfig asks ep to divide fsdp x tp)."""
        ep, tp = self.ep, self.tp
        ranks = self.dp * self.fsdp * self.cp * tp
        if ep % tp or ranks % ep:
            raise WorkloadError(
                f"ep={ep} must be a multiple of tp={tp} and divide dp x fsdp x cp x tp = "
                f"{ranks}: raise dp (serving), or fsdp or cp (training)"
            )

    def _check_pipeline(self, shape: StepShape) -> None:
        """Pipeline stages compose with tensor (and sequence) parallel, FSDP / HSDP, EP and
        context parallel (one stage's program: a stage's ranks run the ring over their
        T/cp tokens and send that shard on); torch's split backward (zero-bubble
        schedules) runs autograd.grad, which FSDP2's hooks (over the fsdp x cp ranks of a
        training step) do not reduce and which cannot separate the weight gradients of
        transformers' tensor-parallel layers."""
        trains = shape.facts.trains
        splits = self.pp_schedule in choices.SPLIT_BACKWARD
        if splits and self.fsdp * self.dp * self.cp > 1 and trains:
            raise WorkloadError(
                f"the {self.pp_schedule} schedule splits each backward (torch's "
                "stage_backward_input / stage_backward_weight), which the gradient reduction "
                "over the data ranks (fsdp, dp, cp) does not follow here: use 1f1b, gpipe or "
                "interleaved-1f1b with fsdp, dp or cp"
            )
        if splits and self.tp > 1 and trains:
            raise WorkloadError(
                f"the {self.pp_schedule} schedule splits each backward into input and weight "
                "gradients (torch's stage_backward_input / stage_backward_weight), which "
                "cannot separate the weight gradients of transformers' tensor-parallel layers "
                "(they compute on local shards: W would be empty): use 1f1b, gpipe or "
                "interleaved-1f1b with tp"
            )
        _ = self.pipeline_split  # a WorkloadError for a malformed pp_split
        if not trains and self.pp_schedule != choices.DEFAULT_PP_SCHEDULE:
            raise WorkloadError(
                f"pp_schedule={self.pp_schedule!r}: a {shape.regime} step has no backward, so "
                "its pipeline runs the forwards in GPipe's order; schedules are for training"
            )
        self._check_stages_per_rank()

    def _check_stages_per_rank(self) -> None:
        """``virtual_stages`` only for an interleaved schedule, and at least 2 there."""
        interleaved = self.pp_schedule in choices.INTERLEAVED
        if interleaved and self.virtual_stages < 2:
            raise WorkloadError(
                f"{self.pp_schedule} interleaves at least 2 stages per rank, got "
                f"virtual_stages={self.virtual_stages} (one stage per rank: pp_schedule=1f1b)"
            )
        if self.virtual_stages != choices.DEFAULT_VIRTUAL_STAGES and not interleaved:
            raise WorkloadError(
                f"virtual_stages={self.virtual_stages} applies to an interleaved schedule "
                f"({', '.join(sorted(choices.INTERLEAVED))}); {self.pp_schedule} holds "
                f"{choices.schedule_stages_per_rank(self.pp_schedule, 1)} stage(s) per rank"
            )

    def _check_context_parallel(self, shape: StepShape) -> None:
        """Context parallel (torch's load-balanced ring attention, torchroof.parallel.program
        .apply_context_parallel) splits each sequence of the step into 2·cp equal chunks;
        it composes with tensor (and sequence) parallel, FSDP / HSDP (a training step shards
        parameters over the fsdp x cp ranks, as torchtitan does), dp replicas, pipeline
        stages (each stage's ranks run the ring over their shard) and expert parallel (a
        cp rank sends its own tokens to the experts), and an
        inference step keeps each rank's own K/V (a dynamic cache: a static one is built for
        the whole sequence)."""
        cp = self.cp
        # seq left out: checked again once the model's default is resolved
        seq = shape.seq
        if seq is not None and shape.tokens(self.microbatches) < shape.batch * seq:
            raise WorkloadError(
                f"cp={cp} splits each sequence's seq new tokens over the cp ranks; a "
                f"{shape.regime} step has fewer ({shape.tokens(self.microbatches)} for "
                f"{shape.batch} sequences)"
            )
        if seq is not None and seq % (2 * cp):
            raise WorkloadError(
                f"cp={cp} splits each sequence into 2 x cp = {2 * cp} equal chunks (torch's "
                f"head-tail load balancing): seq={seq} does not divide"
            )
        if not shape.facts.trains and shape.cache != "dynamic":
            raise WorkloadError(
                f"cp={cp}: each rank caches the K/V of its own seq/cp tokens, which a static "
                "cache (built for the whole sequence) does not: pass cache='dynamic'"
            )

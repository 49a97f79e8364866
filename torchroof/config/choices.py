"""The names each choice knob takes and the facts Workload's checks read about them.

The owners (a regime's module, a quantisation recipe, a pipeline schedule, the trained step's
optimizers and precisions, the inference step's caches) define what each name does; this
module lists the names, so that config imports nothing outside itself.
``tests/test_extension_points.py`` holds every owner's registry equal to the lists here.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")
# seq left out: this, or the model's maximum positions where that is shorter (GPT-2's 1024),
# resolved when the model's config is known (torchroof.api.resolve_seq)
DEFAULT_SEQ = 4096


@dataclass(frozen=True)
class RegimeFacts:
    """What a Workload's checks know of a regime (its module under torchroof.workloads
    declares the same on its ``Regime``): whether it trains, the knobs only some steps read
    that it does (``cache``, ``mla``), and the new tokens it processes per sequence (None:
    all ``seq`` of them; decode: its one new token)."""

    trains: bool = False
    knobs: tuple[str, ...] = ()
    tokens_per_sequence: int | None = None

    def tokens(self, batch: int, seq: int, microbatches: int) -> int:
        """Tokens the step processes: a training step runs ``microbatches`` of its batch."""
        per_sequence = seq if self.tokens_per_sequence is None else self.tokens_per_sequence
        return batch * per_sequence * (microbatches if self.trains else 1)


REGIME_FACTS: dict[str, RegimeFacts] = {
    "prefill": RegimeFacts(knobs=("cache",)),
    "decode": RegimeFacts(knobs=("cache", "mla"), tokens_per_sequence=1),
    "train": RegimeFacts(trains=True),
}
REGIMES: tuple[str, ...] = tuple(REGIME_FACTS)

# the step that trains (torchroof.workloads.train)
OPTIMIZERS = (
    "adamw",
    "adam",
    "sgd",
    "sgd-momentum",
    "adamw8bit",
    "adamw-bf16-moments",
    "adafactor",
    "muon",
)
PRECISIONS = ("bf16", "fp16", "fp32", "mixed")
REDUCE_DTYPES = ("fp32", "bf16")
"""What mixed precision reduces its gradients in over the data-parallel ranks: fp32 (the
bf16 gradients cast before the reduction; torchtitan's ``mixed_precision_reduce`` default,
Megatron's ``accumulate_allreduce_grads_in_fp32`` under bf16) or bf16 (Megatron-Bridge's
``grad_reduce_in_fp32 = False``: half the bytes on the wire and, where the whole gradient is
kept until it is reduced (ZeRO-1), in memory)."""
CHECKPOINT_POLICIES = ("full", "selective")
"""What a checkpointed layer recomputes: its whole forward, or what torchtitan's per-op
policy does not keep (torchroof.workloads.selective)."""

# the inference steps (torchroof.workloads.inference)
CACHES = ("static", "dynamic")
# How a decode step runs multi-head latent attention: over the latent with the
# up-projections absorbed (FlashMLA, vLLM, SGLang) or expanded per step (transformers).
MLA_DECODES = ("absorbed", "expanded")

# Quantisation recipes (torchroof.quant.recipes), each with whether a training step can use
# it (the others are serving recipes: weights stored narrow, no gradients through them).
RECIPE_TRAINS: dict[str, bool] = {
    "fp8": True,
    "fp8-rowwise": True,
    "int8-weight": False,
    "fp8-weight": False,
    "int4-weight": False,
    "mxfp4-weight": False,
    "nvfp4": False,
}
NO_QUANT = "none"
QUANTS: tuple[str, ...] = (NO_QUANT, *RECIPE_TRAINS)
KV_DTYPES = ("model", "fp8", "int8")


def quant_names() -> tuple[str, ...]:
    """:data:`QUANTS` as the recipes stand now (a recipe registered later included)."""
    return (NO_QUANT, *RECIPE_TRAINS)


# Pipeline schedules (torchroof.parallel.pipeline.schedule): torch.distributed.pipelining's,
# by torchroof's names, and the stages each rank holds.
PIPELINE_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "interleaved-zb",
    "zbv",
    "dualpipev",
)
SINGLE_STAGE = frozenset({"gpipe", "1f1b"})  # one stage per rank
V_SHAPED = frozenset({"zbv", "dualpipev"})  # two stages per rank: r and 2p − 1 − r
SPLIT_BACKWARD = frozenset({"interleaved-zb", "zbv", "dualpipev"})  # I and W actions
INTERLEAVED = frozenset(PIPELINE_SCHEDULES) - SINGLE_STAGE - V_SHAPED  # virtual_stages per rank
DEFAULT_PP_SCHEDULE = "1f1b"  # torchtitan's default
DEFAULT_VIRTUAL_STAGES = 2  # an interleaved schedule's stages per rank unless given


def schedule_stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each rank holds: one for GPipe and 1F1B, two for V
    schedules, ``virtual_stages`` for the interleaved ones; a ValueError for an unknown one."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return virtual_stages


# Workload fields that size the parallel program, and those only a step that trains can
# have above 1.
PARALLEL_SIZES = ("tp", "fsdp", "dp", "cp", "pp", "ep", "virtual_stages", "microbatches")
TRAINING_SIZES = ("fsdp", "microbatches")

# How a trace is priced (PricingOptions)
FUSION_POLICIES = ("eager", "fused")
LOSS_POLICIES = ("materialized", "chunked")
ATTENTION_POLICIES = ("flash", "math")
KERNEL_TIMING_MODES = ("roofline", "realistic")
"""The modes that time each kernel (validate compares both with what it measures)."""
TIMING_MODES = (*KERNEL_TIMING_MODES, "calibrated")
"""How kernels are timed: the pure roofline (the floor), the realistic mode, and the
realistic mode times the median measured / realistic of the published runs like the step
(torchroof.accuracy)."""

"""What the stage that traced a step tells the stages after it: the step's facts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torchroof.config.checks import unknown_fields
from torchroof.config.workload import Workload

# the op marks a pipeline stage's trace keeps (:class:`StageMarks`, by these names): the op
# index where its forward, input-gradient and whole backward parts end
FORWARD_END, INPUT_END, BACKWARD_END = "forward_end", "input_end", "backward_end"


@dataclass(frozen=True)
class StageMarks:
    """Where each part of a pipeline stage's traced step ends, as op indices: its forward,
    its input-gradient half (set only when the backward is split into input and weight
    gradients, as zero-bubble schedules run it) and its whole backward (None: not traced)."""

    forward_end: int | None = None
    input_end: int | None = None
    backward_end: int | None = None


@dataclass(frozen=True)
class StageFacts:
    """What a pipeline stage's trace records of its place in the pipeline: which stage of
    how many, the decoder layers it holds ``[start, stop)``, its op marks, and the bytes of
    the activation it receives (or, the first stage, sends) per micro-batch."""

    stage: int
    stages: int
    layers: tuple[int, int]
    marks: StageMarks = field(default_factory=StageMarks)
    activation_bytes: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageFacts:
        start, stop = data["layers"]
        return cls(
            stage=data["stage"],
            stages=data["stages"],
            layers=(start, stop),
            marks=StageMarks(**data.get("marks", {})),
            activation_bytes=data.get("activation_bytes", 0),
        )


@dataclass
class StepFacts:
    """What the stage that traced a step tells the stages after it (pricing, the report).

    Every field is optional: a step traced by hand (``with torchroof.trace()``) has none.
    """

    model: str = ""  # the model as it was named (a shipped name, a path, a class)
    build_note: str = ""  # how the model was built when not as asked (its text part only)
    positions: str = ""  # set when positions beyond the model's maximum were allowed
    defaults: str = ""  # a default the model changed (seq: GPT-2's 1024 for 4096)
    workload: Workload | None = None  # the step's Workload (None: a step traced by hand)
    tokens: int = 0  # tokens the step processes (decode: one per sequence)
    cache: str = ""  # the cache an inference step used: static, dynamic, model, none, ...
    cache_fallback: str = ""  # why it is not the cache that was asked for
    kv_cache_tokens: int = 0  # positions the cache holds after the step
    mla: str = ""  # "absorbed" when latent attention decoded over the latent cache
    optimizer: str = ""  # train: the optimizer
    precision: str = ""  # train: bf16, fp16, fp32 or mixed
    parameters: int = 0  # train: trainable parameters
    # ZeRO-1: the bytes of the whole-gradient buffer held (in the reduction's dtype) beside
    # the traced program over those of the sharded fp32 gradients traced
    whole_gradients: float = 0.0
    # ZeRO-1 or DDP with the reduction deferred to the last micro-batch: the traced program
    # holds the whole gradient itself (FSDP2's unsharded accumulation), the fp32 gradients
    # traced standing for views of it (Megatron's main_grad); whole_gradients is then the
    # share of them FSDP2 does not accumulate (parameters on no data-parallel ranks)
    whole_gradients_traced: bool = False
    dtype: str = ""  # the dtype a step traced from a saved file is re-labelled in
    pipeline: StageFacts | None = None  # a pipeline stage's place, layers and op marks
    quant: str = ""  # which linear layers a quantisation recipe changed, and how
    repeated_layers: str = ""  # how many decoder layers ran, and how many were copies
    repeated_microbatches: str = ""  # how many micro-batches ran, and how many were copies

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (an empty string, dict, 0 or None is left out; the
        Workload as its flat fields)."""
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepFacts:
        """The facts :meth:`to_dict` wrote; the Workload is rebuilt (and so re-checked) from
        its fields, a field this torchroof does not know refused by name."""
        stage = data.get("pipeline")
        data = {**data, "pipeline": StageFacts.from_dict(stage) if stage else None}
        saved = data.get("workload")
        if not saved:
            return cls(**{**data, "workload": None})
        if unknown := unknown_fields(Workload, saved):
            raise ValueError(f"the saved workload has fields this torchroof lacks: {unknown}")
        workload = Workload(**saved)
        if "reduce_dtype" not in saved and workload.reduces_mixed_gradients:
            # saved before reduce_dtype existed: that torchroof reduced the bf16 gradients
            # as they were made; its ZeRO-1 buffer is read as bf16 too, as the label says
            workload = replace(workload, reduce_dtype="bf16")
            if data.get("whole_gradients"):
                data = {**data, "whole_gradients": bf16_buffer(data["whole_gradients"])}
        return cls(**{**data, "workload": workload})


def bf16_buffer(whole: float) -> float:
    """ZeRO-1's whole-gradient buffer in bf16 over the sharded fp32 gradients traced, from
    the same buffer in fp32 (``whole``): half its bytes, and never less than the fp32 copy
    of the rank's shard Megatron's distributed optimizer reads at the step
    (distrib_optimizer.py, _copy_model_grads_to_main_grads: shard_main_param.grad =
    shard.float())."""
    return max(1.0, whole / 2)

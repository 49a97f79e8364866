"""What the stage that traced a step tells the stages after it: the step's facts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from torchroof.config.workload import Workload

# the op marks a pipeline stage's trace keeps in ``StepFacts.pipeline["marks"]``: the op
# index where its forward, input-gradient and whole backward parts end
FORWARD_END, INPUT_END, BACKWARD_END = "forward_end", "input_end", "backward_end"


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
    dtype: str = ""  # the dtype a step traced from a saved file is re-labelled in
    pipeline: dict[str, Any] = field(default_factory=dict)  # a pipeline stage's split and marks
    quant: str = ""  # which linear layers a quantisation recipe changed, and how

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (an empty string, dict, 0 or None is left out; the
        Workload as its flat fields)."""
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepFacts:
        """The facts :meth:`to_dict` wrote; the Workload is rebuilt (and so re-checked) from
        its fields, a field this torchroof does not know refused by name."""
        saved = data.get("workload")
        if not saved:
            return cls(**{**data, "workload": None})
        known = {f.name for f in fields(Workload)}
        if unknown := sorted(set(saved) - known):
            raise ValueError(f"the saved workload has fields this torchroof lacks: {unknown}")
        return cls(**{**data, "workload": Workload(**saved)})

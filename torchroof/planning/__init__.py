"""Plan search: the layouts a model can train with on N GPUs, each priced as an estimate
prices it, ranked, with the reason every left-out family was left out."""

from __future__ import annotations

from typing import Any

from torchroof.config.errors import OptionError
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.planning.layouts import ServingLayout, TrainingLayout
from torchroof.planning.search import PricedPlan, TrainingPlans, plan_training
from torchroof.planning.space import TrainingSpace, enumerate_training


def plan(model: Any = DEFAULT_MODEL, regime: str = "train", **options: Any) -> TrainingPlans:
    """The fastest layouts of ``model`` for ``regime`` (``train``): :func:`plan_training`
    with ``options`` (``gpus``, ``hardware``, ``seq``, ``global_batch`` or
    ``tokens_per_step``, ``space``, ...)."""
    if regime != "train":
        raise OptionError(
            f"plan search covers training layouts so far, not regime {regime!r}: for serving, "
            "torchroof.serving.highest_rate prices one deployment at a time"
        )
    if "gpus" not in options:
        raise OptionError("give gpus=N: the GPUs to lay the training step out on")
    return plan_training(model, **options)


__all__ = [
    "PricedPlan",
    "ServingLayout",
    "TrainingLayout",
    "TrainingPlans",
    "TrainingSpace",
    "enumerate_training",
    "plan",
    "plan_training",
]

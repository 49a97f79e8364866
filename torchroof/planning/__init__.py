"""Plan search: the layouts a model can train with on N GPUs, or be served with on up to N
GPUs, each priced as an estimate or a serving simulation prices it, ranked, with the reason
every left-out family was left out."""

from __future__ import annotations

from typing import Any

from torchroof.config.errors import OptionError
from torchroof.models.sources import DEFAULT_MODEL
from torchroof.planning.layouts import ServingLayout, TrainingLayout
from torchroof.planning.search import PricedPlan, TrainingPlans, plan_training
from torchroof.planning.serving_search import ServedPlan, ServingPlans, plan_serving
from torchroof.planning.serving_space import ServingSpace, enumerate_serving
from torchroof.planning.space import TrainingSpace, enumerate_training

SEARCHES: dict[str, Any] = {"train": plan_training, "serve": plan_serving}
"""Each search by the regime it lays out."""
REGIMES = tuple(SEARCHES)


def plan(
    model: Any = DEFAULT_MODEL, regime: str = "train", **options: Any
) -> TrainingPlans | ServingPlans:
    """The best layouts of ``model`` for ``regime``: ``train``, :func:`plan_training` with
    ``options`` (``gpus``, ``hardware``, ``seq``, ``global_batch`` or ``tokens_per_step``,
    ``space``, ...); ``serve``, :func:`plan_serving` (``hardware``, ``rate`` or
    ``concurrency``, ``requests``, ``input_len``, ``output_len``, ``ttft_s``, ``tpot_s``,
    ``gpus_max``, ``space``, ...)."""
    search = SEARCHES.get(regime)
    if search is None:
        raise OptionError(
            f"plan search covers training layouts (regime 'train') and serving layouts (regime "
            f"'serve'), not regime {regime!r}"
        )
    if search is plan_training and "gpus" not in options:
        raise OptionError("give gpus=N: the GPUs to lay the training step out on")
    return search(model, **options)


__all__ = [
    "PricedPlan",
    "ServedPlan",
    "ServingLayout",
    "ServingPlans",
    "ServingSpace",
    "TrainingLayout",
    "TrainingPlans",
    "TrainingSpace",
    "enumerate_serving",
    "enumerate_training",
    "plan",
    "plan_serving",
    "plan_training",
]

"""The parallel plans transformers ships on a model, less what a pipeline stage does not own."""

from __future__ import annotations

from torch import nn

STAND_INS = ("PipelineIdentityLayer", "SkippedLayer", "AddedNothing")
"""What a pipeline stage puts in place of a module it does not own: transformers'
``PipelineIdentityLayer``, and torchroof.parallel.stages' stand-ins for a derived split."""


def not_owned(module: nn.Module | None) -> bool:
    """A module a pipeline stage does not own (:data:`STAND_INS`)."""
    return type(module).__name__ in STAND_INS


def owned_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` without the entries for modules a pipeline stage does not own (replaced by
    transformers' ``PipelineIdentityLayer``, or absent)."""
    kept = {}
    for name, style in plan.items():
        path = name
        while path:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                path = path.rpartition(".")[0]  # a parameter's name: its module
                continue
            if not not_owned(module):
                kept[name] = style
            break
    return kept


def transformers_plan(
    model: nn.Module, attribute: str, given: dict[str, str] | None
) -> dict[str, str]:
    """``given``, else the model's own transformers plan (``tp_plan``, ``fsdp_plan``); a
    clear error for a model transformers did not build (its plans name its modules)."""
    if not hasattr(model, "_expand_parallel_plan"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers PreTrainedModel: torchroof applies "
            "parallel plans through transformers (its configs ship them)"
        )
    plan = given if given is not None else getattr(model, attribute, None)
    if not isinstance(plan, dict) or not plan:
        kind = attribute.removesuffix("_plan")
        raise ValueError(
            f"{type(model).__name__} has no {attribute} (its config's base_model_{attribute} "
            f"is empty): pass plan= (module name -> transformers {kind} style)"
        )
    return dict(plan)

"""The training plan search: every layout of a model on N GPUs (:mod:`.space`), those that
cannot fit left out before pricing (:mod:`.memory_floor`), the rest priced as
:func:`torchroof.estimate` prices them (from two shallow copies of the model where its
layers are alike, :mod:`.shallow`, the fastest then priced again at full depth) and ranked
by throughput.

Every layout of one global batch trains the same tokens per step, so ranking by step time,
tokens/s and MFU agree; a layout whose priced footprint exceeds the GPU's memory is kept
apart (it does not run). The Pareto front is the fitting plans no other plan beats on both
throughput and memory left free.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchroof.api import config_of
from torchroof.config import PricingOptions, Workload, split_knobs
from torchroof.config.errors import OptionError, WorkloadError
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import text_config
from torchroof.planning.layouts import TrainingLayout
from torchroof.planning.memory_floor import layer_parameters, memory_floor
from torchroof.planning.shallow import (
    STAGE_DEEP,
    STAGE_LEAST,
    alike_layers,
    copy_stages,
    offloaded,
    priced_from_copies,
    step_priced_whole,
)
from torchroof.planning.space import TrainingSpace, enumerate_training
from torchroof.planning.workers import PricingJob, run_jobs
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.runtime import with_knobs
from torchroof.progress import current, reporting

SEARCHED = frozenset(
    {
        *TrainingLayout.__dataclass_fields__,
        "pp_schedule",
        "checkpointing",
        "checkpoint_policy",
    }
) - {"recompute"}
"""Workload fields a layout sets: the search chooses them."""
WHOLE_AS_ASKED = "as asked (--whole, shallow=False)"
"""Why a search priced every layout whole when told to."""
TIED = 1e-9
"""Step times this close (relative) tie: a confirm prices again every carried plan tied with
the last one it must confirm (carried times differ from the full model's by rounding)."""
OVERSHOOT = 0.05
"""How far above the GPU's memory a plan carried on ranks of several stages each may lie
and still fit at full depth: such memory is no lower bound (+3.9% above the full model's
at most, measured on Llama-3-70B), so those are priced whole before they are set aside."""
SET_HERE = frozenset({"gpus", "seq", "global_batch"})
"""Space fields given as plan_training's own arguments."""

DEFAULT_MAX_PLANS = 400
"""Layouts priced at most unless raised: each is one trace of the model's training step, or
two of its shallow copies (:mod:`~torchroof.planning.shallow`)."""


@dataclass(frozen=True)
class PricedPlan:
    """A layout and its figures (:func:`~torchroof.report.compare.point_metrics`)."""

    layout: TrainingLayout
    metrics: dict[str, Any]

    @property
    def step_time_s(self) -> float:
        return float(self.metrics["step_time_s"])

    @property
    def memory_bytes(self) -> int:
        return int(self.metrics["memory_bytes"])

    @property
    def fits(self) -> bool:
        return bool(self.metrics["fits"])

    @property
    def carried(self) -> bool:
        """Whether its figures were carried from shallow copies of the model
        (:mod:`~torchroof.planning.shallow`) rather than priced at full depth."""
        return "shallow" in self.metrics

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.label(), **vars(self.layout), **self.metrics}


@dataclass
class TrainingPlans:
    """What a training search found: the fitting plans best first, those priced over the
    GPU's memory, and every layout left out, with why."""

    ranked: list[PricedPlan]
    over_memory: list[PricedPlan]
    rejected: Counter[str]  # a refused family's reason -> how many families
    pruned: int  # layouts whose memory floor alone exceeds the GPU's memory
    failed: Counter[str] = field(default_factory=Counter)  # a pricing's error -> layouts
    enumerated: int = 0  # layouts the space held that the model can run
    capacity_bytes: int = 0
    whole: str | None = None  # why no layout was priced from shallow copies (None: some were)
    confirmed: int = 0  # carried plans priced again at full depth

    @property
    def best(self) -> PricedPlan:
        if not self.ranked:
            raise OptionError(self.nothing_fits())
        return self.ranked[0]

    def nothing_fits(self) -> str:
        """Why no plan is ranked, in one line."""
        if self.over_memory:
            least = min(self.over_memory, key=lambda p: p.memory_bytes)
            return (
                f"no layout fits: the least memory is {least.memory_bytes / 2**30:.1f} GiB "
                f"({least.layout.label()}), above the {self.capacity_bytes / 2**30:.1f} GiB a "
                "GPU has: use more GPUs, recompute, or a smaller batch"
            )
        if self.pruned:
            return (
                f"no layout fits: the weights and optimizer state of all {self.pruned:,} "
                f"exceed the {self.capacity_bytes / 2**30:.1f} GiB a GPU has"
            )
        if self.failed:
            reason, count = self.failed.most_common(1)[0]
            return (
                f"no layout could be priced: {sum(self.failed.values()):,} failed ({count:,}: "
                f"{reason})"
            )
        reasons = "; ".join(reason for reason, _ in self.rejected.most_common(3))
        return f"no layout to price: every one was refused ({reasons or 'none enumerated'})"

    def pareto(self) -> list[PricedPlan]:
        """The fitting plans no other beats on both throughput and memory (fastest first)."""
        front: list[PricedPlan] = []
        for plan in self.ranked:  # fastest first: keep one that needs less than all before
            if all(plan.memory_bytes < kept.memory_bytes for kept in front):
                front.append(plan)
        return front

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        return {
            "enumerated": self.enumerated,
            "pruned_by_memory": self.pruned,
            "priced": len(self.ranked) + len(self.over_memory) + sum(self.failed.values()),
            "ranked": [plan.to_dict() for plan in self.ranked[:top]],
            "pareto": [plan.layout.label() for plan in self.pareto()],
            "over_memory": len(self.over_memory),
            "rejected": dict(self.rejected),
            "failed": dict(self.failed),
            "carried": sum(plan.carried for plan in [*self.ranked, *self.over_memory]),
            "confirmed": self.confirmed,
            "priced_whole_because": self.whole,
        }


def plan_training(
    model: Any,
    gpus: int,
    hardware: str | Path | ClusterSpec | HardwareSpec = "dgx-h100",
    *,
    seq: int = 4096,
    global_batch: int | None = None,
    tokens_per_step: int | None = None,
    space: dict[str, Any] | None = None,
    pricing: PricingOptions | None = None,
    max_plans: int = DEFAULT_MAX_PLANS,
    jobs: int = 1,
    ray_address: str | None = None,
    progress: bool = False,
    shallow: bool = True,
    confirm: int = 1,
    **knobs: Any,
) -> TrainingPlans:
    """Search every training layout of ``model`` on ``gpus`` GPUs of ``hardware`` for one
    optimizer step of ``global_batch`` sequences of ``seq`` tokens (or ``tokens_per_step``
    tokens). ``space`` narrows what is searched (fields of :class:`TrainingSpace`:
    ``{"tp": (4, 8), "recompute": ("none",)}``); ``knobs`` are the step's other workload
    fields (``precision``, ``optimizer``, ``dtype``) and pricing options (``mode``, ...).
    ``jobs`` processes price the layouts, or a Ray cluster at ``ray_address`` (``"local"``:
    one started here with ``jobs`` CPUs); the result is the same either way. With
    ``shallow``, a layout of a model whose layers are all alike is priced from copies of
    it with 2 and 3 layers, a stage where pipelined (:mod:`~torchroof.planning.shallow`), and
    the ``confirm`` fastest fitting plans are then priced at full depth (the others keep
    the carried figures), each that no longer fits moved among those over memory;
    ``shallow=False`` prices every layout whole."""
    for name, value, least in (("jobs", jobs, 1), ("confirm", confirm, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise OptionError(f"{name} must be a whole number >= {least}, got {value!r}")
    batch = _global_batch(seq, global_batch, tokens_per_step)
    workload_knobs, pricing_knobs = split_knobs(knobs)
    chosen = sorted(set(workload_knobs) & SEARCHED)
    if chosen:
        raise OptionError(
            f"{', '.join(chosen)}: the search chooses it; narrow it with space={{...}} "
            f"({', '.join(TrainingSpace.__dataclass_fields__)}) instead"
        )
    _check_knobs(seq, gpus, workload_knobs)
    with_knobs(pricing, pricing_knobs)  # a bad pricing option refused once, before anything
    unknown = sorted(set(space or {}) - set(TrainingSpace.__dataclass_fields__) - SET_HERE)
    if unknown or set(space or {}) & SET_HERE:
        raise OptionError(
            f"space takes {', '.join(sorted(set(TrainingSpace.__dataclass_fields__) - SET_HERE))}"
            f", not {', '.join(unknown or sorted(set(space or {}) & SET_HERE))}"
        )
    settings = TrainingSpace(gpus=gpus, seq=seq, global_batch=batch, **(space or {}))
    spec, _ = resolve_hardware(hardware)
    if spec.hbm_capacity_bytes is None:
        raise OptionError(f"{spec.name} states no memory capacity: no layout can be checked")
    capacity = int(spec.hbm_capacity_bytes.value)
    config = config_of(model)
    name = _name(model, config)
    with reporting(progress):
        enumeration = enumerate_training(config, settings, name, workload_knobs)
        counts = layer_parameters(config)
        precision = workload_knobs.get("precision", "mixed")
        optimizer = workload_knobs.get("optimizer", "adamw")
        kept = [
            layout
            for layout in enumeration.layouts
            if memory_floor(layout, counts, precision, optimizer) <= capacity
        ]
        result = TrainingPlans(
            [],
            [],
            enumeration.rejected,
            len(enumeration.layouts) - len(kept),
            enumerated=len(enumeration.layouts),
            capacity_bytes=capacity,
        )
        if len(kept) > max_plans:
            raise OptionError(
                f"{len(kept):,} layouts to price (each a trace of the training step), above "
                f"max_plans={max_plans:,}: narrow the space (tp, pp, cp, recompute, "
                "schedules, micro_batch, max_micro_batch) or raise max_plans"
            )
        options = (workload_knobs, pricing, pricing_knobs)
        result.whole = (
            _why_whole(model, config, kept, workload_knobs, offloaded(pricing, pricing_knobs))
            if shallow
            else WHOLE_AS_ASKED
        )
        from_copies = result.whole is None
        workers = (jobs, ray_address)
        _price(model, kept, hardware, seq, options, result, workers, from_copies)
        _confirm(model, hardware, seq, options, result, workers, confirm)
    result.over_memory.sort(key=lambda plan: plan.memory_bytes)
    return result


def _why_whole(
    model: Any,
    config: Any,
    layouts: list[TrainingLayout],
    workload: dict[str, Any],
    offload: int = 0,
) -> str | None:
    """Why none of ``layouts`` of ``model`` is priced from shallow copies of it, or None
    (then those :func:`~torchroof.planning.shallow.priced_from_copies` takes are)."""
    if isinstance(model, torch.nn.Module):
        return "a module is traced as given"
    layers = getattr(text_config(config), "num_hidden_layers", None)
    why = step_priced_whole(layers, workload, offload)
    if why is not None:
        return why
    assert isinstance(layers, int)  # step_priced_whole refuses any other
    if not any(priced_from_copies(layers, layout, workload, offload) for layout in layouts):
        return (
            f"every layout is pipelined with fewer than {STAGE_DEEP} layers a stage "
            f"({STAGE_LEAST} under interleaved 1F1B whose ranks hold {STAGE_DEEP})"
        )
    return alike_layers(config)


def _confirm(
    model: Any,
    hardware: Any,
    seq: int,
    options: tuple[dict[str, Any], PricingOptions | None, dict[str, Any]],
    result: TrainingPlans,
    workers: tuple[int, str | None],
    confirm: int,
) -> None:
    """Rank the fitting plans fastest first, pricing at full depth any of the ``confirm``
    fastest whose figures were carried from shallow copies (and any tied with the last of
    them, :data:`TIED`), until the ``confirm`` fastest were all priced whole; a plan that
    no longer fits is moved among those over memory. A carried plan over memory that may
    fit at full depth (:func:`_may_fit`) and would rank among the ``confirm`` fastest is
    priced whole too. A round of one plan is priced here, not in a pool or on Ray."""
    while True:
        ranked = sorted(result.ranked, key=lambda plan: (plan.step_time_s, plan.memory_bytes))
        result.ranked[:] = ranked
        if not confirm:
            return
        last = ranked[:confirm][-1].step_time_s * (1 + TIED) if ranked else math.inf
        again = [plan for plan in ranked if plan.carried and plan.step_time_s <= last]
        if len(ranked) < confirm:
            last = math.inf  # any plan that fits joins the ``confirm`` fastest
        near = [
            plan
            for plan in result.over_memory
            if _may_fit(plan, result.capacity_bytes) and plan.step_time_s <= last
        ]
        if not again and not near:
            return
        for plan in again:
            result.ranked.remove(plan)
        for plan in near:
            result.over_memory.remove(plan)
        result.confirmed += len(again) + len(near)
        layouts = [plan.layout for plan in [*again, *near]]
        here = workers if len(layouts) > 1 else (1, None)
        _price(model, layouts, hardware, seq, options, result, here, at="at full depth")


def _may_fit(plan: PricedPlan, capacity_bytes: int) -> bool:
    """Whether ``plan``, priced over ``capacity_bytes``, may fit at full depth: carried, on
    ranks of several pipeline stages each (whose carried memory can exceed the full
    model's, :mod:`~torchroof.planning.shallow`), within :data:`OVERSHOOT` of it."""
    several = copy_stages(plan.layout) > plan.layout.pp
    return plan.carried and several and plan.memory_bytes <= capacity_bytes * (1 + OVERSHOOT)


def _price(
    model: Any,
    layouts: list[TrainingLayout],
    hardware: Any,
    seq: int,
    options: tuple[dict[str, Any], PricingOptions | None, dict[str, Any]],
    result: TrainingPlans,
    workers: tuple[int, str | None] = (1, None),
    from_copies: bool = False,
    at: str = "",
) -> None:
    """Price each layout (its metrics from one estimate, or carried from shallow copies
    where ``from_copies``) on ``workers`` (processes, a Ray address), into ``result``."""
    workload_knobs, pricing, pricing_knobs = options
    if not layouts:
        return
    jobs = [
        PricingJob(
            model, layout, seq, hardware, workload_knobs, pricing, pricing_knobs, from_copies
        )
        for layout in layouts
    ]
    report = current()
    plans = "plan" if len(layouts) == 1 else "plans"
    title = f"pricing {len(layouts):,} training {plans} {at}".rstrip()
    with report.stage(title, len(layouts), "plans"):
        for layout, priced in zip(layouts, run_jobs(jobs, *workers), strict=True):
            report.advance()
            if isinstance(priced, str):
                result.failed[priced] += 1  # the same refusal of many layouts counted once
                continue
            plan = PricedPlan(layout, priced)
            (result.ranked if plan.fits else result.over_memory).append(plan)


def _check_knobs(seq: int, gpus: int, knobs: dict[str, Any]) -> None:
    """Refuse in one line, before anything is enumerated, a workload field no layout of
    the default space could take (a bad precision, ...): checked on a step of one GPU, and
    where that refuses it, on one with what the space may add (recompute, which
    ``checkpoint_every`` narrows; two data ranks, which ``reduce_dtype`` needs); the first
    refusal is the one said. A field only the layouts of a narrowed space refuse is
    refused with each of them (``TrainingPlans.rejected``)."""
    try:
        Workload(regime="train", seq=seq, **knobs)
    except (WorkloadError, OptionError, ValueError) as first:
        added: dict[str, Any] = {"checkpointing": True}
        if gpus > 1:
            added["dp"] = 2
        try:
            Workload(regime="train", seq=seq, **added, **knobs)
        except (WorkloadError, OptionError, ValueError):
            raise first from None


def _name(model: Any, config: Any) -> str:
    """What refusals call the model: its name or path, else its config's."""
    if isinstance(model, (str, Path)):
        return str(model)
    return str(getattr(config, "name_or_path", "") or getattr(config, "model_type", "the model"))


def _global_batch(seq: int, global_batch: int | None, tokens_per_step: int | None) -> int:
    """The global batch in sequences, from itself or from tokens per step."""
    if (global_batch is None) == (tokens_per_step is None):
        raise OptionError("give the global batch in sequences or in tokens per step (one)")
    if tokens_per_step is not None:
        if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int):
            raise OptionError(f"tokens_per_step must be a whole number, got {tokens_per_step!r}")
        if tokens_per_step < seq or tokens_per_step % seq:
            raise OptionError(
                f"tokens_per_step={tokens_per_step:,} is not a whole number of {seq:,}-token "
                "sequences"
            )
        return tokens_per_step // seq
    assert global_batch is not None
    return global_batch

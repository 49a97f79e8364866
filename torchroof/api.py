"""The model-level entry points: build a model on meta, trace one step of a workload,
price it (:func:`estimate`), and the :class:`Trace` a user's own ``with trace():`` block
returns, which prices itself.

Everything here composes the stages below it (capture, workloads, pipeline); no stage
imports this module.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from torchroof import pp_step, records
from torchroof.capture import Capture, OpBudgetExceeded, op_budget
from torchroof.errors import OptionError, WorkloadError, first_line
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models import build_model, check_layers, check_positions, load_config
from torchroof.options import (
    DEFAULT_PP_SCHEDULE,
    DEFAULT_VIRTUAL_STAGES,
    PricingOptions,
    Workload,
    split_knobs,
)
from torchroof.pipeline import estimate_trace, resolve_hardware
from torchroof.pp_schedule import SPLIT_BACKWARD, action_order, stages_per_rank
from torchroof.quantize import check_hardware
from torchroof.report import Estimate
from torchroof.workloads import compute_dtype, regime, run_workload
from torchroof.workloads.parallel_step import check_plan
from torchroof.workloads.pipeline_stages import decoder_layers, make_stage, split_layers, stage_key


class Trace(records.Trace):
    """A :class:`torchroof.records.Trace` that prices itself: what ``with trace() as t``,
    :func:`trace_model` and ``Trace.load`` give a user."""

    def estimate(
        self, hardware: str | Path | HardwareSpec = "h100-sxm", **options: Any
    ) -> Estimate:
        """Price every op and time it with the roofline on ``hardware`` (name, alias, path
        or HardwareSpec). Options are the fields of :class:`torchroof.options.PricingOptions`."""
        return estimate_trace(self, hardware, **options)

    @classmethod
    def of(cls, trace: records.Trace) -> Trace:
        """The same trace (no copy of its ops), able to price itself."""
        if isinstance(trace, cls):
            return trace
        return cls(**{f.name: getattr(trace, f.name) for f in fields(records.Trace)})


class PipelineTrace(pp_step.PipelineTrace):
    """A pipelined step's traces (:class:`torchroof.pp_step.PipelineTrace`) that price
    themselves, as :class:`Trace` does: what :func:`trace_model` gives for ``pp`` > 1."""

    def estimate(
        self, hardware: str | Path | HardwareSpec | ClusterSpec = "dgx-h100", **options: Any
    ) -> Estimate:
        """Price every stage on ``hardware`` (a cluster: stages send activations between
        GPUs) and lay the schedule out; options as :meth:`Trace.estimate`."""
        return estimate_trace(self, hardware, **options)


def trace(
    *,
    flash_attention: bool = True,
    max_ops: int | None = None,
    max_item_answers: int | None = None,
) -> Capture:
    """Record every aten op run inside the ``with`` block.

    >>> with torchroof.trace() as t:      # doctest: +SKIP
    ...     model(ids)
    >>> t.estimate("h100-sxm").table()    # doctest: +SKIP

    ``flash_attention=False`` records SDPA as the ops the current device decomposes it into
    (on meta and CPU: the math path with an N×N score tensor).

    ``max_ops`` (default :data:`torchroof.limits.DEFAULT_MAX_OPS`, 10M) bounds the aten ops
    the block may run, recorded or not; ``max_item_answers`` (default 10,000) the meta
    ``.item()`` answers in one module call. Past either, :class:`OpBudgetExceeded` names the
    module and the ops of the loop: on meta, a ``while`` loop on a tensor's value never ends.
    """
    return Capture(
        flash_attention=flash_attention,
        max_ops=max_ops,
        max_item_answers=max_item_answers,
        trace_type=Trace,
    )


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model with every parameter and buffer on meta. The original is never
    touched (a workload sets train mode, gradients, checkpointing on the copy) and no real
    weight is copied: deepcopy is handed meta stand-ins for them."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_meta:
            continue
        stand_in = torch.empty_like(t, device="meta")
        if isinstance(t, torch.nn.Parameter):
            stand_in = torch.nn.Parameter(stand_in, requires_grad=t.requires_grad)
        memo[id(t)] = stand_in
    return copy.deepcopy(model, memo)


def estimate(
    model: Any = "llama-3-8b",
    regime: str | None = None,
    *,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    workload: Workload | None = None,
    pricing: PricingOptions | None = None,
    **knobs: Any,
) -> Estimate:
    """Estimate one step of ``model`` on ``hardware``.

    ``model`` is an ``nn.Module`` (any device: it is traced on a meta copy, its weights are
    never touched), a transformers config, a path to a config.json or model directory, or
    a shipped config name (``torchroof models``). ``regime`` is ``prefill`` (B x seq tokens,
    writing the KV cache), ``decode`` (one token for B sequences against a cache of
    ``context`` tokens) or ``train`` (forward, loss, backward, optimizer step); left out,
    the workload's, else prefill.

    Every other keyword is a field of :class:`torchroof.options.Workload` (``batch``,
    ``seq``, ``context``, ``cache``, ``optimizer``, ``precision``, ``checkpointing``,
    ``mla``, ``dtype``; across GPUs ``tp``, ``fsdp``, ``dp``, ``microbatches``, ...) or of
    :class:`torchroof.options.PricingOptions` (``fusion``, …), or pass the objects. A
    module keeps its own dtype unless ``dtype`` or ``precision`` is given; a config is
    built in ``dtype`` (bf16). A step across GPUs is rank 0 of the real parallel program,
    priced on a cluster (``hardware="dgx-h100"``).
    """
    workload_knobs, pricing_knobs = split_knobs(knobs)
    spec, cluster = resolve_hardware(hardware)  # fail on a bad name before any tracing
    pricing = replace(pricing or PricingOptions(), **pricing_knobs)
    quant = workload_knobs.get("quant", workload.quant if workload else "none")
    check_quant_hardware(quant, spec)  # before tracing
    trace = trace_model(model, regime, workload=workload, **workload_knobs)
    return estimate_trace(trace, cluster or spec, pricing)


def check_quant_hardware(
    quant: str, hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm"
) -> None:
    """Refuse, before anything is traced, a recipe whose GEMMs need tensor cores the
    accelerator lacks (fp8 on an A100, fp4 on an H100)."""
    spec, _ = resolve_hardware(hardware)
    check_hardware(quant, spec.tensor_flops_per_s, spec.display_name)


class ModelTraceError(ValueError):
    """The model's own forward or backward failed on meta (a limitation, named in one
    line; the original exception is chained)."""


def trace_model(
    model: Any, regime: str | None = None, *, workload: Workload | None = None, **knobs: Any
) -> Trace | PipelineTrace:
    """The trace :func:`estimate` prices: ``workload``, or its fields as keywords."""
    workload_knobs, pricing_knobs = split_knobs(knobs)
    if pricing_knobs:
        raise OptionError(
            f"{', '.join(sorted(pricing_knobs))} choose how a trace is priced, not what is "
            "traced: pass them to estimate() or estimate_trace()"
        )
    cast = workload is not None or "dtype" in workload_knobs or "precision" in workload_knobs
    if regime is not None:
        workload_knobs["regime"] = regime
    workload = replace(workload, **workload_knobs) if workload else Workload(**workload_knobs)
    return trace_workload(model, workload, cast_module=cast)


def trace_workload(
    model: Any, workload: Workload, cast_module: bool = False
) -> Trace | PipelineTrace:
    """Build (or meta-copy) the model and trace one step of ``workload`` on it. A module
    keeps its dtype unless ``cast_module``. With ``pp`` > 1, one trace per distinct
    pipeline stage (:func:`trace_pipeline`)."""
    if workload.pp > 1:
        return trace_pipeline(model, workload, cast_module)
    module, label, beyond = _build(model, workload, cast_module)
    trace = _run(module, workload)
    trace.facts.model = label
    if beyond:
        trace.facts.positions = beyond
    return Trace.of(trace)


def _build(model: Any, workload: Workload, cast_module: bool) -> tuple[torch.nn.Module, str, str]:
    """(the model on meta, its label, the positions note) after the checks that refuse a
    workload before anything is built."""
    if isinstance(model, torch.nn.Module):
        label = type(model).__name__
        config = getattr(model, "config", None)
        if config is None:
            raise WorkloadError(
                f"{label} is not a transformers model: the {workload.regime} regime drives a "
                "model's forward with input_ids, labels and a KV cache; trace any other module "
                "by hand: `with torchroof.trace() as t: model(x).sum().backward(); opt.step()` "
                "then `t.estimate(...)` (README, 'A step traced by hand')"
            )
    else:
        label = str(model) if isinstance(model, (str, Path)) else type(model).__name__
        config = load_config(model)
    beyond = None
    if config is not None:  # refused before anything is built
        check_layers(config, name=label)
        check_plan(config, workload, name=label)
        length = regime(workload.regime).positions(workload)
        allow = workload.allow_beyond_max_positions
        beyond = check_positions(config, length, allow, name=label)
    if isinstance(model, torch.nn.Module):
        module = meta_copy(model)
        if cast_module:
            module = module.to(compute_dtype(workload))
    else:
        module = build_model(config, compute_dtype(workload))
    return module, label, beyond or ""


def _run(module: torch.nn.Module, workload: Workload) -> records.Trace:
    try:
        with op_budget(max_ops=workload.max_ops):
            return run_workload(module, workload)
    except (WorkloadError, OpBudgetExceeded):
        raise
    except Exception as error:  # noqa: BLE001 - the model's own code failed on meta
        raise ModelTraceError(
            f"{type(module).__name__} could not be traced for {workload.regime}: "
            f"{first_line(error)} (see README, 'Architectures that do not trace')"
        ) from error


def trace_pipeline(model: Any, workload: Workload, cast_module: bool = False) -> PipelineTrace:
    """A pipelined step (issue 14): torch's action order for ``pp_schedule`` (an inference
    step runs the forwards of GPipe's), the decoder layers split into pp · stages-per-rank
    stages (:func:`torchroof.workloads.pipeline_stages.split_layers`), and each distinct
    stage traced once as rank 0 of its own program (tp, fsdp, dp), one micro-batch."""
    trains = regime(workload.regime).trains
    schedule = workload.pp_schedule if trains else "gpipe"
    try:
        order = action_order(schedule, workload.pp, workload.microbatches, workload.virtual_stages)
    except ValueError as error:
        raise WorkloadError(str(error)) from error
    if not trains:
        order = {rank: [a for a in listed if a.kind == "F"] for rank, listed in order.items()}
    count = workload.pp * stages_per_rank(schedule, workload.virtual_stages)
    stage_workload = replace(  # one stage, one micro-batch: the pipeline is laid out here
        workload,
        pp=1,
        microbatches=1,
        pp_split="",
        pp_schedule=DEFAULT_PP_SCHEDULE,
        virtual_stages=DEFAULT_VIRTUAL_STAGES,
    )
    reference, label, beyond = _build(model, stage_workload, cast_module)
    _, _, layers = decoder_layers(reference)
    splits = split_layers(len(layers), count, workload.pipeline_split)
    keys = [stage_key(reference, split) for split in splits]
    traced_as = [keys.index(key) for key in keys]
    traces: dict[int, records.Trace] = {}
    for split in splits:
        if traced_as[split.index] != split.index:
            continue
        module = reference if not traces else _build(model, stage_workload, cast_module)[0]
        make_stage(module, split, split_backward=trains and schedule in SPLIT_BACKWARD)
        traces[split.index] = _run(module, stage_workload)
    facts = replace(traces[0].facts, model=label, positions=beyond, pipeline={})
    facts.workload = workload.to_dict()
    tokens = regime(workload.regime).tokens(workload)
    facts.tokens = tokens if trains else tokens * workload.microbatches
    plan = workload.parallel_plan
    return PipelineTrace(
        traces=traces,
        traced_as=traced_as,
        layers=[split.describe() for split in splits],
        order=order,
        schedule=schedule,
        pp=workload.pp,
        microbatches=workload.microbatches,
        ranks_per_stage=plan.world // plan.pp,
        trains=trains,
        facts=facts,
    )

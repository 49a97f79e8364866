"""The model-level entry points: build a model on meta, trace one step of a workload,
price it (:func:`estimate`), and the :class:`Trace` a user's own ``with trace():`` block
returns, which prices itself.

Everything here composes the stages below it (capture, workloads, pipeline); no stage
imports this module.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from torchroof.capture.budget import OpBudgetExceeded, op_budget
from torchroof.capture.mode import Capture
from torchroof.capture.replay_training import ReplayFallback
from torchroof.collector import paused_gc
from torchroof.config import (
    DEFAULT_SEQ,
    PRICING_KNOBS,
    WORKLOAD_KNOBS,
    PricingOptions,
    Workload,
    split_knobs,
)
from torchroof.config.errors import OptionError, WorkloadError, first_line
from torchroof.hardware import ClusterSpec, HardwareSpec
from torchroof.models.sources import (
    build_model,
    check_layers,
    check_new_positions,
    check_positions,
    load_config,
    position_limit,
)
from torchroof.parallel.pipeline import price as pp_step
from torchroof.parallel.pipeline.shared import current_shared
from torchroof.parallel.pipeline.trace import trace_pipeline
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.price import TracePlans, price_trace, pricing_options
from torchroof.pricing.runtime import check_runtime_regime, with_knobs, workload_defaults
from torchroof.pricing.trace_checks import RULE_ERRORS, unpriceable_op
from torchroof.progress import current as current_progress
from torchroof.progress import reporting
from torchroof.quant.recipes import check_hardware
from torchroof.quiet import quiet_trace
from torchroof.records import trace as records
from torchroof.report.estimate import Estimate
from torchroof.workloads import compute_dtype, regime, run_workload
from torchroof.workloads.parallel_step import check_plan
from torchroof.workloads.repeated import copied_or_every_layer


class Trace(records.Trace):
    """A :class:`torchroof.records.trace.Trace` that prices itself: what ``with trace() as t``,
    :func:`trace_model` and ``Trace.load`` give a user."""

    def estimate(
        self, hardware: str | Path | HardwareSpec = "h100-sxm", **options: Any
    ) -> Estimate:
        """Price every op and time it with the roofline on ``hardware`` (name, alias, path
        or HardwareSpec). Options are the fields of
        :class:`torchroof.config.PricingOptions`."""
        return estimate_trace(self, hardware, **options)

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """:meth:`torchroof.records.trace.Trace.from_dict`, and the recorded tokens checked
        against what the recorded workload's regime processes (an edited count is refused)."""
        from torchroof.pricing.trace_checks import recorded_tokens_problem

        trace = cls.of(super().from_dict(data))  # already one of cls: of() returns it as is
        if problem := recorded_tokens_problem(trace.facts):
            raise records.TraceFileError([problem])
        return trace

    @classmethod
    def of(cls, trace: records.Trace) -> Trace:
        """The same trace (no copy of its ops), able to price itself."""
        if isinstance(trace, cls):
            return trace
        return cls(**{f.name: getattr(trace, f.name) for f in fields(records.Trace)})


class PipelineTrace(pp_step.PipelineTrace):
    """A pipelined step's traces (:class:`torchroof.parallel.pipeline.price.PipelineTrace`)
    that price themselves, as :class:`Trace` does: what :func:`trace_model` gives for
    ``pp`` > 1."""

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
    >>> text.layer_table(t.estimate("h100-sxm"))    # doctest: +SKIP

    ``flash_attention=False`` records SDPA as the ops the current device decomposes it into
    (on meta and CPU: the math path with an N×N score tensor).

    ``max_ops`` (default :data:`torchroof.config.limits.DEFAULT_MAX_OPS`, 10M) bounds the aten ops
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
    inputs: Sequence[Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    progress: bool = False,
    # -- the fields of torchroof.config.Workload (None: the field's default) -------------
    batch: int | None = None,
    seq: int | None = None,
    context: int | None = None,
    cache: str | None = None,
    optimizer: str | None = None,
    precision: str | None = None,
    reduce_dtype: str | None = None,
    checkpointing: bool | None = None,
    checkpoint_policy: str | None = None,
    checkpoint_every: int | None = None,
    mla: str | None = None,
    dtype: str | None = None,
    quant: str | None = None,
    kv_dtype: str | None = None,
    allow_beyond_max_positions: bool | None = None,
    max_ops: int | None = None,
    full_trace: bool | None = None,
    tp: int | None = None,
    sequence_parallel: bool | None = None,
    fsdp: int | None = None,
    dp: int | None = None,
    zero: int | None = None,
    ep: int | None = None,
    cp: int | None = None,
    reshard_after_forward: bool | None = None,
    microbatches: int | None = None,
    pp: int | None = None,
    pp_schedule: str | None = None,
    virtual_stages: int | None = None,
    pp_split: str | None = None,
    defer_gradient_sync: bool | None = None,
    # -- the fields of torchroof.config.PricingOptions (None: the field's default) -------
    runtime: str | None = None,
    fusion: str | None = None,
    epilogue: bool | None = None,
    dequantise_in_gemm: bool | None = None,
    loss: str | None = None,
    attention: str | None = None,
    sequence_parallel_regather: bool | None = None,
    save_fp8_inputs: bool | None = None,
    on_chip_budget_bytes: int | None = None,
    allow_tf32: bool | None = None,
    overlap: bool | None = None,
    overlap_communication: bool | None = None,
    routing_imbalance: float | None = None,
    routing: str | None = None,
    offload_activations: int | None = None,
    compute_efficiency: float | None = None,
    bandwidth_efficiency: float | None = None,
    launch_overhead_s: float | None = None,
    mode: str | None = None,
    on_chip: bool | None = None,
    waves: bool | None = None,
    latency_shelf: bool | None = None,
    achievable: bool | None = None,
    launch: bool | None = None,
    cuda_graphs: bool | None = None,
    softmax_pipes: bool | None = None,
    gemm_tile: str | None = None,
    **unknown: Any,  # a misspelt knob: an OptionError that lists every knob
) -> Estimate:
    """Estimate one step of ``model`` on ``hardware``.

    ``model`` is an ``nn.Module`` (any device: it is traced on a meta copy, its weights are
    never touched), a transformers config, a path to a config.json or model directory, or
    a shipped config name (``torchroof models``). ``regime`` is ``prefill`` (B x seq tokens,
    writing the KV cache), ``decode`` (one token for B sequences against a cache of
    ``context`` tokens) or ``train`` (forward, loss, backward, optimizer step); left out,
    the workload's, else prefill.

    A plain ``nn.Module`` (no transformers config) takes ``inputs``: ``prefill`` runs
    ``module(*inputs)``; ``train`` runs it, takes ``loss_fn(output)`` as the loss (default:
    the output if it is a scalar, else its ``.sum()``), backward and the ``optimizer``'s step.

    Every other keyword is a field of :class:`torchroof.config.Workload` (``batch``,
    ``seq``, ``context``, ``cache``, ``optimizer``, ``precision``, ``checkpointing``,
    ``mla``, ``dtype``; across GPUs ``tp``, ``fsdp``, ``dp``, ``microbatches``, ...) or of
    :class:`torchroof.config.PricingOptions` (``fusion``, …), or pass the objects; one
    left out (None) keeps the object's value, else the field's default (``seq``: 4096, or
    the model's maximum positions if shorter; ``precision``: mixed). A module keeps its own
    dtype unless ``dtype`` or ``precision`` is given, or it trains (a training step computes
    in its precision: mixed is bf16); a config is built in ``dtype`` (bf16). A step across
    GPUs is rank 0 of the real parallel program, priced on a cluster (``hardware="dgx-h100"``).
    ``progress=True`` shows each stage (building, tracing the forward and backward passes,
    pricing, fusing) and its time on stderr; silent otherwise.
    """
    given = locals()
    knobs = {k: given[k] for k in (*WORKLOAD_KNOBS, *PRICING_KNOBS) if given.get(k) is not None}
    knobs.pop("regime", None)  # the positional argument
    split_knobs(unknown)  # any name here is not a knob: the error lists them
    workload_knobs, pricing_knobs = split_knobs(knobs)
    spec, cluster = resolve_hardware(hardware)  # fail on a bad name before any tracing
    pricing = with_knobs(pricing, pricing_knobs)  # a bad runtime fails here too
    check_runtime_regime(pricing, regime or (workload.regime if workload else "prefill"))
    workload_knobs = workload_defaults(pricing, workload_knobs, workload, regime)
    quant = workload_knobs.get("quant", workload.quant if workload else "none")
    check_quant_hardware(quant, spec)  # before tracing
    with reporting(progress):  # progress=True: each stage on stderr as it runs
        trace: Trace | PipelineTrace
        if inputs is not None or loss_fn is not None:
            trace = trace_module(
                model, inputs, regime, workload=workload, loss_fn=loss_fn, **workload_knobs
            )
        else:
            trace = trace_model(model, regime, workload=workload, **workload_knobs)
        return estimate_trace(trace, cluster or spec, pricing)


def estimate_trace(
    trace: records.Trace | pp_step.PipelineTrace,
    hardware: str | Path | HardwareSpec | ClusterSpec = "h100-sxm",
    pricing: PricingOptions | None = None,
    *,
    plans: TracePlans | None = None,
    **knobs: Any,
) -> Estimate:
    """Price and time every op of ``trace`` on ``hardware``: an accelerator, or a cluster
    (``dgx-h100``, a cluster TOML or a ClusterSpec) whose accelerator runs the kernels and
    whose links carry the collectives (:func:`torchroof.pricing.collectives.time_collective`).
    A step with collectives over more than one rank needs a cluster
    (:class:`torchroof.pricing.collectives.ClusterRequiredError`). A pipelined step prices
    each distinct stage once and lays the schedule out
    (:func:`torchroof.parallel.pipeline.price.price`).

    ``pricing`` or its fields as keywords (:class:`torchroof.config.PricingOptions`:
    ``fusion``, ``epilogue``, ``loss``, ``attention``, ``on_chip_budget_bytes``,
    ``allow_tf32``, ``overlap``, ``overlap_communication``, ``compute_efficiency``,
    ``bandwidth_efficiency``, ``launch_overhead_s``) choose the kernels and how each is
    timed. With collectives the step time is the schedule's
    (:mod:`torchroof.timing.streams`); without, the plain sum of the kernels' times.
    ``plans`` keeps each trace's kernels across calls (:class:`TracePlans`); a pipelined
    step's stages inside a :func:`~torchroof.parallel.pipeline.shared.shared_stages` block
    keep theirs in the block's instead, shared with every step that runs those stages.
    """
    pricing = pricing_options(pricing, knobs)
    with paused_gc(), current_progress().ending():
        if isinstance(trace, pp_step.PipelineTrace):  # one trace per distinct stage + schedule
            spec, cluster = resolve_hardware(hardware)
            chosen = pricing
            shared = current_shared()  # stages planned once for every step that shares them
            held = shared.plans if shared is not None else plans
            return pp_step.price(
                trace,
                lambda stage: price_trace(
                    stage, cluster or spec, chosen, held.of(stage) if held is not None else None
                ),
                cluster,
                int(spec.hbm_capacity_bytes.value),
            )
        try:
            return price_trace(
                trace, hardware, pricing, plans.of(trace) if plans is not None else None
            )
        except OptionError:
            raise
        except RULE_ERRORS as e:
            named = unpriceable_op(trace)  # the op a rule could not read, if one is to blame
            if named is None:
                raise
            raise named from e


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
    model: Any,
    regime: str | None = None,
    *,
    workload: Workload | None = None,
    progress: bool = False,
    **knobs: Any,
) -> Trace | PipelineTrace:
    """The trace :func:`estimate` prices: ``workload``, or its fields as keywords;
    ``progress=True`` shows each stage on stderr as it runs."""
    workload, cast = traced_workload(regime, workload, knobs)
    with reporting(progress):
        return trace_workload(model, workload, cast_module=cast)


def traced_workload(
    step: str | None,
    workload: Workload | None,
    knobs: dict[str, Any],
    priced_by: str = "estimate() or estimate_trace()",
) -> tuple[Workload, bool]:
    """(the workload to trace, whether a module is cast to its compute dtype) from a
    regime, a workload and its fields as keywords; pricing knobs are refused here. A module
    is cast when a workload, ``dtype`` or ``precision`` is given, or the step trains (in its
    precision's compute dtype: mixed, the default, is bf16)."""
    workload_knobs, pricing_knobs = split_knobs(knobs)
    if pricing_knobs:
        raise OptionError(
            f"{', '.join(sorted(pricing_knobs))} choose how a trace is priced, not what is "
            f"traced: pass them to {priced_by}"
        )
    cast = workload is not None or "dtype" in workload_knobs or "precision" in workload_knobs
    if step is not None:
        workload_knobs["regime"] = step
    workload = replace(workload, **workload_knobs) if workload else Workload(**workload_knobs)
    return workload, cast or workload.trains


@paused_gc()
def trace_module(
    model: torch.nn.Module,
    inputs: Sequence[Any] | torch.Tensor | None,
    regime: str | None = None,
    *,
    workload: Workload | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    cast_module: bool | None = None,
    **knobs: Any,
) -> Trace:
    """One step of a plain ``nn.Module`` on the ``inputs`` given (tensors on any device:
    meta copies are run, as the module is): ``prefill`` runs ``module(*inputs)``;
    ``train`` the forward, ``loss_fn(output)`` (default: the output if it is a scalar, else
    its ``.sum()``), backward and the ``optimizer``'s step in ``precision``
    (:func:`torchroof.workloads.module_step.trace_module_step`); decode is refused. One GPU
    only; the module keeps its dtype unless ``dtype`` or ``precision`` is given or it
    trains (in its precision's compute dtype: mixed, the default, is bf16)."""
    from torchroof.workloads.module_step import trace_module_step

    if not isinstance(model, torch.nn.Module):
        raise WorkloadError(
            f"inputs= and loss_fn= drive a plain nn.Module; {type(model).__name__} is not one "
            "(a config or a shipped name makes its own inputs)"
        )
    if inputs is None:
        raise WorkloadError(
            f"{type(model).__name__}: give the inputs its forward takes, inputs=(x,)"
        )
    workload, cast = traced_workload(regime, workload, knobs)
    cast = cast if cast_module is None else cast_module
    label = type(model).__name__
    if workload.parallel_plan.world > 1 or workload.microbatches > 1 or workload.quant != "none":
        raise WorkloadError(
            f"{label}: a plain nn.Module is traced as one step on one GPU (no tp, fsdp, dp, "
            "cp, pp, ep, micro-batches or quant); a transformers model takes them"
        )
    module = meta_copy(model)
    if cast:
        module = module.to(compute_dtype(workload))
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)

    def on_meta(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        kind = dtype if cast and dtype is not None and x.is_floating_point() else x.dtype
        return torch.empty_like(x, device="meta", dtype=kind)

    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    try:
        with op_budget(max_ops=workload.max_ops), quiet_trace(), current_progress().ending():
            trace = trace_module_step(module, [on_meta(x) for x in args], workload, loss_fn)
    except (WorkloadError, OpBudgetExceeded):
        raise
    except Exception as error:  # noqa: BLE001 - the module's own code failed on meta
        raise ModelTraceError(
            f"{label} could not be traced for {workload.regime}: {first_line(error)}"
        ) from error
    trace.facts.model = label
    if workload.trains:
        loss = "loss_fn(output)" if loss_fn is not None else "the output (summed unless a scalar)"
        trace.facts.build_note = (
            f"{label} is a plain nn.Module, trained on the inputs given: forward, loss = "
            f"{loss}, backward and the {workload.optimizer} step, {workload.precision} precision"
        )
    else:
        trace.facts.build_note = f"{label} is a plain nn.Module: its forward on the inputs given"
    return Trace.of(trace)


@paused_gc()
def trace_workload(
    model: Any, workload: Workload, cast_module: bool = False
) -> Trace | PipelineTrace:
    """Build (or meta-copy) the model and trace one step of ``workload`` on it. A module
    keeps its dtype unless ``cast_module``. With ``pp`` > 1, one trace per distinct
    pipeline stage (:func:`torchroof.parallel.pipeline.trace.trace_pipeline`)."""
    if workload.pp > 1:
        return trace_pipeline(
            workload,
            resolve=lambda given: resolve_seq(model, given),
            build=lambda given: build_step_model(model, given, cast_module),
            run=run_step,
            trace_type=PipelineTrace,
        )
    workload, note = resolve_seq(model, workload)
    module, label, beyond = build_step_model(model, workload, cast_module)
    trace = copied_or_every_layer(
        workload,
        lambda: run_step(module, workload),
        lambda full: run_step(build_step_model(model, full, cast_module)[0], full),
    )
    step_facts(trace, label, note, beyond)
    return Trace.of(trace)


def config_of(model: Any) -> Any:
    """The model's transformers config (None for a module without one)."""
    if isinstance(model, torch.nn.Module):
        return getattr(model, "config", None)
    return load_config(model)


def resolve_seq(model: Any, workload: Workload, config: Any = None) -> tuple[Workload, str]:
    """``workload`` with ``seq`` given, and the line that says why when the model chose it.

    ``seq`` left out (None) is :data:`~torchroof.config.DEFAULT_SEQ` (4096), or, where that
    is longer than the model's maximum positions (GPT-2's 1024, any 2k-context config),
    the longest the model takes: ``seq`` for prefill and train, a decode's cache
    (``context`` left out follows ``seq``); the summary says so (``seq: 1024, the model's
    maximum positions ...``). An explicit ``seq`` (or ``context``) is left as given, and
    refused past the maximum as before. ``config`` is the model's, when already loaded."""
    if workload.seq is not None:
        return workload, ""
    full = replace(workload, seq=DEFAULT_SEQ)
    config = config_of(model) if config is None else config
    limit = position_limit(config) if config is not None else None
    if not limit:
        return full, ""
    step = regime(workload.regime)
    # the step's own new tokens need positions too (decode writes its token at ``context``)
    over = step.positions(full) + step.new_positions - limit[1]
    if over <= 0 or DEFAULT_SEQ - over < 1:
        return full, ""
    fitted = replace(workload, seq=DEFAULT_SEQ - over)
    if step.positions(fitted) + step.new_positions > limit[1]:  # not set by seq
        return full, ""
    # decode: the cache's context (left out, it follows seq) is what the limit bounds
    assert fitted.context is not None  # a workload with a seq has its context
    longer = replace(fitted, context=fitted.context + 1)
    name = "context" if step.positions(longer) != step.positions(fitted) else "seq"
    new = f", less {step.new_positions} for the step's new token" if step.new_positions else ""
    return fitted, (
        f"{name}: {getattr(fitted, name)}, the model's maximum positions ({limit[0]}="
        f"{limit[1]}{new}; the default {DEFAULT_SEQ} is longer)"
    )


def step_checks(model: Any, workload: Workload, config: Any = None) -> tuple[str, Any, str]:
    """(the model's label, its config or None, the positions note): the checks that refuse
    a workload before anything is built, in the words a fresh trace refuses it with.
    ``config`` is the model's, when already loaded."""
    if isinstance(model, torch.nn.Module):
        label = type(model).__name__
        config = getattr(model, "config", None)
        if config is None:
            raise WorkloadError(
                f"{label} is not a transformers model: the {workload.regime} regime drives a "
                "model's forward with input_ids, labels and a KV cache; give a plain module "
                "its inputs, torchroof.estimate(module, 'prefill' or 'train', inputs=(x,)), "
                "or trace it by hand: `with torchroof.trace() as t: model(x).sum().backward(); "
                "opt.step()` then `t.estimate(...)` (README, 'A step traced by hand')"
            )
    else:
        label = str(model) if isinstance(model, (str, Path)) else type(model).__name__
        config = load_config(model) if config is None else config
    beyond = None
    if config is not None:  # refused before anything is built
        check_layers(config, name=label)
        check_plan(config, workload, name=label)
        length = regime(workload.regime).positions(workload)
        allow = workload.allow_beyond_max_positions
        beyond = check_positions(config, length, allow, name=label) or check_new_positions(
            config, length, regime(workload.regime).new_positions, name=label
        )
    return label, config, beyond or ""


def build_step_model(
    model: Any, workload: Workload, cast_module: bool
) -> tuple[torch.nn.Module, str, str]:
    """(the model on meta, its label, the positions note) after :func:`step_checks`."""
    label, config, beyond = step_checks(model, workload)
    with current_progress().stage("building the model on the meta device"), quiet_trace():
        if isinstance(model, torch.nn.Module):
            module = meta_copy(model)
            if cast_module:
                module = module.to(compute_dtype(workload))
        else:
            module = build_model(config, compute_dtype(workload))
    return module, label, beyond


def step_facts(trace: records.Trace, label: str, note: str, beyond: str) -> None:
    """Name the traced step's model, the default it changed and the positions it allowed."""
    trace.facts.model = label
    trace.facts.defaults = note
    if beyond:
        trace.facts.positions = beyond


def run_step(module: torch.nn.Module, workload: Workload) -> records.Trace:
    """Trace one step of ``workload`` on the built ``module``, its errors in one line."""
    try:  # other libraries' notes on what torchroof does are not the user's concern
        with op_budget(max_ops=workload.max_ops), quiet_trace(), current_progress().ending():
            return run_workload(module, workload)
    except (WorkloadError, OpBudgetExceeded, ReplayFallback):
        raise
    except Exception as error:  # noqa: BLE001 - the model's own code failed on meta
        if isinstance(error.__cause__, ReplayFallback):
            raise error.__cause__ from None
        raise ModelTraceError(
            f"{type(module).__name__} could not be traced for {workload.regime}: "
            f"{first_line(error)} (see README, 'Architectures that do not trace')"
        ) from error

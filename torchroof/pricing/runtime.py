"""The runtime named by ``PricingOptions.runtime``: its profile, the kernel policy it sets,
the workload defaults it brings, and what it changes in timing one step
(:class:`torchroof.timing.runtime.StepRuntime`).

Without a runtime nothing changes. With one, its kernel settings (fusion, epilogue, loss,
attention) replace the defaults of those it sets but never a value given alongside it,
and a pipelined FSDP step takes its ``reshard_after_forward_with_pp`` unless
``reshard_after_forward`` is given."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchroof.config import PricingOptions, Workload
from torchroof.config.choices import REGIME_FACTS
from torchroof.config.errors import OptionError
from torchroof.hardware import HardwareSpec, spec_dtype
from torchroof.hardware.runtime import (
    RUNTIME_DIR,
    RuntimeProfile,
    RuntimeProfileError,
    UnknownRuntimeError,
    available_runtimes,
    get_runtime,
)
from torchroof.timing.roofline import launch_of, measured_attention_share
from torchroof.timing.runtime import StepRuntime, step_runtime


def runtime_profile(pricing: PricingOptions) -> RuntimeProfile | None:
    """The profile ``pricing.runtime`` names (None when it names none); an unknown name or
    a bad file is an :class:`OptionError` in one line. A file is read once per change."""
    if not pricing.runtime:
        return None
    path = Path(pricing.runtime)
    stamp = path.stat().st_mtime_ns if path.is_file() else 0
    return _profile(pricing.runtime, stamp)


@functools.lru_cache(maxsize=64)
def _profile(name: str, stamp: int) -> RuntimeProfile:
    """The profile ``name`` names; ``stamp`` (a file's modification time) keys the cache."""
    try:
        return get_runtime(name)
    except UnknownRuntimeError as error:
        raise OptionError(str(error)) from None
    except RuntimeProfileError as error:
        raise OptionError(str(error)) from None


def _absolute(runtime: str) -> str:
    """A profile given by path, made absolute (an estimate saved with it names the file it
    read, wherever it is loaded); a shipped name as it is."""
    path = Path(runtime)
    if runtime.endswith(".toml") or path.is_file():
        return str(path.resolve())
    return runtime


def with_knobs(pricing: PricingOptions | None, knobs: Mapping[str, Any]) -> PricingOptions:
    """``pricing`` (or the defaults) with the pricing ``knobs`` given; where ``knobs`` names
    a runtime, its kernel settings fill the kernel fields ``knobs`` does not give."""
    if knobs.get("runtime"):
        knobs = {**knobs, "runtime": _absolute(str(knobs["runtime"]))}
    options = replace(pricing or PricingOptions(), **knobs)
    if not knobs.get("runtime"):
        return options
    profile = runtime_profile(options)
    assert profile is not None
    policy = {k: v for k, v in profile.kernel_policy().items() if k not in knobs}
    return replace(options, **policy)


def runtime_options(runtime: str, **knobs: Any) -> PricingOptions:
    """The pricing options of ``runtime`` (a shipped profile's name or a TOML path): its
    kernel settings, then ``knobs`` (any :class:`PricingOptions` field) over them."""
    return with_knobs(None, {**knobs, "runtime": runtime})


def workload_defaults(
    pricing: PricingOptions,
    knobs: Mapping[str, Any],
    workload: Workload | None = None,
    regime: str | None = None,
) -> dict[str, Any]:
    """The workload ``knobs`` with the runtime's defaults for those not given: FSDP's
    ``reshard_after_forward`` in a pipelined step (torchtitan keeps the gathered parameters
    for backward under pipeline parallelism), the ZeRO stage of a training step over
    dp replicas without FSDP (Megatron's distributed optimizer: ZeRO-1), and one gradient
    reduction after the last of several micro-batches over data ranks that keep whole
    gradients (Megatron's DDP and distributed optimizer, not Megatron-FSDP; a pipelined
    step is traced one micro-batch a stage). ``regime`` is the step's when not
    among the knobs."""
    profile = runtime_profile(pricing)
    out = dict(knobs)
    if profile is None:
        return out

    def given(name: str, default: Any) -> Any:
        return knobs.get(name, getattr(workload, name) if workload is not None else default)

    keep = profile.setting("reshard_after_forward_with_pp")
    if "reshard_after_forward" not in knobs and given("pp", 1) > 1 and isinstance(keep, bool):
        out["reshard_after_forward"] = keep
    zero = profile.figure("zero_with_dp")
    step = regime or given("regime", "prefill")
    facts = REGIME_FACTS.get(step)
    replicas = given("dp", 1) > 1 and given("fsdp", 1) == 1
    if zero is not None and "zero" not in knobs and facts and facts.trains and replicas:
        out["zero"] = int(zero)
    # Megatron-FSDP reduces its sharded gradients after every micro-batch whatever no_sync
    # says, as DeepSpeed's ZeRO-2 and ZeRO-3 do: only data ranks that keep whole gradients
    # (DDP, ZeRO-1 / the distributed optimizer) wait
    defer = profile.setting("defer_gradient_sync")
    whole_stage = out.get("zero", given("zero", 0)) in (0, 1)
    whole = whole_stage and given("fsdp", 1) == 1 and given("dp", 1) * given("cp", 1) > 1
    several = given("microbatches", 1) > 1 and given("pp", 1) == 1
    if defer is True and "defer_gradient_sync" not in knobs and facts and facts.trains:
        if whole and several:
            out["defer_gradient_sync"] = True
    return out


def check_runtime(pricing: PricingOptions, workload: Workload | None) -> None:
    """Refuse a step its runtime does not run (a serving engine's training step)."""
    if workload is not None:
        check_runtime_regime(pricing, workload.regime)


def check_runtime_regime(pricing: PricingOptions, regime: str) -> None:
    """Refuse a step of ``regime`` its runtime does not run, before anything is traced."""
    profile = runtime_profile(pricing)
    facts = REGIME_FACTS.get(regime)
    trains = facts is not None and facts.trains
    if profile is None or facts is None or profile.runs_steps(trains):
        return
    fitting = [p.name for p in available_runtimes() if p.runs_steps(trains)]
    step = "training" if trains else f"{regime} (serving)"
    raise OptionError(
        f"runtime {profile.name} runs {profile.runs} steps, not {step} steps; "
        f"choose one of {', '.join(fitting)}"
    )


def timing_of(pricing: PricingOptions, workload: Workload | None) -> StepRuntime:
    """What the runtime changes in timing a step of ``workload`` (nothing without one)."""
    if workload is None:
        return runtime_at(pricing, "prefill", 1)
    return runtime_at(pricing, workload.regime, workload.batch)


def runtime_at(pricing: PricingOptions, regime: str, batch: int) -> StepRuntime:
    """What the runtime changes in timing a step of ``regime`` at ``batch`` sequences a rank
    (:func:`timing_of` without building the step's workload)."""
    profile = runtime_profile(pricing)
    return step_runtime(profile, regime, batch, pricing.realistic, graphs_on=pricing.cuda_graphs)


def fp16_accumulated(step: StepRuntime, tensor_flops: Mapping[str, int]) -> bool:
    """Whether the step's fp16 matmuls accumulate in fp16 (its runtime says so and it has
    some), whatever the part: one that lists a faster rate for it (a GeForce card) times
    them at that rate, any other at its fp16 peak."""
    return step.fp16_accumulate and any(spec_dtype(dtype) == "fp16" for dtype in tensor_flops)


def runtime_lines(
    pricing: PricingOptions,
    step: StepRuntime,
    communicates: bool,
    spec: HardwareSpec | None = None,
    in_graph: int = 0,
    fp16_accumulate: bool = False,
    workload: Workload | None = None,
) -> list[str]:
    """The estimate's statement of the runtime it assumes (``step``: what it changed in
    timing this step on ``spec``; ``communicates``: the step has collectives, ``in_graph``
    of them timed by NCCL's in-graph model; ``fp16_accumulate``: its fp16 matmuls
    accumulate in fp16; a ``workload`` that does not train states no backward), one line
    each."""
    trains = workload is None or workload.trains
    profile = runtime_profile(pricing)
    realistic = pricing.realistic
    if profile is None:
        launch = (
            "the accelerator file's launch per kernel"
            if realistic
            else "launches not priced (the pure roofline)"
        )
        nccl = ", NCCL collectives" if communicates else ""
        return [
            "runtime: none named (--runtime): the kernel policy given "
            f"({pricing.fusion}, {pricing.attention} attention, {pricing.loss} loss){nccl}, "
            f"{launch}"
        ]
    where = f" ({profile.path})" if not profile.path.startswith(str(RUNTIME_DIR)) else ""
    attention = profile.setting("attention_kernel") if pricing.attention == "flash" else "math"
    parts = [
        f"runtime: {profile.display_name}{where}: {pricing.fusion} kernels",
        f"{attention} attention",
        f"{pricing.loss} loss",
    ]
    rate = spec.fp16_accumulate_tensor_flops_per_s if spec is not None else None
    if fp16_accumulate and rate is not None:  # elsewhere the rate is the fp16 peak: nothing new
        parts.append(f"fp16 matmuls accumulating in fp16 ({rate.value / 1e12:.1f} TFLOP/s)")
    if realistic:
        how = "from a CUDA graph" if step.graph_replayed else "eagerly"
        launch_s = launch_of(step, spec) if spec is not None else step.launch_s
        # an eager launch measured on the device replaces the runtime's: said so
        measured_on = (
            f" (measured on {spec.display_name})" if spec and launch_s != step.launch_s else ""
        )
        parts.append(f"{(launch_s or 0) * 1e6:.1f} us per kernel launched {how}{measured_on}")
        if step.host_overhead_s:
            parts.append(f"{step.host_overhead_s * 1e3:.2f} ms of host time per step")
        if step.gemm_efficiency != 1.0:
            parts.append(f"GEMMs at {step.gemm_efficiency:.0%} of peak")
        shares = [
            measured_attention_share(spec, pricing, step, backward) if spec is not None else None
            for backward in ((False, True) if trains else (False,))
        ]
        if any(share is not None for share in shares):
            measured = ", ".join(
                f"{share:.0%} {way}"
                for share, way in zip(shares, ("forward", "backward"), strict=False)
                if share is not None
            )
            parts.append(f"{attention} attention at its measured {measured} of the tensor peak")
    if step.all_reduce is not None and communicates:
        parts.append(
            f"its own all-reduce up to {step.all_reduce.max_bytes / 2**20:g} MiB in a node "
            f"({step.all_reduce.latency_s * 1e6:g} us)"
        )
    if in_graph:
        plural = "s" if in_graph > 1 else ""
        parts.append(
            f"{in_graph} NCCL collective{plural} in a node timed by NCCL's own model inside "
            "the CUDA graph (no host launch)"
        )
    return [", ".join(parts)]


def reference_peak(
    tensor_flops: dict[str, int], spec: HardwareSpec, pricing: PricingOptions, runtime: StepRuntime
) -> tuple[str, float]:
    """(the dtype MFU is measured in, its peak as the step's kernels are timed against it):
    the tensor-unit dtype with the most FLOPs, else the fp32 vector peak."""
    if not tensor_flops:
        return "fp32", spec.vector_peak("fp32")
    dtype = max(tensor_flops, key=tensor_flops.__getitem__)
    peak = spec.tensor_peak(
        dtype, allow_tf32=pricing.allow_tf32, fp16_accumulate=runtime.fp16_accumulate
    )
    return spec_dtype(dtype), peak

"""A saved estimate checked before it is rebuilt: every field where the dataclasses expect
it, every kernel's numbers finite and not negative, and its totals against its kernels (an
edited step time or total is refused, not reported). One :class:`EstimateFileError`
lists every problem found, in one line."""

from __future__ import annotations

import math
from dataclasses import MISSING, fields
from typing import Any, TypeGuard

from torchroof.report.memory import MemoryFootprint

PROBLEMS_LISTED = 5
_REL = 1e-6  # how far a saved total may be from its kernels' (JSON floats round-trip)
_TIMES = ("compute_s", "memory_s", "time_s", "network_s", "exposed_s", "latency_s", "overhead_s")


class EstimateFileError(ValueError):
    """A saved estimate that is not one torchroof wrote, or was edited since."""

    def __init__(self, problems: list[str], where: str = "estimate") -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            message = f"{where}: {problems[0]}"
        else:
            listed = problems[:PROBLEMS_LISTED]
            rest = len(problems) - len(listed)
            message = f"{where}: {len(problems)} problems: " + "; ".join(listed)
            message += f"; and {rest} more" if rest else ""
        super().__init__(message)


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record_problems(name: str, data: Any, cls: type) -> list[str]:
    """``data`` against the fields of dataclass ``cls``: an object, no unknown field, every
    required one present, numbers finite and not negative where the field is a number."""
    if not isinstance(data, dict):
        return [f"{name} is {type(data).__name__}, not an object"]
    known = {f.name: f for f in fields(cls)}
    problems = [f"{name} has an unknown field {key!r}" for key in data if key not in known]
    for f in known.values():
        required = f.default is MISSING and f.default_factory is MISSING
        if f.name not in data:
            if required:
                problems.append(f"{name} is missing {f.name!r}")
            continue
        value, kind = data[f.name], str(f.type)
        if kind in ("int", "float"):
            if not _number(value) or (kind == "int" and not isinstance(value, int)):
                problems.append(f"{name}.{f.name} is {value!r}, not a number")
            elif math.isnan(value) or (value < 0 and f.name != "first_op"):
                problems.append(f"{name}.{f.name} is {value!r}, not a number >= 0")
            elif math.isinf(value) and (kind == "int" or f.name in _TIMES):
                problems.append(f"{name}.{f.name} is {value!r}, not finite")
    return problems


def estimate_problems(data: Any, kernel_class: type) -> list[str]:
    """Every problem of a would-be saved estimate (already past its format marker);
    ``kernel_class`` is the dataclass a kernel row is read into (report.KernelEstimate,
    passed in so this module does not import the report it checks)."""
    problems: list[str] = []
    kernels = data.get("kernels")
    if "kernels" not in data:
        return ['missing "kernels"']
    if not isinstance(kernels, list):
        return [f'"kernels" is {type(kernels).__name__}, not a list']
    for n, kernel in enumerate(kernels):
        problems += _record_problems(f"kernels[{n}]", kernel, kernel_class)
        if len(problems) > 20:
            return problems
    for key in (
        "hardware",
        "hardware_display",
        "hbm_bytes_per_s",
        "reference_peak_flops_per_s",
        "reference_dtype",
        "op_count",
        "uncounted",
        "assumptions",
        "options",
        "metadata",
    ):
        if key not in data:
            problems.append(f"missing {key!r}")
    memory = data.get("memory")
    if memory:
        problems += _record_problems('"memory"', memory, MemoryFootprint)
    if problems:
        return problems
    summed = sum(k["time_s"] for k in kernels)
    step = data.get("step_time_s")
    pipeline = data.get("pipeline")
    if isinstance(pipeline, dict):  # a pipelined step: its schedule's time, not its kernels'
        scheduled = pipeline.get("step_time_s")
        if _number(scheduled) and not (
            _number(step) and math.isclose(step, scheduled, rel_tol=_REL, abs_tol=1e-12)
        ):
            problems.append(
                f'"step_time_s" is {step!r}, but its pipeline schedule ends at {scheduled!r} s'
            )
    elif step is not None:
        ends = [k["start_s"] + k["time_s"] for k in kernels if _number(k.get("start_s"))]
        last = max(ends) if ends else summed
        if not _number(step) or not math.isclose(step, last, rel_tol=_REL, abs_tol=1e-12):
            problems.append(
                f'"step_time_s" is {step!r}, but its kernels end at {last!r} s (edited?)'
            )
    totals = data.get("totals")
    host = data.get("host_overhead_s", 0.0)
    if not _number(host) or host < 0:
        problems.append(f'"host_overhead_s" is {host!r}: a number of seconds >= 0')
        host = 0.0
    offload = data.get("offload_exposed_s", 0.0)
    if not _number(offload) or offload < 0:
        problems.append(f'"offload_exposed_s" is {offload!r}: a number of seconds >= 0')
        offload = 0.0
    correction = data.get("correction", 1.0)
    if not _number(correction) or not math.isfinite(correction) or correction <= 0:
        problems.append(f'"correction" is {correction!r}: a factor > 0')
    if isinstance(totals, dict):
        time_s = (step if step is not None else summed) + host + offload
        if _number(totals.get("time_s")) and not math.isclose(
            totals["time_s"], time_s, rel_tol=_REL, abs_tol=1e-12
        ):
            problems.append(
                f'"totals"."time_s" is {totals["time_s"]!r}, but its kernels give {time_s!r} s'
            )
        flops = sum(k["flops"] for k in kernels)
        if _number(totals.get("flops")) and totals["flops"] != flops:
            problems.append(
                f'"totals"."flops" is {totals["flops"]!r}, but its kernels sum to {flops!r}'
            )
    return problems

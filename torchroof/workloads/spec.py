"""What a regime is: one step a workload can trace, and everything the rest of torchroof
asks of it. Each regime is one module of this package exposing ``REGIME`` (see
:mod:`torchroof.workloads.registry`); nothing outside those modules tests a regime's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchroof.records.trace import Trace

if TYPE_CHECKING:
    from torchroof.config import Workload

TARGET = "target"  # the model every regime runs; a regime may name others (a draft model)


def no_lines(*_: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class Regime:
    """One step a workload can trace.

    ``trace`` runs the step on meta models keyed by role (``models[TARGET]``, and any other
    role in ``roles``: a speculative-decoding step holds a draft and a target) and returns
    its trace. ``tokens``: tokens the step processes; ``positions``: the sequence length
    checked against the model's maximum positions; ``compute_dtype``: the dtype the model
    is built in; ``label``: the one-line description the CLI prints; ``summary`` (of an
    Estimate: lines after its throughput), ``memory_summary`` (after its memory line) and
    ``sweep_summary`` (of a sweep over one knob): what the regime adds to the report;
    ``new_positions``: positions the step's own new tokens take past ``positions`` (decode:
    its one token, at index ``context``); ``knobs``: the workload knobs that only some
    steps read (``cache``, ``mla``) and this one does;
    ``real_step``: the same step on a real device, for ``torchroof validate``; ``trains``:
    the model runs in train mode; ``batching``: the step's batch is the serving batch, so B*
    and the KV crossover (docs/concepts/attention-kv.md) describe it.
    """

    name: str
    help: str
    trace: Callable[[Mapping[str, torch.nn.Module], Workload], Trace]
    tokens: Callable[[Workload], int]
    positions: Callable[[Workload], int]
    compute_dtype: Callable[[Workload], torch.dtype]
    label: Callable[[str, Workload], str]
    real_step: Callable[[torch.nn.Module, Workload, str, int], Callable[[], None]]
    roles: tuple[str, ...] = (TARGET,)
    trains: bool = False  # the model runs in train mode (dropout on, gradients kept)
    summary: Callable[[Any], list[str]] = no_lines
    memory_summary: Callable[[Any], list[str]] = no_lines
    sweep_summary: Callable[[Any, str, Workload], list[str]] = no_lines
    batching: bool = False
    new_positions: int = 0
    knobs: tuple[str, ...] = ()

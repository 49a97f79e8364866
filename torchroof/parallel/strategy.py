"""What a parallel strategy is: a name, a check of the workload, and how it shards a model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torchroof.config import Workload


def accepts_any(_workload: Workload) -> None:
    """A strategy with nothing to refuse before the model is built."""


def nothing_to_wrap(
    _model: nn.Module, _mesh: DeviceMesh, _workload: Workload
) -> AbstractContextManager[Any]:
    """What a strategy that does not apply to this step returns: no context for the step."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Strategy:
    """One kind of parallelism, as torchtitan applies it: one small step over the model.

    ``validate(workload)`` refuses (a one-line WorkloadError), before any model is built, a
    workload this strategy cannot run. ``apply(model, mesh, workload)`` makes the model
    (built on meta) rank 0 of the strategy on ``mesh`` (every dimension of
    :data:`torchroof.config.parallel_plan.MESH_DIMS`, from
    :func:`torchroof.parallel.mesh.build_mesh`), inside the fake process group, and returns
    the context the step then runs in (a null context for most; FSDP's fake parameters,
    context parallel's ring attention); a strategy the workload does not use leaves the
    model alone. A ValueError it raises is the step's refusal. The strategies run in the
    order of :data:`torchroof.parallel.program.STRATEGIES`.
    """

    name: str
    validate: Callable[[Workload], None] = accepts_any
    apply: Callable[[nn.Module, DeviceMesh, Workload], AbstractContextManager[Any]] = (
        nothing_to_wrap
    )

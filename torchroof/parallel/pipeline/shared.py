"""Stage traces shared between the pipelined steps traced inside one :func:`shared_stages`
block, and the kernel plans made from them.

Each stage of a pipelined step is traced as a program of its own: one micro-batch of its
layers on its own ranks (tp, cp, fsdp, dp), with the pipeline size, the schedule, the
stages each rank holds and the micro-batch count left out
(:func:`torchroof.parallel.pipeline.trace.stage_workload`). So two steps that differ only
in those run the same stage programs wherever their stages hold the same layers, as the
stages of one step already share a trace (``traced_as``): 1F1B and interleaved 1F1B over
the same ranks, and their copies with 2 and 3 layers a stage
(:mod:`torchroof.planning.shallow`), whatever the depth of the model the stage was cut
from. Inside the block a stage whose program was traced before is not traced again, and
its kernels are planned once (:class:`~torchroof.pricing.price.TracePlans`). A stage over
data-parallel replicas that shard nothing over them (DDP, HSDP) runs the program it runs
over any other number of them but for its all-reduces' groups: pipelines of several sizes
over replicas of the same shards (FSDP 2 x DP 16 at PP 2, FSDP 2 x DP 8 at PP 4) share
it, carried to each one's replicas (:func:`~torchroof.parallel.replicas.regrouped`) with
its kernel plans.

The key is everything the stage program is made of: the model's config with its depth left
out (its layer count, and each per-layer list whose entries are all alike), the model's
parameters outside its decoder layers, the stage's workload, whether its backward is split
(zero-bubble schedules), its ends and its layers' signatures
(:func:`torchroof.parallel.stages.stage_key`). A trace handed out again keeps
the stage facts of the stage that traced it, as ``traced_as`` does: pricing reads only
their op marks and the activation's bytes, the same for both.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from torch import nn

from torchroof.config import Workload
from torchroof.parallel.replicas import regrouped, replica_free, replicated
from torchroof.parallel.stages import StageSplit, pipeline_layout, stage_key
from torchroof.pricing.price import KernelPlan, TracePlans
from torchroof.records.trace import Trace


class StageKey(NamedTuple):
    """What a stage program is made of (:func:`share_key`)."""

    model: tuple[Any, ...]
    workload: Workload
    split_backward: bool
    stage: tuple[Any, ...]


@dataclass
class SharedStages:
    """The stage traces of one block, by key, the kernel plans made of them, and how many
    stages were traced and how many handed out again (``carried`` of them carried to
    another number of replicas)."""

    traces: dict[StageKey, Trace] = field(default_factory=dict)
    plans: TracePlans = field(default_factory=TracePlans)
    traced: int = 0
    reused: int = 0
    carried: int = 0
    # the first trace of each program over any number of replicas (replica_free)
    replicas: dict[StageKey, Trace] = field(default_factory=dict)

    def find(self, key: StageKey) -> Trace | None:
        """The trace of the stage program ``key``: one traced before in the block, or one of
        the same program over other replicas carried to its own
        (:func:`~torchroof.parallel.replicas.regrouped`); None where neither is held."""
        found = self.traces.get(key)
        if found is not None:
            return found
        source = self.replicas.get(key._replace(workload=replica_free(key.workload)))
        carried = None if source is None else regrouped(source, key.workload)
        if source is not None and carried is not None:
            self.traces[key] = carried
            self.carried += 1
            held = self.plans.of(carried)
            for policy, plan in self.plans.of(source).items():
                held.setdefault(policy, _regrouped_plan(plan, source, carried))
        return carried

    def keep(self, key: StageKey, trace: Trace) -> None:
        """Hold ``trace`` as the stage program ``key`` (and as that program over any number
        of replicas, where it has none yet)."""
        self.traces.setdefault(key, trace)
        if replicated(key.workload):
            self.replicas.setdefault(key._replace(workload=replica_free(key.workload)), trace)


_SHARED: contextvars.ContextVar[SharedStages | None] = contextvars.ContextVar(
    "torchroof_shared_stages", default=None
)


@contextlib.contextmanager
def shared_stages() -> Iterator[SharedStages]:
    """Inside, pipelined steps share the traces of stages that run the same program (see
    the module); they are dropped on leaving."""
    shared = SharedStages()
    token = _SHARED.set(shared)
    try:
        yield shared
    finally:
        _SHARED.reset(token)


def _regrouped_plan(plan: KernelPlan, source: Trace, carried: Trace) -> KernelPlan:
    """``source``'s kernel plan as ``carried``'s, ``carried`` being ``source`` over other
    replicas (:func:`~torchroof.parallel.replicas.regrouped`): each kernel holding one of
    the collectives whose group changed holds its new record instead. A collective's W
    and Q are its buffers' (:func:`torchroof.counters.collectives.collective_cost`), the
    same over any group; pricing times it from the group it records."""
    changed = {
        id(old): new for old, new in zip(source.ops, carried.ops, strict=True) if old is not new
    }
    kernels = [
        replace(kernel, ops=tuple(changed.get(id(op), op) for op in kernel.ops))
        if any(id(op) in changed for op in kernel.ops)
        else kernel
        for kernel in plan.kernels
    ]
    return replace(plan, kernels=kernels)


def current_shared() -> SharedStages | None:
    """The innermost :func:`shared_stages` block's traces, or None outside one."""
    return _SHARED.get()


def model_key(model: nn.Module) -> tuple[Any, ...]:
    """What a model's stages are made of beside their layers: its config without its depth
    (:func:`depthless_config`) and every parameter outside its decoder layers (names,
    shapes, dtypes: the embeddings, the final norm and head, and anything sized by the
    depth, which then keeps two depths apart)."""
    layers = {id(p) for p in pipeline_layout(model).layers.parameters()}
    ends = tuple(
        (name, tuple(p.shape), str(p.dtype))
        for name, p in model.named_parameters()
        if id(p) not in layers
    )
    return depthless_config(getattr(model, "config", None)), ends


def share_key(
    model: tuple[Any, ...],
    workload: Workload,
    split: StageSplit,
    split_backward: bool,
    reference: nn.Module,
) -> StageKey:
    """What stage ``split`` of ``reference`` (whose :func:`model_key` is ``model``) traced
    under ``workload`` (one stage, one micro-batch) is made of: equal keys, the same
    program."""
    return StageKey(model, workload, split_backward, stage_key(reference, split))


def depthless_config(config: Any) -> str:
    """``config`` as JSON without its depth: at every level (a multimodal model's text
    config) the layer count dropped (``num_hidden_layers``, or the name the config maps it
    to: GPT-2's ``n_layer``) and each list of that length whose entries are all alike (one
    per layer: ``layer_types``) kept as one entry, as
    :func:`torchroof.planning.shallow.shallow_config` cuts them; a config that is no
    transformers config, by its repr."""
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return repr(config)
    names = {"num_hidden_layers"}
    for each in (config, getattr(config, "get_text_config", lambda: config)()):
        names.add(getattr(each, "attribute_map", {}).get("num_hidden_layers", ""))
    return json.dumps(_without_depth(to_dict(), names), sort_keys=True, default=repr)


def _without_depth(value: Any, names: set[str]) -> Any:
    if isinstance(value, dict):
        layers = next((value[n] for n in names if n in value), None)
        return {k: _per_layer(v, layers, names) for k, v in value.items() if k not in names}
    if isinstance(value, (list, tuple)):
        return [_without_depth(v, names) for v in value]
    return value


def _per_layer(value: Any, layers: Any, names: set[str]) -> Any:
    """A list of one alike entry a layer as that entry, once; anything else as it is."""
    if (
        isinstance(value, (list, tuple))
        and isinstance(layers, int)
        and len(value) == layers
        and all(v == value[0] for v in value)
    ):
        return ["each layer", _without_depth(value[0], names)]
    return _without_depth(value, names)

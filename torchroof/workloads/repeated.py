"""Which layers of a model are its repeated blocks, for :mod:`torchroof.capture.replay`:
the decoder-layer list transformers' pipeline plan names (``model.layers``), in every model
a step runs (a draft's and a target's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from torchroof.capture.replay import LayerReplay
from torchroof.capture.replay_training import ReplayFallback, TrainingReplay
from torchroof.config.errors import WorkloadError
from torchroof.parallel.stages import decoder_layers, owned_layers, stage_of
from torchroof.records.trace import Trace
from torchroof.workloads.microbatches import alike_microbatches, layers_run_whole

if TYPE_CHECKING:
    from torchroof.config import Workload


class Replays:
    """The layer replays of one step, and the line that says what they did."""

    def __init__(self, replays: list[tuple[LayerReplay, int]]) -> None:
        self._replays = replays

    def describe(self, trace: Trace) -> str:
        """``80 repeated layers, 1 distinct kind: 1 traced, 79 copied`` for the capture
        that recorded ``trace``, with why a kind ran every time ("" when every layer ran
        and none was asked to be copied)."""
        lines = []
        for replay, layers in self._replays:
            counts = replay.counts_for(trace)
            if counts is not None and (counts.replayed or counts.not_replayed):
                lines.append(counts.describe(layers))
        return "; ".join(lines)


def copied_or_every_layer(
    workload: Workload,
    traced: Callable[[], Trace],
    every_layer: Callable[[Workload], Trace],
) -> Trace:
    """``traced()``, the step of ``workload`` with its repeated layers copied; where a
    copied layer's backward turns out not to be copyable (:class:`ReplayFallback`),
    ``every_layer`` of the same workload with ``full_trace``, its facts keeping
    ``workload`` and saying why."""
    try:
        return traced()
    except ReplayFallback as why:
        with layers_run_whole():  # its micro-batches are still copied
            trace = every_layer(replace(workload, full_trace=True))
        trace.facts.workload = workload
        trace.facts.repeated_layers = f"every layer run: {why}"
        return trace


def trains_copied(workload: Workload) -> bool:
    """Whether a training step copies its repeated layers: with one micro-batch, or with
    several that each run the same program
    (:func:`~torchroof.workloads.microbatches.alike_microbatches`: otherwise a second
    accumulates into the gradients the first left, or ZeRO-1/2 keeps the parameters
    gathered until the last), on any plan; each layer call is then
    checked (:mod:`torchroof.capture.replay_training`): sequence parallel's DTensor
    activations and expert parallel's hooks inside the layer run every layer."""
    return workload.trains and (workload.microbatches == 1 or alike_microbatches(workload))


def repeated_layers(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The model's stacks of repeated blocks: the decoder-layer list its pipeline plan
    names, else every outermost ``nn.ModuleList`` in which two blocks share a class (an
    encoder's and a decoder's layers; GPT-2's ``h``)."""
    try:
        _, _, layers = decoder_layers(model)
        return [list(layers)]
    except WorkloadError:
        pass
    stacks: list[list[torch.nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in inside):
            continue  # a list inside a block (experts): the block's replay covers it
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            kinds = [type(m) for m in module]
            if len(set(kinds)) < len(kinds):
                stacks.append(list(module))
                inside.append(name)
    return stacks


@contextlib.contextmanager
def replayed(models: Mapping[str, torch.nn.Module], workload: Workload) -> Iterator[Replays]:
    """Every model's repeated layers traced once per distinct kind while the step runs
    (nothing with ``full_trace``)."""
    replays: list[tuple[LayerReplay, int]] = []
    with contextlib.ExitStack() as stack:
        if not workload.full_trace:
            for model in models.values():
                # a pipeline stage copies the layers it owns (the others are identities,
                # which run as they are), unless its schedule splits the backward
                state = stage_of(model)
                split = state is not None and state.split_backward
                owned = owned_layers(model)
                for layers in repeated_layers(model):
                    copies = trains_copied(workload) and not split
                    training = TrainingReplay(layers) if copies else None
                    replay = stack.enter_context(LayerReplay(layers, training, owned))
                    replays.append((replay, len(layers if owned is None else owned)))
        yield Replays(replays)

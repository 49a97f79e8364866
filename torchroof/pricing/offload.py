"""Activation offload: a training step's decoder layers sending what their forward saved to
host memory, and reading it back before their backward.

Megatron-Core's ``cpu_offloading`` with ``cpu_offloading_num_layers = N`` (Transformer
Engine's ``get_cpu_offload_context``) copies the activations each of the first N decoder
layers keeps for its backward to pinned host memory once the layer's forward is done, on a
stream of its own, and copies them back ahead of the layer's backward. The device holds
them no longer; each copy crosses the GPU's host link (PCIe, or NVLink-C2C on a Grace
superchip) and overlaps the neighbouring layer's compute. Priced here:

- memory: the activations' peak falls by the offloaded layers' saved bytes, less one
  layer's (a layer's copy is in flight while the next computes);
- time: each layer's copy takes its bytes over the link's line rate each way; what a copy
  takes beyond its layer's forward (out) or backward (back) compute is exposed, a layer at a
  time, as Transformer Engine overlaps one layer's copy with one layer's compute.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torchroof.config.errors import OptionError
from torchroof.records.trace import Trace
from torchroof.records.units import gib
from torchroof.report.estimate import KernelEstimate
from torchroof.report.memory import Residency, forward_end, saved_bytes_by_producer

NOT_PIPELINED = (
    "offload_activations is not priced for pipelined steps yet: each stage's layers would "
    "need their own count"
)
NOT_SERVING = (
    "offload_activations moves what a forward saves for its backward: it applies to a training step"
)
_INDEXED = re.compile(r"^(?P<list>.*?)\.(?P<index>\d+)(?:\.|$)")


@dataclass(frozen=True)
class Offload:
    """What offloading ``layers`` decoder layers' activations moves and costs."""

    layers: int  # decoder layers offloaded, counted from the first
    of_layers: int  # decoder layers in the step
    bytes: int  # activations moved each way, per micro-batch
    held_bytes: int  # one offloaded layer's, on the device while its copy is in flight
    link: str  # the host link's name
    link_bytes_per_s: float  # its line rate, per direction
    copy_s: float  # the copies' time each way, every micro-batch's
    exposed_s: float  # what the copies add to the step
    microbatches: int = 1

    def line(self) -> str:
        each = f" per micro-batch ({self.microbatches})" if self.microbatches > 1 else ""
        return (
            f"activation offload: the first {self.layers} of {self.of_layers} decoder layers "
            f"send {gib(self.bytes)} of saved activations{each} to host memory after their "
            f"forward and read them back before their backward over {self.link} at "
            f"{self.link_bytes_per_s / 1e9:.0f} GB/s each way ({self.copy_s * 1e3:.1f} ms "
            f"each way, {self.exposed_s * 1e3:.1f} ms not hidden behind the layers' compute)"
        )


def decoder_layer_list(modules: Iterable[str]) -> str | None:
    """The module path of the step's decoder-layer list: the ``<path>.<index>`` prefix with
    the most distinct indices among the ops' modules (``model.layers`` in a Llama)."""
    indices: dict[str, set[int]] = {}
    for module in modules:
        found = _INDEXED.match(module)  # the outermost indexed list: not a layer's experts
        if found:
            indices.setdefault(found["list"], set()).add(int(found["index"]))
    if not indices:
        return None
    most = max(len(found) for found in indices.values())
    lists = [path for path, found in indices.items() if len(found) == most]
    if len(lists) > 1:  # an encoder's and a decoder's layers: which to offload is not said
        raise OptionError(
            f"offload_activations: the step has {len(lists)} lists of {most} layers "
            f"({', '.join(sorted(lists))}), not one list of decoder layers"
        )
    return lists[0]


def layer_of(module: str, layer_list: str) -> int | None:
    """The index of the decoder layer ``module`` sits in (None: outside the layers)."""
    prefix = layer_list + "."
    if not module.startswith(prefix):
        return None
    head = module[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def offload_activations(
    trace: Trace,
    roles: Mapping[int, str],
    residency: Residency | None,
    kernels: Sequence[KernelEstimate],
    layers: int,
    link: tuple[str, float],
) -> Offload:
    """:class:`Offload` of the first ``layers`` decoder layers of a training ``trace``, whose
    priced ``kernels`` give each layer's forward and backward time; ``link`` is the host
    link's (name, bytes per second each way). An OptionError when the step cannot offload."""
    if trace.facts.pipeline is not None:  # a stage's trace: its workload has pp 1
        raise OptionError(NOT_PIPELINED)
    end = forward_end(trace)
    if end is None:
        raise OptionError(NOT_SERVING)
    layer_list = decoder_layer_list(op.module for op in trace.ops)
    if layer_list is None:
        raise OptionError("offload_activations: this model has no list of decoder layers")
    by_op = saved_bytes_by_producer(trace, end, roles, residency)
    per_layer: Counter[int] = Counter()
    count = 0
    for op in trace.ops:
        layer = layer_of(op.module, layer_list)
        if layer is not None:
            count = max(count, layer + 1)
            per_layer[layer] += by_op.get(op.index, 0)
    if layers >= count:
        raise OptionError(
            f"offload_activations={layers}: the step has {count} decoder layers, and the last "
            "one's backward starts at once: offload fewer"
        )
    name, rate = link
    # each micro-batch's forward saves, and offloads, as much as the first one's
    microbatches = trace.facts.workload.microbatches if trace.facts.workload else 1
    forward: defaultdict[int, float] = defaultdict(float)
    backward: defaultdict[int, float] = defaultdict(float)
    for kernel in kernels:
        layer = layer_of(kernel.module, layer_list)
        if layer is None or kernel.stream != "compute":  # collectives hide nothing
            continue
        if kernel.phase == "forward":
            forward[layer] += kernel.time_s / microbatches
        elif kernel.phase in ("backward", "recompute"):
            backward[layer] += kernel.time_s / microbatches
    moved = [per_layer[k] for k in range(layers)]
    copies = [size / rate for size in moved]
    exposed = microbatches * sum(
        max(0.0, copy - forward[k]) + max(0.0, copy - backward[k]) for k, copy in enumerate(copies)
    )
    return Offload(
        layers=layers,
        of_layers=count,
        bytes=sum(moved),
        held_bytes=max(moved, default=0),
        link=name,
        link_bytes_per_s=rate,
        copy_s=microbatches * sum(copies),
        exposed_s=exposed,
        microbatches=microbatches,
    )

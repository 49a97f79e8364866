"""Memory footprint of a traced step: weights, gradients, optimizer state, KV cache, and
the peak of live activations from tensor lifetimes in the trace; compared with capacity.
A parallel step's footprint is its traced rank's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from torchroof.counters import kind_of
from torchroof.records.tensors import storage_extent_bytes
from torchroof.records.trace import Trace
from torchroof.records.units import gib

# FSDP2's own ops (torch.distributed.fsdp._fully_shard._fsdp_collectives): the copy of a
# unit's shards into the all-gather buffer, the copy out of it into each parameter's
# unsharded storage, and the copy of the unsharded gradients into the reduce-scatter input.
ALL_GATHER_COPY_IN = "fsdp.all_gather_copy_in"
ALL_GATHER_COPY_OUT = "fsdp.split_with_sizes_copy"
REDUCE_SCATTER_COPY_IN = "fsdp.chunk_cat"
_NO_DATA_KINDS = ("view", "metadata")  # counters' kinds of ops that touch no element


def unsharded_layer_buffers(trace: Trace) -> set[int]:
    """Storages of FSDP2's unsharded layer buffers (PyTorch docs, ``fully_shard``): the
    all-gather buffers, the unsharded parameters they are copied out to, the unsharded
    gradients and the reduce-scatter inputs they are copied into. Their size follows the
    layer, not the batch."""
    found: set[int] = set()
    for op in trace.ops:
        packet = op.packet
        if packet == ALL_GATHER_COPY_IN:
            tensors = [*op.outputs, *op.tensors("all_gather_output")]
        elif packet == ALL_GATHER_COPY_OUT:
            tensors = [*op.tensors("out"), *op.tensors("all_gather_output")]
        elif packet == REDUCE_SCATTER_COPY_IN:
            tensors = [*op.tensors("out"), *op.tensors("tensors")]
        else:
            continue
        found.update(t.storage for t in tensors)
    return found


@dataclass(frozen=True)
class Residency:
    """What a step's kernels keep in device memory, where it differs from its ops one by
    one: ``unwritten``, the storages its fused kernels make but never write out (an
    intermediate inside one kernel, or a forward tensor the backward rebuilds instead of
    reading); ``late_reads``, op index -> storages a kernel ending there reads besides what
    its ops read (the sources a rebuilt tensor is made from); ``refilled``, op index ->
    storages a collective writes again just before that op after they were freed (a
    sequence-parallel input Megatron-Core all-gathers again for the backward,
    :mod:`torchroof.kernels.regather`): a new life of each starts there; and ``narrowed``,
    storage -> how many times its bytes divide from its last forward use on and in a life
    refilled in the backward (an input Transformer Engine saves in fp8,
    :mod:`torchroof.kernels.fp8_saves`). Eager kernels keep every op's output: no
    ``unwritten``."""

    unwritten: frozenset[int] = frozenset()
    late_reads: Mapping[int, frozenset[int]] = field(default_factory=dict)
    refilled: Mapping[int, frozenset[int]] = field(default_factory=dict)
    narrowed: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TransientPeak:
    """The largest sum of transient storages alive at once, and how much of it is FSDP's
    unsharded layer buffers (batch-independent) rather than activations."""

    total_bytes: int
    layer_buffers_bytes: int = 0

    @property
    def activations_bytes(self) -> int:
        return self.total_bytes - self.layer_buffers_bytes


def transient_peak(
    trace: Trace, roles: dict[int, str] | None = None, residency: Residency | None = None
) -> TransientPeak:
    """Largest sum of transient storages (activations, FSDP's unsharded layer buffers)
    alive at once.

    A storage is born at the first op that writes it and dies after the last op that
    touches it; storages with a role (weights, gradients, optimizer state, KV cache) and
    inputs that existed before the trace are not transient. FSDP2 frees a parameter's
    unsharded storage after use (``resize_(0)``, which no op records) and all-gathers into
    the same storage again later (the backward, the next micro-batch): a copy-out into a
    storage used since its birth starts a new life of it. NB: sizes are the largest extent
    any view reached, a lower bound on the allocation; allocator rounding and
    fragmentation are not modelled. ``roles`` replaces ``trace.roles`` (labels found by
    reading the trace, e.g. the gradients and optimizer state of a step traced by hand);
    ``residency`` drops what fused kernels never write (:class:`Residency`).
    """
    return first_peak(live_bytes(trace, roles, residency))


def live_bytes(
    trace: Trace, roles: dict[int, str] | None = None, residency: Residency | None = None
) -> list[TransientPeak]:
    """The transient bytes alive after each op where they change, in execution order (of
    which :func:`transient_peak` is the largest): sizes whose polynomials are evaluated
    at every point of a grid at once (:mod:`torchroof.pricing.symbolic_plan`)."""
    known: Mapping[int, str] = trace.roles if roles is None else roles
    born, dies, size, buffers = _lifetimes(trace, known, residency)
    delta: dict[int, list[int]] = {}
    for key, start in born.items():
        in_buffers = key[0] in buffers
        for index, sign in ((start, 1), (dies[key] + 1, -1)):
            change = delta.setdefault(index, [0, 0])
            change[0] += sign * size[key]
            change[1] += sign * size[key] * in_buffers
    live = [0, 0]
    out = []
    for index in sorted(delta):
        live = [live[0] + delta[index][0], live[1] + delta[index][1]]
        out.append(TransientPeak(live[0], live[1]))
    return out


def first_peak(lives: list[TransientPeak]) -> TransientPeak:
    """The first of ``lives`` holding the most bytes in all (none: zero)."""
    peak = TransientPeak(0, 0)
    for live in lives:
        if live.total_bytes > peak.total_bytes:
            peak = live
    return peak


Life = tuple[int, int]  # (storage, which life of it)


def _lifetimes(
    trace: Trace, roles: Mapping[int, str], residency: Residency | None = None
) -> tuple[dict[Life, int], dict[Life, int], dict[Life, int], set[int]]:
    """(birth op, death op, bytes) of every transient storage life, and FSDP's unsharded
    layer buffers (see :func:`transient_peak`); a storage ``residency`` says no kernel
    writes has none."""
    buffers = unsharded_layer_buffers(trace)
    # FSDP writes its buffers through ``out=`` arguments no kernel cost lists: always kept
    unwritten = residency.unwritten - buffers if residency else frozenset()
    late_reads = residency.late_reads if residency else {}
    refilled = residency.refilled if residency else {}
    narrowed = residency.narrowed if residency else {}
    last_forward: dict[Life, int] = {}  # of the narrowed storages' lives
    life: dict[int, int] = {}  # storage -> its current life (FSDP storages live several)
    size: dict[tuple[int, int], int] = {}
    born: dict[tuple[int, int], int] = {}
    dies: dict[tuple[int, int], int] = {}

    def refill(storage: int, index: int, used_since: bool) -> None:
        """A new life of ``storage`` from op ``index`` (its bytes as before), when it has
        lived, and when ``used_since`` only if it was used after its birth."""
        key = (storage, life.get(storage, 0))
        if key in born and (dies[key] > born[key] or not used_since):
            life[storage] = key[1] + 1
            new = (storage, key[1] + 1)
            born[new], dies[new], size[new] = index, index, size[key]

    for op in trace.ops:
        if op.packet == ALL_GATHER_COPY_OUT:  # used since: freed, now refilled
            for t in op.tensors("out"):
                refill(t.storage, op.index, used_since=True)
        for storage in refilled.get(op.index, ()):  # gathered again after its last use
            refill(storage, op.index, used_since=False)
        # FSDP2 re-views and queries its unsharded parameters while their storage is
        # freed: only an op that reads or writes a buffer's data keeps it alive.
        keeps_buffers = kind_of(op.packet) not in _NO_DATA_KINDS
        for t in op.outputs:
            if t.storage in roles or t.storage in unwritten:
                continue
            key = (t.storage, life.get(t.storage, 0))
            if key not in born:
                born[key] = dies[key] = op.index
            size[key] = max(size.get(key, 0), storage_extent_bytes(t))
            if keeps_buffers or t.storage not in buffers:
                dies[key] = op.index
        for t in op.inputs:
            key = (t.storage, life.get(t.storage, 0))
            if key in born:
                size[key] = max(size[key], storage_extent_bytes(t))
                if keeps_buffers or t.storage not in buffers:
                    dies[key] = op.index
        for storage in late_reads.get(op.index, ()):
            key = (storage, life.get(storage, 0))
            if key in born:
                dies[key] = max(dies[key], op.index)
        if narrowed and op.phase == "forward":
            for t in (*op.outputs, *op.inputs):
                key = (t.storage, life.get(t.storage, 0))
                if t.storage in narrowed and key in born:
                    last_forward[key] = op.index
    for key, cut in last_forward.items():
        if dies[key] > cut:  # kept for the backward: as its narrower copy from here on
            tail = narrow_copy(key)
            born[tail], dies[tail] = cut + 1, dies[key]
            size[tail] = size[key] // narrowed[key[0]]
            dies[key] = cut
    for key in born:
        if key[0] in narrowed and key[1] > 0:  # gathered again in the backward, narrow
            size[key] = size[key] // narrowed[key[0]]
    return born, dies, size, buffers


def narrow_copy(life: Life) -> Life:
    """The life of the narrower copy a storage's ``life`` is kept as for the backward (a
    negative life number: apart from the refilled lives 1, 2, ...); and back."""
    return (life[0], -1 - life[1])


def saved_bytes(
    trace: Trace,
    index: int,
    roles: Mapping[int, str] | None = None,
    residency: Residency | None = None,
) -> int:
    """Bytes of transient storages (activations) born by op ``index`` and used after it:
    what a forward ending there keeps for its backward (in a pipelined step each micro-batch a
    pipeline stage holds in flight keeps this much). FSDP's unsharded parameters kept from
    the forward to the backward (``reshard_after_forward=False``) are not among them: every
    micro-batch uses the same buffers, counted once in ``layer_buffers_bytes``."""
    return sum(saved_bytes_by_producer(trace, index, roles, residency).values())


def saved_bytes_by_producer(
    trace: Trace,
    index: int,
    roles: Mapping[int, str] | None = None,
    residency: Residency | None = None,
) -> dict[int, int]:
    """:func:`saved_bytes` split by the op that made each storage (op index -> bytes)."""
    known: Mapping[int, str] = trace.roles if roles is None else roles
    born, dies, size, buffers = _lifetimes(trace, known, residency)
    out: dict[int, int] = {}
    for key, start in born.items():
        made = born[narrow_copy(key)] if key[1] < 0 else start  # a copy: its original's maker
        if made < index <= dies[key] and key[0] not in buffers:
            out[made] = out.get(made, 0) + size[key]
    return out


def forward_end(trace: Trace) -> int | None:
    """The index of the op that ends a training step's forward (a pipeline stage's mark,
    else its first op outside the forward); None for a step with no backward."""
    if trace.facts.pipeline is not None and trace.facts.pipeline.marks.forward_end is not None:
        return trace.facts.pipeline.marks.forward_end
    if not any(op.phase == "backward" for op in trace.ops):
        return None
    return next(op.index for op in trace.ops if op.phase != "forward")


def backward_saved_bytes(
    trace: Trace, roles: dict[int, str] | None = None, residency: Residency | None = None
) -> int:
    """:func:`saved_bytes` where the forward ends (0 without a backward)."""
    end = forward_end(trace)
    return 0 if end is None else saved_bytes(trace, end, roles, residency)


@dataclass(frozen=True)
class MemoryFootprint:
    """What must sit in one device's memory for the step, against its capacity.

    For a parallel step every figure is rank 0's: its parameter,
    gradient and optimizer-state shards (the gradients held across micro-batches are the
    gradient-accumulation buffers), its KV heads, its activations (per TP shard), and
    ``layer_buffers_bytes``, FSDP's unsharded parameters and gradients in flight at the
    transient peak (``activations_peak_bytes`` is the rest of that peak)."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    kv_cache_bytes: int
    activations_peak_bytes: int
    capacity_bytes: int
    batch: int = 1
    layer_buffers_bytes: int = 0
    # what one forward keeps for its backward (a training step's; part of the activations'
    # peak, not added to it): each further micro-batch a pipeline stage holds keeps as much
    backward_saved_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.kv_cache_bytes
            + self.activations_peak_bytes
            + self.layer_buffers_bytes
        )

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def missing_bytes(self) -> int:
        """How much more memory the step needs than the device has (0 when it fits)."""
        return max(0, self.total_bytes - self.capacity_bytes)

    @property
    def max_batch(self) -> int:
        """Largest batch (per rank, per micro-batch) whose per-sequence bytes (KV cache +
        activations, which scale with batch) fit beside the batch-independent ones
        (weights, gradients, optimizer state, FSDP's unsharded layer buffers)."""
        fixed = self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes
        fixed += self.layer_buffers_bytes
        per_sequence = (self.kv_cache_bytes + self.activations_peak_bytes) / self.batch
        free = self.capacity_bytes - fixed
        if free <= 0:
            return 0
        return int(free // per_sequence) if per_sequence else 0

    @property
    def fixed_bytes(self) -> int:
        """The bytes that do not grow with the batch: weights, gradients, optimizer state and
        FSDP's unsharded layer buffers."""
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.layer_buffers_bytes
        )

    def floor_bytes(self, held: int) -> int:
        """What the fullest moment holds at least: the weights, gradients, optimizer state
        and KV cache, and ``held`` bytes of activations kept for a backward, with no
        transient beside them."""
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.kv_cache_bytes
            + held
        )

    def line(self) -> str:
        """The footprint against the capacity, in GiB as vendors quote capacities (an H100's
        80 GB are 80 GiB)."""
        parts = [f"weights {gib(self.weights_bytes)}"]
        if self.gradients_bytes:
            parts.append(f"gradients {gib(self.gradients_bytes)}")
        if self.optimizer_state_bytes:
            parts.append(f"optimizer state {gib(self.optimizer_state_bytes)}")
        if self.kv_cache_bytes:
            parts.append(f"KV cache {gib(self.kv_cache_bytes)}")
        if self.layer_buffers_bytes:
            parts.append(f"unsharded layer buffers {gib(self.layer_buffers_bytes)}")
        parts.append(f"activations (peak) {gib(self.activations_peak_bytes)}")
        verdict = "fits" if self.fits else f"does NOT fit: {gib(self.missing_bytes)} missing"
        return (
            f"memory: {gib(self.total_bytes)} of {gib(self.capacity_bytes)} "
            f"({', '.join(parts)}) -> {verdict}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def footprint(
    trace: Trace,
    capacity_bytes: float,
    batch: int = 1,
    roles: dict[int, str] | None = None,
    role_bytes: dict[str, int] | None = None,
    peak: TransientPeak | None = None,
    backward_saved: int | None = None,
) -> MemoryFootprint:
    """The step's footprint; ``roles`` and ``role_bytes`` replace the trace's own labels
    (pipeline adds what it reads from the optimizer phase of a step traced by hand);
    ``peak`` and ``backward_saved`` are :func:`transient_peak` and
    :func:`backward_saved_bytes` of the same trace and roles, when already known."""
    role = trace.role_bytes if role_bytes is None else role_bytes
    if peak is None:
        peak = transient_peak(trace, roles)
    if backward_saved is None:
        backward_saved = backward_saved_bytes(trace, roles)
    return MemoryFootprint(
        weights_bytes=role.get("weights", 0),
        gradients_bytes=role.get("gradients", 0),
        optimizer_state_bytes=role.get("optimizer_state", 0),
        kv_cache_bytes=role.get("kv_cache", 0),
        activations_peak_bytes=peak.activations_bytes,
        capacity_bytes=int(capacity_bytes),
        batch=batch,
        layer_buffers_bytes=peak.layer_buffers_bytes,
        backward_saved_bytes=backward_saved,
    )

"""Memory footprint of a traced step: weights, gradients, optimizer state, KV cache, and
the peak of live activations from tensor lifetimes in the trace; compared with capacity."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torchroof.records import TensorMeta, Trace


def storage_extent_bytes(t: TensorMeta) -> int:
    """Bytes of storage a tensor view reaches: (offset + last element + 1) · itemsize."""
    if t.numel == 0:
        return 0
    last = sum((size - 1) * step for size, step in zip(t.shape, t.stride, strict=True))
    return (t.offset + last + 1) * t.itemsize


def peak_activation_bytes(trace: Trace, roles: dict[int, str] | None = None) -> int:
    """Largest sum of activation storages alive at once.

    A storage is born at the first op that writes it and dies after the last op that
    touches it; storages with a role (weights, gradients, optimizer state, KV cache) and
    inputs that existed before the trace are not activations. NB: sizes are the largest
    extent any view reached, a lower bound on the allocation; allocator rounding and
    fragmentation are not modelled. ``roles`` replaces ``trace.roles`` (labels found by
    reading the trace, e.g. the gradients and optimizer state of a step traced by hand).
    """
    roles = trace.roles if roles is None else roles
    size: dict[int, int] = {}
    born: dict[int, int] = {}
    dies: dict[int, int] = {}
    for op in trace.ops:
        for t in op.outputs:
            if t.storage in roles:
                continue
            born.setdefault(t.storage, op.index)
            size[t.storage] = max(size.get(t.storage, 0), storage_extent_bytes(t))
            dies[t.storage] = op.index
        for t in op.inputs:
            if t.storage in born:
                dies[t.storage] = op.index
                size[t.storage] = max(size[t.storage], storage_extent_bytes(t))
    delta: dict[int, int] = {}
    for sid, start in born.items():
        delta[start] = delta.get(start, 0) + size[sid]
        delta[dies[sid] + 1] = delta.get(dies[sid] + 1, 0) - size[sid]
    live = peak = 0
    for index in sorted(delta):
        live += delta[index]
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class MemoryFootprint:
    """What must sit in device memory for the step, against the accelerator's capacity."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    kv_cache_bytes: int
    activations_peak_bytes: int
    capacity_bytes: int
    batch: int = 1

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.kv_cache_bytes
            + self.activations_peak_bytes
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
        """Largest batch whose per-sequence bytes (KV cache + activations, which scale with
        batch) fit beside the batch-independent ones (weights, gradients, optimizer)."""
        fixed = self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes
        per_sequence = (self.kv_cache_bytes + self.activations_peak_bytes) / self.batch
        free = self.capacity_bytes - fixed
        if free <= 0:
            return 0
        return int(free // per_sequence) if per_sequence else 0

    def line(self) -> str:
        gb = 1e9
        parts = [f"weights {self.weights_bytes / gb:.2f} GB"]
        if self.gradients_bytes:
            parts.append(f"gradients {self.gradients_bytes / gb:.2f} GB")
        if self.optimizer_state_bytes:
            parts.append(f"optimizer state {self.optimizer_state_bytes / gb:.2f} GB")
        if self.kv_cache_bytes:
            parts.append(f"KV cache {self.kv_cache_bytes / gb:.2f} GB")
        parts.append(f"activations (peak) {self.activations_peak_bytes / gb:.2f} GB")
        verdict = "fits" if self.fits else f"does NOT fit: {self.missing_bytes / gb:.2f} GB missing"
        return (
            f"memory: {self.total_bytes / gb:.2f} GB of {self.capacity_bytes / gb:.2f} GB "
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
) -> MemoryFootprint:
    """The step's footprint; ``roles`` and ``role_bytes`` replace the trace's own labels
    (pipeline adds what it reads from the optimizer phase of a step traced by hand)."""
    role = trace.role_bytes if role_bytes is None else role_bytes
    return MemoryFootprint(
        weights_bytes=role.get("weights", 0),
        gradients_bytes=role.get("gradients", 0),
        optimizer_state_bytes=role.get("optimizer_state", 0),
        kv_cache_bytes=role.get("kv_cache", 0),
        activations_peak_bytes=peak_activation_bytes(trace, roles),
        capacity_bytes=int(capacity_bytes),
        batch=batch,
    )

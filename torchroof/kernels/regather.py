"""Sequence parallel's gathered inputs as Megatron-Core keeps them: the rank's shard is saved
for the backward and all-gathered again there.

Under sequence parallel a column-wise linear layer reads its input all-gathered along the
sequence. torch's autograd saves what the matmul read, the gathered tensor: tensor-parallel
size times the rank's shard, and the trace records exactly that. Megatron-Core saves the
shard instead and all-gathers it once more in the backward, started before the
input-gradient GEMM and waited for by the weight-gradient GEMM that reads it (Megatron-LM
``megatron/core/tensor_parallel/layers.py``,
``LinearWithGradAccumulationAndAsyncCommunication.backward``; Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2, which
counts the shard in its activation memory). Transformer Engine's linear layers do the same.

With ``PricingOptions.sequence_parallel_regather`` the step is priced that way:

- memory: a gathered input lives through the forward's use of it, and again from its
  backward re-gather to its last use; its shard lives until the re-gather
  (:class:`torchroof.report.memory.Residency`'s ``refilled`` and ``late_reads``);
- time: the re-gather is a collective of the forward all-gather's bytes on the same group,
  issued just before the first backward kernel that reads the gathered tensor. It needs
  nothing the backward computes, so it may start as soon as the communication stream is
  free: at most that stream's backlog earlier than Megatron, which issues it at the start
  of the layer's backward (:mod:`torchroof.timing.streams`).

The gathers taken are forward ``all_gather_into_tensor`` ops over the step's tensor-parallel
group (``tp`` consecutive ranks: tensor parallel is the mesh's innermost dimension,
:data:`torchroof.config.parallel_plan.MESH_DIMS`) whose result the backward reads; FSDP's
parameter all-gathers write into its own buffers and are never among them.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torchroof.kernels.fusion import Kernel
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta

ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
CAT = "aten.cat.default"
FP8 = "float8_e4m3fn"  # Transformer Engine's forward fp8 format (E4M3)


@dataclass(frozen=True)
class Regather:
    """A forward all-gather whose result the backward reads, and where it is read first.
    ``result`` is the gathered tensor the backward reads: the all-gather's output, or where
    the sequence is not the first dimension, the ``cat`` of its chunks that puts the ranks'
    tokens in place (funcol gathers along dimension 0; Megatron's layout is sequence-first
    and needs no such copy)."""

    gather: OpRecord
    result: TensorMeta
    first_use: int  # index of the first backward op that reads ``result``

    @property
    def shard(self) -> int:
        """The storage of the rank's shard (what Megatron saves)."""
        return self.gather.inputs[0].storage

    @property
    def gathered(self) -> int:
        """The storage of the gathered tensor the backward reads (what torch saves)."""
        return self.result.storage


def tensor_parallel_group(op: OpRecord, tp: int) -> bool:
    """Whether ``op`` runs over a tensor-parallel group of ``tp`` ranks: ``tp`` consecutive
    ranks starting at a multiple of ``tp``."""
    ranks = op.arg("group_ranks")
    if tp <= 1 or not isinstance(ranks, (list, tuple)) or len(ranks) != tp:
        return False
    first = ranks[0]
    return first % tp == 0 and list(ranks) == list(range(first, first + tp))


def sequence_parallel_gathers(ops: Sequence[OpRecord], tp: int) -> list[Regather]:
    """The forward all-gathers over the tensor-parallel group of ``tp`` ranks whose result a
    backward op reads, each with the first such op (this module's docstring)."""
    first_read: dict[int, int] = {}
    for op in ops:
        if op.phase == "backward":
            for t in op.inputs:
                first_read.setdefault(t.storage, op.index)
    # a cat of one all-gather's chunks (funcol's split + cat for a gather along dimension 1)
    arranged: dict[int, TensorMeta] = {}
    for op in ops:
        if op.name == CAT and op.phase == "forward" and op.outputs:
            sources = {t.storage for t in op.inputs}
            if len(sources) == 1:
                arranged.setdefault(sources.pop(), op.outputs[0])
    found = []
    for op in ops:
        if op.phase != "forward" or op.name != ALL_GATHER or not op.inputs or not op.outputs:
            continue
        if not tensor_parallel_group(op, tp):
            continue
        for result in (op.outputs[0], arranged.get(op.outputs[0].storage)):
            use = first_read.get(result.storage) if result is not None else None
            if result is not None and use is not None:
                found.append(Regather(op, result, use))
                break
    return found


def with_regathers(
    kernels: Sequence[Kernel],
    sources: tuple[int, ...] | None,
    regathers: Sequence[Regather],
    narrowed: Mapping[int, int] | None = None,
) -> tuple[list[Kernel], tuple[int, ...] | None]:
    """``kernels`` with one collective kernel per re-gather, each placed just before the
    kernel holding its first backward reader, a copy of the forward all-gather's kernel in
    the backward (its bytes divided by ``narrowed``'s divisor of the gathered storage, where
    it names one: a shard saved in fp8 is gathered in fp8); ``sources`` (per kernel, the
    kernel it is a copy of) renumbered, a re-gather its own."""
    divisors = narrowed or {}
    if not regathers:
        return list(kernels), sources
    holder = {op.index: i for i, kernel in enumerate(kernels) for op in kernel.ops}
    held = sorted(holder)
    forward = {id(r.gather): holder[r.gather.index] for r in regathers}
    before: dict[int, list[Regather]] = {}
    for r in sorted(regathers, key=lambda r: r.gather.index):
        # a view is in no kernel: the first kernel from the first reader on
        at = bisect.bisect_left(held, r.first_use)
        before.setdefault(holder[held[at]] if at < len(held) else len(kernels), []).append(r)
    out: list[Kernel] = []
    moved: list[int] = []  # old position -> new
    added: list[int] = []  # new positions of the re-gathers
    for i in range(len(kernels) + 1):  # position len(kernels): read by no kernel, at the end
        for r in before.get(i, ()):
            added.append(len(out))
            out.append(_copy(kernels[forward[id(r.gather)]], r, divisors.get(r.gathered, 1)))
        if i < len(kernels):
            moved.append(len(out))
            out.append(kernels[i])
    if sources is None:
        return out, None
    renumbered = [0] * len(out)
    for old, new in enumerate(moved):
        renumbered[new] = moved[sources[old]]
    for new in added:
        renumbered[new] = new
    return out, tuple(renumbered)


def _copy(forward: Kernel, regather: Regather, divisor: int = 1) -> Kernel:
    """The forward all-gather's kernel run again in the backward, writing the gathered
    tensor the backward reads (in place, as Megatron's sequence-first gather does), at the
    index of its first reader (where a pipeline stage's backward files it); with
    ``divisor`` > 1, of fp8 tensors (``divisor`` times fewer bytes)."""
    op = replace(
        regather.gather,
        index=regather.first_use,
        phase="backward",
        outputs=(regather.result,),
    )
    cost = forward.cost
    if divisor > 1:
        op = replace(
            op,
            inputs=tuple(_fp8(t) for t in op.inputs),
            outputs=tuple(_fp8(t) for t in op.outputs),
        )
        cost = replace(
            cost,
            bytes_read=cost.bytes_read // divisor,
            bytes_written=cost.bytes_written // divisor,
            reads=tuple((_fp8(t), n // divisor) for t, n in cost.reads),
            writes=tuple((_fp8(t), n // divisor) for t, n in cost.writes),
        )
    return Kernel((op,), cost, forward.flags)


def _fp8(tensor: TensorMeta) -> TensorMeta:
    return replace(tensor, dtype=FP8)


def regather_line(regathers: Sequence[Regather]) -> str:
    """The estimate's statement of the re-gathers (one line)."""
    saved = sum(r.gather.inputs[0].nbytes for r in regathers)
    gathered = sum(r.result.nbytes for r in regathers)
    return (
        f"sequence parallel: {len(regathers)} all-gathered inputs are saved for the "
        f"backward as the rank's shards ({saved / 2**20:,.2f} MiB in all, not "
        f"{gathered / 2**20:,.2f} MiB gathered) and all-gathered again there, beside the "
        "input-gradient GEMM (Megatron-Core)"
    )

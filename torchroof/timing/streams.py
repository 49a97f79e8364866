"""Two streams over a step in issue order: when each kernel starts and ends once collectives
overlap compute as far as the program allows.

A real step is a graph of kernels with a critical
path, so per-kernel bounds summed are a loose bound on the step. The graph kept here is the
one a multi-GPU step has: a compute stream and a communication stream, joined only where a
kernel uses what a kernel on the other stream wrote. At the network boundary
(docs/concepts/network-ridges.md) communication
hides behind compute when there is compute to hide behind; what does not hide is exposed.

The rules, over kernels in issue order (the trace's order):

- Compute kernels run one after another on the compute stream; communication kernels one
  after another on one communication stream. NB: NCCL runs one stream per process group,
  so the collectives of two groups (an FSDP all-gather and a TP all-reduce) could run at
  once; here they queue on one stream, which over-prices a step only where both kinds are
  in flight together.
- A communication kernel starts when its stream is free and every compute kernel issued
  before it that touched (read or wrote) a storage it touches has ended: a collective waits
  for the kernel that produced its input. A read counts too, because some ops write into
  buffers their schemas only pass in (``fsdp.chunk_cat`` fills the reduce-scatter input).
  It does not wait for anything else: the CPU issues kernels ahead of the GPU, so a
  collective issued early starts early (FSDP's prefetched all-gather hides behind the
  previous layer).
- A compute kernel starts when the compute stream is free and every communication kernel
  issued before it that wrote a storage it reads or writes has ended: the first use of a
  collective's result waits for it (a TP all-reduce read at once blocks; a gradient
  reduce-scatter read only by the optimizer hides behind the rest of backward).
- Storages are those of the kernels' ops (``read_tensors`` / ``written_tensors``). A view
  shares its base's storage, and capture records the ops that re-wrap a collective's result
  as a new tensor (``wait_tensor``, ``_wrap_tensor_autograd``) under the collective's
  storage (``Capture.alias_storage``), so the first use of the result is seen.
- FSDP2 (``torch.distributed.fsdp.fully_shard``) runs the copies that feed its collectives
  on its own streams: ``fsdp.all_gather_copy_in`` on the all-gather copy-in stream and
  ``fsdp.chunk_cat`` on the reduce-scatter stream. They are scheduled on the communication
  stream. FSDP2 keeps one all-gather result in flight: the next all-gather's copy-in waits
  for the previous all-gather's copy-out (``fsdp.split_with_sizes_copy``, on the compute
  stream; FSDP2's ``_wait_all_gather_streams_on_event``), so layer i+1's all-gather runs
  during layer i's compute, not further ahead.

- A pair the runtime pipelines (``Task.beside``, ``Task.until``: a tensor-parallel all-gather
  and the GEMM reading it, a GEMM and the reduce-scatter of its output,
  :mod:`torchroof.timing.tp_overlap`) runs side by side: the later of the two starts no
  sooner than the earlier one starts (not ends), and ends no sooner than it ends. A GEMM
  that outlasts its all-gather hides it; an all-gather that outlasts its GEMM keeps the
  compute stream waiting for the difference. A reduce-scatter beside its GEMM holds the one
  communication stream until the GEMM ends, as the chunks of a real one keep its stream.

The step ends when the last kernel on either stream ends. The compute stream's idle time is
the exposed communication; each idle interval is shared among the communication kernels that
run during it (on one stream they cover it exactly, see :func:`schedule`), so a kernel's
exposed time never exceeds its own, and hidden = its time - exposed. Without overlap every
kernel waits for the one before it: the step is the plain sum, every communication kernel
fully exposed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.kernels.fusion import Kernel

Stream = Literal["compute", "communication"]
COMPUTE: Stream = "compute"
COMMUNICATION: Stream = "communication"

FSDP_COPY_IN = "fsdp.all_gather_copy_in"
FSDP_COPY_OUT = "fsdp.split_with_sizes_copy"
SIDE_STREAM_COPIES = frozenset({FSDP_COPY_IN, "fsdp.chunk_cat"})
"""Copies FSDP2 runs on its all-gather copy-in and reduce-scatter streams, beside the
collectives they feed: scheduled on the communication stream."""


@dataclass(frozen=True)
class Task:
    """One kernel as the schedule sees it: how long it runs, on which stream, the storages
    it reads and writes, and earlier tasks (by position) it waits for beyond its data."""

    duration_s: float
    stream: Stream = COMPUTE
    reads: frozenset[int] = frozenset()
    writes: frozenset[int] = frozenset()
    after: tuple[int, ...] = ()
    # a pipelined pair's (torchroof.timing.tp_overlap): the earlier task on the other stream
    # it starts with (not after), the task it ends no sooner than, and the tasks of its pair
    # whose end it does not wait for
    beside: int | None = None
    until: int | None = None
    skip: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Schedule:
    """Start and end of every task, the compute stream's idle time attributed to each
    communication task (0 for compute tasks), the step time (the last end), and what each
    task waits for on the other stream (:func:`waits`, whether or not overlap used them)."""

    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    exposed_s: tuple[float, ...]
    step_time_s: float
    waits: tuple[tuple[int, ...], ...] = ()


def schedule(tasks: Sequence[Task], overlap: bool = True) -> Schedule:
    """Lay ``tasks`` (in issue order) on the two streams under the rules of this module's
    docstring; ``overlap=False``: each task starts when the one before it ends.

    Why the idle intervals are covered exactly by communication runs: the compute stream
    idles from ``a`` (its last end) only while waiting for a communication task C that ends
    at ``b``. C started at max(end of the task before it on its stream, its data's ready
    time), and its data were ready by ``a`` (made by compute kernels issued earlier), so
    either C started by ``a`` or its predecessor ran until C started; by induction the
    stream is busy over all of [a, b]. The same holds for the tail after the last compute
    kernel. Each communication task is charged its overlap with the idle intervals.
    """
    count = len(tasks)
    start = [0.0] * count
    end = [0.0] * count
    before = tuple(waits(tasks))
    if not overlap:
        clock = 0.0
        for i, task in enumerate(tasks):
            start[i] = clock
            clock += task.duration_s
            end[i] = clock
        blocking = tuple(t.duration_s if t.stream == COMMUNICATION else 0.0 for t in tasks)
        return Schedule(tuple(start), tuple(end), blocking, clock, before)
    compute_free = communication_free = 0.0
    idle: list[tuple[float, float]] = []  # the compute stream's waits, in time order
    runs: list[int] = []  # communication tasks in stream order
    for i, task in enumerate(tasks):
        beside, until = task.beside, task.until
        for earlier in (beside, until, *task.skip):
            if earlier is not None and not 0 <= earlier < i:
                raise ValueError(f"task {i} runs beside task {earlier}, which is not before it")
        ready = max((end[j] for j in before[i] if j not in task.skip), default=0.0)
        if beside is not None:  # side by side: from its partner's start, not its end
            if tasks[beside].stream == task.stream:
                raise ValueError(f"task {i} runs beside task {beside} on its own stream")
            ready = max(ready, start[beside])
        if task.stream == COMMUNICATION:
            start[i] = max(communication_free, ready)
            finish = start[i] + task.duration_s
            if until is not None:
                finish = max(finish, end[until])
            end[i] = communication_free = finish
            runs.append(i)
        else:
            start[i] = max(compute_free, ready)
            if start[i] > compute_free:
                idle.append((compute_free, start[i]))
            finish = start[i] + task.duration_s
            if until is not None and end[until] > finish:  # waits for the last chunk
                idle.append((finish, end[until]))
                finish = end[until]
            end[i] = compute_free = finish
    if communication_free > compute_free:  # the step waits for its last collectives
        idle.append((compute_free, communication_free))
    exposed = [0.0] * count
    first = 0  # the first idle interval that may still overlap a later run
    for i in runs:
        while first < len(idle) and idle[first][1] <= start[i]:
            first += 1
        k = first
        while k < len(idle) and idle[k][0] < end[i]:
            a, b = idle[k]
            if a <= start[i] and end[i] <= b:  # wholly exposed: its own time, unrounded
                exposed[i] += tasks[i].duration_s
            else:
                exposed[i] += max(0.0, min(end[i], b) - max(start[i], a))
            k += 1
    step_time_s = max(compute_free, communication_free)
    return Schedule(tuple(start), tuple(end), tuple(exposed), step_time_s, before)


def waits(tasks: Sequence[Task]) -> list[tuple[int, ...]]:
    """For each task, the earlier tasks on the other stream whose end it waits for (the
    rules of this module's docstring), plus its ``after``. Which tasks these are follows
    from issue order alone, not from durations: a stream runs its tasks in order, so the
    last compute task to touch a storage is the last to end, and the same for the last
    communication task to write one. The estimate keeps them (``KernelEstimate.waits_on``)
    so the HTML report re-lays the schedule when it re-prices the kernels."""
    last_compute_touch: dict[int, int] = {}  # storage -> last compute task that touched it
    last_communication_write: dict[int, int] = {}  # storage -> last comm task that wrote it
    out: list[tuple[int, ...]] = []
    for i, task in enumerate(tasks):
        storages = task.reads | task.writes
        if task.stream == COMMUNICATION:
            before = {last_compute_touch[s] for s in storages if s in last_compute_touch}
            for storage in task.writes:
                last_communication_write[storage] = i
        else:
            before = {
                last_communication_write[s] for s in storages if s in last_communication_write
            }
            for storage in storages:
                last_compute_touch[storage] = i
        out.append(tuple(sorted(before | set(task.after))))
    return out


def stream_of(kernel: Kernel) -> Stream:
    """The stream ``kernel`` runs on: collectives (unit ``network``) and the FSDP2 side-stream
    copies on the communication stream, every other kernel on the compute stream."""
    packets = {op.packet for op in kernel.ops}
    if kernel.cost.unit == "network" or packets & SIDE_STREAM_COPIES:
        return COMMUNICATION
    return COMPUTE


def tasks_of(
    kernels: Sequence[Kernel],
    durations: Sequence[float],
    beside: Mapping[int, tuple[int, int | None, frozenset[int]]] | None = None,
) -> list[Task]:
    """The schedule's view of priced kernels: collectives (unit ``network``) and the FSDP2
    side-stream copies on the communication stream, every other kernel on the compute
    stream, with the storages their ops read and write; ``beside`` (kernel -> the kernel it
    starts with, the one it ends no sooner than and those it does not wait for: a pipelined
    pair's, :func:`torchroof.timing.tp_overlap.pipelined_pairs`) as :class:`Task` says."""
    alongside = beside or {}
    tasks: list[Task] = []
    last_copy_out: int | None = None
    for i, (kernel, duration) in enumerate(zip(kernels, durations, strict=True)):
        packets = {op.packet for op in kernel.ops}
        stream = stream_of(kernel)
        reads = frozenset(t.storage for op in kernel.ops for t in read_tensors(op))
        writes = frozenset(t.storage for op in kernel.ops for t in written_tensors(op))
        after = (last_copy_out,) if FSDP_COPY_IN in packets and last_copy_out is not None else ()
        start_with, until, skip = alongside.get(i, (None, None, frozenset()))
        tasks.append(Task(duration, stream, reads, writes, after, start_with, until, skip))
        if FSDP_COPY_OUT in packets:
            last_copy_out = i
    return tasks

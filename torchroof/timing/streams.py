"""Streams over a step in issue order: when each kernel starts and ends once collectives
overlap compute as far as the program allows.

A real step is a graph of kernels with a critical
path, so per-kernel bounds summed are a loose bound on the step. The graph kept here is the
one a multi-GPU step has: a compute stream and communication streams, joined only where a
kernel uses what a kernel on another stream wrote. At the network boundary
(docs/concepts/network-ridges.md) communication
hides behind compute when there is compute to hide behind; what does not hide is exposed.

The rules, over kernels in issue order (the trace's order):

- Compute kernels run one after another on the compute stream; communication kernels one
  after another on the communication stream of the link they cross (``Task.lane``,
  :func:`lane_of`): one for collectives within a node (NVLink, xGMI, PCIe) and one for
  those that cross the network (a hierarchical collective's slow part is the network).
  NCCL runs each process group's collectives on the group's own stream (``ProcessGroupNCCL``
  keeps a stream per device and communicator), so an FSDP all-gather across nodes runs
  while a tensor-parallel all-reduce or an expert all-to-all within the node runs; two
  groups that cross the same link share its bandwidth, which this schedule prices by
  queueing them, so together they take their summed time.
- A communication kernel starts when its stream is free and every compute kernel issued
  before it that touched (read or wrote) a storage it touches has ended: a collective waits
  for the kernel that produced its input. A read counts too, because some ops write into
  buffers their schemas only pass in (``fsdp.chunk_cat`` fills the reduce-scatter input).
  It waits as well for the last collective of another communication stream that wrote a
  storage it touches (HSDP's all-reduce across nodes of the gradients its reduce-scatter
  within the node wrote).
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
  stream of the collective they feed (the first later one that reads what they write).
  FSDP2 keeps one all-gather result in flight: the next all-gather's copy-in waits
  for the previous all-gather's copy-out (``fsdp.split_with_sizes_copy``, on the compute
  stream; FSDP2's ``_wait_all_gather_streams_on_event``), so layer i+1's all-gather runs
  during layer i's compute, not further ahead.

- A pair the runtime pipelines (``Task.beside``, ``Task.until``: a tensor-parallel all-gather
  and the GEMM reading it, a GEMM and the reduce-scatter of its output,
  :mod:`torchroof.timing.tp_overlap`) runs side by side: the later of the two starts no
  sooner than the earlier one starts (not ends), and ends no sooner than it ends. A GEMM
  that outlasts its all-gather hides it; an all-gather that outlasts its GEMM keeps the
  compute stream waiting for the difference. A reduce-scatter beside its GEMM holds its
  communication stream until the GEMM ends, as the chunks of a real one keep its stream.

The step ends when the last kernel on any stream ends. The compute stream's idle time is
the exposed communication; each idle interval is shared among the communication kernels that
run during it (the communication streams cover it exactly, see :func:`schedule`): where one
runs alone it is charged the overlap, where several run at once each is charged an equal
share, so a kernel's exposed time never exceeds its own, the charges add up to the idle
time, and hidden = its time - exposed. Without overlap every
kernel waits for the one before it: the step is the plain sum, every communication kernel
fully exposed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from torchroof.counters.tensors import read_tensors, written_tensors
from torchroof.kernels.fusion import Kernel

Stream = Literal["compute", "communication"]
COMPUTE: Stream = "compute"
COMMUNICATION: Stream = "communication"

INTRA_NODE = "intra-node"
NETWORK = "network"
NETWORK_LINKS = frozenset({"network", "hierarchical"})
"""Links whose collectives queue on the network's communication stream; every other
collective (NVLink, xGMI, PCIe, a group of one) queues on the intra-node one."""

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
    # the communication stream a communication task queues on (:func:`lane_of`); tasks of
    # different lanes run at once
    lane: str = ""


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


def schedule(
    tasks: Sequence[Task],
    overlap: bool = True,
    before: Sequence[tuple[int, ...]] | None = None,
    durations: Sequence[float] | None = None,
) -> Schedule:
    """Lay ``tasks`` (in issue order) on the streams under the rules of this module's
    docstring; ``overlap=False``: each task starts when the one before it ends. ``before``:
    :func:`waits` of the tasks, where the caller has it (it follows from their streams and
    storages alone); ``durations``: each task's time in place of its ``duration_s`` (a
    planned step lays the same tasks at every point with that point's times).

    Why the idle intervals are covered exactly by communication runs: the compute stream
    idles from ``a`` (its last end) only while waiting for a communication task C that ends
    at ``b``. C started at max(end of the task before it on its stream, its data's ready
    time). Its data made by compute kernels were ready by ``a`` (they were issued earlier);
    so either C started by ``a``, or the task before it on its stream ran until C started,
    or C waited for a communication task of another stream that ran until C started; by
    induction some communication stream is busy at every instant of [a, b]. The same holds
    for the tail after the last compute kernel. Each idle interval is charged to the
    communication tasks running in it (:func:`_charge`).
    """
    count = len(tasks)
    start = [0.0] * count
    end = [0.0] * count
    before = tuple(waits(tasks) if before is None else before)
    duration = [t.duration_s for t in tasks] if durations is None else list(durations)
    if len(duration) != count:
        raise ValueError(f"{len(duration)} durations for {count} tasks")
    if not overlap:
        clock = 0.0
        for i, took in enumerate(duration):
            start[i] = clock
            clock += took
            end[i] = clock
        blocking = tuple(
            took if t.stream == COMMUNICATION else 0.0
            for t, took in zip(tasks, duration, strict=True)
        )
        return Schedule(tuple(start), tuple(end), blocking, clock, before)
    compute_free = 0.0
    lane_free: dict[str, float] = {}  # each communication stream's last end
    idle: list[tuple[float, float]] = []  # the compute stream's waits, in time order
    runs: list[int] = []  # communication tasks
    for i, task in enumerate(tasks):
        beside, until, skip = task.beside, task.until, task.skip
        if beside is not None or until is not None or skip:
            for earlier in (beside, until, *skip):
                if earlier is not None and not 0 <= earlier < i:
                    raise ValueError(f"task {i} runs beside task {earlier}, which is not before it")
            ready = max((end[j] for j in before[i] if j not in skip), default=0.0)
        else:
            waited = before[i]
            ready = max([end[j] for j in waited]) if waited else 0.0
        if beside is not None:  # side by side: from its partner's start, not its end
            if tasks[beside].stream == task.stream:
                raise ValueError(f"task {i} runs beside task {beside} on its own stream")
            ready = max(ready, start[beside])
        if task.stream == COMMUNICATION:
            start[i] = max(lane_free.get(task.lane, 0.0), ready)
            finish = start[i] + duration[i]
            if until is not None:
                finish = max(finish, end[until])
            end[i] = lane_free[task.lane] = finish
            runs.append(i)
        else:
            start[i] = max(compute_free, ready)
            if start[i] > compute_free:
                idle.append((compute_free, start[i]))
            finish = start[i] + duration[i]
            if until is not None and end[until] > finish:  # waits for the last chunk
                idle.append((finish, end[until]))
                finish = end[until]
            end[i] = compute_free = finish
    communication_free = max(lane_free.values(), default=0.0)
    if communication_free > compute_free:  # the step waits for its last collectives
        idle.append((compute_free, communication_free))
    exposed = _charge(idle, runs, start, end, duration)
    step_time_s = max(compute_free, communication_free)
    return Schedule(tuple(start), tuple(end), tuple(exposed), step_time_s, before)


def _charge(
    idle: Sequence[tuple[float, float]],
    runs: Sequence[int],
    start: Sequence[float],
    end: Sequence[float],
    duration: Sequence[float],
) -> list[float]:
    """Each communication run's share of the compute stream's ``idle`` intervals (disjoint,
    in time order): a run alone over its part of an interval is charged that part (its own
    time, unrounded, when it lies wholly inside); where several run at once, each instant is
    split equally among them."""
    exposed = [0.0] * len(duration)
    order = sorted(runs, key=lambda i: (start[i], i))
    following = 0  # the first run in ``order`` not yet considered
    live: list[int] = []  # runs started before the current interval's end
    for a, b in idle:
        while following < len(order) and start[order[following]] < b:
            live.append(order[following])
            following += 1
        live = [i for i in live if end[i] > a]
        inside = [i for i in live if start[i] < b]
        if len(inside) == 1 or _one_after_another(inside, start, end):
            for i in inside:
                if a <= start[i] and end[i] <= b:  # wholly exposed: its own time
                    exposed[i] += duration[i]
                else:
                    exposed[i] += max(0.0, min(end[i], b) - max(start[i], a))
            continue
        cuts = sorted({a, b, *(t for i in inside for t in (start[i], end[i]) if a < t < b)})
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            running = [i for i in inside if start[i] <= lo and hi <= end[i]]
            for i in running:
                exposed[i] += (hi - lo) / len(running)
    return exposed


def _one_after_another(runs: Sequence[int], start: Sequence[float], end: Sequence[float]) -> bool:
    """No two of ``runs`` (in start order) run at once."""
    return all(end[i] <= start[j] for i, j in zip(runs, runs[1:], strict=False))


def waits(tasks: Sequence[Task]) -> list[tuple[int, ...]]:
    """For each task, the earlier tasks on other streams whose end it waits for (the rules
    of this module's docstring), plus its ``after``. Which tasks these are follows from
    issue order alone, not from durations: a stream runs its tasks in order, so the last
    compute task to touch a storage is the last to end, and a communication task that
    overwrites another stream's result waited for it. The estimate keeps them
    (``KernelEstimate.waits_on``) so the HTML report re-lays the schedule when it re-prices
    the kernels."""
    last_compute_touch: dict[int, int] = {}  # storage -> last compute task that touched it
    last_communication_write: dict[int, int] = {}  # storage -> last comm task that wrote it
    out: list[tuple[int, ...]] = []
    for i, task in enumerate(tasks):
        storages = task.reads | task.writes
        if task.stream == COMMUNICATION:
            before = {last_compute_touch[s] for s in storages if s in last_compute_touch}
            before |= {
                last_communication_write[s]
                for s in storages
                if s in last_communication_write
                and tasks[last_communication_write[s]].lane != task.lane
            }
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


def lane_of(link: str) -> str:
    """The communication stream a collective crossing ``link`` queues on: the network's for
    the network and hierarchical collectives, the intra-node one for every other."""
    return NETWORK if link in NETWORK_LINKS else INTRA_NODE


def stream_of(kernel: Kernel) -> Stream:
    """The stream ``kernel`` runs on: collectives (unit ``network``) and the FSDP2 side-stream
    copies on a communication stream, every other kernel on the compute stream."""
    packets = {op.packet for op in kernel.ops}
    if kernel.cost.unit == "network" or packets & SIDE_STREAM_COPIES:
        return COMMUNICATION
    return COMPUTE


def tasks_of(
    kernels: Sequence[Kernel],
    durations: Sequence[float],
    beside: Mapping[int, tuple[int, int | None, frozenset[int]]] | None = None,
    links: Sequence[str] | None = None,
) -> list[Task]:
    """The schedule's view of priced kernels: collectives (unit ``network``) on the
    communication stream of the link they cross (``links``, one per kernel, "" for those
    that are no collective; none given: one communication stream) and the FSDP2 side-stream
    copies on the stream of the collective they feed, every other kernel on the compute
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
        task = Task(duration, stream, reads, writes, after, start_with, until, skip)
        tasks.append(task)
        if FSDP_COPY_OUT in packets:
            last_copy_out = i
    if links is None:
        return tasks
    return _laned(tasks, [k.cost.unit == "network" for k in kernels], links)


def _laned(tasks: list[Task], collective: Sequence[bool], links: Sequence[str]) -> list[Task]:
    """``tasks`` with each collective on its link's stream (:func:`lane_of`) and each FSDP2
    side-stream copy on the stream of the first later collective that reads what it wrote
    (the intra-node one when none does)."""
    lanes = [
        lane_of(link) if is_collective else ""
        for is_collective, link in zip(collective, links, strict=True)
    ]
    next_reader: dict[int, int] = {}  # storage -> the first later collective reading it
    for i in reversed(range(len(tasks))):
        task = tasks[i]
        if collective[i]:
            for storage in task.reads:
                next_reader[storage] = i
        elif task.stream == COMMUNICATION:
            fed = [next_reader[s] for s in task.writes if s in next_reader]
            lanes[i] = lanes[min(fed)] if fed else INTRA_NODE
    return [
        replace(task, lane=lane) if task.stream == COMMUNICATION else task
        for task, lane in zip(tasks, lanes, strict=True)
    ]


def lanes_line(lanes: Collection[str]) -> list[str]:
    """The assumption a step whose collectives cross both the network and the node states
    once (``lanes``: the streams its collectives ran on); none otherwise."""
    if not {NETWORK, INTRA_NODE} <= set(lanes):
        return []
    return [
        "collectives across the network run on their own stream beside those within the "
        "node, as NCCL runs each process group on its own stream; two groups on one link "
        "queue one after the other"
    ]

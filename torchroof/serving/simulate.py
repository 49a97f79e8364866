"""A serving deployment simulated request by request: engines stepping continuous batches,
requests arriving, a router between replicas, as a discrete-event simulation (SimPy).

Each replica is one engine (its own GPUs, tensor/expert parallel as the prepared model
says) running :class:`~torchroof.serving.scheduler.Scheduler`: while it has requests it
schedules a step, prices it with the shared :class:`~torchroof.serving.step_time.StepTimer`
and holds for that time; idle, it waits for a request. Requests arrive at their times (an
open workload) or are sent by closed-loop clients, each sending its next request when its
last one finishes. The router sends each request to a replica: ``round-robin``, or
``least-loaded`` (the fewest requests waiting and running; the lowest index on a tie).

Replicas whose routed experts are spread over each other's GPUs (data-parallel attention:
a step prepared with ep = tp x g over g data-parallel ranks) step in lock-step, as vLLM
runs its data-parallel ranks of a MoE model ("Data Parallel Deployment", docs.vllm.ai: the
forward passes are aligned and a rank without requests runs a dummy one): each of a group
of g consecutive replicas schedules its own step, each is priced as vLLM runs it beside the
others (:meth:`~torchroof.serving.step_time.StepTimer.group_times`: CUDA graphs only where
every rank's step replays one, every rank then padded to the most tokens; else eager, the
routed experts at the group's mean tokens and their all-to-alls at its most), and the
group holds for the longest, every MoE layer's all-to-all waiting for the busiest rank.

An engine's KV blocks are what its GPU memory holds after the weights and the activations
of its largest step (``max_num_batched_tokens`` tokens), at ``gpu_memory_utilization``,
as vLLM sizes its cache from a profiling run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Generator, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import simpy

from torchroof.collector import paused_gc
from torchroof.config.errors import OptionError
from torchroof.pricing.hardware import resolve_hardware
from torchroof.pricing.price import host_link
from torchroof.progress import current
from torchroof.serving.requests import Request
from torchroof.serving.results import RequestRecord, ServeResult, StepLog
from torchroof.serving.scheduler import EngineConfig, Running, ScheduledStep, Scheduler
from torchroof.serving.speculative import Drafter
from torchroof.serving.step_time import StepTimer, coupled_ranks

ROUTERS = ("round-robin", "least-loaded")
FLOAT_COLUMNS = ("start_s", "time_s", "expected_accepted")


@dataclass(frozen=True)
class KvCapacity:
    """One engine's KV cache, per GPU: what memory is left for it, in blocks."""

    blocks: int
    bytes_per_token: int
    usable_bytes: int  # HBM x gpu_memory_utilization
    weights_bytes: int
    activations_bytes: int


def kv_capacity(
    timer: StepTimer,
    engine: EngineConfig,
    draft: StepTimer | None = None,
    shared_bytes: int = 0,
) -> KvCapacity:
    """The KV blocks one engine holds (per GPU: every rank holds its own heads' share), or
    ``num_gpu_blocks_override`` of them where the engine sets it (as vLLM's does): what
    ``gpu_memory_utilization`` of its memory leaves after the weights and the activations
    of its largest step (:meth:`~torchroof.serving.step_time.StepTimer.step_activations`
    of ``max_num_batched_tokens`` tokens, logits for ``max_num_seqs`` rows at most). With
    a ``draft`` model its weights are held too (but ``shared_bytes`` of them, a head's
    embedding and LM head, which are the served model's), each token's block keeps its K/V
    as well, and the larger of the two models' largest steps is set aside."""
    memory = timer.memory(1)
    usable = int(memory.capacity_bytes * engine.gpu_memory_utilization)
    per_token = timer.kv_bytes_per_token()
    weights = memory.weights_bytes
    activations = timer.step_activations(engine.max_num_batched_tokens, engine.max_num_seqs)
    if draft is not None:
        per_token += draft.kv_bytes_per_token()
        weights += draft.memory(1).weights_bytes - shared_bytes
        activations = max(
            activations,
            draft.step_activations(engine.max_num_batched_tokens, engine.max_num_seqs),
        )
    left = usable - weights - activations
    blocks = max(0, left // (per_token * engine.block_size))
    if engine.num_gpu_blocks_override is not None:
        blocks = engine.num_gpu_blocks_override
    return KvCapacity(blocks, per_token, usable, weights, activations)


@dataclass(frozen=True)
class HostSwap:
    """Host memory for swapped KV blocks, per GPU, and the time a block takes to cross the
    GPU's host link one way."""

    blocks: int
    seconds_per_block: float


def host_swap(timer: StepTimer, engine: EngineConfig, kv: KvCapacity) -> HostSwap:
    """What ``swap_space_gib`` of host memory holds of one GPU's KV blocks, and a block's
    copy over the host link (the cluster's, else the accelerator's PCIe figure, one way);
    none without swap preemption."""
    if engine.preemption != "swap":
        return HostSwap(0, 0.0)
    block_bytes = engine.block_size * kv.bytes_per_token
    spec, cluster = resolve_hardware(timer.hardware)
    try:
        _, bandwidth = host_link(spec, cluster)
    except OptionError:
        raise OptionError(
            f"swap preemption copies KV blocks over the GPU's host link: {spec.name} gives "
            "no pcie figure (interconnect_bytes_per_s.pcie in its hardware file)"
        ) from None
    return HostSwap(int(engine.swap_space_gib * 2**30) // block_bytes, block_bytes / bandwidth)


class _Replica:
    """One engine in the simulation: its scheduler and its process's wake-up event."""

    def __init__(self, index: int, scheduler: Scheduler, env: simpy.Environment) -> None:
        self.index = index
        self.scheduler = scheduler
        self.env = env
        self.idle: simpy.Event | None = None  # shared by a lock-step group's replicas

    def submit(self, state: Running) -> None:
        self.scheduler.submit(state)
        if self.idle is not None and not self.idle.triggered:
            self.idle.succeed()

    @property
    def load(self) -> int:
        scheduler = self.scheduler
        return len(scheduler.waiting) + len(scheduler.running) + len(scheduler.swapped)


class _Run:
    """The mutable state of one simulation: replicas, records, the step log."""

    def __init__(
        self,
        timer: StepTimer,
        engine: EngineConfig,
        blocks: int,
        replicas: int,
        router: str,
        requests: Sequence[Request],
        drafter: Drafter | None = None,
        random_state: int = 0,
        swap: HostSwap | None = None,
    ) -> None:
        self.env = simpy.Environment()
        swap = swap or HostSwap(0, 0.0)
        self.timer = timer
        self.drafter = drafter
        # with a draft model the engine's full CUDA graphs are for k + 1 tokens a request
        self.graphed = drafter.tokens + 1 if drafter is not None else None
        acceptance = drafter.acceptance if drafter is not None else None
        head = drafter is not None and drafter.head
        streams = np.random.SeedSequence(random_state).spawn(replicas)
        rngs = [np.random.default_rng(stream) for stream in streams]
        self.replicas = [
            _Replica(i, Scheduler(engine, blocks, acceptance, rngs[i], swap.blocks, head), self.env)
            for i in range(replicas)
        ]
        self.swap = swap
        self.router = router
        self._turn = itertools.count()
        self.records: list[RequestRecord] = []
        self.gaps: list[list[float]] = []
        self.steps: list[tuple[float, ...]] = []
        self.done = {r.index: self.env.event() for r in requests}
        self.report = current()

    def route(self, request: Request) -> None:
        if self.router == "round-robin":
            replica = self.replicas[next(self._turn) % len(self.replicas)]
        else:
            replica = min(self.replicas, key=lambda r: (r.load, r.index))
        replica.submit(Running(request, arrival_s=self.env.now))

    def engine(self, group: Sequence[_Replica]) -> Generator[simpy.Event, Any, None]:
        """Step ``group``'s replicas together (one replica: an engine alone): each busy one
        schedules its step, and all hold for the longest."""
        while True:
            busy = [replica for replica in group if replica.scheduler.busy]
            if not busy:
                idle = self.env.event()
                for replica in group:
                    replica.idle = idle
                yield idle
                for replica in group:
                    replica.idle = None
                continue
            steps = [(replica, self._schedule(replica.scheduler)) for replica in busy]
            start = self.env.now
            mixes = [step.mix for _, step in steps]
            if len(group) > 1:
                times = self.timer.group_times(mixes, len(group), self.graphed)
            else:
                times = [self.timer.time(mixes[0], self.graphed)]
            timed = zip(steps, times, strict=True)
            seconds = max(self._seconds(step, time.time_s) for (_, step), time in timed)
            yield self.env.timeout(seconds)
            for replica, step in steps:
                self._log(replica.index, start, seconds, step)
                for state in replica.scheduler.complete(step, self.env.now):
                    self._finish(replica.index, state)

    def _schedule(self, scheduler: Scheduler) -> ScheduledStep:
        """A busy scheduler's next step (scheduled again where it only made room)."""
        while True:
            step = scheduler.schedule(self.env.now)
            if step.requests:
                return step
            if not step.preempted:
                raise OptionError(_stuck(scheduler))

    def _seconds(self, step: ScheduledStep, model_s: float) -> float:
        """The step's time: the model's (``model_s``), the drafter's, and its swapped
        blocks' copies."""
        seconds = model_s
        if self.drafter is not None:
            seconds += self.drafter.time_s(step.draft)
        return seconds + step.swap_blocks * self.swap.seconds_per_block

    def arrivals(self, requests: Sequence[Request]) -> Generator[simpy.Event, Any, None]:
        for request in requests:
            assert request.arrival_s is not None
            if request.arrival_s > self.env.now:
                yield self.env.timeout(request.arrival_s - self.env.now)
            self.route(request)

    def client(self, queue: Iterator[Request]) -> Generator[simpy.Event, Any, None]:
        for request in queue:
            self.route(request)
            yield self.done[request.index]

    def _log(self, replica: int, start: float, seconds: float, step: ScheduledStep) -> None:
        self.steps.append(step_row(replica, start, seconds, step))

    def _finish(self, replica: int, state: Running) -> None:
        self.records.append(request_record(state, replica))
        self.gaps.append(state.gaps)
        self.done[state.request.index].succeed()
        self.report.advance()


@paused_gc()
def simulate(
    timer: StepTimer,
    requests: Sequence[Request],
    *,
    engine: EngineConfig | None = None,
    concurrency: int | None = None,
    replicas: int = 1,
    router: str = "round-robin",
    drafter: Drafter | None = None,
    random_state: int = 0,
) -> ServeResult:
    """Serve ``requests`` on ``replicas`` engines priced by ``timer``: at their own
    arrival times, or sent by ``concurrency`` closed-loop clients (then the requests'
    arrival times are ignored). With a ``drafter`` the engines decode speculatively, its
    acceptances drawn from ``random_state``."""
    engine = engine or EngineConfig()
    described = timer.describe()
    check_group(described["tp"], described["ep"], replicas)
    if router not in ROUTERS:
        raise OptionError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
    if not requests:
        raise OptionError("no requests to serve")
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
    ):
        raise OptionError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
    if isinstance(random_state, bool) or not isinstance(random_state, int) or random_state < 0:
        raise OptionError(f"random_state must be a whole number >= 0, got {random_state!r}")
    if concurrency is None and any(r.arrival_s is None for r in requests):
        raise OptionError("requests without arrival times need a concurrency (closed loop)")
    timer.check_lengths(requests)
    if drafter is not None:
        drafter.timer.check_lengths(requests)
    capacity = (
        kv_capacity(timer, engine, drafter.timer, drafter.shared_weights_bytes)
        if drafter is not None
        else kv_capacity(timer, engine)
    )
    check_fits(requests, engine, capacity, drafter.tokens if drafter is not None else 0)
    if len({r.index for r in requests}) != len(requests):
        raise OptionError("two requests share an index: number them apart")
    swap = host_swap(timer, engine, capacity)
    run = _Run(
        timer, engine, capacity.blocks, replicas, router, requests, drafter, random_state, swap
    )
    group = timer.lockstep
    for first in range(0, replicas, group):
        run.env.process(run.engine(run.replicas[first : first + group]))
    if concurrency is None:
        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        run.env.process(run.arrivals(ordered))
    else:
        queue = iter(requests)
        for _ in range(min(concurrency, len(requests))):
            run.env.process(run.client(queue))
    report = run.report
    with report.stage(f"serving {len(requests):,} requests", len(requests), "requests"):
        run.env.run(until=simpy.AllOf(run.env, list(run.done.values())))
    groups = len({r.prefix_group for r in requests if r.prefix_len})
    return _result(run, engine, capacity, replicas, router, concurrency, groups)


def check_group(tp: int, ep: int, replicas: int) -> None:
    """Refuse replicas that are not a whole number >= 1, or that split a lock-step group:
    ep > tp couples ep / tp data-parallel ranks, each an engine, which step together."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise OptionError(f"replicas must be a whole number >= 1, got {replicas!r}")
    group = coupled_ranks(tp, ep)
    if replicas % group:
        raise OptionError(
            f"expert parallel {ep} over tp {tp} couples {group} data-parallel ranks, each an "
            f"engine stepping with the others: give replicas as a multiple of {group}, not "
            f"{replicas}"
        )


def check_fits(
    requests: Sequence[Request], engine: EngineConfig, kv: KvCapacity, lookahead: int = 0
) -> None:
    """Refuse requests no engine can ever finish: one whose KV outgrows the whole cache
    (with the ``lookahead`` slots a draft model writes its drafts to), or, without chunked
    prefill, one whose prompt (and, recomputed after a preemption, its output) exceeds
    the step's token budget."""
    longest = max(requests, key=lambda r: r.input_len + r.output_len)
    tokens = longest.input_len + longest.output_len - 1  # the last token's K/V is not kept
    need = math.ceil((tokens + lookahead) / engine.block_size)
    if need > kv.blocks:
        raise OptionError(
            f"the KV cache holds {kv.blocks:,} blocks of {engine.block_size} tokens "
            f"({kv.blocks * engine.block_size:,} tokens: {kv.usable_bytes / 2**30:.1f} GiB usable, "
            f"weights {kv.weights_bytes / 2**30:.1f} GiB, activations "
            f"{kv.activations_bytes / 2**30:.1f} GiB, {kv.bytes_per_token:,} B per token), "
            f"below request {longest.index}'s {tokens + lookahead:,} tokens: use more GPUs, a "
            "narrower KV dtype, fewer tokens per step (max_num_batched_tokens), or shorter requests"
        )
    if not engine.chunked_prefill and tokens > engine.max_num_batched_tokens:
        raise OptionError(
            f"without chunked prefill a preempted request computes its prompt and output "
            f"again in one step: request {longest.index} may need {tokens:,} tokens in a "
            f"step, above max_num_batched_tokens={engine.max_num_batched_tokens:,} (vLLM "
            "asks for max_num_batched_tokens >= max_model_len likewise)"
        )


def _stuck(scheduler: Scheduler) -> str:
    return (
        f"the engine cannot schedule a step: {len(scheduler.waiting)} requests waiting, "
        f"{scheduler.free_blocks} of {scheduler.kv_blocks} KV blocks free"
    )


def request_record(state: Running, replica: int) -> RequestRecord:
    """A finished request as the result records it, served by ``replica``."""
    assert state.first_token_s is not None and state.finish_s is not None
    request = state.request
    return RequestRecord(
        index=request.index,
        replica=replica,
        input_len=request.input_len,
        output_len=request.output_len,
        arrival_s=state.arrival_s,
        admitted_s=state.admitted_s if state.admitted_s is not None else state.arrival_s,
        first_token_s=state.first_token_s,
        finish_s=state.finish_s,
        preemptions=state.preemptions,
        cached_tokens=state.cached_tokens,
    )


def step_row(replica: int, start: float, seconds: float, step: ScheduledStep) -> tuple[float, ...]:
    """One step as the :class:`StepLog`'s columns hold it, in their order."""
    return (
        start,
        seconds,
        replica,
        step.mix.sequences,
        step.mix.tokens,
        step.prefill_tokens,
        step.blocks_used,
        step.preempted,
        step.mix.verifications,
        step.mix.drafted,
        sum(step.accepted),
        step.expected_accepted,
        step.queried_tokens,
        step.cached_tokens,
        step.swapped_out,
        step.swapped_in,
        step.swap_blocks,
    )


def step_log(rows: Sequence[tuple[float, ...]]) -> StepLog:
    """The :class:`StepLog` of rows made by :func:`step_row`."""
    names = list(StepLog.__dataclass_fields__)
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(names)
    kinds = [float if name in FLOAT_COLUMNS else int for name in names]
    return StepLog(
        **{
            name: np.array(col, dtype=kind)
            for name, col, kind in zip(names, columns, kinds, strict=True)
        }
    )


def _result(
    run: _Run,
    engine: EngineConfig,
    kv: KvCapacity,
    replicas: int,
    router: str,
    concurrency: int | None,
    prefix_groups: int,
) -> ServeResult:
    records = tuple(sorted(run.records, key=lambda r: r.index))
    log = step_log(run.steps)
    gaps = itertools.chain.from_iterable(run.gaps)
    itl = np.fromiter(gaps, dtype=float, count=sum(map(len, run.gaps)))
    described: dict[str, Any] = {
        **asdict(engine),
        "kv_blocks": kv.blocks,
        "kv_bytes_per_token": kv.bytes_per_token,
        "replicas": replicas,
        "lockstep": run.timer.lockstep,
        "router": router,
        "concurrency": concurrency,
        "prefix_groups": prefix_groups,
        "host_swap_blocks": run.swap.blocks,
        "host_swap_s_per_block": run.swap.seconds_per_block,
        **run.timer.describe(),
        **(run.drafter.describe() if run.drafter is not None else {}),
    }
    return ServeResult(records, itl, log, described)

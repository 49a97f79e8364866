"""Disaggregated prefill and decode simulated request by request (SimPy): x prefill
instances and y decode instances, each an engine with its own step timer, KV cache and
scheduler, and every request's KV cache sent between them over the cluster's links.

A request's path (DistServe, Zhong et al. 2024; vLLM's disaggregated prefilling and its
NixlConnector, docs.vllm.ai):

1. A router (``round-robin`` or ``least-loaded``, as between replicas) sends it to a
   prefill instance, which schedules it as any engine does (queueing, chunked prefill as
   its engine says) and samples its first token at the end of its prompt.
2. The same kind of router picks a decode instance. There the request waits, first come
   first served, until the decode instance has free KV blocks for its prompt and its next
   token (it takes none while a request it preempted waits to run again); they are then
   reserved for it, as vLLM's decode scheduler allocates a remote prompt's blocks before
   it reads them.
3. Its cache is sent over the link between the two instances
   (:class:`~torchroof.serving.disaggregation.KvTransfers`); the transfers out of one
   prefill instance take its link one at a time, in the order their blocks were reserved.
   The prefill instance keeps the request's blocks until its transfer ends (vLLM's docs,
   "NIXL KV Cache Lease Renewal": the prefill instance holds them until the decode
   instance has read them), so a slow decode side fills the prefill side's cache.
4. The decode instance then runs it as a request whose prompt is cached and whose first
   token is sampled: one token a step until it ends (preempted, it computes its prompt
   again there).

Time to first token runs from the arrival to the end of the transfer: the first token
reaches the client once the decode instance holds the cache it continues from, so TTFT =
prefill queueing + prefill + the wait for the decode instance's blocks and for the link +
the transfer. Time per output token and the gaps between tokens are the decode instance's
steps from there. A request of one output token ends when its cache arrives.

Steps are logged with replica numbers 0 to x - 1 for the prefill instances and x to
x + y - 1 for the decode instances; a request's replica is its decode instance.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import simpy

from torchroof.collector import paused_gc
from torchroof.config.errors import OptionError
from torchroof.hardware import ClusterSpec
from torchroof.pricing.hardware import resolve_hardware
from torchroof.progress import current
from torchroof.serving.disaggregated_result import DisaggregatedResult, TransferLog
from torchroof.serving.disaggregation import KvSend, KvTransfers, Layout, place
from torchroof.serving.requests import Request
from torchroof.serving.results import RequestRecord
from torchroof.serving.scheduler import EngineConfig, Running, Scheduler
from torchroof.serving.simulate import (
    ROUTERS,
    KvCapacity,
    check_fits,
    kv_capacity,
    request_record,
    step_log,
    step_row,
)
from torchroof.serving.step_time import StepTimer


class _Instance:
    """One engine of a side: its scheduler and step timer, its process's wake-up event,
    and the event it waits on when it can schedule nothing until blocks it lent come
    back."""

    side = "engine"

    def __init__(
        self, index: int, scheduler: Scheduler, env: simpy.Environment, timer: StepTimer
    ) -> None:
        self.index = index
        self.scheduler = scheduler
        self.env = env
        self.timer = timer
        self.idle: simpy.Event | None = None
        self.lent = 0  # prefill: blocks of caches not yet sent; decode: transfers under way
        self.returned: simpy.Event | None = None

    def blocked(self) -> simpy.Event | None:
        """The event of the next blocks coming back, or None where none are lent."""
        if not self.lent:
            return None
        self.returned = self.env.event()
        return self.returned

    def unblock(self) -> None:
        if self.returned is not None and not self.returned.triggered:
            self.returned.succeed()

    def wake(self) -> None:
        if self.idle is not None and not self.idle.triggered:
            self.idle.succeed()

    def submit(self, state: Running) -> None:
        self.scheduler.submit(state)
        self.wake()

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def stuck(self) -> str:
        scheduler = self.scheduler
        return (
            f"{self.side} instance {self.index} cannot schedule "
            f"a step: {len(scheduler.waiting)} requests waiting, {scheduler.free_blocks} of "
            f"{scheduler.kv_blocks} KV blocks free"
        )


class _Prefill(_Instance):
    """A prefill instance: its link, which its transfers take one at a time."""

    side = "prefill"

    def __init__(
        self, index: int, scheduler: Scheduler, env: simpy.Environment, timer: StepTimer
    ) -> None:
        super().__init__(index, scheduler, env, timer)
        self.link = simpy.Resource(env, capacity=1)


class _Decode(_Instance):
    """A decode instance: the prefilled requests waiting for its blocks."""

    side = "decode"

    def __init__(
        self, index: int, scheduler: Scheduler, env: simpy.Environment, timer: StepTimer
    ) -> None:
        super().__init__(index, scheduler, env, timer)
        self.incoming: deque[_Handoff] = deque()

    @property
    def load(self) -> int:
        """Its requests: running, waiting, on their way and waiting for its blocks."""
        return super().load + self.lent + len(self.incoming)


@dataclass(eq=False)
class _Handoff:
    """A prefilled request on its way from a prefill instance to a decode instance."""

    state: Running  # as the prefill instance ran it
    prefill: _Prefill
    decode: _Decode
    ready_s: float
    prefill_blocks: int
    blocks: int = 0  # reserved on the decode instance
    start_s: float = math.nan
    sent: KvSend | None = None


class _Run:
    """The mutable state of one simulation: both sides' instances, records, step log."""

    def __init__(
        self,
        timers: tuple[StepTimer, StepTimer],
        engines: tuple[EngineConfig, EngineConfig],
        blocks: tuple[int, int],
        layout: Layout,
        transfers: KvTransfers,
        router: str,
        requests: Sequence[Request],
    ) -> None:
        self.env = env = simpy.Environment()
        x = layout.prefill
        self.prefill = [
            _Prefill(i, Scheduler(engines[0], blocks[0]), env, timers[0]) for i in range(x)
        ]
        self.decode = [
            _Decode(x + j, Scheduler(engines[1], blocks[1]), env, timers[1])
            for j in range(layout.decode)
        ]
        self.transfers = transfers
        self.router = router
        self._turns = (itertools.count(), itertools.count())
        self.requests = {r.index: r for r in requests}
        self.records: list[RequestRecord] = []
        self.gaps: list[list[float]] = []
        self.steps: list[tuple[float, ...]] = []
        self.handoffs: list[_Handoff] = []
        self.done = {r.index: env.event() for r in requests}
        self.report = current()

    def route(self, request: Request) -> None:
        """To a prefill instance, to compute the prompt and sample the first token only."""
        prefill = self._pick(self.prefill, self._turns[0])
        prefill.submit(Running(replace(request, output_len=1), arrival_s=self.env.now))

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

    def engine(self, instance: _Instance) -> Generator[simpy.Event, Any, None]:
        """One instance stepping while it has requests; with nothing it can schedule, it
        waits for blocks it lent (None lent: the engine is stuck, said in one line)."""
        scheduler, env = instance.scheduler, self.env
        while True:
            if not scheduler.busy:
                instance.idle = env.event()
                yield instance.idle
                instance.idle = None
            step = scheduler.schedule(env.now)
            if not step.requests and step.preempted:  # it made room: schedule again at once
                continue
            if not step.requests:
                returned = instance.blocked()
                if returned is None:
                    raise OptionError(instance.stuck())
                yield returned
                continue
            start = env.now
            seconds = instance.timer.time(step.mix).time_s
            yield env.timeout(seconds)
            self.steps.append(step_row(instance.index, start, seconds, step))
            for state in scheduler.complete(step, env.now):
                if isinstance(instance, _Prefill):
                    self._prefilled(instance, state)
                elif isinstance(instance, _Decode):
                    self._finish(instance, state)
            if isinstance(instance, _Decode):
                self._reserve(instance)

    def _pick(self, instances: Sequence[_Instance], turn: Iterator[int]) -> Any:
        if self.router == "round-robin":
            return instances[next(turn) % len(instances)]
        return min(instances, key=lambda r: (r.load, r.index))

    def _prefilled(self, prefill: _Prefill, state: Running) -> None:
        """A prompt done: its blocks kept for its transfer, a decode instance picked."""
        scheduler = prefill.scheduler
        kept = scheduler.blocks_for(state.computed)
        scheduler.free_blocks -= kept
        prefill.lent += kept
        decode = self._pick(self.decode, self._turns[1])
        handoff = _Handoff(state, prefill, decode, self.env.now, kept)
        self.handoffs.append(handoff)
        decode.incoming.append(handoff)
        self._reserve(decode)

    def _reserve(self, decode: _Decode) -> None:
        """Reserve blocks for the requests waiting for ``decode``, first come first
        served, while its blocks allow and no request it preempted waits, and send them."""
        scheduler = decode.scheduler
        while decode.incoming and all(s.blocks for s in scheduler.waiting):
            handoff = decode.incoming[0]
            request = self.requests[handoff.state.request.index]
            next_token = 1 if request.output_len > 1 else 0
            need = scheduler.blocks_for(request.input_len + next_token)
            if need > scheduler.free_blocks:
                break
            decode.incoming.popleft()
            scheduler.free_blocks -= need
            handoff.blocks = need
            decode.lent += 1
            self.env.process(self._send(handoff))

    def _send(self, handoff: _Handoff) -> Generator[simpy.Event, Any, None]:
        """The cache over the prefill instance's link; then its blocks there are free."""
        prefill, decode = handoff.prefill, handoff.decode
        with prefill.link.request() as turn:
            yield turn
            handoff.start_s = self.env.now
            tokens = handoff.state.computed
            handoff.sent = self.transfers.send(
                tokens, prefill.index, decode.index - len(self.prefill)
            )
            yield self.env.timeout(handoff.sent.time_s)
        prefill.scheduler.free_blocks += handoff.prefill_blocks
        prefill.lent -= handoff.prefill_blocks
        prefill.unblock()
        decode.lent -= 1
        self._land(handoff)
        decode.unblock()

    def _land(self, handoff: _Handoff) -> None:
        """The request on its decode instance, its prompt cached and its first token out:
        ahead of every request waiting there without blocks."""
        decode, prefilled, now = handoff.decode, handoff.state, self.env.now
        request = self.requests[prefilled.request.index]
        state = Running(
            request,
            arrival_s=prefilled.arrival_s,
            computed=request.input_len,
            generated=1,
            blocks=handoff.blocks,
            first_token_s=now,
            last_token_s=now,
            admitted_s=prefilled.admitted_s,
            preemptions=prefilled.preemptions,
        )
        scheduler = decode.scheduler
        if state.done:  # one output token: nothing to decode
            scheduler.free_blocks += state.blocks
            state.blocks, state.finish_s = 0, now
            self._finish(decode, state)
            self._reserve(decode)
            return
        scheduler.queue_after_holders(state)
        decode.wake()

    def _finish(self, decode: _Decode, state: Running) -> None:
        self.records.append(request_record(state, decode.index))
        self.gaps.append(state.gaps)
        self.done[state.request.index].succeed()
        self.report.advance()


def check_disaggregated(
    requests: Sequence[Request], engines: Sequence[EngineConfig], hardware: Any
) -> ClusterSpec:
    """The cluster ``hardware`` names (a lone accelerator refused: the KV caches cross its
    links); and refused, what disaggregated serving does not simulate yet: swap
    preemption, and shared prompt prefixes (a prefill instance lends a finished prompt's
    blocks to its transfer, and prefix blocks shared with other requests are not
    modelled there)."""
    cluster = resolve_hardware(hardware)[1]
    if cluster is None:
        raise OptionError(
            "disaggregated serving sends each request's KV cache between GPUs: price it on "
            "a cluster (dgx-h100, ...; `torchroof hardware` lists them)"
        )
    if any(engine.preemption == "swap" for engine in engines):
        raise OptionError(
            "swap preemption on disaggregated prefill and decode is not simulated yet: "
            "use recompute preemption there"
        )
    shared = next((r for r in requests if r.prefix_len), None)
    if shared is not None:
        raise OptionError(
            f"prefix caching on disaggregated prefill and decode is not simulated yet: "
            f"request {shared.index} shares a prefix (serve requests without prefix groups)"
        )
    return cluster


DISAGGREGATED_GROUPS = (
    "data-parallel attention (ep above tp) on a disaggregated side is not simulated yet: its "
    "ranks would step alone; give each side ep = tp"
)


@paused_gc()
def simulate_disaggregated(
    timers: tuple[StepTimer, StepTimer],
    requests: Sequence[Request],
    *,
    layout: Layout | str,
    engines: tuple[EngineConfig, EngineConfig] | None = None,
    concurrency: int | None = None,
    router: str = "round-robin",
) -> DisaggregatedResult:
    """Serve ``requests`` on ``layout``'s prefill instances (priced by ``timers[0]``, run
    by ``engines[0]``) and decode instances (``timers[1]``, ``engines[1]``) of the
    cluster both timers price on: at their own arrival times, or sent by
    ``concurrency`` closed-loop clients."""
    layout = layout if isinstance(layout, Layout) else Layout.parse(layout)
    engines = engines or (EngineConfig(), EngineConfig())
    _check_load(requests, concurrency, router)
    if any(timer.lockstep > 1 for timer in timers):
        raise OptionError(DISAGGREGATED_GROUPS)
    cluster = check_disaggregated(requests, engines, timers[1].hardware)
    # a prefill instance lends a finished prompt's blocks to its transfer: prefix blocks
    # shared with other requests are not modelled there, so neither side caches prefixes
    engines = (
        replace(engines[0], prefix_caching=False),
        replace(engines[1], prefix_caching=False),
    )
    plans = [timer.prepared.workload_for() for timer in timers]
    cached = [sorted({layer.kv_dtype for layer in timer.layers()}) for timer in timers]
    if cached[0] != cached[1]:
        raise OptionError(
            f"the prefill side caches K and V in {', '.join(cached[0])} and the decode side "
            f"in {', '.join(cached[1])}: give both one dtype or kv_dtype"
        )
    for timer in timers:
        timer.check_lengths(requests)
    capacities = (kv_capacity(timers[0], engines[0]), kv_capacity(timers[1], engines[1]))
    prompts = [replace(r, output_len=1) for r in requests]
    for side, load, engine, capacity in zip(
        ("prefill", "decode"), (prompts, requests), engines, capacities, strict=True
    ):
        try:
            check_fits(load, engine, capacity)
        except OptionError as error:
            raise OptionError(f"on the {side} side, {error}") from None
    placement = place(layout, plans[0].parallel_plan.world, plans[1].parallel_plan.world, cluster)
    transfers = KvTransfers(
        cluster, placement, plans[0].tp, plans[1].tp, capacities[1].bytes_per_token
    )
    blocks = (capacities[0].blocks, capacities[1].blocks)
    run = _Run(timers, engines, blocks, layout, transfers, router, requests)
    for instance in [*run.prefill, *run.decode]:
        run.env.process(run.engine(instance))
    if concurrency is None:
        run.env.process(run.arrivals(sorted(requests, key=lambda r: (r.arrival_s, r.index))))
    else:
        queue = iter(requests)
        for _ in range(min(concurrency, len(requests))):
            run.env.process(run.client(queue))
    with run.report.stage(f"serving {len(requests):,} requests", len(requests), "requests"):
        run.env.run(until=simpy.AllOf(run.env, list(run.done.values())))
    described = _described(run, layout, engines, capacities, concurrency)
    described["prefill"]["gpus"] = [list(gpus) for gpus in placement.prefill]
    described["decode"]["gpus"] = [list(gpus) for gpus in placement.decode]
    return _result(run, described)


def _check_load(requests: Sequence[Request], concurrency: int | None, router: str) -> None:
    """Refuse an unknown router, no requests, a concurrency that is not a whole number
    >= 1, open arrivals without times, and two requests of one index."""
    if router not in ROUTERS:
        raise OptionError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
    if not requests:
        raise OptionError("no requests to serve")
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
    ):
        raise OptionError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
    if concurrency is None and any(r.arrival_s is None for r in requests):
        raise OptionError("requests without arrival times need a concurrency (closed loop)")
    if len({r.index for r in requests}) != len(requests):
        raise OptionError("two requests share an index: number them apart")


def _described(
    run: _Run,
    layout: Layout,
    engines: tuple[EngineConfig, EngineConfig],
    capacities: tuple[KvCapacity, KvCapacity],
    concurrency: int | None,
) -> dict[str, Any]:
    """The deployment: the decode side's engine and plan at the top (its tokens reach the
    client), the layout, and each side's instances, plan, engine and KV cache."""
    sides: dict[str, Any] = {}
    each: tuple[Sequence[_Instance], Sequence[_Instance]] = (run.prefill, run.decode)
    for name, instances, engine, kv in zip(
        ("prefill", "decode"), each, engines, capacities, strict=True
    ):
        plan = instances[0].timer.describe()
        sides[name] = {
            "instances": len(instances),
            "first_replica": instances[0].index,
            **{key: plan[key] for key in ("tp", "ep", "dtype", "kv_dtype", "quant")},
            **asdict(engine),
            "kv_blocks": kv.blocks,
            "kv_bytes_per_token": kv.bytes_per_token,
        }
    return {
        **asdict(engines[1]),
        "kv_blocks": capacities[1].blocks,
        "kv_bytes_per_token": capacities[1].bytes_per_token,
        "replicas": layout.prefill + layout.decode,
        "router": run.router,
        "concurrency": concurrency,
        **run.decode[0].timer.describe(),
        "disaggregate": str(layout),
        **sides,
    }


def _result(run: _Run, described: dict[str, Any]) -> DisaggregatedResult:
    records = tuple(sorted(run.records, key=lambda r: r.index))
    log = step_log(run.steps)
    itl = np.array([gap for gaps in run.gaps for gap in gaps], dtype=float)
    handoffs = sorted(run.handoffs, key=lambda h: h.state.request.index)
    sent = [h.sent for h in handoffs]
    assert all(s is not None for s in sent)  # every request's transfer ended
    transfers = TransferLog(
        index=np.array([h.state.request.index for h in handoffs], dtype=int),
        prefill=np.array([h.prefill.index for h in handoffs], dtype=int),
        decode=np.array([h.decode.index for h in handoffs], dtype=int),
        bytes=np.array([s.bytes for s in sent if s], dtype=np.int64),
        ready_s=np.array([h.ready_s for h in handoffs], dtype=float),
        start_s=np.array([h.start_s for h in handoffs], dtype=float),
        time_s=np.array([s.time_s for s in sent if s], dtype=float),
        link=tuple(s.link for s in sent if s),
    )
    return DisaggregatedResult(records, itl, log, described, transfers)

"""Pipeline schedules: torch's own action order, laid on a per-rank timeline.

PyTorch docs, ``torch.distributed.pipelining``: its schedules expose
``pipeline_order``, each rank's list of actions (``0F3``: stage 0, forward, micro-batch 3;
``B`` a whole backward, ``I`` / ``W`` the input and weight halves of a split backward), built
for every rank without running anything. That order is the program; the bubble comes out of
laying it on a timeline with the stages' traced times, not out of the textbook formula:

- each rank runs its actions one after another, in its list's order;
- ``F`` of stage s, micro-batch m waits for ``F`` of stage s − 1, m and the activation's
  transfer between the two stages' ranks;
- ``B`` or ``I`` of stage s, m waits for ``F`` of s, m and for ``B``/``I`` of stage s + 1, m
  and the gradient's transfer back; ``W`` waits for ``I`` of the same stage and micro-batch;
- a transfer between two stages on one rank (the turn of a V schedule) takes no time;
  transfers overlap compute (torch posts its sends and receives asynchronously).

With equal stages, ``F`` and ``B`` times t_F, t_B and free transfers, GPipe and 1F1B both
take (m + p − 1)(t_F + t_B): each rank idles (p − 1)/(m + p − 1) of the step (Huang et al.
2019, GPipe; Narayanan et al. 2021: a step is a graph with a critical path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from torchroof.config.choices import SINGLE_STAGE, V_SHAPED
from torchroof.parallel.program import fake_process_group

ActionKind = Literal["F", "B", "I", "W"]
FORWARD: ActionKind = "F"
BACKWARD: ActionKind = "B"
BACKWARD_INPUT: ActionKind = "I"
BACKWARD_WEIGHT: ActionKind = "W"

SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torchroof's names for ``torch.distributed.pipelining``'s schedules."""
# which schedules hold one stage per rank or two in a V are config's facts (SINGLE_STAGE,
# V_SHAPED): the Workload checks them before any tracing


@dataclass(frozen=True, order=True)
class Action:
    """One entry of a rank's list: a stage's forward, backward, or backward half, on one
    micro-batch."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each rank holds: one for GPipe and 1F1B, two for V schedules, ``virtual_stages``
    for the interleaved ones."""
    check_schedule(schedule)
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return virtual_stages


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
        )


def action_order(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 2
) -> dict[int, list[Action]]:
    """Each rank's actions, in order, as torch's ``schedule`` class builds them for ``pp``
    ranks and ``microbatches`` micro-batches (its ``pipeline_order``; idle slots dropped).
    Built on a fake process group of ``pp`` ranks over placeholder stages on meta: the order
    depends on the rank count, the stage count and the micro-batches only. A ValueError
    when torch refuses the combination (its own message)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    check_schedule(schedule)
    if pp < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got pp={pp}")
    per_rank = stages_per_rank(schedule, virtual_stages)
    stages = pp * per_rank
    if schedule in V_SHAPED:
        indices = [0, stages - 1]
    else:
        indices = [k * pp for k in range(per_rank)]
    with fake_process_group(pp):
        group = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",)).get_group()
        placeholders = [
            PipelineStage(torch.nn.Identity(), index, stages, torch.device("cpu"), group=group)
            for index in indices
        ]
        cls = getattr(torch_schedules, SCHEDULES[schedule])
        try:
            if schedule in SINGLE_STAGE:
                built = cls(placeholders[0], n_microbatches=microbatches)
            else:
                built = cls(placeholders, n_microbatches=microbatches)
        except (ValueError, AssertionError, RuntimeError) as error:
            raise ValueError(
                f"torch's {SCHEDULES[schedule]} refuses pp={pp}, {microbatches} micro-batches"
                f" and {stages} stages: {error}"
            ) from error
        order = built.pipeline_order
    actions = {rank: list(_actions(order[rank])) for rank in sorted(order)}
    if schedule in SINGLE_STAGE:
        # Schedule1F1B's order (torch 2.13, ``_get_pipeline_order``, a picture of what
        # ``_step_microbatches`` runs) numbers the last rank's forwards from 1, not 0; each
        # stage of a single-stage schedule takes its micro-batches in order, so renumber.
        actions = {rank: _in_order(listed) for rank, listed in actions.items()}
    return actions


def _in_order(actions: list[Action]) -> list[Action]:
    """The same kinds in the same order, each kind's micro-batches numbered 0, 1, ..."""
    seen: dict[str, int] = {}
    renumbered = []
    for action in actions:
        count = seen.get(action.kind, 0)
        seen[action.kind] = count + 1
        renumbered.append(Action(action.stage, action.kind, count))
    return renumbered


def _actions(entries: Iterable[object]) -> Iterable[Action]:
    """torch's actions as :class:`Action`; an overlapped forward + backward pair (DualPipeV's
    ``OVERLAP_F_B``) as its two actions one after another (their overlap is not credited)."""
    for entry in entries:
        if entry is None:
            continue
        subs = getattr(entry, "sub_actions", None)
        if subs:
            yield from _actions(subs)
            continue
        kind = entry.computation_type.value  # type: ignore[attr-defined]
        if kind not in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            continue  # sends, receives, unshard/reshard: timed as transfers or not at all
        yield Action(entry.stage_index, kind, entry.microbatch_index)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineTimeline:
    """Every action's start and end, each rank's busy time, and the step (the last end)."""

    actions: tuple[TimedAction, ...]
    ranks: int
    step_time_s: float

    def busy_s(self, rank: int) -> float:
        return sum(t.end_s - t.start_s for t in self.actions if t.rank == rank)

    def idle_share(self, rank: int) -> float:
        """The share of the step ``rank`` waits: its bubble."""
        return 1.0 - self.busy_s(rank) / self.step_time_s if self.step_time_s else 0.0

    @property
    def bubble_share(self) -> float:
        """Idle share over every rank: 1 − Σ busy / (ranks · step)."""
        if not self.step_time_s:
            return 0.0
        busy = sum(t.end_s - t.start_s for t in self.actions)
        return 1.0 - busy / (self.ranks * self.step_time_s)

    def in_flight(self, stage: int) -> int:
        """The most micro-batches whose activations ``stage`` holds at once: forwards run
        whose backward has not yet finished (a whole ``B``, or the ``W`` half of a split
        one: the weight gradients still read the saved inputs), in the rank's own order."""
        return self.held_peak({stage: 1})

    def held_peak(self, saved: Mapping[int, int]) -> int:
        """The most a rank holds at once of what each forward of its stages keeps for its
        backward: ``saved[stage]`` per micro-batch in flight, summed over the stages at the
        same moment (a rank's stages peak at different times: torch's interleaved order
        keeps rank 0's first stage full while its last has not begun, so the sum of each
        stage's own peak overstates it). With ``pp`` ranks, ``v`` stages each and enough
        micro-batches, rank 0 holds 2(pp − 1) + (v − 1)·pp + 1 stage-micro-batches at once,
        the warm-up count of Megatron-LM's interleaved schedule
        (``get_pipeline_parallel_schedule`` / ``forward_backward_pipelining_with_interleaving``
        in megatron/core/pipeline_parallel/schedules.py) plus the one in its steady state."""
        release = (BACKWARD, BACKWARD_WEIGHT)
        held = peak = 0
        for timed in sorted(self.actions, key=lambda t: (t.start_s, t.end_s)):
            size = saved.get(timed.action.stage)
            if size is None:
                continue
            if timed.action.kind == FORWARD:
                held += size
                peak = max(peak, held)
            elif timed.action.kind in release:
                held -= size
        return peak


def simulate(
    order: dict[int, list[Action]],
    duration_s: Callable[[Action], float],
    transfer_s: Callable[[int, int], float] = lambda source, target: 0.0,
) -> PipelineTimeline:
    """Lay ``order`` on a timeline under this module's rules. ``duration_s(action)`` is the
    action's time on its rank, ``transfer_s(stage, next_stage)`` the time an activation (or
    its gradient) takes between the two stages' ranks. A ValueError when the order cannot
    run (an action waits for one that never comes)."""
    host = {a.stage: rank for rank, actions in order.items() for a in actions}
    last_stage = max(host)
    done: dict[Action, float] = {}
    position = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    timed: list[TimedAction] = []
    remaining = sum(len(actions) for actions in order.values())

    def edge(source: int, target: int) -> float:
        return 0.0 if host[source] == host[target] else transfer_s(source, target)

    def ready(action: Action) -> float | None:
        waits: list[tuple[Action, float]] = []
        s, m = action.stage, action.microbatch
        if action.kind == FORWARD:
            if s > 0:
                waits.append((Action(s - 1, FORWARD, m), edge(s - 1, s)))
        elif action.kind in (BACKWARD, BACKWARD_INPUT):
            waits.append((Action(s, FORWARD, m), 0.0))
            if s < last_stage:
                later = Action(s + 1, action.kind, m)
                if later not in done:
                    other = BACKWARD if action.kind == BACKWARD_INPUT else BACKWARD_INPUT
                    alternative = Action(s + 1, other, m)
                    later = alternative if alternative in done else later
                waits.append((later, edge(s + 1, s)))
        else:  # W
            waits.append((Action(s, BACKWARD_INPUT, m), 0.0))
        at = 0.0
        for needed, delay in waits:
            if needed not in done:
                return None
            at = max(at, done[needed] + delay)
        return at

    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                at = ready(action)
                if at is None:
                    break
                start = max(free[rank], at)
                end = start + duration_s(action)
                done[action] = free[rank] = end
                timed.append(TimedAction(rank, action, start, end))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(a[position[r]]) for r, a in order.items() if position[r] < len(a)}
            raise ValueError(f"the pipeline order cannot run: ranks wait on {stuck}")
    step = max((t.end_s for t in timed), default=0.0)
    return PipelineTimeline(tuple(timed), len(order), step)

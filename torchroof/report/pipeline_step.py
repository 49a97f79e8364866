"""A pipelined step's schedule as the estimate holds it: one row per stage and per rank, the
timeline's spans, and the bubble, the slowest rank and the activations' trip between stages."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage of a priced step: where it runs, what it holds, each action's
    time per micro-batch, what runs once after the pipeline (gradient sync, optimizer), and
    its memory with the micro-batches the schedule keeps in flight."""

    stage: int
    rank: int
    layers: str
    traced_as: int  # the stage whose trace this one reuses (equal layers)
    forward_s: float
    backward_s: float  # B, or I + W
    input_s: float  # I (split backward), else 0
    weight_s: float  # W (split backward), else 0
    after_s: float  # once per step, after the pipeline drains
    flops: int  # one micro-batch's F + B
    after_flops: int
    activation_bytes: int  # what it sends on (or receives) per micro-batch
    in_flight: int  # micro-batches held: activations (train), cached sequences (serving)
    saved_bytes: int  # activations one micro-batch keeps for its backward
    memory_bytes: int  # fixed + peak + (in_flight - 1) · saved (serving: · KV instead)
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class RankRow:
    rank: int
    stages: tuple[int, ...]
    busy_s: float  # its actions' time
    end_s: float  # when its step ends: its last action, then its after-pipeline work
    memory_bytes: int = 0  # its footprint at its fullest moment
    # what that moment holds at least: weights, gradients, optimizer state, KV cache and the
    # activations its stages keep for the micro-batches in flight (no transient beside them)
    floor_bytes: int = 0

    def idle_share(self, step_s: float) -> float:
        return 1.0 - self.busy_s / step_s if step_s else 0.0


@dataclass(frozen=True)
class Span:
    """One interval of a rank's timeline: an action (``F``, ``B``, ``I``, ``W`` of a stage
    and micro-batch), a ``send`` of an activation or gradient to another stage's rank, or
    the work ``after`` the pipeline (gradient sync, optimizer)."""

    rank: int
    what: str  # F, B, I, W, send, after
    stage: int
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineStep:
    """A pipelined step as the schedule laid it out."""

    schedule: str
    pp: int
    microbatches: int
    stages: tuple[StageRow, ...]
    ranks: tuple[RankRow, ...]
    pipeline_s: float  # from the first action to the last
    step_time_s: float  # the last rank's end, after-pipeline work included
    bubble_share: float  # idle share of the ranks over the pipeline
    transfer_s: float  # one activation across the slowest stage boundary
    transfer_link: str  # that boundary's link
    slowest_rank: int
    slowest_reason: str
    trains: bool
    timeline: tuple[Span, ...] = ()
    heaviest_rank: int = 0  # the rank whose memory the estimate reports
    latency_s: float = 0.0  # one micro-batch's forward through every stage and boundary

    @property
    def steady_state_s(self) -> float:
        """A step's time once successive steps' micro-batches keep every stage busy (how a
        serving pipeline runs): the busiest rank's work, no fill or drain."""
        return max(r.busy_s for r in self.ranks)

    @property
    def rank_flops(self) -> int:
        """FLOPs the slowest rank runs in the step: its stages' per-micro-batch work times
        the micro-batches, plus its after-pipeline work."""
        rank = self.ranks[self.slowest_rank]
        rows = [self.stages[s] for s in rank.stages]
        return sum(r.flops * self.microbatches + r.after_flops for r in rows)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PipelineStep:
        values = dict(data)
        values["stages"] = tuple(StageRow(**row) for row in data["stages"])
        values["ranks"] = tuple(
            RankRow(**{**row, "stages": tuple(row["stages"])}) for row in data["ranks"]
        )
        values["timeline"] = tuple(Span(**span) for span in data.get("timeline", ()))
        return cls(**values)

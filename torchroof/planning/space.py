"""Every training layout of a model on N GPUs that torchroof can run, and why each family
it leaves out is left out.

The sizes multiply to N = tp x cp x pp x fsdp x dp (:class:`TrainingLayout`). A family is
refused where a size cannot shard what it splits: tensor parallel splits whole query and
K/V heads (transformers' ``base_model_tp_plan``, :func:`~torchroof.parallel.tensor.
check_tensor_parallel`), context parallel the sequence, each pipeline stage holds at least
one decoder layer (torchtitan's ``pipeline_module_split``), expert parallel whole experts;
the data ranks (fsdp x dp) split the global batch into micro-batches of whole sequences.
What is left is checked as :func:`torchroof.estimate` checks a workload (the knobs, each
parallel strategy's own refusal, and torch's pipeline schedule for its micro-batches and
stages), so a layout listed here is one an estimate takes.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torchroof.config import Workload
from torchroof.config.choices import INTERLEAVED, PIPELINE_SCHEDULES, SINGLE_STAGE
from torchroof.config.errors import OptionError, WorkloadError
from torchroof.models.sources import text_config
from torchroof.parallel.pipeline.schedule import action_order
from torchroof.parallel.tensor import check_tensor_parallel
from torchroof.planning.layouts import RECOMPUTE, TrainingLayout
from torchroof.workloads.parallel_step import check_plan

LISTED = (
    "tp",
    "sequence_parallel",
    "cp",
    "pp",
    "schedules",
    "virtual_stages",
    "ep",
    "zero",
    "recompute",
    "micro_batch",
)
"""The :class:`TrainingSpace` fields that list choices."""

DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b")
"""The pipeline schedules searched unless others are given: torchtitan's default and its
interleaved form (two stages a rank)."""


@dataclass(frozen=True)
class TrainingSpace:
    """What a training search may choose. ``None`` for a size: every divisor of the GPU
    count that can shard it. Micro-batch sizes are those in ``micro_batch`` (sequences a
    data rank trains on at once), else the divisors of each data rank's sequences up to
    ``max_micro_batch``."""

    gpus: int
    seq: int
    global_batch: int  # sequences per optimizer step
    tp: tuple[int, ...] | None = None
    sequence_parallel: tuple[bool, ...] = (False, True)
    cp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    virtual_stages: tuple[int, ...] = (2,)  # stages a rank holds under an interleaved schedule
    ep: tuple[int, ...] | None = None
    hsdp: bool = True  # shard x replicate splits of the data ranks, not only all of one
    zero: tuple[int, ...] = (0, 1, 2)  # stages searched where the data ranks replicate
    max_micro_batch: int = 8
    recompute: tuple[str, ...] = RECOMPUTE
    micro_batch: tuple[int, ...] | None = None  # None: every divisor up to max_micro_batch

    def __post_init__(self) -> None:
        for name in LISTED:  # each choice once, in the order given
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or (
                value is not None and not isinstance(value, (tuple, list))
            ):
                raise OptionError(
                    f"{name} takes a list of choices, e.g. ({value!r},), got {value!r}"
                )
            if value is not None:
                object.__setattr__(self, name, tuple(dict.fromkeys(value)))
        for name in ("gpus", "seq", "global_batch", "max_micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("tp", "cp", "pp", "ep", "virtual_stages", "micro_batch"):
            sizes = getattr(self, name)
            if sizes is not None and (
                not sizes
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            ):
                raise OptionError(f"{name} must list whole numbers >= 1, got {sizes!r}")
        unknown = sorted(set(self.schedules) - set(PIPELINE_SCHEDULES))
        if unknown:
            raise OptionError(
                f"unknown pipeline schedule {unknown[0]!r} (known: {', '.join(PIPELINE_SCHEDULES)})"
            )
        bad = sorted(set(self.recompute) - set(RECOMPUTE))
        if bad or not self.recompute:
            raise OptionError(
                f"recompute must list some of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if any(stage not in (0, 1, 2) for stage in self.zero) or not self.zero:
            raise OptionError(f"zero must list stages among 0, 1, 2, got {self.zero!r}")


@dataclass
class Enumeration:
    """The layouts to price, and each left-out family's reason with how many times it
    held: a size, schedule or batch split refused counts once for every layout under it;
    a layout the workload checks refuse counts once itself."""

    layouts: list[TrainingLayout] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1


@dataclass(frozen=True)
class ModelFacts:
    layers: int
    experts: int  # routed experts per MoE layer, 0 for a dense model


def model_facts(config: Any) -> ModelFacts:
    """What the search reads of a model's config: its decoder layers, query and K/V heads
    and routed experts (0 for a dense model)."""
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise OptionError("the model's config states no num_hidden_layers: no layout to search")
    experts = 0
    for name in ("num_local_experts", "n_routed_experts", "num_experts"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 1:
            experts = value
            break
    return ModelFacts(layers, experts)


def enumerate_training(
    config: Any,
    space: TrainingSpace,
    name: str = "the model",
    workload: dict[str, Any] | None = None,
) -> Enumeration:
    """Every layout of ``space`` that ``config``'s model can run, and the reasons for the
    rest (:class:`Enumeration`); ``workload`` holds the step's other fields (precision,
    optimizer, ...), checked with each layout."""
    facts = model_facts(config)
    out = Enumeration()
    for tp in _sizes("tp", space.tp, space.gpus, out):
        try:
            check_tensor_parallel(config, tp)
        except ValueError as error:
            out.reject(f"tp={tp}: {error}")
            continue
        for cp in _sizes("cp", space.cp, space.gpus // tp, out):
            if space.seq % cp:
                out.reject(f"cp={cp} does not divide the sequence of {space.seq:,} tokens")
                continue
            for pp in _sizes("pp", space.pp, space.gpus // (tp * cp), out):
                if pp > facts.layers:
                    out.reject(f"pp={pp} exceeds the {facts.layers} decoder layers")
                    continue
                _data_layouts(config, space, facts, (tp, cp, pp), out, (name, workload or {}))
    return out


def _data_layouts(
    config: Any,
    space: TrainingSpace,
    facts: ModelFacts,
    sizes: tuple[int, int, int],
    out: Enumeration,
    named: tuple[str, dict[str, Any]],
) -> None:
    """The layouts of one (tp, cp, pp): each split of the data ranks, micro-batch,
    schedule, expert-parallel size, sequence parallel and recompute."""
    tp, cp, pp = sizes
    data = space.gpus // (tp * cp * pp)
    if space.global_batch % data:
        out.reject(
            f"the global batch of {space.global_batch:,} sequences does not split over "
            f"{data} data-parallel ranks"
        )
        return
    per_rank = space.global_batch // data
    experts = list(_expert_sizes(space, facts, tp, data * cp * tp, out))
    schedules = list(_schedules(space, pp, facts.layers, out))
    micros = _micro_batches(space, per_rank, out)
    for fsdp, dp, zero in _data_splits(data, space):
        for ep in experts:
            for micro in micros:
                for schedule, stages in schedules:
                    for sp in space.sequence_parallel if tp > 1 else (False,):
                        for recompute in space.recompute:
                            layout = TrainingLayout(
                                tp, sp, cp, pp, schedule, stages, ep, fsdp, dp, zero,
                                micro, per_rank // micro, recompute,
                            )  # fmt: skip
                            problem = check_layout(config, layout, space.seq, *named)
                            if problem is None:
                                out.layouts.append(layout)
                            else:
                                out.reject(problem)


def check_layout(
    config: Any, layout: TrainingLayout, seq: int, name: str, fields: dict[str, Any]
) -> str | None:
    """Why :func:`torchroof.estimate` would refuse ``layout`` with the step's other
    ``fields`` (its first line), or None."""
    try:
        workload = Workload(regime="train", seq=seq, **fields, **layout.knobs())
        check_plan(config, workload, name)
    except (WorkloadError, OptionError, ValueError) as error:
        return str(error).splitlines()[0]
    if layout.pp > 1:  # torch's schedule takes these micro-batches over these stages
        return _schedule_refusal(
            workload.pp_schedule, layout.pp, layout.microbatches, workload.virtual_stages
        )
    return None


@functools.lru_cache(maxsize=4096)
def _schedule_refusal(schedule: str, pp: int, microbatches: int, stages: int) -> str | None:
    """What torch's pipeline schedule says of ``pp`` ranks, ``microbatches`` and ``stages``
    a rank (its refusal's first line), or None; built once per combination."""
    try:
        action_order(schedule, pp, microbatches, stages)
    except ValueError as error:
        return str(error).splitlines()[0]
    return None


def _micro_batches(space: TrainingSpace, per_rank: int, out: Enumeration) -> list[int]:
    """The micro-batch sizes for data ranks of ``per_rank`` sequences each: the given ones
    that divide them (the others refused), else every divisor up to ``max_micro_batch``."""
    if space.micro_batch is None:
        return [micro for micro in _divisors(per_rank) if micro <= space.max_micro_batch]
    for micro in space.micro_batch:
        if per_rank % micro:
            out.reject(
                f"a micro-batch of {micro} sequences does not divide the {per_rank} each "
                "data rank trains on"
            )
    return [micro for micro in space.micro_batch if per_rank % micro == 0]


def _data_splits(data: int, space: TrainingSpace) -> Iterator[tuple[int, int, int]]:
    """(fsdp, dp, zero) for ``data`` data ranks: all sharded (FSDP), all replicated (DDP
    and each ZeRO stage searched), and with ``hsdp`` every shard x replicate split between."""
    if data == 1:
        yield 1, 1, 0
        return
    yield data, 1, 0
    for zero in space.zero:
        yield 1, data, zero
    if space.hsdp:
        for shard in _divisors(data):
            if 1 < shard < data:
                yield shard, data // shard, 0


def _expert_sizes(
    space: TrainingSpace, facts: ModelFacts, tp: int, ranks: int, out: Enumeration
) -> Iterator[int]:
    """Expert-parallel sizes: 1 for a dense model; for a MoE, multiples of tp dividing both
    its experts and the ``ranks`` (data x cp x tp) they borrow."""
    if not facts.experts:
        for ep in space.ep or ():
            if ep > 1:
                out.reject(f"ep={ep}: the model has no routed experts to shard")
        yield 1
        return
    for ep in space.ep or _divisors(ranks):
        if ep > 1 and (facts.experts % ep or ranks % ep or ep % tp):
            out.reject(
                f"ep={ep} must divide the {facts.experts} experts and the {ranks} data x cp x tp "
                f"ranks, and be a multiple of tp={tp}"
            )
            continue
        yield ep


def _schedules(
    space: TrainingSpace, pp: int, layers: int, out: Enumeration
) -> Iterator[tuple[str, int]]:
    """(schedule, stages a rank holds) for ``pp`` stages; one entry without a pipeline."""
    if pp == 1:
        yield "1f1b", 1
        return
    for schedule in space.schedules:
        if schedule in SINGLE_STAGE:
            yield schedule, 1
            continue
        for stages in space.virtual_stages if schedule in INTERLEAVED else (2,):
            if pp * stages > layers:
                out.reject(
                    f"pp={pp} with {stages} stages a rank ({schedule}) needs {pp * stages} "
                    f"stages, above the {layers} decoder layers"
                )
                continue
            yield schedule, stages


def _sizes(name: str, given: tuple[int, ...] | None, limit: int, out: Enumeration) -> list[int]:
    """The sizes of ``name`` to try on ``limit`` ranks: the given ones that divide it (the
    others refused), else every divisor."""
    if given is None:
        return _divisors(limit)
    for size in sorted(set(given)):
        if limit % size:
            out.reject(f"{name}={size} does not divide the {limit} GPUs left for it")
    return [size for size in sorted(set(given)) if limit % size == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

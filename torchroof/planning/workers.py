"""Where a search prices its layouts: one after another here, in a pool of processes
(``jobs``), or on a Ray cluster (``ray_address``) for searches that outgrow one machine.

Each layout is priced by :func:`price_layout` from its own arguments, so every worker
gives the numbers this process would: results come back in the layouts' order whatever
finishes first. Layouts whose pipelines run the same stage programs (1F1B and interleaved
1F1B over the same ranks; pipelines of several sizes over replicas of the same shards:
:func:`share_group`) go to one worker together, which prices
them in one :func:`price_group` and traces each such stage once
(:mod:`torchroof.parallel.pipeline.shared`); the figures are those each gets alone.
Processes start with ``spawn`` (a fresh interpreter, as torch.multiprocessing recommends
where threads may hold locks); Ray runs :func:`price_group` as a remote task (docs.ray.io,
"Tasks").
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from torchroof.api import config_of
from torchroof.config import PricingOptions
from torchroof.config.errors import OptionError, first_line
from torchroof.models.sources import text_config
from torchroof.parallel.pipeline.shared import shared_stages
from torchroof.parallel.pipeline.workers import WORKERS_VARIABLE
from torchroof.planning.layouts import TrainingLayout
from torchroof.planning.shallow import offloaded, priced_from_copies, shallow_metrics
from torchroof.prepared import prepare
from torchroof.progress import silenced


@dataclass(frozen=True)
class PricingJob:
    """Everything one layout's pricing needs: the model, the step, where it runs."""

    model: Any
    layout: TrainingLayout
    seq: int
    hardware: Any
    workload: dict[str, Any]
    pricing: PricingOptions | None
    pricing_knobs: dict[str, Any]
    shallow: bool = False  # priced from shallow copies where the layout takes them


def price_layout(job: PricingJob) -> dict[str, Any] | str:
    """The layout's figures (:meth:`~torchroof.prepared.PreparedModel.metrics`; carried
    from shallow copies of the model where ``job.shallow`` and the layout takes them,
    :mod:`torchroof.planning.shallow`), or the one line its refusal says."""
    try:
        with silenced():
            if job.shallow:
                config = config_of(job.model)
                layers = text_config(config).num_hidden_layers
                offload = offloaded(job.pricing, job.pricing_knobs)
                if priced_from_copies(layers, job.layout, job.workload, offload):
                    carried = shallow_metrics(
                        config,
                        job.layout,
                        job.seq,
                        job.hardware,
                        job.workload,
                        job.pricing,
                        job.pricing_knobs,
                    )
                    if carried is not None:
                        return carried
            prepared = prepare(
                job.model, "train", seq=job.seq, **job.workload, **job.layout.knobs()
            )
            return prepared.metrics(job.hardware, pricing=job.pricing, **job.pricing_knobs)
    except ValueError as error:  # a refusal of this layout (WorkloadError and kin)
        return first_line(error)


def run_jobs(
    jobs: Sequence[PricingJob], processes: int = 1, ray_address: str | None = None
) -> Iterator[dict[str, Any] | str]:
    """Each job's result, in order: here, in ``processes`` processes, or on Ray; the jobs
    whose pipelines may share stage traces (:func:`share_group`) priced together, in one
    :func:`price_group`."""
    groups = _groups(jobs)
    tasks = [[jobs[i] for i in group] for group in groups]
    if ray_address is not None:
        with contextlib.closing(_on_ray(tasks, ray_address, processes)) as done:
            yield from _in_order(groups, done)
    elif processes > 1 and len(tasks) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            min(processes, len(tasks)), mp_context=context, initializer=_stages_in_turn
        ) as pool:
            yield from _in_order(groups, pool.map(price_group, tasks))
    else:
        yield from _in_order(groups, map(price_group, tasks))


def price_group(jobs: Sequence[PricingJob]) -> list[dict[str, Any] | str]:
    """Each job's :func:`price_layout`, their pipelines' stages traced once where they run
    the same program (:func:`torchroof.parallel.pipeline.shared.shared_stages`)."""
    with shared_stages():
        return [price_layout(job) for job in jobs]


def share_group(layout: TrainingLayout) -> TrainingLayout:
    """What a layout's stages are made of: the layout but its schedule and the stages each
    rank holds (1F1B and interleaved 1F1B over the same ranks run stages of the same
    programs wherever the stages hold the same layers; without a pipeline, its own), and
    where its data ranks are replicas that shard nothing over them (DDP, HSDP), but its
    pipeline's size and with it their number and the micro-batches (a stage program over
    some replicas is the one over others but its all-reduces' groups,
    :mod:`torchroof.parallel.replicas`)."""
    if layout.pp == 1:
        return layout
    shared = replace(layout, pp_schedule="", virtual_stages=1)
    if layout.dp > 1 and layout.zero == 0 and layout.ep == 1:
        shared = replace(shared, pp=0, dp=0, microbatches=0)
    return shared


def _groups(jobs: Sequence[PricingJob]) -> list[list[int]]:
    """The jobs' indices grouped by :func:`share_group` (with the rest of the job equal),
    the groups in the order of their first job."""
    groups: dict[Any, list[int]] = {}
    for index, job in enumerate(jobs):
        key = replace(job, layout=share_group(job.layout))
        groups.setdefault(_hashable(key), []).append(index)
    return list(groups.values())


def _hashable(job: PricingJob) -> tuple[Any, ...]:
    """``job`` as a dictionary key: its fields, the dictionaries among them as their
    items, anything else unhashable by its repr."""
    out = []
    for value in vars(job).values():
        if isinstance(value, dict):
            value = tuple(sorted(value.items(), key=repr))
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        out.append(value)
    return tuple(out)


def _in_order(
    groups: Sequence[Sequence[int]], results: Iterable[list[dict[str, Any] | str]]
) -> Iterator[dict[str, Any] | str]:
    """The groups' results as one sequence in the jobs' order, each yielded as soon as
    every job before it has its result."""
    ready: dict[int, dict[str, Any] | str] = {}
    following = 0
    for group, priced in zip(groups, results, strict=True):
        ready.update(zip(group, priced, strict=True))
        while following in ready:
            yield ready.pop(following)
            following += 1


def _stages_in_turn() -> None:
    """In a pool's process: trace a pipelined layout's stages one after another (the pool
    already keeps every processor busy; each process forking its own stage tracers would
    run processors x processors of them)."""
    os.environ[WORKERS_VARIABLE] = "1"


def _on_ray(
    tasks: Sequence[Sequence[PricingJob]], address: str, processes: int
) -> Generator[list[dict[str, Any] | str], None, None]:
    """Each group of jobs (:func:`price_group`) as a Ray task on the cluster at
    ``address`` (``local``: a Ray instance of ``processes`` CPUs started here), their
    results in order."""
    try:
        import ray
    except ImportError:
        raise OptionError(
            "pricing on Ray needs the ray package: pip install 'torchroof[ray]'"
        ) from None
    started = not ray.is_initialized()
    if started:
        where = {"num_cpus": processes} if address == "local" else {"address": address}
        ray.init(**where, log_to_driver=False)
    try:
        remote: Callable[..., Any] = ray.remote(price_group).remote
        refs = [remote(task) for task in tasks]
        for ref in refs:
            yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()

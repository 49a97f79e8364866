"""Where a search prices its layouts: one after another here, in a pool of processes
(``jobs``), or on a Ray cluster (``ray_address``) for searches that outgrow one machine.

Each layout is priced by :func:`price_layout` alone, from its own arguments, so every
worker gives the numbers this process would: results come back in the layouts' order
whatever finishes first. Processes start with ``spawn`` (a fresh interpreter, as
torch.multiprocessing recommends where threads may hold locks); Ray runs the same function
as a remote task (docs.ray.io, "Tasks").
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from torchroof.api import config_of
from torchroof.config import PricingOptions
from torchroof.config.errors import OptionError, first_line
from torchroof.models.sources import text_config
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
    """Each job's result, in order: here, in ``processes`` processes, or on Ray."""
    if ray_address is not None:
        yield from _on_ray(jobs, ray_address, processes)
    elif processes > 1 and len(jobs) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            min(processes, len(jobs)), mp_context=context, initializer=_stages_in_turn
        ) as pool:
            yield from pool.map(price_layout, jobs)
    else:
        yield from map(price_layout, jobs)


def _stages_in_turn() -> None:
    """In a pool's process: trace a pipelined layout's stages one after another (the pool
    already keeps every processor busy; each process forking its own stage tracers would
    run processors x processors of them)."""
    os.environ[WORKERS_VARIABLE] = "1"


def _on_ray(
    jobs: Sequence[PricingJob], address: str, processes: int
) -> Iterator[dict[str, Any] | str]:
    """The jobs as Ray tasks on the cluster at ``address`` (``local``: a Ray instance of
    ``processes`` CPUs started here), their results in order."""
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
        remote: Callable[..., Any] = ray.remote(price_layout).remote
        refs = [remote(job) for job in jobs]
        for ref in refs:
            yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()

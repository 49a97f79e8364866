"""Parallel programs on one CPU: torch.distributed's own parallelism on a fake process group.

No home-made model of tensor parallelism or FSDP (PyTorch docs: torch.distributed.tensor,
FSDP2 ``fully_shard``).
The model gets PyTorch's (and transformers') real parallel plans on a process group of N
fake ranks, and capture records the program one rank runs: its local ops at per-rank
shapes and its collectives with their groups (torchroof.capture.mode, torchroof.counters
.collectives). One module per strategy (:mod:`~torchroof.parallel.tensor`,
:mod:`~torchroof.parallel.sequence`, :mod:`~torchroof.parallel.expert`,
:mod:`~torchroof.parallel.fsdp`, :mod:`~torchroof.parallel.context`), each exposing a
``STRATEGY`` (:class:`~torchroof.parallel.strategy.Strategy`), listed once in
:data:`STRATEGIES` in torchtitan's order (``models/llama3/parallelize.py``); by hand::

    plan = ParallelPlan(fsdp=4, tp=2)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        model = ...                                  # built on meta
        apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp(model, mesh)
        with fake_parameters(model):                 # FSDP2 refuses meta parameters
            ids = torch.zeros(batch, seq, dtype=torch.long)
            with torchroof.trace() as trace:
                model(ids, labels=ids).loss.backward()

Context parallel wraps the step instead (after FSDP over the fsdp x cp ranks in training):
``with apply_context_parallel(model, mesh["cp"]):`` each forward then runs on the rank's
T/cp tokens with torch's ring attention.

Rank 0 is the rank traced (ranks are symmetric under these plans).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist

from torchroof.parallel import context, expert, fsdp, sequence, tensor
from torchroof.parallel.strategy import Strategy

FAKE_BACKEND = "fake"

STRATEGIES: tuple[Strategy, ...] = (
    tensor.STRATEGY,
    sequence.STRATEGY,
    expert.STRATEGY,
    fsdp.STRATEGY,
    context.STRATEGY,
)
"""The strategies a parallel step applies, in torchtitan's order (``parallelize_llama``;
``parallelize_deepseekv3`` for experts): tensor parallel or its sequence-parallel plan,
then the routed experts, then FSDP over the data ranks (activation checkpointing, which
torchtitan applies between tensor parallel and FSDP, is the train regime's); context
parallel wraps the step itself, as torchtitan's training loop does. Adding a strategy is
its module, one entry here, and its tests."""


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks, this process rank 0; its
    collectives return at once (``torch.testing._internal.distributed.fake_pg``). Destroyed
    on exit. Re-entrant: inside a fake group of the same size it is a no-op (the outer one
    destroys it); any other initialised group is an error."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        backend, size = dist.get_backend(), dist.get_world_size()
        if backend == FAKE_BACKEND and size == world_size:
            yield
            return
        raise RuntimeError(
            f"a process group is already initialised (backend {backend!r}, {size} ranks); "
            f"a fake group of {world_size} ranks cannot replace it: leave the outer one first"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]: " to each line
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook  # one prefix more per group otherwise, and none is wanted

"""A pipeline's distinct stages traced side by side: each stage is a program of its own
(its own model, process group and capture), so on a machine with several processors the
stages are shared out between this process and forked copies of it, which send their
traces back (Python's ``multiprocessing`` with the ``fork`` start method: a copy starts
with everything this process has imported and built, so it pays no start-up).

Forking is skipped, and every stage traced here in turn, where it is not safe or not
worth it: one processor, one stage, no ``fork`` on this platform (Windows), other threads
running (a forked copy would inherit their locks held), CUDA initialised, or
``TORCHROOF_WORKERS=1`` in the environment (``TORCHROOF_WORKERS=N`` caps the processes at
N). A copy that fails to send its traces (it died) has its stages traced here instead; a
stage that fails in a copy raises here the error it raised there.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from torchroof import progress

T = TypeVar("T")
WORKERS_VARIABLE = "TORCHROOF_WORKERS"


def processors() -> int:
    """The processors this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def worker_count(jobs: int) -> int:
    """How many processes share ``jobs`` jobs (1: this one alone)."""
    given = os.environ.get(WORKERS_VARIABLE, "").strip()
    cap = int(given) if given.isdigit() and int(given) > 0 else processors()
    if (
        jobs < 2
        or cap < 2
        or "fork" not in multiprocessing.get_all_start_methods()
        or threading.active_count() > 1
        or torch.cuda.is_initialized()
    ):
        return 1
    return min(cap, jobs)


def run_shared(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Every job's result, in order: the jobs shared out round-robin between this process
    (the first share) and forked copies of it (:func:`worker_count`)."""
    workers = worker_count(len(jobs))
    if workers == 1:
        return [job() for job in jobs]
    shares = [list(range(first, len(jobs), workers)) for first in range(workers)]
    context = multiprocessing.get_context("fork")
    started = []
    for share in shares[1:]:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_worker, args=(send, [jobs[i] for i in share]))
        process.start()
        send.close()
        started.append((process, receive, share))
    results: dict[int, T] = {}
    try:
        for index in shares[0]:
            results[index] = jobs[index]()
        for _, receive, share in started:
            got = _received(receive, [jobs[i] for i in share])
            results.update(zip(share, got, strict=True))
    finally:
        for process, receive, _ in started:
            receive.close()
            if process.is_alive():
                process.kill()
            process.join()
    return [results[i] for i in range(len(jobs))]


def _worker(send: Any, jobs: list[Callable[[], Any]]) -> None:
    """In a forked copy: run ``jobs`` quietly and send ("ok", results) or ("error", the
    first error)."""
    with progress.silenced():
        try:
            message: tuple[str, Any] = ("ok", [job() for job in jobs])
        except Exception as error:  # noqa: BLE001 - raised again in the parent
            message = ("error", error)
    try:
        send.send(message)
    except Exception as error:  # noqa: BLE001 - an error that does not pickle
        send.send(("error", RuntimeError(f"{type(error).__name__}: {error}")))
    send.close()


def _received(receive: Any, jobs: list[Callable[[], T]]) -> list[T]:
    """A copy's results; its jobs run here when it sent none (it died) or sent what does
    not unpickle here."""
    try:
        status, value = receive.recv()
    except Exception:  # noqa: BLE001 - the jobs run here say what went wrong, if anything
        return [job() for job in jobs]
    if status == "error":
        raise value
    return list(value)

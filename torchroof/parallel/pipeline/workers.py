"""A pipeline's distinct stages traced side by side: each stage is a program of its own
(its own model, process group and capture), so on a machine with several processors the
stages are shared out between this process and forked copies of it, which send their
traces back (Python's ``multiprocessing`` with the ``fork`` start method, as PyTorch's
``DataLoader`` starts its workers on Linux: a copy starts with everything this process has
imported and built, so it pays no start-up).

Forking is left out, and every stage traced here in turn, where it is not safe or not
worth it: not Linux (macOS's system libraries are not safe to fork, Windows has no fork),
one processor, one stage, other Python threads running (a copy inherits their locks held),
an accelerator visible to torch (autograd's device threads refuse a forked copy once a
backward has run), a daemon process (which may not have children), or
``TORCHROOF_WORKERS=1`` in the environment (``TORCHROOF_WORKERS=N`` caps the processes at
N). A copy that cannot be started, dies, or sends what does not travel between processes
has its stages traced here instead; a stage that fails in a copy raises here the error it
raised there.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from torchroof import progress
from torchroof.config.errors import OptionError

T = TypeVar("T")
WORKERS_VARIABLE = "TORCHROOF_WORKERS"
# CPython 3.12+ warns at every fork of a process with any thread, torch's own idle ones
# included; the copies here run no thread of their own (see the module docstring)
_FORK_WARNING = r".*use of fork\(\) may lead to deadlocks"


def processors() -> int:
    """The processors this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def worker_cap() -> int:
    """``TORCHROOF_WORKERS`` (a positive number of processes), else every processor; an
    OptionError in one line for anything else."""
    given = os.environ.get(WORKERS_VARIABLE, "").strip()
    if not given:
        return processors()
    if not given.isdecimal() or not given.isascii() or int(given) < 1:
        raise OptionError(
            f"{WORKERS_VARIABLE}={given!r}: give a positive number of processes "
            "(1 traces a pipeline's stages in turn)"
        )
    return int(given)


def accelerator_visible() -> bool:
    """Whether torch sees a GPU or any other accelerator (without initialising one)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and accelerator.device_count() > 0:
        return True
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.device_count() > 0 or (mps is not None and mps.is_available())


def worker_count(jobs: int) -> int:
    """How many processes share ``jobs`` jobs (1: this one alone)."""
    cap = worker_cap()
    if (
        jobs < 2
        or cap < 2
        or not sys.platform.startswith("linux")
        or threading.active_count() > 1
        or multiprocessing.current_process().daemon
        or accelerator_visible()
    ):
        return 1
    return min(cap, processors(), jobs)


def run_shared(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Every job's result, in order: the jobs shared out round-robin between this process
    (the first share) and forked copies of it (:func:`worker_count`)."""
    workers = worker_count(len(jobs))
    if workers == 1:
        return [job() for job in jobs]
    shares = [list(range(first, len(jobs), workers)) for first in range(workers)]
    context = multiprocessing.get_context("fork")
    started: list[tuple[Any, Any, list[int]]] = []
    here = list(shares[0])
    results: dict[int, T] = {}
    try:
        for share in shares[1:]:
            receive, send = context.Pipe(duplex=False)
            held = [receive, *(r for _, r, _ in started)]  # read ends a copy must not keep
            process = context.Process(
                target=_worker, args=(send, held, [jobs[i] for i in share]), daemon=True
            )
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", _FORK_WARNING, DeprecationWarning)
                    process.start()
            except (OSError, ValueError):  # no process to be had: its share runs here
                receive.close()
                send.close()
                here += share
                continue
            send.close()
            started.append((process, receive, share))
        for index in here:
            results[index] = jobs[index]()
        for _, receive, share in started:
            got = _received(receive, [jobs[i] for i in share])
            results.update(zip(share, got, strict=True))
    finally:
        for process, receive, _ in started:
            receive.close()  # a copy still writing gets a broken pipe, not a wait
            process.join(timeout=1)
            if process.is_alive():
                process.kill()
                process.join()
    return [results[i] for i in range(len(jobs))]


def _worker(send: Any, held: list[Any], jobs: list[Callable[[], Any]]) -> None:
    """In a forked copy: run ``jobs`` quietly and send ("ok", results), ("error", the
    first error) or, when either does not travel between processes, ("rerun", why)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its copies itself
    for receive in held:  # so that the parent's end closing breaks this copy's pipe
        receive.close()
    with progress.silenced():
        try:
            message: tuple[str, Any] = ("ok", [job() for job in jobs])
        except Exception as error:  # noqa: BLE001 - raised again in the parent
            message = ("error", error)
    try:
        payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        if message[0] == "error":  # an error the parent could not unpickle: it reruns
            pickle.loads(payload)
    except Exception as why:  # noqa: BLE001 - the parent runs these jobs itself
        payload = pickle.dumps(("rerun", f"{type(why).__name__}: {why}"))
    try:
        send.send_bytes(payload)
    finally:
        send.close()


def _received(receive: Any, jobs: list[Callable[[], T]]) -> list[T]:
    """A copy's results; its jobs run here when it sent none (it died) or sent what does
    not travel between processes."""
    try:  # its message, or the end of its pipe when it ended without one
        status, value = pickle.loads(receive.recv_bytes())
    except Exception:  # noqa: BLE001 - ended, cut short, or not to be unpickled here
        status, value = "rerun", None
    if status == "error":
        raise value
    if status == "rerun":
        return [job() for job in jobs]
    return list(value)

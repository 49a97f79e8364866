"""A pipeline's distinct stages traced side by side (torchroof.parallel.pipeline.workers):
the jobs are shared out between this process and forked copies of it, their results come
back in order, a copy's error is raised here, a copy that dies has its jobs run here, and
a pipelined step traced so is the step traced stage after stage, op for op."""

import os
import sys

import pytest
from conftest import small_llama

import torchroof
from torchroof.config.errors import OptionError
from torchroof.parallel.pipeline import workers
from torchroof.records.equality import first_difference

PARENT = os.getpid()


FORKS = pytest.mark.skipif(
    not sys.platform.startswith("linux") or workers.accelerator_visible(),
    reason="stages are forked on Linux without a visible accelerator only",
)


@pytest.fixture
def two_workers(monkeypatch):
    """Two processes whatever this machine has, and no thread of the test runner's in the
    way (the step itself starts none)."""
    monkeypatch.setattr(workers, "processors", lambda: 2)
    monkeypatch.setattr(workers.threading, "active_count", lambda: 1)
    monkeypatch.delenv(workers.WORKERS_VARIABLE, raising=False)


def job(index):
    return lambda: (index, os.getpid())


@FORKS
def test_jobs_are_shared_round_robin_and_come_back_in_order(two_workers):
    """Five jobs on two processes: jobs 0, 2, 4 here, 1 and 3 in a copy."""
    got = workers.run_shared([job(i) for i in range(5)])
    assert [index for index, _ in got] == [0, 1, 2, 3, 4]
    assert [pid == PARENT for _, pid in got] == [True, False, True, False, True]


@FORKS
def test_one_worker_when_asked_or_when_not_worth_it(two_workers, monkeypatch):
    assert workers.worker_count(1) == 1  # one job
    assert workers.worker_count(4) == 2
    monkeypatch.setenv(workers.WORKERS_VARIABLE, "1")
    assert workers.worker_count(4) == 1
    got = workers.run_shared([job(i) for i in range(3)])
    assert all(pid == PARENT for _, pid in got)
    monkeypatch.delenv(workers.WORKERS_VARIABLE)
    monkeypatch.setattr(workers.threading, "active_count", lambda: 3)  # threads running
    assert workers.worker_count(4) == 1


@pytest.mark.parametrize("given", ["0", "-2", "two"])
def test_a_worker_count_that_is_no_number_of_processes_is_refused(monkeypatch, given):
    monkeypatch.setenv(workers.WORKERS_VARIABLE, given)
    with pytest.raises(OptionError, match=f"TORCHROOF_WORKERS='{given}': give a positive"):
        workers.worker_count(4)


@FORKS
def test_a_result_that_does_not_unpickle_here_has_its_jobs_run_here(two_workers):
    """A copy's result that pickles there but not here: done again here."""
    got = workers.run_shared([strict_result(i) for i in range(2)])
    assert [type(value) for value in got] == [int, int]


class Strict:
    """Pickles, but does not unpickle (its own arguments are keywords)."""

    def __init__(self, *, value: int) -> None:
        self.value = value

    def __reduce__(self):
        return (Strict, (self.value,))


def strict_result(index):
    return lambda: index if os.getpid() == PARENT else Strict(value=index)


class StrictError(Exception):
    """Pickles, but does not unpickle (its own arguments are keywords)."""

    def __init__(self, *, why: str) -> None:
        super().__init__(why)


def strict(index):
    def run():
        if os.getpid() != PARENT:
            raise StrictError(why="only in the copy")
        return index, os.getpid()

    return run


@FORKS
def test_an_error_that_does_not_travel_has_its_jobs_run_here(two_workers):
    """What a copy cannot send back is done again here (here the job succeeds)."""
    assert workers.run_shared([strict(i) for i in range(2)]) == [(0, PARENT), (1, PARENT)]


def failing(index):
    def run():
        if os.getpid() != PARENT:
            raise ValueError(f"stage {index} failed in its copy")
        return index

    return run


@FORKS
def test_an_error_in_a_copy_is_raised_here(two_workers):
    with pytest.raises(ValueError, match="stage 1 failed in its copy"):
        workers.run_shared([failing(i) for i in range(2)])


def dying(index):
    def run():
        if os.getpid() != PARENT:
            os._exit(3)  # the copy dies before it sends anything
        return index, os.getpid()

    return run


@FORKS
def test_the_jobs_of_a_copy_that_died_run_here(two_workers):
    got = workers.run_shared([dying(i) for i in range(4)])
    assert got == [(i, PARENT) for i in range(4)]


@FORKS
def test_stages_traced_side_by_side_are_the_stages_traced_in_turn(two_workers, monkeypatch):
    """pp 4 over 14 layers: stages of 4, 4, 3 and 3 layers, four distinct (the first, a
    middle one of each length, the last), the second and fourth traced in a copy (the
    second copying one of its layers); with FSDP and tensor parallel, every trace is the
    one traced here, op for op, and priced the same."""
    assert workers.worker_count(4) == 2
    original = workers._received

    def not_here():
        raise AssertionError("the copy's stages were traced here, not sent back")

    def received(receive, jobs):  # the copy's stages, never traced again here
        return original(receive, [not_here] * len(jobs))

    monkeypatch.setattr(workers, "_received", received)
    knobs = dict(seq=32, pp=4, microbatches=8, fsdp=2, tp=2)
    shared = torchroof.trace_model(small_llama(14), "train", **knobs)
    monkeypatch.setenv(workers.WORKERS_VARIABLE, "1")
    in_turn = torchroof.trace_model(small_llama(14), "train", **knobs)
    assert sorted(shared.traces) == sorted(in_turn.traces) == [0, 1, 2, 3]
    assert shared.traces[1].facts.repeated_layers.endswith("3 traced, 1 copied")
    for index, trace in in_turn.traces.items():
        assert first_difference(trace, shared.traces[index]) == ""
        assert trace.facts == shared.traces[index].facts
    a = torchroof.estimate_trace(shared, "dgx-h100").to_dict()
    b = torchroof.estimate_trace(in_turn, "dgx-h100").to_dict()
    assert a == b

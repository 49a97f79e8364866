"""A pipeline's distinct stages traced side by side (torchroof.parallel.pipeline.workers):
the jobs are shared out between this process and forked copies of it, their results come
back in order, a copy's error is raised here, a copy that dies has its jobs run here, and
a pipelined step traced so is the step traced stage after stage, op for op."""

import os

import pytest
from conftest import small_llama

import torchroof
from torchroof.parallel.pipeline import workers
from torchroof.records.equality import first_difference

PARENT = os.getpid()


@pytest.fixture
def two_workers(monkeypatch):
    """Two processes whatever this machine has, and no thread of the test runner's in the
    way (the step itself starts none)."""
    monkeypatch.setattr(workers, "processors", lambda: 2)
    monkeypatch.setattr(workers.threading, "active_count", lambda: 1)
    monkeypatch.delenv(workers.WORKERS_VARIABLE, raising=False)


def job(index):
    return lambda: (index, os.getpid())


@pytest.mark.skipif("fork" not in workers.multiprocessing.get_all_start_methods(), reason="")
def test_jobs_are_shared_round_robin_and_come_back_in_order(two_workers):
    """Five jobs on two processes: jobs 0, 2, 4 here, 1 and 3 in a copy."""
    got = workers.run_shared([job(i) for i in range(5)])
    assert [index for index, _ in got] == [0, 1, 2, 3, 4]
    assert [pid == PARENT for _, pid in got] == [True, False, True, False, True]


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


def failing(index):
    def run():
        if os.getpid() != PARENT:
            raise ValueError(f"stage {index} failed in its copy")
        return index

    return run


@pytest.mark.skipif("fork" not in workers.multiprocessing.get_all_start_methods(), reason="")
def test_an_error_in_a_copy_is_raised_here(two_workers):
    with pytest.raises(ValueError, match="stage 1 failed in its copy"):
        workers.run_shared([failing(i) for i in range(2)])


def dying(index):
    def run():
        if os.getpid() != PARENT:
            os._exit(3)  # the copy dies before it sends anything
        return index, os.getpid()

    return run


@pytest.mark.skipif("fork" not in workers.multiprocessing.get_all_start_methods(), reason="")
def test_the_jobs_of_a_copy_that_died_run_here(two_workers):
    got = workers.run_shared([dying(i) for i in range(4)])
    assert got == [(i, PARENT) for i in range(4)]


@pytest.mark.skipif("fork" not in workers.multiprocessing.get_all_start_methods(), reason="")
def test_stages_traced_side_by_side_are_the_stages_traced_in_turn(two_workers, monkeypatch):
    """pp 4 over 10 layers: stages of 3, 3, 2 and 2 layers, four distinct (the first, a
    middle one of each length, the last), two traced in a copy; with FSDP and tensor
    parallel, every trace is the one traced here, op for op, and priced the same."""
    knobs = dict(seq=32, pp=4, microbatches=8, fsdp=2, tp=2)
    shared = torchroof.trace_model(small_llama(10), "train", **knobs)
    monkeypatch.setenv(workers.WORKERS_VARIABLE, "1")
    in_turn = torchroof.trace_model(small_llama(10), "train", **knobs)
    assert sorted(shared.traces) == sorted(in_turn.traces) == [0, 1, 2, 3]
    for index, trace in in_turn.traces.items():
        assert first_difference(trace, shared.traces[index]) == ""
        assert trace.facts == shared.traces[index].facts
    a = torchroof.estimate_trace(shared, "dgx-h100").to_dict()
    b = torchroof.estimate_trace(in_turn, "dgx-h100").to_dict()
    assert a == b

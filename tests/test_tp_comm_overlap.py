"""Tensor-parallel communication beside its GEMMs (Transformer Engine's userbuffers, the
``megatron-te`` profile's ``tp_comm_overlap``): the two-stream schedule runs a pipelined
all-gather and the GEMM reading it, or a GEMM and the reduce-scatter of its output, side
by side, each pair taking the longer of the two."""

from __future__ import annotations

import pytest
from conftest import PARALLEL_LLAMA
from torchroof.counters import kind_of
from transformers import LlamaConfig

import torchroof
from torchroof.pricing.runtime import runtime_options
from torchroof.timing.streams import COMMUNICATION, COMPUTE, Task, schedule
from torchroof.timing.tp_overlap import ALL_GATHER, REDUCE_SCATTER, pipelined_pairs

# storages: 1 the shard, 2 the gathered input, 3 the GEMM's output, 4 its rearranged copy,
# 5 the scattered result
GATHER = Task(10.0, COMMUNICATION, frozenset({1}), frozenset({2}))
GEMM_AFTER = Task(8.0, COMPUTE, frozenset({2}), frozenset({3}))
GEMM = Task(8.0, COMPUTE, frozenset({2}), frozenset({3}))
SCATTER = Task(5.0, COMMUNICATION, frozenset({3}), frozenset({5}))


def test_an_all_gather_beside_its_gemm_takes_the_longer_of_the_two():
    # in turn: the gather 0-10 s, then the GEMM 10-18 s: 18 s, the gather wholly exposed
    alone = schedule([GATHER, GEMM_AFTER])
    assert alone.step_time_s == 18.0 and alone.exposed_s[0] == 10.0
    # side by side: the GEMM starts with the gather and waits 2 s for its last chunk: 10 s,
    # 2 s exposed
    paired = schedule(
        [GATHER, Task(8.0, COMPUTE, frozenset({2}), frozenset({3}), (), 0, 0, frozenset({0}))]
    )
    assert paired.step_time_s == 10.0 and paired.exposed_s[0] == 2.0
    assert paired.start_s == (0.0, 0.0) and paired.end_s == (10.0, 10.0)


def test_a_reduce_scatter_beside_its_gemm_hides_behind_it():
    # in turn: the GEMM 0-8 s, the reduce-scatter 8-13 s: 13 s, 5 s exposed
    alone = schedule([GEMM, SCATTER])
    assert alone.step_time_s == 13.0 and alone.exposed_s[1] == 5.0
    # side by side: the scatter runs 0-5 s with the GEMM's chunks but ends with it at 8 s
    paired = schedule(
        [GEMM, Task(5.0, COMMUNICATION, frozenset({3}), frozenset({5}), (), 0, 0, frozenset({0}))]
    )
    assert paired.step_time_s == 8.0 and paired.exposed_s[1] == 0.0


def test_a_layout_copy_between_runs_in_the_pair_too():
    # GEMM 8 s, a 1 s copy of its output (torch's cat), the scatter of the copy: side by
    # side the scatter starts with the GEMM and ends no sooner than the copy: 9 s, not 14
    copy = Task(1.0, COMPUTE, frozenset({3}), frozenset({4}))
    scatter = Task(5.0, COMMUNICATION, frozenset({4}), frozenset({5}), (), 0, 1, frozenset({0, 1}))
    assert (
        schedule([GEMM, copy, Task(5.0, COMMUNICATION, frozenset({4}), frozenset({5}))]).step_time_s
        == 14.0
    )
    assert schedule([GEMM, copy, scatter]).step_time_s == 9.0
    # without overlap every task waits for the one before it, pairs or not
    assert schedule([GEMM, copy, scatter], overlap=False).step_time_s == 14.0
    # a wait outside the pair is kept: another collective (3 s) whose result the scatter
    # also reads holds it
    other = Task(3.0, COMMUNICATION, frozenset({1}), frozenset({6}))
    held = Task(5.0, COMMUNICATION, frozenset({4, 6}), frozenset({5}), (), 0, 1, frozenset({0, 1}))
    laid = schedule([GEMM, copy, other, held])
    # other runs 0-3 s; the scatter starts with the GEMM's start but after other's end:
    # 3 s, and ends at max(3 + 5, copy's end 9) = 9 s
    assert laid.start_s[3] == 3.0 and laid.step_time_s == 9.0


def test_a_pair_must_look_back_to_the_other_stream():
    later = Task(1.0, COMPUTE, frozenset(), frozenset(), (), 1, None, frozenset())
    with pytest.raises(ValueError, match="not before it"):
        schedule([later, GATHER])
    same = Task(1.0, COMPUTE, frozenset(), frozenset(), (), 0, None, frozenset())
    with pytest.raises(ValueError, match="on its own stream"):
        schedule([GEMM, same])


@pytest.fixture(scope="module")
def sp_train():
    return torchroof.trace_model(
        LlamaConfig(**PARALLEL_LLAMA), "train", batch=1, seq=32, tp=2, sequence_parallel=True
    )


def test_each_layer_pairs_its_gathers_and_scatters_with_gemms(sp_train):
    from torchroof.pricing.price import plan_kernels

    kernels = plan_kernels(sp_train, runtime_options("megatron-te")).kernels
    found = pipelined_pairs(kernels, 2)
    collectives = {i: j for i, j in found.pairs.items() if kernels[i].cost.unit == "network"}
    for i, j in collectives.items():
        assert kernels[i].ops[0].name in (ALL_GATHER, REDUCE_SCATTER)
        assert kernels[i].ops[0].arg("group_ranks") == [0, 1]
        assert kind_of(kernels[j].lead.packet) == "matmul" and found.pairs[j] == i
    names = [kernels[i].ops[0].name for i in collectives]
    # per layer 6 gathers (the attention's and the MLP's inputs, their re-gathers, the
    # gathers of their output gradients before o_proj's and down_proj's backward) and 4
    # scatters (after o_proj and down_proj, and of q/k/v's and gate/up's input gradients);
    # the lm_head adds its gather, its re-gather and the scatter of its input gradient. The
    # embedding's scatter and its gradient's gather meet no GEMM: 2 x 6 + 2 = 14 gathers,
    # 2 x 4 + 1 = 9 scatters
    assert names.count(ALL_GATHER) == 14
    assert names.count(REDUCE_SCATTER) == 9


def test_the_megatron_profile_overlaps_and_says_so(sp_train, tmp_path):
    from torchroof.hardware.runtime import RUNTIME_DIR

    source = (RUNTIME_DIR / "megatron-te.toml").read_text()
    no_overlap = tmp_path / "megatron-no-overlap.toml"
    no_overlap.write_text(
        source.replace("tp_comm_overlap = { value = true", "tp_comm_overlap = { value = false")
    )
    traced = torchroof.Trace.of(sp_train)
    megatron = traced.estimate("dgx-h100", runtime="megatron-te")
    plain = traced.estimate("dgx-h100", runtime=str(no_overlap))
    line = next(a for a in megatron.assumptions if a.startswith("tensor-parallel comm"))
    assert "14 all-gathers and 9 reduce-scatters" in line, line
    assert not any(a.startswith("tensor-parallel comm") for a in plain.assumptions)
    # the same kernels, laid side by side: never a longer step, less exposed
    assert [k.time_s for k in megatron.kernels] == [k.time_s for k in plain.kernels]
    assert megatron.time_s < plain.time_s
    assert sum(k.exposed_s for k in megatron.kernels) < sum(k.exposed_s for k in plain.kernels)
    paired = [k for k in megatron.kernels if k.pipelined_with is not None]
    assert paired and all(
        megatron.kernels[k.pipelined_with].pipelined_with == k.index for k in paired
    )
    # the page cannot re-lay such a schedule: it says so instead of re-pricing it wrong
    from torchroof.render.html import why_not_repriced

    assert "beside their GEMMs" in why_not_repriced(megatron)
    # collectives that block compute (--no-overlap-communication) pair nothing either
    blocking = traced.estimate("dgx-h100", runtime="megatron-te", overlap_communication=False)
    assert all(k.pipelined_with is None for k in blocking.kernels)
    assert not any(a.startswith("tensor-parallel comm") for a in blocking.assumptions)
    # without sequence parallel Megatron all-reduces: nothing to pair
    plain_tp = torchroof.trace_model(LlamaConfig(**PARALLEL_LLAMA), "train", batch=1, seq=32, tp=2)
    est = torchroof.Trace.of(plain_tp).estimate("dgx-h100", runtime="megatron-te")
    assert all(k.pipelined_with is None for k in est.kernels)

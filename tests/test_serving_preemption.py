"""Swap preemption in the serving simulation: a preempted request's KV blocks go to host
memory and come back, instead of being computed again, each copy priced over the GPU's
host link (the H100 SXM's PCIe Gen5, 64 GB/s each way). The case is
tests/test_serving_simulation.py's: four requests of 32 + 33 tokens in 15 blocks of 16
tokens, on tests/conftest.py's small Llama (2 layers, 512 B of K and V per token)."""

import pytest
from conftest import small_llama

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.serving import SequenceWork, StepTimer
from torchroof.serving.requests import Request
from torchroof.serving.scheduler import EngineConfig, Running, Scheduler
from torchroof.serving.simulate import simulate

BLOCK_S = 16 * 512 / 64e9  # one block of 16 tokens x 512 B over 64 GB/s


def _run(mode, host_blocks=100):
    scheduler = Scheduler(EngineConfig(preemption=mode), kv_blocks=15, host_blocks=host_blocks)
    states = [Running(Request(i, 32, 33, 0.0), arrival_s=0.0) for i in range(4)]
    for state in states:
        scheduler.submit(state)
    steps, now = [], 0.0
    while scheduler.busy:
        step = scheduler.schedule(now)
        steps.append(([(w.new_tokens, w.context) for w in step.work], step.swapped_out,
                      step.swapped_in, step.swap_blocks))  # fmt: skip
        now += 1.0
        scheduler.complete(step, now)
    return steps, states


def test_a_swapped_request_resumes_where_it_stopped():
    steps, states = _run("swap")
    # at step 18 the four hold 3 blocks each (48 tokens) and each needs a fourth: the
    # newest is swapped out, its 3 blocks copied to host memory
    assert steps[17] == ([(1, 48)] * 3, 1, 0, 3)
    # the others end at step 33; at step 34 its 3 blocks come back and it decodes its 18th
    # token over its 48 cached, where recompute preemption computes 49 tokens again
    assert steps[33] == ([(1, 48)], 0, 1, 3)
    recomputed, _ = _run("recompute")
    assert recomputed[33] == ([(49, 0)], 0, 0, 0)
    assert len(steps) == len(recomputed) == 49
    assert [s.finish_s for s in states] == [33.0, 33.0, 33.0, 49.0]


def test_a_full_host_memory_falls_back_to_recompute():
    steps, states = _run("swap", host_blocks=2)  # 2 blocks cannot hold its 3
    assert steps[17] == ([(1, 48)] * 3, 0, 0, 0)
    assert steps[33] == ([(49, 0)], 0, 0, 0)
    assert states[3].preemptions == 1


def test_the_copies_are_priced_in_their_steps():
    timer = StepTimer(torchroof.prepare(small_llama(2), "decode", context=16), "h100-sxm")
    requests = [Request(i, 32, 33, 0.0) for i in range(4)]

    def serve(mode):
        engine = EngineConfig(num_gpu_blocks_override=15, preemption=mode)
        return simulate(timer, requests, engine=engine)

    swapped, recomputed = serve("swap"), serve("recompute")
    # the step that swaps out: 3 decodes over 48, plus 3 blocks to host memory; the step
    # that swaps back: 1 decode over 48, plus 3 blocks back (each 3 x 8,192 B / 64 GB/s)
    out = timer.time([SequenceWork(1, 48)] * 3).time_s + 3 * BLOCK_S
    back = timer.time([SequenceWork(1, 48)]).time_s + 3 * BLOCK_S
    assert swapped.steps.time_s[17] == pytest.approx(out, rel=1e-12)
    assert swapped.steps.time_s[33] == pytest.approx(back, rel=1e-12)
    assert recomputed.steps.time_s[33] == pytest.approx(
        timer.time([SequenceWork(49)]).time_s, rel=1e-12
    )
    swap = swapped.summary()["swap"]
    assert swap == {
        "swapped_out": 1,
        "swapped_in": 1,
        "blocks_copied": 6,
        "copy_time_s": pytest.approx(6 * BLOCK_S, rel=1e-12),
    }
    # 4 GiB of host memory holds 4 x 2^30 / 8,192 = 524,288 blocks
    assert swapped.engine["host_swap_blocks"] == 524_288


def test_bad_preemption_settings_are_refused_in_a_line(capsys):
    with pytest.raises(OptionError, match="unknown preemption mode 'spill'"):
        EngineConfig(preemption="spill")
    with pytest.raises(OptionError, match="swap_space_gib must be 0 or more GiB, got -1"):
        EngineConfig(preemption="swap", swap_space_gib=-1)
    assert main(["serve", "gpt2", "--rate", "1", "--swap-space", "8"]) == 2
    assert "--swap-space is the host memory of --preemption-mode swap" in capsys.readouterr().err


def test_disaggregated_serving_refuses_what_it_does_not_simulate():
    for options, message in [
        ({"engine": EngineConfig(preemption="swap")}, "swap preemption on disaggregated"),
        (
            {"speculative": torchroof.serving.Speculative(small_llama(1), acceptance=0.5)},
            "speculative decoding on disaggregated prefill and decode is not simulated",
        ),
    ]:
        with pytest.raises(OptionError, match=message):
            torchroof.serve(
                small_llama(2), "dgx-h100", concurrency=1, requests=2, disaggregate="1P1D",
                **options,
            )  # fmt: skip


def test_every_scheduled_step_s_mix_is_its_items_mix():
    """The scheduler sums its running decodes' mix as it schedules them and the rest's
    after: over 120 engines drawn at random (chunked prefill or not, token budgets from 8
    to 2,048, recompute or swap preemption, speculative decoding with 1 to 5 drafts or
    none, prefix caching on or off, 12 to 400 KV blocks), every step's mix is the mix of
    its items, one item per request in the same order, and some steps preempt, verify
    drafts and swap requests back in."""
    import random

    import numpy as np

    from torchroof.serving.composition import StepMix
    from torchroof.serving.speculative import Acceptance

    draw = random.Random(1)
    steps = preempting = verifying = swapping = 0
    for trial in range(120):
        chunked = draw.random() < 0.7
        config = EngineConfig(
            max_num_batched_tokens=draw.choice([8, 17, 40, 256, 2048]) if chunked else 2048,
            chunked_prefill=chunked,
            preemption=draw.choice(["recompute", "swap"]),
            prefix_caching=draw.random() < 0.5,
            max_num_seqs=draw.choice([2, 4, 64]),
        )
        speculative = draw.random() < 0.4
        acceptance = (
            Acceptance.of(draw.choice([0.3, 0.8, 1.0]), draw.choice([1, 3, 5]))
            if speculative
            else None
        )
        scheduler = Scheduler(
            config,
            draw.choice([12, 20, 60, 400]),
            acceptance,
            np.random.default_rng(trial) if speculative else None,
            host_blocks=draw.choice([0, 10, 100]),
            head=draw.random() < 0.5,
        )
        for i in range(draw.randint(1, 8)):
            group = draw.choice([None, 0, 1])
            prompt = draw.randint(1, 120 if chunked else 200)
            shared = min(prompt, draw.choice([0, 16, 32, 64])) if group is not None else 0
            request = Request(i, prompt, draw.randint(1, 30), 0.0, group, shared)
            scheduler.submit(Running(request, 0.0))
        now = 0.0
        while scheduler.busy and now < 400:
            step = scheduler.schedule(now)
            assert step.mix == StepMix.of(step.items)
            assert len(step.requests) == len(step.items)
            steps += 1
            preempting += step.preempted > 0
            verifying += any(verifies for *_, verifies in step.items)
            swapping += step.swapped_in > 0
            now += 1.0
            scheduler.complete(step, now)
    assert steps > 5000 and min(preempting, verifying, swapping) > 0

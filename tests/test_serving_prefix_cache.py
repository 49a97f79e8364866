"""Prefix caching in the serving simulation (torchroof.serving.prefix_cache): prompts of a
group start with the same tokens, whose full KV blocks a later request finds cached,
shares while both run, and loses once they are evicted, oldest freed first. Blocks of 16
tokens throughout; latencies on tests/conftest.py's small Llama (2 layers) on the H100
SXM's pure roofline."""

import json

import pytest
from conftest import small_llama

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.serving import SequenceWork, StepTimer
from torchroof.serving.prefix_cache import PrefixCache
from torchroof.serving.requests import (
    Arrivals,
    Lengths,
    Prefixes,
    Request,
    make_requests,
    read_requests,
)
from torchroof.serving.scheduler import EngineConfig, Running, Scheduler
from torchroof.serving.simulate import simulate


def _serve(scheduler, states, now=0.0):
    """Step ``scheduler`` until idle, each step 1 s; each step as (work, cached, queried)."""
    for state in states:
        scheduler.submit(state)
    steps = []
    while scheduler.busy:
        step = scheduler.schedule(now)
        steps.append(
            (
                [(w.new_tokens, w.context) for w in step.work],
                step.cached_tokens,
                step.queried_tokens,
                step.blocks_used,
            )
        )
        now += 1.0
        scheduler.complete(step, now)
    return steps


def _state(index, tokens, output, group, prefix):
    return Running(Request(index, tokens, output, 0.0, group, prefix), arrival_s=0.0)


def test_a_later_request_starts_from_the_cached_prefix():
    scheduler = Scheduler(EngineConfig(), kv_blocks=100)
    first = _state(0, 80, 2, 0, 64)  # 64 prefix tokens (4 blocks) + 16 of its own
    steps = _serve(scheduler, [first])
    # all 80 computed; 81 tokens at its end in ceil(81 / 16) = 6 blocks, 4 of them the
    # prefix's, kept cached (and free) after it ends
    assert steps == [([(80, 0)], 0, 80, 5), ([(1, 80)], 0, 0, 6)]
    assert scheduler.free_blocks == 100 and len(scheduler.cache.evictable) == 4
    second = _state(1, 80, 2, 0, 64)
    steps = _serve(scheduler, [second], now=2.0)
    # 4 blocks found: 16 tokens computed over 64 cached; 5 blocks in use, 4 of them shared
    assert steps[0] == ([(16, 64)], 64, 80, 5)
    assert second.cached_tokens == 64 and first.cached_tokens == 0


def test_a_whole_prompt_found_cached_still_computes_its_last_block():
    scheduler = Scheduler(EngineConfig(), kv_blocks=100)
    _serve(scheduler, [_state(0, 64, 1, 0, 64)])
    # the prompt is all prefix: at most (64 - 1) // 16 = 3 blocks are found, so the last
    # 16 tokens are computed again (its logits are needed)
    steps = _serve(scheduler, [_state(1, 64, 1, 0, 64)])
    assert steps == [([(16, 48)], 48, 64, 4)]


def test_running_requests_share_their_prefix_blocks():
    scheduler = Scheduler(EngineConfig(), kv_blocks=100)
    first, second = _state(0, 80, 3, 0, 64), _state(1, 80, 3, 0, 64)
    scheduler.submit(first)
    step = scheduler.schedule(0.0)
    scheduler.complete(step, 1.0)
    scheduler.submit(second)  # admitted after the first cached its prefix
    step = scheduler.schedule(1.0)
    assert [(w.new_tokens, w.context) for w in step.work] == [(1, 80), (16, 64)]
    # the first holds 4 shared + 2 own blocks (81 tokens), the second uses the same 4 and
    # 1 own (80 tokens): 7 in use, not 6 + 5 = 11
    assert step.blocks_used == 7
    assert (first.blocks, len(first.shared), second.blocks, len(second.shared)) == (2, 4, 1, 4)
    scheduler.complete(step, 2.0)
    # without prefix caching each holds its own copy
    alone = Scheduler(EngineConfig(prefix_caching=False), kv_blocks=100)
    alone.submit(_state(0, 80, 3, 0, 64))
    alone.complete(alone.schedule(0.0), 1.0)
    alone.submit(_state(1, 80, 3, 0, 64))
    assert alone.schedule(1.0).blocks_used == 6 + 5


def test_the_oldest_freed_blocks_are_evicted_first_tail_first():
    scheduler = Scheduler(EngineConfig(), kv_blocks=10)
    # group 0's request: 5 blocks, 4 of them its prefix; it ends at its first token and
    # frees them last block first: blocks 3, 2, 1, 0 of group 0 are the oldest freed
    _serve(scheduler, [_state(0, 80, 1, 0, 64)])
    assert list(scheduler.cache.evictable) == [(0, 3), (0, 2), (0, 1), (0, 0)]
    # group 1's request of 112 tokens needs 7 blocks: 6 empty ones and group 0's block 3
    _serve(scheduler, [_state(1, 112, 1, 1, 64)])
    assert (0, 3) not in scheduler.cache.users and (0, 2) in scheduler.cache.users
    # group 0 again: blocks 0-2 found (48 tokens), block 3 computed again
    again = _state(2, 80, 1, 0, 64)
    steps = _serve(scheduler, [again])
    assert steps[0][:3] == ([(32, 48)], 48, 80) and again.cached_tokens == 48


def test_a_cached_prefix_shortens_the_time_to_first_token():
    timer = StepTimer(torchroof.prepare(small_llama(2), "decode", context=16), "h100-sxm")
    requests = [Request(i, 80, 4, float(i), 0, 64) for i in range(3)]  # 1 s apart: alone
    served = simulate(timer, requests)
    # the first computes its 80 tokens; the others 16 over 64 cached
    whole, rest = timer.time([SequenceWork(80)]).time_s, timer.time([SequenceWork(16, 64)]).time_s
    assert [r.ttft_s for r in served.requests] == pytest.approx([whole, rest, rest], rel=1e-12)
    assert served.summary()["prefix_cache"] == {
        "queried_tokens": 240,
        "cached_tokens": 128,
        "hit_rate": 128 / 240,
    }
    off = simulate(timer, requests, engine=EngineConfig(prefix_caching=False))
    assert [r.ttft_s for r in off.requests] == pytest.approx([whole] * 3, rel=1e-12)
    assert off.summary()["prefix_cache"]["cached_tokens"] == 0


def test_drawn_prefixes_come_after_the_same_draws():
    lengths, arrivals = Lengths.parse("uniform:10,100", "input_len"), Arrivals("poisson", rate=2)
    plain = make_requests(50, lengths, Lengths.parse(8, "o"), arrivals, 3)
    shared = make_requests(50, lengths, Lengths.parse(8, "o"), arrivals, 3, Prefixes(4, 500))
    # the same lengths and times, the prefix's 500 tokens before each prompt's own
    assert [r.input_len + 500 for r in plain] == [r.input_len for r in shared]
    assert [r.arrival_s for r in plain] == [r.arrival_s for r in shared]
    assert {r.prefix_group for r in shared} == {0, 1, 2, 3}
    assert {r.prefix_len for r in shared} == {500}


def test_prefixes_in_a_file_and_bad_ones_named(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"input_len": 90, "output_len": 4, "prefix_group": 2, "prefix_len": 64})
        + "\n"
        + json.dumps({"input_len": 20, "output_len": 4})
        + "\n"
    )
    first, second = read_requests(good)
    assert (first.prefix_group, first.prefix_len) == (2, 64)
    assert (second.prefix_group, second.prefix_len) == (None, 0)
    bad = tmp_path / "bad.csv"
    bad.write_text("input_len,output_len,prefix_group,prefix_len\n90,4,1,64\n30,4,1,64\n")
    with pytest.raises(OptionError, match=r"bad.csv line 3: prefix_len 64 is longer than its"):
        read_requests(bad)
    endless = tmp_path / "endless.csv"
    endless.write_text("input_len,output_len,prefix_group,prefix_len\n90,4,inf,64\n")
    with pytest.raises(OptionError, match=r"endless.csv line 2: prefix_group 'inf' is not a fin"):
        read_requests(endless)
    with pytest.raises(OptionError, match="prefix_group must be a whole number >= 0, got -1"):
        Request(0, 90, 4, prefix_group=-1)
    with pytest.raises(OptionError, match="a prefix_len needs a prefix_group"):
        Request(0, 90, 4, prefix_len=10)
    with pytest.raises(OptionError, match="prefix groups must be a whole number >= 1"):
        Prefixes(0, 10)


def test_shared_prefixes_from_the_command_line(tmp_path, capsys):
    config = tmp_path / "llama.json"
    small_llama(2).to_json_file(config)
    base = ["serve", str(config), "--concurrency", "1", "--requests", "8", "--output-len", "4"]
    main([*base, "--input-len", "16", "--prefix-groups", "1", "--prefix-len", "64"])
    # one at a time, one group: the first request computes its 80 tokens, the 7 others
    # find the 64 of the prefix: 448 of 8 x 80 = 640 tokens, 70.0%
    out = capsys.readouterr().out
    assert "prefix cache (on): 70.0% of 640 prompt tokens found cached (shared prefixes: 1)" in out
    for flags, message in [
        (["--prefix-groups", "2"], "shared prefixes need both --prefix-groups and --prefix-len"),
        (["--prefix-len", "64", "--prefix-groups", "2", "--trace", str(config)], "--trace gives"),
    ]:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err


def test_freed_blocks_of_any_request_queue_before_a_prefix_is_kept():
    scheduler = Scheduler(EngineConfig(), kv_blocks=10)
    # group 0's request ends: its own block, then its prefix's 3, 2, 1, 0 join the free
    # queue behind the 5 never used
    _serve(scheduler, [_state(0, 80, 1, 0, 64)])
    # a 96-token request takes the 5 never used and the first freed (its own block), and
    # frees its 6 behind the prefix; the next takes the queue's first 6: the prefix's 4
    # and 2 of those. Group 0 then finds nothing cached, as in vLLM's one free queue
    _serve(scheduler, [_state(1, 96, 1, None, 0)])
    _serve(scheduler, [_state(2, 96, 1, None, 0)])
    again = _state(3, 80, 1, 0, 64)
    steps = _serve(scheduler, [again])
    assert steps[0][:3] == ([(80, 0)], 0, 80) and again.cached_tokens == 0


def test_a_preempted_request_is_not_looked_up_again_in_the_hit_rate():
    # two requests of 64 tokens (48 of them a group's prefix) and 60 outputs in 9 blocks:
    # they run out of blocks and the newest is preempted and computes its prompt again;
    # only the first lookups (64 + 64 prompt tokens, none cached) count, as vLLM's
    scheduler = Scheduler(EngineConfig(), kv_blocks=9)
    states = [_state(0, 64, 60, 0, 48), _state(1, 64, 60, 0, 48)]
    steps = _serve(scheduler, states)
    assert scheduler.preemptions >= 1
    assert (sum(s[2] for s in steps), sum(s[1] for s in steps)) == (128, 0)
    assert [s.cached_tokens for s in states] == [0, 0]


def test_a_request_s_own_blocks_queue_as_one_entry_taken_in_part():
    cache = PrefixCache(8)
    # a request takes 5 of the 8 blocks never used: 4 its own, 1 its prefix's block 0
    cache.take(5)
    cache.add((0, 0))
    # it ends: its 4 own blocks join the queue as one entry, then its prefix block, cached
    cache.free_own(4)
    cache.release([(0, 0)])
    assert list(cache.queue.values()) == [4, 1] and cache.evictable == [(0, 0)]
    cache.take(5)  # the 3 never used, then 2 of the 4: the other 2 stay first in the queue
    assert cache.never_used == 0 and list(cache.queue.values()) == [2, 1]
    cache.take(2)  # the rest of them: the cached block is next, still cached
    assert cache.evictable == [(0, 0)] and (0, 0) in cache.users
    cache.take(1)  # then the cached block, evicted
    assert not cache.queue and (0, 0) not in cache.users
    cache.free_own(0)  # a request that held none queues nothing
    assert not cache.queue

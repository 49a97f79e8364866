"""The serving simulation (torchroof.serving.simulate, torchroof.serve, ``torchroof serve``):
its scheduler by hand, its latencies against the step function they come from, and the
properties a serving engine has (saturation throughput, chunked prefill's trade, preemption
exactly when the KV blocks run out, determinism), on tests/conftest.py's small Llama (2
layers, d = 128, 4 heads of 32, 2 K/V heads: 2 x 2 x 2 x 32 x 2 B = 512 B of K and V per
token) priced on the H100 SXM's pure roofline."""

import json

import numpy as np
import pytest
from conftest import small_llama

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.render.serving import serving_lines
from torchroof.serving import SequenceWork, StepTimer, prompt
from torchroof.serving.composition import StepMix, items_of
from torchroof.serving.rate_search import search_rate
from torchroof.serving.requests import Arrivals, Lengths, Request, make_requests, read_requests
from torchroof.serving.scheduler import EngineConfig, Running, Scheduler
from torchroof.serving.simulate import kv_capacity, simulate


@pytest.fixture(scope="module")
def timer():
    prepared = torchroof.prepare(small_llama(2), "decode", context=16)
    return StepTimer(prepared, "h100-sxm")


def test_a_prompt_runs_in_chunks_of_the_budget_then_decodes():
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=256), kv_blocks=1000)
    state = Running(Request(0, 1000, 3, 0.0), arrival_s=0.0)
    scheduler.submit(state)
    chunks = []
    now = 0.0
    while scheduler.busy:
        step = scheduler.schedule(now)
        chunks.append([(w.new_tokens, w.context, w.samples) for w in step.work])
        now += 1.0
        scheduler.complete(step, now)
    # 1000 prompt tokens in 256-token chunks, the last (232) samples the first token; then
    # two decodes feed back tokens 1 and 2 over 1000 and 1001 cached tokens
    assert chunks == [
        [(256, 0, False)],
        [(256, 256, False)],
        [(256, 512, False)],
        [(232, 768, True)],
        [(1, 1000, True)],
        [(1, 1001, True)],
    ]
    assert state.first_token_s == 4.0 and state.finish_s == 6.0 and state.gaps == [1.0, 1.0]
    # its blocks are freed when it finishes: ceil(1002 / 16) = 63 held at the end
    assert scheduler.free_blocks == 1000 and state.blocks == 0


def test_preemption_starts_exactly_where_the_blocks_run_out():
    # four requests of 32 prompt + 33 output tokens hold ceil((32 + 33 - 1) / 16) = 4
    # blocks each at their end: 16 blocks serve all four at once, 15 do not
    def run(blocks):
        scheduler = Scheduler(EngineConfig(), kv_blocks=blocks)
        states = [Running(Request(i, 32, 33, 0.0), arrival_s=0.0) for i in range(4)]
        for state in states:
            scheduler.submit(state)
        steps, now, peak = 0, 0.0, 0
        while scheduler.busy:
            step = scheduler.schedule(now)
            peak = max(peak, step.blocks_used)
            now += 1.0
            scheduler.complete(step, now)
            steps += 1
        return scheduler.preemptions, steps, peak, states

    preemptions, steps, peak, _ = run(16)
    assert (preemptions, steps, peak) == (0, 33, 16)  # 1 prefill step + 32 decode steps
    preemptions, steps, peak, states = run(15)
    # after 16 decodes the four hold 3 blocks each and each needs its fourth: the first
    # three take the 3 left, the newest finds none and preempts itself, freeing its 3 (the
    # step ends with 12 in use); it waits (it needs 4 blocks to hold its 32 + 17 tokens
    # again) until the others end at step 33, then computes its prompt and its 17 tokens
    # again in one step, which samples its 18th, and decodes its last 15
    assert (preemptions, peak) == (1, 12)
    assert [s.preemptions for s in states] == [0, 0, 0, 1] and all(s.done for s in states)
    assert steps == 33 + 1 + 15


def test_one_request_alone_takes_its_prefill_then_its_decodes(timer):
    request = Request(0, 48, 5, arrival_s=0.0)
    result = simulate(timer, [request])
    record = result.requests[0]
    # TTFT: the prompt's step; each later token: a decode over 48, 49, 50 and 51 cached
    prefill = timer.time([prompt(48)]).time_s
    decodes = [timer.time([SequenceWork(1, 48 + i)]).time_s for i in range(4)]
    assert record.ttft_s == pytest.approx(prefill, rel=1e-12)
    assert record.finish_s - record.first_token_s == pytest.approx(sum(decodes), rel=1e-12)
    assert record.tpot_s == pytest.approx(sum(decodes) / 4, rel=1e-12)
    assert np.allclose(result.itl_s, decodes, rtol=1e-12)
    assert record.queue_s == 0.0 and len(result.steps.start_s) == 5


def test_at_saturation_throughput_is_the_full_batch_per_step(timer):
    # 8 clients each sending 64-token prompts for 512 tokens, 8 sequences at most: the
    # engine decodes 8 at a time almost always, over contexts from 64 to 575
    engine = EngineConfig(max_num_seqs=8)
    requests = [Request(i, 64, 512) for i in range(32)]
    result = simulate(timer, requests, engine=engine, concurrency=8)
    summary = result.summary()
    middle = timer.time([SequenceWork(1, 64 + 255)] * 8).time_s  # the mean context
    assert summary["output_tokens_per_s"] == pytest.approx(8 / middle, rel=0.03)


def test_chunked_prefill_trades_time_to_first_token_for_smooth_tokens(timer):
    # on this model a 2048-token prompt's step takes 16 us, a 512-token chunk beside 8
    # decodes 5 us, 8 decodes alone 1.6 us; at 30,000 requests/s a few requests overlap
    requests = make_requests(
        200, Lengths.parse(2048, "in"), Lengths.parse(64, "out"), Arrivals("poisson", 3e4), 3
    )
    whole = EngineConfig(max_num_batched_tokens=4096, chunked_prefill=False)
    whole = simulate(timer, requests, engine=whole).summary()
    chunked = simulate(timer, requests, engine=EngineConfig(max_num_batched_tokens=512))
    chunked = chunked.summary()
    # a whole prompt stalls every decode for its step: the tail gap between tokens is
    # that step; in 512-token chunks each stall is a quarter of it (Sarathi-Serve's
    # point), while the prompt's own first token waits for four steps instead of one
    assert chunked["itl_s"]["p99"] < 0.5 * whole["itl_s"]["p99"]
    assert chunked["ttft_s"]["p50"] > 2 * whole["ttft_s"]["p50"]


def test_the_same_inputs_give_the_same_bytes(timer):
    requests = make_requests(
        40,
        Lengths.parse("uniform:8,200", "in"),
        Lengths.parse("zipf:1.2,100", "out"),
        Arrivals("gamma", 30.0, cv=2.0),
        7,
    )
    a = json.dumps(simulate(timer, requests, replicas=2, router="least-loaded").to_dict(0.1, 0.01))
    b = json.dumps(simulate(timer, requests, replicas=2, router="least-loaded").to_dict(0.1, 0.01))
    assert a == b


def test_the_garbage_collector_rests_while_the_engine_steps(timer, collector_at_each_step):
    """Each engine step makes containers (its items, a request's gaps) that reference
    counting frees, so the cyclic collector is paused while the engine steps (its full
    passes rescan every request held) and on again after, as it was."""
    import gc

    seen = collector_at_each_step
    requests = [Request(i, 32, 8, arrival_s=1e-3 * i) for i in range(4)]
    assert gc.isenabled()
    simulate(timer, requests)
    assert seen and not any(seen)  # off at every step
    assert gc.isenabled()
    with pytest.raises(OptionError, match="unknown router"):
        simulate(timer, requests, router="fastest")
    assert gc.isenabled()  # on again after a refusal too
    gc.disable()  # left off where it was off
    try:
        simulate(timer, requests)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_replicas_share_the_load(timer):
    # one request alone takes about 5 us here: arriving 1 us apart, they overlap
    requests = [Request(i, 32, 16, arrival_s=1e-6 * i) for i in range(6)]
    result = simulate(timer, requests, replicas=2)
    assert [r.replica for r in result.requests] == [0, 1, 0, 1, 0, 1]  # round-robin
    alone = simulate(timer, requests)
    assert result.summary()["e2e_s"]["mean"] < alone.summary()["e2e_s"]["mean"]


def test_kv_blocks_are_what_memory_leaves(timer):
    engine = EngineConfig()
    kv = kv_capacity(timer, engine)
    assert kv.bytes_per_token == 512  # 2 layers x 2 K/V heads x (32 + 32) dims x 2 B
    usable = int(80 * 2**30 * 0.9)  # the H100 SXM's 80 GiB at vLLM's 0.9
    # the largest step as vLLM's profiling run makes it: the 8192-token budget over 256
    # requests of 32 tokens, logits for each one's last token
    largest = torchroof.estimate(small_llama(2), "prefill", seq=32, batch=256)
    activations = largest.memory.activations_peak_bytes
    assert kv.activations_bytes == activations
    # not a decode of 8192 rows, whose 8192 rows of logits (2000 B each) no step computes
    every_row = torchroof.estimate(small_llama(2), "decode", batch=8192, context=16)
    assert every_row.memory.activations_peak_bytes > activations
    assert kv.weights_bytes == largest.memory.weights_bytes
    assert kv.blocks == (usable - kv.weights_bytes - activations) // (512 * 16)
    assert kv_capacity(timer, EngineConfig(num_gpu_blocks_override=7)).blocks == 7
    # GPT-2 has 1024 positions: 8192 tokens over 4 requests would be 2048 each, so the
    # largest step is 8 sequences of 1024
    gpt2 = StepTimer(torchroof.prepare("gpt2", "decode", context=16))
    eight = torchroof.estimate("gpt2", "prefill", batch=8, seq=1024)
    assert gpt2.step_activations(8192, 4) == eight.memory.activations_peak_bytes


def test_lengths_and_arrivals_are_drawn_as_written():
    rng = np.random.default_rng(0)
    assert set(Lengths.parse("uniform:3,5", "x").draw(rng, 500)) == {3, 4, 5}
    zipf = Lengths.parse("zipf:2,10", "x").draw(rng, 20000)
    assert zipf.min() >= 1 and zipf.max() <= 10
    # P(1) = 1 / sum(k^-2, k = 1..10) = 1 / 1.5498 = 0.645
    assert (zipf == 1).mean() == pytest.approx(0.645, abs=0.015)
    assert list(Lengths.parse(7, "x").draw(rng, 3)) == [7, 7, 7]
    gaps = np.diff([0.0, *Arrivals("poisson", 20.0).times(rng, 20000)])
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)  # exponential gaps, mean 1/rate
    bursty = np.diff([0.0, *Arrivals("gamma", 20.0, cv=2.0).times(rng, 20000)])
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)


def test_request_files(tmp_path):
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text(
        '{"input_len": 10, "output_len": 4, "arrival_s": 0.5}\n\n'
        '{"input_len": 20, "output_len": 2, "arrival_s": 0.1}\n'
    )
    assert [(r.input_len, r.output_len, r.arrival_s) for r in read_requests(jsonl)] == [
        (10, 4, 0.5),
        (20, 2, 0.1),
    ]
    table = tmp_path / "trace.csv"
    table.write_text("input_len,output_len\n10,4\n12,x\n")
    with pytest.raises(OptionError, match="line 3: output_len 'x' is not a number"):
        read_requests(table)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_len": 10, "output_len": 4}\n{"input_len": 0, "output_len": 4}\n')
    with pytest.raises(OptionError, match="line 2: input_len must be a whole number >= 1"):
        read_requests(bad)


def test_serve_end_to_end_and_on_the_command_line(tmp_path, capsys):
    result = torchroof.serve(
        small_llama(2), rate=50.0, requests=30, input_len="uniform:16,64", output_len=8
    )
    summary = result.summary(ttft_slo_s=1.0)
    assert summary["requests"] == summary["requests_meeting_slo"] == 30
    assert result.engine["kv_bytes_per_token"] == 512
    out = tmp_path / "run.json"
    code = main(
        [
            "serve",
            "gpt2",
            "--rate",
            "20",
            "--requests",
            "20",
            "--input-len",
            "32",
            "--output-len",
            "4",
            "--ttft-ms",
            "500",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "time to first token" in text and "goodput:" in text
    assert len(json.loads(out.read_text())["requests"]) == 20


def test_bad_serving_input_is_answered_in_one_line(timer, tmp_path, capsys):
    one = [Request(0, 16, 4, 0.0)]
    cases = [
        (lambda: Arrivals("poisson", 0.0), "rate must be above 0"),
        (lambda: Arrivals("poisson", -1.0), "rate must be above 0"),
        (lambda: Lengths.parse("pareto:1,2", "input_len"), "unknown distribution 'pareto'"),
        (lambda: Lengths.parse("uniform:9,3", "input_len"), "LO <= HI"),
        (lambda: Lengths.parse("0", "input_len"), "whole number of tokens from 1"),
        (lambda: simulate(timer, one, replicas=0), "replicas must be"),
        (lambda: simulate(timer, one, router="random"), "unknown router"),
        (lambda: simulate(timer, [Request(0, 4000, 200, 0.0)]), "positions"),
        (
            lambda: simulate(timer, one, engine=EngineConfig(num_gpu_blocks_override=1)),
            "the KV cache holds 1 blocks",
        ),
        (
            lambda: simulate(
                timer,
                [Request(0, 600, 4, 0.0)],
                engine=EngineConfig(max_num_batched_tokens=512, chunked_prefill=False),
            ),
            "without chunked prefill",
        ),
        (lambda: torchroof.serve(small_llama(2), requests=3), "give a request rate"),
        (
            lambda: torchroof.serve(small_llama(2), rate=1.0, concurrency=2, requests=3),
            "not both",
        ),
        (lambda: torchroof.serve(small_llama(2), rate=1.0, batch=4), "batch is not taken"),
        (lambda: EngineConfig(max_num_seqs=0), "max_num_seqs must be"),
        (lambda: Lengths.parse("zipf:1.5,1e9", "input_len"), "past 10,000,000 tokens"),
        (lambda: Request(0, 16, 0), "output_len must be a whole number >= 1"),
        (lambda: Request(0, 16, 4, float("nan")), "arrival_s must be 0 or more"),
        (lambda: Request(0, 16, 4, -1.0), "arrival_s must be 0 or more"),
        (lambda: simulate(timer, one, concurrency=0), "concurrency must be"),
        (lambda: torchroof.serve(small_llama(2), concurrency=0, requests=3), "concurrency"),
        (
            lambda: make_requests(
                3, Lengths("fixed", 4), Lengths("fixed", 4), Arrivals("closed", concurrency=1), -1
            ),
            "random_state must be",
        ),
        (lambda: EngineConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    ]
    for call, message in cases:
        with pytest.raises((OptionError, ValueError)) as caught:
            call()
        assert message in str(caught.value) and "\n" not in str(caught.value)
    assert main(["serve", "gpt2", "--rate", "0"]) == 2
    assert "must be above 0" in capsys.readouterr().err
    trace = tmp_path / "trace.csv"
    trace.write_text("input_len,output_len\n10,4\n")
    assert main(["serve", "gpt2", "--trace", str(trace), "--requests", "5", "--rate", "1"]) == 2
    assert "--requests is not taken with it" in capsys.readouterr().err
    # draws past the longest length are clipped to it, then refused by the positions
    wide = Lengths.parse("normal:9e6,1e7", "x")
    huge = make_requests(50, wide, Lengths.parse(4, "y"), Arrivals("poisson", 1.0), 0)
    assert max(r.input_len for r in huge) == 10_000_000 and min(r.input_len for r in huge) == 1
    with pytest.raises(ValueError, match="positions"):
        simulate(timer, huge)


def test_the_highest_rate_within_the_targets(timer, capsys):
    # on this model a 512-token prompt's step takes about 4 us and a decode about 0.4 us
    requests = make_requests(
        100, Lengths.parse(512, "in"), Lengths.parse(64, "out"), Arrivals("poisson", 1.0), 0
    )
    found = search_rate(timer, requests, ttft_s=50e-6, tpot_s=2e-6, start=32768.0)
    best = found.best
    assert best is not None and best.attainment >= 0.9
    # first the requests one at a time, none overlapping: each TTFT its prompt's step
    alone = found.tried[0].result.summary()
    assert alone["ttft_s"]["p99"] == pytest.approx(timer.time([prompt(512)]).time_s)
    # every rate that met the targets is at most the best, and a rate within 5% above it
    # did not meet them
    # then every request at once, which fails these targets
    assert [t.how for t in found.tried[:2]] == ["one at a time", "all at once"]
    assert found.tried[1].attainment < 0.9
    met = [t.rate for t in found.tried[2:] if t.attainment >= 0.9]
    failed = [t.rate for t in found.tried[2:] if t.attainment < 0.9]
    assert max(met) == best.rate and best.rate < min(failed) <= best.rate * 1.05
    # from a start the targets fail at, the search comes down to the same neighbourhood
    below = search_rate(timer, requests, ttft_s=50e-6, tpot_s=2e-6, start=1e6).best
    assert below is not None and abs(below.rate / best.rate - 1) < 0.2
    # a TTFT below one request's own prefill: no rate meets it, said rather than searched
    none = search_rate(timer, requests, ttft_s=1e-7, tpot_s=None)
    assert none.best is None and len(none.tried) == 1
    assert (
        main(
            [
                "serve",
                "gpt2",
                "--sweep-rate",
                "--ttft-ms",
                "0.0001",
                "--requests",
                "20",
                "--input-len",
                "64",
                "--output-len",
                "4",
                "--quiet",
            ]
        )
        == 0
    )
    assert "no rate meets TTFT <= 0.0001 ms for 90% of requests" in capsys.readouterr().out
    # targets every request at once meets: no rate limits them, found in two runs
    loose = search_rate(timer, requests, ttft_s=1.0, tpot_s=None)
    assert loose.best is not None and loose.best.how == "all at once" and len(loose.tried) == 2
    with pytest.raises(OptionError, match="needs a TTFT or a TPOT target"):
        search_rate(timer, requests, ttft_s=None, tpot_s=None)
    together = [Request(i, 16, 4, 0.5) for i in range(3)]
    with pytest.raises(OptionError, match="all arrive at one time"):
        search_rate(timer, together, ttft_s=1.0, tpot_s=None)


@pytest.fixture(scope="module")
def coupled():
    """The tiny Mixtral of conftest as rank 0 of dp 2 x ep 2: its 8 experts over 2 ranks,
    each rank an engine with its own requests (data-parallel attention)."""
    from conftest import TINY_MIXTRAL
    from transformers import MixtralConfig

    prepared = torchroof.prepare(MixtralConfig(**TINY_MIXTRAL), "decode", context=16, dp=2, ep=2)
    return StepTimer(prepared, "dgx-h100", runtime="vllm")


def test_data_parallel_ranks_of_a_moe_step_together(coupled):
    """Rank 0 gets a 64-token prompt, rank 1 a 256-token one, at once (round-robin): the
    two step together, so both first tokens come when the longer prefill ends. A prefill
    replays no full CUDA graph, so both ranks are priced launched eagerly, each at its own
    tokens but for its routed experts, priced at the group's mean, ceil((64 + 256) / 2) =
    160 tokens, and their all-to-alls, at its most, 256."""
    assert coupled.lockstep == 2
    requests = [Request(0, 64, 1, arrival_s=0.0), Request(1, 256, 1, arrival_s=0.0)]
    result = simulate(coupled, requests, replicas=2)
    first = [r.first_token_s for r in result.requests]
    mixes = [StepMix.of(items_of([prompt(n)])) for n in (64, 256)]
    times = [t.time_s for t in coupled.group_times(mixes, 2)]
    assert first == [max(times), max(times)] and times[0] < times[1]
    parts = {n: coupled._probe(n, eager=True) for n in (64, 160, 256)}
    for n, time in zip((64, 256), times, strict=True):
        by_hand = coupled.time([prompt(n)]).time_s
        by_hand += parts[160].experts_s - parts[n].experts_s
        by_hand += parts[256].exchange_s - parts[n].exchange_s
        assert time == pytest.approx(by_hand, rel=1e-12)
    assert parts[256].experts_s > parts[160].experts_s > 0 and parts[256].exchange_s > 0
    # a rank alone in its group: the idle rank's zero tokens count in the mean, ceil(64/2)
    (alone,) = coupled.group_times(mixes[:1], 2)
    by_hand = coupled.time([prompt(64)]).time_s
    by_hand += coupled._probe(32, eager=True).experts_s - parts[64].experts_s
    assert alone.time_s == pytest.approx(by_hand, rel=1e-12)
    # decodes replay vLLM's full CUDA graph on every rank: each rank is padded to the
    # group's most tokens (3 and 1 decodes: both run 3), its attention and logits its own
    decodes = [StepMix.of(items_of([SequenceWork(1, 40)] * n)) for n in (3, 1)]
    padded = coupled.group_times(decodes, 2)
    three = coupled.time(decodes[0])
    assert padded[0] == three and padded[1].body_s == three.body_s
    assert padded[1].attention_s == coupled.time(decodes[1]).attention_s
    # without CUDA graphs nothing is padded: the 1-decode rank's body at its own token,
    # its experts at ceil(4 / 2) = 2 and their all-to-alls at 3
    eager = StepTimer(coupled.prepared, "dgx-h100", runtime="vllm", cuda_graphs=False)
    unpadded = eager.group_times(decodes, 2)
    probes = {n: eager._probe(n, eager=True) for n in (1, 2, 3)}
    by_hand = eager.time(decodes[1]).body_s + probes[2].experts_s - probes[1].experts_s
    by_hand += probes[3].exchange_s - probes[1].exchange_s
    assert unpadded[1].body_s == pytest.approx(by_hand, rel=1e-12)
    assert unpadded[1].body_s != unpadded[0].body_s
    # a dense model's steps have no experts: its ranks step alone
    dense = torchroof.prepare(small_llama(2), "decode", context=16, dp=2)
    assert StepTimer(dense, "h100-sxm").lockstep == 1
    with pytest.raises(OptionError, match="give replicas as a multiple of 2, not 3") as caught:
        simulate(coupled, requests, replicas=3)
    assert "\n" not in str(caught.value)
    header = serving_lines(result.summary(), result.engine)[0]
    assert "2 data-parallel ranks of ep 2, in lock-step groups of 2" in header


def test_a_split_lock_step_group_is_refused_before_anything_is_traced(monkeypatch):
    import sys

    serving = sys.modules["torchroof.serving.serve"]  # the module, not the package's function

    def traced(*args, **kwargs):
        raise AssertionError("traced before the replicas were checked")

    monkeypatch.setattr(serving, "deployment_timer", traced)
    for call in (
        lambda: torchroof.serve("mixtral-8x7b", "dgx-h100", dp=4, ep=4, replicas=2, rate=1.0),
        lambda: torchroof.serve("mixtral-8x7b", "dgx-h100", tp=2, dp=2, ep=4, replicas=3, rate=1.0),
    ):
        with pytest.raises(OptionError, match="couples . data-parallel ranks") as caught:
            call()
        assert "\n" not in str(caught.value)
    for bad in ("2", 2.5, 0):
        with pytest.raises(OptionError, match="replicas must be a whole number >= 1"):
            torchroof.serve("mixtral-8x7b", "dgx-h100", dp=4, ep=4, replicas=bad, rate=1.0)
    with pytest.raises(OptionError, match="on a disaggregated side is not simulated"):
        torchroof.serve(
            "mixtral-8x7b", "dgx-h100", disaggregate="1P1D", rate=1.0,
            prefill={"dp": 2, "ep": 2}, decode={"dp": 2, "ep": 2},
        )  # fmt: skip

"""Speculative decoding in the serving simulation (torchroof.serving.speculative): the
acceptance rates and their expected tokens (Leviathan et al. 2023's closed form), the
scheduler's verifications and the draft model's passes by hand, the latencies they make,
the KV cache the draft shares, and the speed-up against the closed form. The target is
tests/conftest.py's small Llama with 4 layers (1,024 B of K and V per token: 4 layers x 2
K/V heads x (32 + 32) x 2 B), the draft the same with 1 layer (256 B per token), on the
H100 SXM's pure roofline."""

import json
import math

import numpy as np
import pytest
from conftest import small_llama
from hypothesis import given, settings
from hypothesis import strategies as st

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.serving import SequenceWork, Speculative, StepTimer
from torchroof.serving.composition import StepMix, items_of
from torchroof.serving.requests import Request
from torchroof.serving.scheduler import EngineConfig, Running, Scheduler
from torchroof.serving.simulate import kv_capacity, simulate
from torchroof.serving.speculative import Acceptance, Drafter


@pytest.fixture(scope="module")
def target():
    return StepTimer(torchroof.prepare(small_llama(4), "decode", context=16), "h100-sxm")


@pytest.fixture(scope="module")
def draft():
    return StepTimer(torchroof.prepare(small_llama(1), "decode", context=16), "h100-sxm")


def test_a_rate_gives_the_closed_form_tokens_per_verification():
    # alpha = 0.5, k = 3: positions accepted with 0.5, 0.25, 0.125; a verification yields
    # 1 + 0.5 + 0.25 + 0.125 = 1.875 = (1 - 0.5^4) / (1 - 0.5) tokens
    half = Acceptance.of(0.5, 3)
    assert half.rates == (0.5, 0.25, 0.125)
    assert half.expected_tokens() == 1.875 == (1 - 0.5**4) / (1 - 0.5)
    assert half.expected_tokens(drafts=1) == 1.5
    # per-position rates as an engine reports them: 1 + 0.8 + 0.6 + 0.4 = 2.8
    assert Acceptance.of("0.8,0.6,0.4", 3).expected_tokens() == pytest.approx(2.8)
    assert Acceptance.of([1, 1], 2).expected_tokens() == 3


@pytest.mark.parametrize(
    ("acceptance", "tokens", "message"),
    [
        ("0.4,0.6", 2, "position 2's acceptance 0.6 is above position 1's 0.4"),
        ("0.8,0.6", 3, "2 acceptance rates for 3 speculative tokens"),
        (1.5, 3, "acceptance rates are in [0, 1], got 1.5 at position 1"),
        ("fast", 3, "acceptance must be a rate or rates separated by commas"),
        (0.5, 0, "speculative tokens must be a whole number >= 1, got 0"),
        (float("nan"), 2, "acceptance rates must be numbers in [0, 1]"),
    ],
)
def test_bad_acceptances_are_refused_in_a_line(acceptance, tokens, message):
    with pytest.raises(OptionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Acceptance.of(acceptance, tokens)


def test_draws_follow_the_per_position_rates():
    # 40,000 verifications of 3 drafts at (0.8, 0.6, 0.4): the share accepting at least i
    # drafts is p_i, within 4 standard errors (sqrt(p (1 - p) / n) <= 0.0025)
    rates = Acceptance.of("0.8,0.6,0.4", 3)
    rng = np.random.default_rng(0)
    counts = np.array([rates.draw(rng, 3) for _ in range(40_000)])
    for i, p in enumerate(rates.rates, start=1):
        assert abs((counts >= i).mean() - p) < 4 * math.sqrt(p * (1 - p) / 40_000)
    # fewer drafts (the request's last tokens) cap the count
    assert max(rates.draw(rng, 1) for _ in range(100)) == 1


def _steps(acceptance, output_len=10, head=False):
    """A request of 8 prompt tokens and ``output_len`` output tokens, k = 3, stepped alone:
    per step its target work and the draft's passes, as (new tokens, context) pairs."""
    rng = np.random.default_rng(0)
    scheduler = Scheduler(EngineConfig(), 1000, Acceptance.of(acceptance, 3), rng, head=head)
    state = Running(Request(0, 8, output_len, 0.0), arrival_s=0.0)
    scheduler.submit(state)
    steps, now = [], 0.0
    while scheduler.busy:
        step = scheduler.schedule(now)
        (work,) = step.work
        passes = [[(w.new_tokens, w.context) for w in one] for one in step.draft]
        steps.append(((work.new_tokens, work.context, work.verifies), step.accepted, passes))
        now += 1.0
        scheduler.complete(step, now)
    return steps, state


def test_every_draft_accepted_by_hand():
    steps, state = _steps(1.0)
    assert steps == [
        # the prompt (8 tokens) samples token 1; the draft processes the prompt and token 1
        # (9 tokens over 0) and drafts 2 more over 9 and 10: min(3, 10 - 1 - 1) = 3 drafts
        ((8, 0, False), (0,), [[(9, 0)], [(1, 9)], [(1, 10)]]),
        # token 1 and its 3 drafts verified over 8 cached: all kept, a 4th sampled (5 in
        # all, 12 cached); the draft never saw its third draft: it processes it and the new
        # token (2 over 11), then drafts over 13 and 14: min(3, 10 - 5 - 1) = 3
        ((4, 8, True), (3,), [[(2, 11)], [(1, 13)], [(1, 14)]]),
        # 4 more: 9 sampled, 16 cached; min(3, 10 - 9 - 1) = 0 drafts: no draft pass
        ((4, 12, True), (3,), []),
        ((1, 16, False), (0,), []),  # the 10th token, a plain decode
    ]
    assert state.generated == 10 and state.finish_s == 4.0
    assert state.gaps == [1.0, 1.0, 1.0]  # one gap per step, however many tokens it brings


def test_a_heads_first_pass_takes_every_verified_token_by_hand():
    """As test_every_draft_accepted_by_hand, drafted by a head: its first pass after a
    verification runs over the 4 tokens the served model verified, over the 8 cached before
    them (a draft model's, over the 2 it had not seen), and its next passes follow them."""
    steps, state = _steps(1.0, head=True)
    assert steps == [
        ((8, 0, False), (0,), [[(9, 0)], [(1, 9)], [(1, 10)]]),  # the prompt: as a model's
        ((4, 8, True), (3,), [[(4, 8)], [(1, 12)], [(1, 13)]]),
        ((4, 12, True), (3,), []),
        ((1, 16, False), (0,), []),
    ]
    assert state.generated == 10


def test_every_draft_rejected_by_hand():
    steps, state = _steps(0.0, output_len=4)
    assert steps == [
        ((8, 0, False), (0,), [[(9, 0)], [(1, 9)]]),  # min(3, 4 - 1 - 1) = 2 drafts
        # 2 drafts rejected: one token (2 in all), 9 cached; the draft has the token before
        # it, so it processes the new one (1 over 9) and drafts min(3, 4 - 2 - 1) = 1
        ((3, 8, True), (0,), [[(1, 9)]]),
        ((2, 9, True), (0,), []),  # 3 in all, 10 cached, no drafts left for the last
        ((1, 10, False), (0,), []),
    ]
    assert state.generated == 4


def test_a_lone_request_is_its_steps_and_the_drafts_passes(target, draft):
    drafter = Drafter(draft, Acceptance.of(1.0, 3))
    (record,) = simulate(target, [Request(0, 8, 10, 0.0)], concurrency=1, drafter=drafter).requests

    def step(work, passes):
        return target.time(work).time_s + sum(
            draft.time([SequenceWork(n, c) for n, c in one]).time_s for one in passes
        )

    # the steps of test_every_draft_accepted_by_hand
    first = step([SequenceWork(8)], [[(9, 0)], [(1, 9)], [(1, 10)]])
    rest = (
        step([SequenceWork(4, 8, verifies=True)], [[(2, 11)], [(1, 13)], [(1, 14)]])
        + step([SequenceWork(4, 12, verifies=True)], [])
        + step([SequenceWork(1, 16)], [])
    )
    assert record.ttft_s == pytest.approx(first, rel=1e-12)
    assert record.e2e_s == pytest.approx(first + rest, rel=1e-12)
    assert record.tpot_s == pytest.approx(rest / 9, rel=1e-12)


def test_the_speed_up_matches_the_closed_form(target, draft):
    # alpha = 0.6, k = 3: E = (1 - 0.6^4) / (1 - 0.6) = 2.176 tokens per verification. A
    # speculative step is one verification of 4 tokens and 3 draft passes of 1 token
    # (the first has 2 tokens where all 3 drafts were accepted, 0.216 of the time: priced
    # at its mean below); without speculation a token costs one decode. Over 40 requests
    # of 16 + 257 tokens, one at a time, the mean cached context is about 16 + 128: the
    # speed-up is E x T_decode / T_step there, within 2% (attention is linear in the
    # context, the acceptance is drawn: its mean over ~4,700 verifications is within
    # about 0.5%)
    requests = [Request(i, 16, 257, 0.0) for i in range(40)]
    alpha, context = 0.6, 16 + 128
    expected = Acceptance.of(alpha, 3).expected_tokens()
    assert expected == pytest.approx((1 - alpha**4) / (1 - alpha))
    plain = simulate(target, requests, concurrency=1).summary()["tpot_s"]["mean"]
    drafter = Drafter(draft, Acceptance.of(alpha, 3))
    fast = simulate(target, requests, concurrency=1, drafter=drafter).summary()
    catch_up = (
        0.216 * draft.time([SequenceWork(2, context)]).time_s
        + 0.784 * draft.time([SequenceWork(1, context)]).time_s
    )
    step = (
        target.time([SequenceWork(4, context, verifies=True)]).time_s
        + catch_up
        + 2 * draft.time([SequenceWork(1, context)]).time_s
    )
    closed_form = expected * target.time([SequenceWork(1, context)]).time_s / step
    assert plain / fast["tpot_s"]["mean"] == pytest.approx(closed_form, rel=0.02)
    assert fast["speculative"]["mean_acceptance_length"] == pytest.approx(expected, rel=0.02)


def test_the_cache_holds_the_drafts_weights_and_kv(target, draft):
    # weights: the 4-layer target 994,432 parameters (2 x 1000 x 128 embeddings and
    # head, 4 x 184,576 per layer, 128 of the final norm) = 1,988,864 B in bf16; the
    # 1-layer draft 440,704 = 881,408 B. Each token keeps 1,024 + 256 = 1,280 B.
    engine = EngineConfig()
    alone, shared = kv_capacity(target, engine), kv_capacity(target, engine, draft)
    assert (alone.weights_bytes, shared.weights_bytes) == (1_988_864, 1_988_864 + 881_408)
    assert (alone.bytes_per_token, shared.bytes_per_token) == (1024, 1280)
    assert shared.activations_bytes == max(
        target.step_activations(8192, 256), draft.step_activations(8192, 256)
    )
    left = shared.usable_bytes - shared.weights_bytes - shared.activations_bytes
    assert shared.blocks == left // (1280 * 16)


def _launched_eagerly(step, graphed=None):
    return StepMix.of(items_of(step)).launched_eagerly(graphed)


def test_uniform_verifications_replay_a_graph():
    verify = SequenceWork(4, 100, verifies=True)
    assert not _launched_eagerly([verify, verify])  # vLLM's uniform decode batch
    assert not _launched_eagerly([SequenceWork(1, 5), SequenceWork(1, 9)])
    assert _launched_eagerly([verify, SequenceWork(3, 100, verifies=True)])
    assert _launched_eagerly([verify, SequenceWork(1, 100)])
    assert _launched_eagerly([SequenceWork(4, 100, samples=False)])  # a prompt chunk
    # with 3 drafts a request, only verifications of 3 + 1 tokens replay the graph
    assert not _launched_eagerly([verify, verify], graphed=4)
    assert _launched_eagerly([SequenceWork(1, 5), SequenceWork(1, 9)], graphed=4)


def test_the_same_random_state_gives_the_same_run(target, draft):
    requests = [Request(i, 32, 40, 0.01 * i) for i in range(20)]
    drafter = Drafter(draft, Acceptance.of(0.7, 3))

    def run(state):
        result = simulate(target, requests, drafter=drafter, random_state=state)
        return json.dumps(result.to_dict(), sort_keys=True)

    assert run(1) == run(1)
    assert run(1) != run(2)  # other acceptances drawn


def test_serve_with_a_draft_from_the_command_line(tmp_path, capsys):
    target, small, other = tmp_path / "t.json", tmp_path / "d.json", tmp_path / "v.json"
    small_llama(2).to_json_file(target)
    small_llama(1).to_json_file(small)
    mismatched = small_llama(1)
    mismatched.vocab_size = 512
    mismatched.to_json_file(other)
    base = [
        "serve",
        str(target),
        "--concurrency",
        "4",
        "--requests",
        "40",
        "--input-len",
        "64",
        "--output-len",
        "64",
    ]
    main([*base, "--draft", str(small), "--acceptance", "1", "--speculative-tokens", "2"])
    out = capsys.readouterr().out
    # every draft accepted: after its first token a request of 64 has 63 to go; each
    # verification of 2 drafts yields 3, so 21 verifications (the 21st starts at 61 tokens
    # with min(2, 64 - 61 - 1) = 2 drafts) end it: 40 x 21 x 2 = 1,680 drafts, all kept,
    # 1 + 1,680 / 840 = 3 tokens per verification
    assert (
        "100.0% of 1,680 drafts accepted, 3.00 tokens per verification (the rates give "
        "3.00 for the drafts checked, 3.00 for 2)"
    ) in out
    for flags, message in [
        (["--acceptance", "0.5"], "--acceptance describes a draft model: give --draft too"),
        (["--draft", str(small)], "--draft needs --acceptance"),
        (["--draft", str(other), "--acceptance", "0.5"], "vocabulary has 512 tokens"),
    ]:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err


def test_serve_takes_a_speculative_deployment():
    # every draft accepted, k = 2, outputs of 64: 1 + 2 = 3 tokens per verification (as
    # on the command line); the result says which draft and how it was set
    result = torchroof.serve(
        small_llama(2),
        concurrency=2,
        requests=10,
        input_len=32,
        output_len=64,
        speculative=Speculative(small_llama(1), acceptance=1.0, tokens=2),
    )
    summary = result.summary()["speculative"]
    assert (summary["drafted"], summary["mean_acceptance_length"]) == (10 * 42, 3.0)
    assert result.engine["speculative_tokens"] == 2
    assert result.engine["acceptance_per_position"] == [1.0, 1.0]
    with pytest.raises(OptionError, match="speculative must be a torchroof.serving.Speculative"):
        torchroof.serve(small_llama(2), concurrency=1, requests=2, speculative=0.7)
    with pytest.raises(OptionError, match="position 2's acceptance 0.9 is above"):
        torchroof.serve(
            small_llama(2),
            concurrency=1,
            requests=2,
            speculative=Speculative(small_llama(1), acceptance=[0.5, 0.9], tokens=2),
        )


def test_the_rates_give_the_drafts_a_verification_had(target, draft):
    # 8 + 4 tokens, k = 3, every draft accepted: after its first token the request has 3
    # to make, so its one verification checks min(3, 4 - 1 - 1) = 2 drafts and yields 3:
    # the rates give 1 + 1 + 1 = 3 for it, though 1 + 3 = 4 for k drafts
    drafter = Drafter(draft, Acceptance.of(1.0, 3))
    result = simulate(target, [Request(0, 8, 4, 0.0)], concurrency=1, drafter=drafter)
    spec = result.summary()["speculative"]
    assert (spec["verifications"], spec["drafted"]) == (1, 2)
    assert (spec["mean_acceptance_length"], spec["expected_acceptance_length"]) == (3.0, 3.0)
    assert result.engine["expected_tokens_per_verification"] == 4.0


def test_bad_speculative_settings_are_refused_before_the_draft_is_traced(target):
    for acceptance in ([0.5, None, 0.2], [True, True, True], []):
        with pytest.raises(OptionError, match="acceptance must be a rate or a list of rates"):
            Acceptance.of(acceptance, 3)
    assert Acceptance.of(np.array([0.5, 0.25]), 2).rates == (0.5, 0.25)
    with pytest.raises(OptionError, match=r"the draft's tp is 1 or the served model's \(1\)"):
        torchroof.serve(
            small_llama(2),
            "dgx-h100",
            concurrency=1,
            requests=2,
            speculative=Speculative(small_llama(1), acceptance=0.5, tp=2),
        )
    with pytest.raises(OptionError, match="random_state must be a whole number >= 0, got -1"):
        simulate(target, [Request(0, 8, 4, 0.0)], concurrency=1, random_state=-1)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 2)), min_size=1, max_size=8
    ),
    budget=st.integers(1, 64),
    block_size=st.sampled_from([1, 4, 16]),
    spare=st.integers(0, 12),
    tokens=st.integers(1, 4),
    rate=st.floats(0, 1),
    chunked=st.booleans(),
)
def test_the_scheduler_keeps_its_books_under_drafts_prefixes_and_preemption(
    lengths, budget, block_size, spare, tokens, rate, chunked
):
    # any mix of prompts (sharing a 24-token prefix by group), drafts and a cache just
    # big enough for the longest request plus its lookahead slots: every request ends
    # with its tokens, no step passes the budget or the cache, every scheduled request
    # holds blocks for what it computes (and, running, its k draft slots), and every
    # block is free again at the end
    if not chunked:
        budget = max(budget, max(i + o for i, o, _ in lengths) + tokens)
    requests = [
        Request(i, prompt, output, 0.0, group if prompt >= 24 else None, 24 if prompt >= 24 else 0)
        for i, (prompt, output, group) in enumerate(lengths)
    ]
    longest = max(r.input_len + r.output_len - 1 + tokens for r in requests)
    blocks = -(-longest // block_size) + spare
    engine = EngineConfig(block_size, 4, budget, chunked)
    scheduler = Scheduler(engine, blocks, Acceptance.of(rate, tokens), np.random.default_rng(0))
    states = [Running(r, 0.0) for r in requests]
    for state in states:
        scheduler.submit(state)
    for now in range(10_000):
        if not scheduler.busy:
            break
        step = scheduler.schedule(float(now))
        assert step.work, "stuck"
        assert sum(w.new_tokens for w in step.work) <= budget
        assert 0 <= scheduler.free_blocks and step.blocks_used <= blocks
        for state, work in zip(step.requests, step.work, strict=True):
            slots = work.context + work.new_tokens + (scheduler.lookahead if state.decoding else 0)
            assert state.held * block_size >= slots
        scheduler.complete(step, float(now + 1))
        users = sum(scheduler.cache.users.values())
        assert users == sum(len(s.shared) for s in scheduler.running)
    assert all(s.generated == s.request.output_len and s.finish_s is not None for s in states)
    assert scheduler.free_blocks == blocks


# -- draft heads -----------------------------------------------------------------------------


def tiny_glm_moe(**fields):
    """A two-layer GLM-4.5-style model (GQA, routed experts from its second layer) with one
    multi-token prediction module."""
    from transformers import AutoConfig

    values = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                  first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=512,
                  num_nextn_predict_layers=1, max_position_embeddings=4096)  # fmt: skip
    return AutoConfig.for_model("glm4_moe", **{**values, **fields})


def test_an_eagle_head_drafts_as_a_one_layer_copy_of_the_served_model():
    """An EAGLE head of the four-layer Llama is timed as its configuration with one layer,
    small_llama(1): served one request at a time with either, every request's first token
    comes at the same time (the prompt's passes are alike), and its last no sooner with the
    head, whose
    first pass after a verification takes every verified token. Its memory is
    the layer alone: the embedding, LM head and final norm are the served model's (2 x
    1,000 x 128 x 2 B + 128 x 2 B = 512,256 B, a one-layer copy's 881,408 B less the
    369,152 B a second layer adds), so the cache gets those bytes back."""
    settings = dict(concurrency=1, requests=8, input_len=64, output_len=32, random_state=0)
    head = torchroof.serve(small_llama(4), "h100-sxm", **settings,
                           speculative=Speculative("eagle", 0.7, 2))  # fmt: skip
    model = torchroof.serve(small_llama(4), "h100-sxm", **settings,
                            speculative=Speculative(small_llama(1), 0.7, 2))  # fmt: skip
    assert [r.ttft_s for r in head.requests] == pytest.approx(
        [r.ttft_s for r in model.requests], rel=1e-9
    )
    pairs = list(zip(head.requests, model.requests, strict=True))
    assert all(h.e2e_s >= m.e2e_s for h, m in pairs) and any(h.e2e_s > m.e2e_s for h, m in pairs)
    assert head.summary()["speculative"] == model.summary()["speculative"]
    assert head.engine["draft_model"] == "EAGLE head of llama"
    served, one = (StepTimer(torchroof.prepare(small_llama(n), "decode", context=128),
                             "h100-sxm") for n in (4, 1))  # fmt: skip
    engine = EngineConfig()
    drafted, headed = kv_capacity(served, engine, one), kv_capacity(served, engine, one, 512_256)
    assert headed.weights_bytes == drafted.weights_bytes - 512_256 == 1_988_864 + 369_152
    assert (model.engine["kv_blocks"], head.engine["kv_blocks"]) == (
        drafted.blocks,
        headed.blocks,
    )
    assert headed.blocks > drafted.blocks


def test_an_mtp_head_is_one_block_of_the_models_later_kind():
    """GLM-4.5's MTP module is a routed-experts block though its first layer is dense: the
    head keeps the 8 experts with first_k_dense_replace 0, and its decode routes tokens to
    them; at tensor parallel 2 with experts over 2 GPUs it keeps the served model's expert
    parallelism, and a draft tp of 1 is refused in a line."""
    from torchroof.serving.draft_heads import head_config

    served = tiny_glm_moe()
    head = head_config("mtp", served, "glm")
    assert (head.num_hidden_layers, head.first_k_dense_replace, head.n_routed_experts) == (1, 0, 8)
    assert (served.num_hidden_layers, served.first_k_dense_replace) == (2, 1)  # left alone
    settings = dict(concurrency=1, requests=2, input_len=64, output_len=8, tp=2, ep=2)
    run = torchroof.serve(tiny_glm_moe(), "dgx-h100", **settings,
                          speculative=Speculative("mtp", 0.8, 1))  # fmt: skip
    assert run.engine["draft_model"] == "MTP head of glm4_moe"
    assert (run.engine["draft_tp"], run.engine["draft_ep"]) == (2, 2)
    assert run.summary()["speculative"]["drafted"] > 0
    with pytest.raises(OptionError, match="runs at the model's tensor-parallel size"):
        torchroof.serve(tiny_glm_moe(), "dgx-h100", **settings,
                        speculative=Speculative("mtp", 0.8, 1, tp=1))  # fmt: skip
    eagle = dict(concurrency=1, requests=1, input_len=8, output_len=4, tp=2)
    with pytest.raises(OptionError, match=r"runs at the model's tensor-parallel size \(2\), not 1"):
        torchroof.serve(small_llama(2), "dgx-h100", **eagle,
                        speculative=Speculative("eagle", 0.8, 1, tp=1))  # fmt: skip


def test_an_mtp_block_without_its_experts_is_refused(monkeypatch):
    """Left with GLM's first_k_dense_replace of 1, the one-layer head's block would be dense
    though the model routes experts: refused in a line, not priced as a dense block."""
    from torchroof.serving import draft_heads

    monkeypatch.setattr(draft_heads, "LAYER_PLACEMENT", {})
    with pytest.raises(OptionError, match="came out without the routed experts"):
        torchroof.serve(tiny_glm_moe(), "h100-sxm", concurrency=1, requests=1, input_len=8,
                        output_len=4, speculative=Speculative("mtp", 0.8, 1))  # fmt: skip


def test_a_layer_list_gives_the_head_the_last_layers_kind():
    """Per-layer lists (Qwen-MoE's dense layers by index, a hybrid's layer kinds) are cut
    to the last layer's entry and index-based dense layers cleared."""
    from transformers import AutoConfig

    from torchroof.serving.draft_heads import head_config

    qwen = AutoConfig.for_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0, 1],
                                layer_types=["sliding_attention", "full_attention",
                                             "full_attention"])  # fmt: skip
    head = head_config("eagle", qwen, "qwen", layers=2)
    assert head.mlp_only_layers == [] and head.layer_types == ["full_attention"] * 2
    assert qwen.mlp_only_layers == [0, 1]
    one = AutoConfig.for_model("qwen3", num_hidden_layers=1, layer_types=["full_attention"])
    assert head_config("eagle", one, "one", layers=2).layer_types == ["full_attention"] * 2


def test_a_head_the_served_model_has_not_is_refused_in_a_line(tmp_path, capsys):
    with pytest.raises(OptionError, match="has no multi-token prediction layers"):
        torchroof.serve(small_llama(2), "h100-sxm", concurrency=1, requests=1, input_len=8,
                        output_len=4, speculative=Speculative("mtp", 0.8, 1))  # fmt: skip
    with pytest.raises(OptionError, match="routes tokens to experts, and an EAGLE head"):
        torchroof.serve(tiny_glm_moe(), "h100-sxm", concurrency=1, requests=1, input_len=8,
                        output_len=4, speculative=Speculative("eagle", 0.8, 1))  # fmt: skip
    config = tmp_path / "llama.json"
    small_llama(2).to_json_file(config)
    flags = ["--concurrency", "1", "--requests", "2", "--input-len", "16", "--output-len", "4"]
    assert main(["serve", str(config), *flags, "--draft", "eagle", "--acceptance", "1"]) == 0
    assert f"speculative decoding: EAGLE head of {config} drafts 3 tokens" in (
        capsys.readouterr().out
    )

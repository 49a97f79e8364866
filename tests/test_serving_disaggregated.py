"""Disaggregated prefill and decode (torchroof.serving.disaggregated, ``--disaggregate``):
the KV transfer added to the time to first token, on the link the placement says, queued
on the prefill instance's link, waiting for the decode instance's blocks, on
tests/conftest.py's small Llama (2 layers, 2 K/V heads of 32 dims, bf16: 2 x 2 x 2 x 32
x 2 B = 512 B of K and V per token over every layer and head) priced on the pure roofline.

The links, from hardware/clusters/dgx-h100.toml: NVLink 4 within a node, alpha 25.6 us,
beta 450 GB/s x 0.8222 = 369.99 GB/s; InfiniBand NDR between nodes, alpha 47 us, beta
50 GB/s x 0.94 = 47 GB/s."""

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import small_llama
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torchroof.hardware import get_cluster

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.serving import SequenceWork, StepTimer, prompt
from torchroof.serving.disaggregated import simulate_disaggregated
from torchroof.serving.disaggregation import Layout
from torchroof.serving.requests import Request
from torchroof.serving.scheduler import EngineConfig
from torchroof.serving.simulate import simulate

NVLINK_ALPHA, NVLINK_BETA = 25.6e-6, 450e9 * 0.8222
NETWORK_ALPHA, NETWORK_BETA = 47e-6, 50e9 * 0.94


@pytest.fixture(scope="module")
def prepared():
    return torchroof.prepare(small_llama(2), "decode", context=16)


@pytest.fixture(scope="module")
def one_gpu(prepared):
    return StepTimer(prepared, "dgx-h100")


@pytest.fixture(scope="module")
def two_gpus():
    return StepTimer(torchroof.prepare(small_llama(2), "decode", context=16, tp=2), "dgx-h100")


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory, prepared):
    """dgx-h100's links on nodes of 2 GPUs, at most 2 nodes: 4 GPUs."""
    shipped = Path(get_cluster("dgx-h100").path).read_text()
    text = "\n".join(line for line in shipped.splitlines() if not line.startswith("aliases"))
    text = text.replace('name = "dgx-h100"', 'name = "two-gpu-nodes"')
    text = text.replace("gpus_per_node = { value = 8,", "gpus_per_node = { value = 2,")
    text = text.replace(
        "[intra_node]", 'max_nodes = { value = 2, source = "a test cluster" }\n\n[intra_node]'
    )
    path = tmp_path_factory.mktemp("cluster") / "two-gpu-nodes.toml"
    path.write_text(text)
    return StepTimer(prepared, path)


def test_a_lone_request_adds_its_kv_transfer_to_its_first_token(one_gpu, two_gpus):
    # 1P1D on one DGX H100: prefill on GPU 0 (tp 1), decode on GPUs 1-2 (tp 2)
    request = Request(0, 48, 5, arrival_s=0.0)
    result = simulate_disaggregated((one_gpu, two_gpus), [request], layout="1P1D")
    record = result.requests[0]
    aggregated = simulate(one_gpu, [request]).requests[0].ttft_s
    # the 48 tokens' cache: 48 x 512 B = 24,576 B; each decode rank takes its K/V head
    # (12,288 B), both from the one prefill rank, which sends 24,576 B over NVLink:
    # 25.6 us + 24,576 B / 369.99 GB/s = 25.6 us + 0.066 us
    transfer = NVLINK_ALPHA + 48 * 512 / NVLINK_BETA
    assert record.ttft_s == pytest.approx(aggregated + transfer, rel=1e-9)
    assert result.transfers.time_s[0] == pytest.approx(transfer, rel=1e-9)
    assert int(result.transfers.bytes[0]) == 24_576 and result.transfers.link == ("nvlink",)
    assert result.transfers.wait_s[0] == 0.0
    # then the decode plan's decodes over 48, 49, 50 and 51 cached tokens
    decodes = [two_gpus.time([SequenceWork(1, 48 + i)]).time_s for i in range(4)]
    assert record.tpot_s == pytest.approx(sum(decodes) / 4, rel=1e-12)
    assert np.allclose(result.itl_s, decodes, rtol=1e-12)
    # replicas: the prefill instance is 0, the decode instance 1
    assert list(result.steps.replica) == [0, 1, 1, 1, 1] and record.replica == 1
    assert result.engine["prefill"]["gpus"] == [[0]]
    assert result.engine["decode"]["gpus"] == [[1, 2]]
    summary = result.summary()
    assert summary["kv_transfer"]["bytes"]["mean"] == 24_576
    assert summary["kv_transfer"]["time_s"]["p99"] == pytest.approx(transfer, rel=1e-9)


def test_the_garbage_collector_rests_while_both_sides_step(
    one_gpu, two_gpus, collector_at_each_step
):
    import gc

    simulate_disaggregated((one_gpu, two_gpus), [Request(0, 48, 5, arrival_s=0.0)], layout="1P1D")
    seen = collector_at_each_step
    assert len(seen) == 5 and not any(seen)  # 1 prefill step, 4 decodes: all with it off
    assert gc.isenabled()


def test_the_transfer_crosses_the_network_between_nodes(small_cluster):
    # 1P2D on nodes of 2 GPUs: prefill on GPU 0, decode instances on GPU 1 (node 0) and
    # GPU 2 (node 1); round-robin sends request 0 to the first, request 1 to the second,
    # a second apart (neither waits for the other)
    requests = [Request(0, 48, 5, arrival_s=0.0), Request(1, 48, 5, arrival_s=1.0)]
    timers = (small_cluster, small_cluster)
    result = simulate_disaggregated(timers, requests, layout="1P2D")
    aggregated = simulate(small_cluster, requests[:1]).requests[0].ttft_s
    nvlink = NVLINK_ALPHA + 24_576 / NVLINK_BETA  # 25.666 us
    network = NETWORK_ALPHA + 24_576 / NETWORK_BETA  # 47 us + 0.523 us = 47.523 us
    first, second = result.requests
    assert (first.replica, second.replica) == (1, 2)
    assert result.transfers.link == ("nvlink", "network")
    assert first.ttft_s == pytest.approx(aggregated + nvlink, rel=1e-9)
    assert second.ttft_s == pytest.approx(aggregated + network, rel=1e-9)
    # 2P3D would take 5 GPUs of the 4
    with pytest.raises(OptionError, match="2P3D takes 5 GPUs .* more than two-gpu-nodes's 4"):
        simulate_disaggregated(timers, requests, layout="2P3D")


def test_transfers_out_of_one_prefill_instance_queue_on_its_link(one_gpu):
    # two 48-token prompts arriving together run in one prefill step and are ready at
    # once: the second transfer starts when the first ends
    requests = [Request(i, 48, 5, arrival_s=0.0) for i in range(2)]
    result = simulate_disaggregated((one_gpu, one_gpu), requests, layout="1P1D")
    step = one_gpu.time([prompt(48), prompt(48)]).time_s
    transfer = NVLINK_ALPHA + 24_576 / NVLINK_BETA
    first, second = result.requests
    assert first.ttft_s == pytest.approx(step + transfer, rel=1e-9)
    assert second.ttft_s == pytest.approx(step + 2 * transfer, rel=1e-9)
    assert list(result.transfers.wait_s) == pytest.approx([0.0, transfer], rel=1e-9)
    # the same inputs give the same bytes
    again = simulate_disaggregated((one_gpu, one_gpu), requests, layout="1P1D")
    assert json.dumps(result.to_dict()) == json.dumps(again.to_dict())


def test_requests_wait_for_the_decode_instances_blocks(one_gpu):
    # prompts of 32 tokens and 17 output tokens: each holds ceil(48 / 16) = 3 KV blocks at
    # its end on the decode instance, which has 3: it takes one request at a time. The
    # prefill instance has 4 blocks: two 32-token prompts (2 blocks each) fill it, and it
    # keeps them until their caches are sent
    requests = [Request(i, 32, 17, arrival_s=0.0) for i in range(3)]
    engines = (EngineConfig(num_gpu_blocks_override=4), EngineConfig(num_gpu_blocks_override=3))
    result = simulate_disaggregated((one_gpu, one_gpu), requests, layout="1P1D", engines=engines)
    transfer = NVLINK_ALPHA + 32 * 512 / NVLINK_BETA
    records, sent = result.requests, result.transfers
    # request 0's cache goes at once; request 1's when request 0 has ended on the decode
    # instance and freed its 3 blocks; request 2's when request 1 has
    assert sent.start_s[0] == result.steps.time_s[0]  # the end of the first prefill step
    assert sent.start_s[1] == records[0].finish_s
    assert sent.start_s[2] == records[1].finish_s
    assert records[1].ttft_s == pytest.approx(records[0].finish_s + transfer, rel=1e-9)
    # request 2 is prefilled once request 0's transfer has freed its 2 prefill blocks
    prefill_starts = result.steps.start_s[result.steps.replica == 0]
    assert prefill_starts[1] == pytest.approx(sent.start_s[0] + transfer, rel=1e-9)
    decode_blocks = result.steps.blocks_used[result.steps.replica == 1]
    assert decode_blocks.max() == 3 and result.summary()["preemptions"] == 0
    assert result.summary()["kv_blocks_peak_share_by_side"] == {"prefill": 1.0, "decode": 1.0}


def test_serve_and_the_command_line_disaggregated(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["serve", "gpt2", "--hardware", "dgx-h100", "--disaggregate", "1P1D", "--rate"]
    argv += ["100", "--requests", "10", "--input-len", "32", "--output-len", "4", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1P1D: prefill 1 GPU, decode 1 GPU" in text and "KV cache sent: " in text
    data = json.loads(out.read_text())
    # GPT-2: 12 layers x 12 heads x (64 + 64) dims x 2 B = 36,864 B per token; 32 tokens
    assert [t["bytes"] for t in data["kv_transfers"]] == [32 * 36_864] * 10
    assert data["engine"]["disaggregate"] == "1P1D"
    result = torchroof.serve(
        small_llama(2),
        "dgx-h100",
        rate=100.0,
        requests=4,
        input_len=16,
        output_len=1,
        disaggregate="1p2d",
        decode={"tp": 2, "max_num_seqs": 8},
    )
    assert result.engine["decode"]["max_num_seqs"] == 8 and result.engine["decode"]["tp"] == 2
    # one output token: the request ends when its cache arrives, no decode step
    assert all(r.finish_s == r.first_token_s for r in result.requests)
    assert set(result.steps.replica) == {0}


def test_bad_disaggregated_input_is_answered_in_one_line(one_gpu, capsys):
    one = [Request(0, 16, 4, 0.0)]
    cases = [
        (lambda: Layout.parse("1P"), "disaggregate takes xPyD"),
        (lambda: Layout.parse(12), "disaggregate takes xPyD"),
        (lambda: Layout.parse("0P2D"), "at least one prefill and one decode instance"),
        (
            lambda: torchroof.serve(small_llama(2), rate=1.0, requests=2, prefill={"tp": 2}),
            "give disaggregate='xPyD'",
        ),
        (
            lambda: torchroof.serve(small_llama(2), rate=1.0, disaggregate="1P1D", replicas=2),
            "replicas=2 is not taken",
        ),
        (
            lambda: torchroof.serve(
                small_llama(2), rate=1.0, disaggregate="1P1D", prefill={"mode": "realistic"}
            ),
            "not mode (pricing is alike on both sides",
        ),
        (
            lambda: torchroof.serve(
                small_llama(2), "dgx-h100", rate=1.0, disaggregate="1P1D", decode={"tp": 4}
            ),
            "cannot run with tp=4",
        ),
        (
            lambda: simulate_disaggregated((one_gpu, one_gpu), one, layout="1P1D", router="x"),
            "unknown router",
        ),
        (
            lambda: simulate_disaggregated(
                (one_gpu, one_gpu),
                one,
                layout="1P1D",
                engines=(EngineConfig(), EngineConfig(num_gpu_blocks_override=1)),
            ),
            "on the decode side, the KV cache holds 1 blocks",
        ),
    ]
    for call, message in cases:
        with pytest.raises(OptionError) as caught:
            call()
        assert message in str(caught.value) and "\n" not in str(caught.value)
    lone = StepTimer(one_gpu.prepared, "h100-sxm")
    with pytest.raises(OptionError, match="price it on a cluster"):
        simulate_disaggregated((lone, lone), one, layout="1P1D")
    assert main(["serve", "gpt2", "--prefill-tp", "2", "--rate", "1"]) == 2
    assert "set the sides of --disaggregate: give it" in capsys.readouterr().err
    sweep = ["serve", "gpt2", "--disaggregate", "1P1D", "--sweep-rate", "--ttft-ms", "1"]
    assert main(sweep) == 2
    assert "does not search a --disaggregate deployment" in capsys.readouterr().err


def test_an_instance_that_fits_a_node_is_not_split_over_two():
    from torchroof.serving.disaggregation import Layout, place

    # 3P1D on a DGX H100 (8 GPUs a node), prefill at TP 2 and decode at TP 4: the prefill
    # instances take GPUs 0-5; the decode instance would take 6-9 across the two nodes, so
    # it starts on the next node, at GPU 8
    placed = place(Layout.parse("3P1D"), 2, 4, get_cluster("dgx-h100"))
    assert placed.prefill == ((0, 1), (2, 3), (4, 5))
    assert placed.decode == ((8, 9, 10, 11),)


@settings(max_examples=30, deadline=None)
@given(
    spec=st.lists(
        st.tuples(st.integers(20, 80), st.integers(2, 60), st.integers(0, 200)),
        min_size=2,
        max_size=14,
    ),
    spare=st.integers(0, 4),
)
@example(  # a run that stalled when a preempted request was queued ahead of a landed one
    spec=[(29, 50, 61), (46, 18, 29), (36, 38, 100), (50, 54, 58), (62, 47, 164), (62, 35, 29),
          (77, 8, 185), (43, 55, 113), (80, 50, 29), (38, 48, 119), (58, 9, 33), (50, 48, 191),
          (44, 9, 26), (61, 5, 122)],
    spare=0,
)  # fmt: skip
def test_a_tight_decode_cache_preempts_but_never_stalls(spec, spare):
    # requests landing on a decode side whose cache holds little more than the longest
    # one: running requests get preempted and landed ones wait, but every request ends
    # with all its tokens (a landed request holding its blocks is never queued behind a
    # preempted one that needs more than are free)
    timer = _tight_timer()
    requests = [Request(i, a, b, arrival_s=us * 1e-6) for i, (a, b, us) in enumerate(spec)]
    longest = max(-(-(a + b - 1) // 16) for a, b, _ in spec)
    engines = (EngineConfig(), EngineConfig(num_gpu_blocks_override=longest + spare))
    result = simulate_disaggregated((timer, timer), requests, layout="1P1D", engines=engines)
    assert sorted(r.index for r in result.requests) == list(range(len(spec)))
    assert all(r.finish_s >= r.first_token_s >= r.arrival_s for r in result.requests)


@functools.cache
def _tight_timer():
    return StepTimer(torchroof.prepare(small_llama(2), "decode", context=16), "dgx-h100")


def test_each_sides_steps_are_drawn_against_its_own_cache(one_gpu):
    from torchroof.serving.series import batches_shown, replica_name, step_series

    # prefill instance 0 holds 20 blocks and decode instance 1 holds 10: a step's share
    # of the cache is its blocks in use over its own side's
    engines = (EngineConfig(num_gpu_blocks_override=20), EngineConfig(num_gpu_blocks_override=10))
    requests = [Request(i, 40, 6, arrival_s=0.001 * i) for i in range(4)]
    result = simulate_disaggregated((one_gpu, one_gpu), requests, layout="1P1D", engines=engines)
    series = step_series(result)
    order = np.lexsort((result.steps.replica, result.steps.start_s))
    used = result.steps.blocks_used[order]
    expected = np.where(series.replica == 0, used / 20, used / 10)
    assert np.array_equal(series.kv_share, expected)
    assert [replica_name(result.engine, r) for r in (0, 1)] == ["prefill 0", "decode 1"]
    shown, title = batches_shown(result.engine, series)
    assert set(series.replica[shown]) == {1} and "first decode instance" in title


def test_what_disaggregated_serving_does_not_simulate_is_refused_before_tracing():
    from torchroof.serving import highest_rate, serve_rates

    model = "no/such/model/ever.json"  # never traced: every refusal comes first
    shared = [Request(0, 80, 4, 0.0, prefix_group=0, prefix_len=64)]
    for call, message in [
        (
            lambda: torchroof.serve(model, "dgx-h100", requests=shared, disaggregate="1P1D"),
            "prefix caching on disaggregated prefill and decode is not simulated yet",
        ),
        (
            lambda: torchroof.serve(model, "h100-sxm", rate=1, requests=2, disaggregate="1P1D"),
            "price it on a cluster",
        ),
        (
            lambda: highest_rate(model, "dgx-h100", ttft_s=1.0, disaggregate="1P1D"),
            "a rate search does not take a disaggregated deployment yet (disaggregate given)",
        ),
        (
            lambda: serve_rates(model, "dgx-h100", rates=[1.0], decode={"tp": 2}),
            "serving a list of rates does not take a disaggregated deployment yet",
        ),
    ]:
        with pytest.raises(OptionError, match=re.escape(message)):
            call()

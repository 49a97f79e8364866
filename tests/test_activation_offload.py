"""Activation offload (offload_activations=N): the first N decoder layers' saved activations
go to host memory after their forward and come back before their backward, over the GPU's
host link; memory falls by all but one of them, time rises by what the copies do not hide."""

from __future__ import annotations

import pytest

import torchroof
from torchroof.api import load_config
from torchroof.config.errors import OptionError

MIB = 2**20
LAYER = (168 + 32 + 32 + 16 + 8 + 16 + 0.25) * MIB + 2 * 8192  # one Llama-3-8B layer at seq
# 2048, compiled (tests/test_activation_residency.py derives it): 272.27 MiB


@pytest.fixture(scope="module")
def step() -> torchroof.Trace:
    config = load_config("llama-3-8b")
    config.num_hidden_layers = 4
    return torchroof.trace_model(config, "train", seq=2048, batch=1)


def _offload_line(estimate: torchroof.Estimate) -> str:
    (line,) = [a for a in estimate.assumptions if a.startswith("activation offload")]
    return line


def test_offloading_two_layers_moves_their_saved_activations_over_pcie(step) -> None:
    plain = step.estimate("h100-sxm")
    moved = step.estimate("h100-sxm", offload_activations=2)
    # two layers' saved activations leave; one is back on the device while copied
    drop = plain.memory.activations_peak_bytes - moved.memory.activations_peak_bytes
    assert drop == LAYER
    # each way over PCIe Gen5 x16 at 64 GB/s: 2 x 285.49 MB / 64e9 B/s = 8.92 ms
    assert "first 2 of 4 decoder layers" in _offload_line(moved)
    assert "over PCIe at 64 GB/s each way (8.9 ms each way" in _offload_line(moved)
    # what the copies add is what they do not hide behind the two layers' compute
    assert moved.time_s == pytest.approx(plain.time_s + moved.offload_exposed_s, rel=1e-12)
    assert 0 < moved.offload_exposed_s < 2 * 2 * LAYER / 64e9
    # the estimate keeps it through JSON; the HTML report does not re-price it in the page
    again = torchroof.Estimate.from_dict(moved.to_dict())
    assert again.offload_exposed_s == moved.offload_exposed_s and again.time_s == moved.time_s
    from torchroof.render.html import why_not_repriced

    assert why_not_repriced(moved).startswith("activation offload hides its copies")
    assert why_not_repriced(plain) == ""


def test_a_faster_host_link_hides_more_of_the_copies(step) -> None:
    # a GB200's NVLink-C2C (225 GB/s a GPU each way) against a DGX H100's PCIe (64 GB/s)
    pcie = step.estimate("dgx-h100", offload_activations=2)
    c2c = step.estimate("gb200-nvl72", offload_activations=2)
    assert "over NVLink-C2C to the Grace CPU at 225 GB/s" in _offload_line(c2c)
    assert c2c.offload_exposed_s < pcie.offload_exposed_s


@pytest.mark.parametrize(
    "value, words",
    [(-1, "an integer >= 0"), (True, "an integer >= 0"), (4, "has 4 decoder layers")],
)
def test_bad_offload_counts_are_one_clear_line(step, value, words) -> None:
    with pytest.raises(OptionError, match=words):
        step.estimate("h100-sxm", offload_activations=value)


def test_offload_needs_a_backward_and_one_stage() -> None:
    config = load_config("llama-3-8b")
    config.num_hidden_layers = 2
    with pytest.raises(OptionError, match="applies to a training step"):
        torchroof.estimate(config, "prefill", seq=128, offload_activations=1)
    with pytest.raises(OptionError, match="not priced for pipelined steps"):
        torchroof.estimate(
            config,
            "train",
            hardware="dgx-h100",
            seq=128,
            pp=2,
            microbatches=2,
            offload_activations=1,
        )


def test_every_micro_batch_offloads_its_own_activations(step) -> None:
    # two micro-batches: each forward saves, and sends, the same two layers' activations,
    # and each copy hides behind that micro-batch's layer only: twice the copies (2 x 8.9 ms
    # each way) and twice what they do not hide
    config = load_config("llama-3-8b")
    config.num_hidden_layers = 4
    one = step.estimate("h100-sxm", offload_activations=2)
    two = torchroof.estimate(
        config, "train", seq=2048, batch=1, microbatches=2, offload_activations=2
    )
    assert "per micro-batch (2)" in _offload_line(two)
    assert "(17.8 ms each way" in _offload_line(two)
    assert two.offload_exposed_s == pytest.approx(2 * one.offload_exposed_s, rel=1e-9)

"""Transformer Engine's fp8 linear layers save their input in fp8 for the backward, where
torchao's Float8Linear saves it in bf16 and casts it again (``save_fp8_inputs``, set by the
``megatron-te`` profile).

The model: a one-layer Llama, d = 256, 8 heads (4 KV heads), MLP 512, vocab 1024, trained
in bf16 with the fp8 recipe on B = 1 sequence of T = 64 tokens. One (1, 64, 256) bf16
activation is A = 64 x 256 x 2 B = 32,768 B; the MLP's product is (1, 64, 512): 2A.
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

import torchroof
from torchroof.config import PricingOptions
from torchroof.kernels.fp8_saves import fp8_saved_inputs
from torchroof.pricing.price import plan_kernels
from torchroof.pricing.runtime import runtime_options

A = 64 * 256 * 2  # 32,768 B
CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
)


def _trace(**knobs):
    return torchroof.trace_model(
        LlamaConfig(**CONFIG), "train", seq=64, batch=1, quant="fp8", **knobs
    )


@pytest.fixture(scope="module")
def single():
    return _trace()


@pytest.fixture(scope="module")
def sequence_parallel():
    return _trace(tp=2, sequence_parallel=True)


def _saved(trace, fusion: str, **options) -> int:
    return plan_kernels(trace, PricingOptions(fusion=fusion, **options)).backward_saved_bytes


def test_the_inputs_only_fp8_layers_read_again_are_found(single):
    found = fp8_saved_inputs(single.ops)
    # q/k/v's input (the first norm's output, A), gate/up's (the second norm's, A) and
    # down_proj's (the SwiGLU product, 2A); o_proj's input is the attention's output, which
    # the attention's backward reads in bf16: kept whole
    assert sorted(t.nbytes for t in found.values()) == [A, A, 2 * A]


@pytest.mark.parametrize("fusion", ["fused", "eager"])
def test_fp8_inputs_halve_what_the_forward_keeps_of_them(single, fusion):
    # (A + A + 2A) / 2 = 65,536 B fewer, whatever the kernels keep besides
    saved = _saved(single, fusion) - _saved(single, fusion, save_fp8_inputs=True)
    assert saved == (A + A + 2 * A) // 2 == 65_536


@pytest.mark.parametrize("fusion", ["fused", "eager"])
def test_under_a_re_gather_the_shard_is_what_is_kept_in_fp8(sequence_parallel, fusion):
    regather = {"sequence_parallel_regather": True}
    torch_saves = _saved(sequence_parallel, fusion, **regather)
    megatron = _saved(sequence_parallel, fusion, save_fp8_inputs=True, **regather)
    # tp 2: the two gathered inputs are kept as shards of 32 tokens (A/2 each) and the
    # down_proj input has 256 of the 512 MLP columns (A): (A/2 + A/2 + A) / 2 = 32,768 B
    assert torch_saves - megatron == (A // 2 + A // 2 + A) // 2 == 32_768
    # without the re-gather the gathered inputs themselves narrow: (A + A + A) / 2
    plain = _saved(sequence_parallel, fusion)
    assert plain - _saved(sequence_parallel, fusion, save_fp8_inputs=True) == 3 * A // 2


def test_the_megatron_profile_saves_fp8_inputs_and_says_so(single):
    assert runtime_options("megatron-te").save_fp8_inputs
    assert not runtime_options("torchtitan").save_fp8_inputs
    megatron = torchroof.Trace.of(single).estimate("h100-sxm", runtime="megatron-te")
    line = next(a for a in megatron.assumptions if a.startswith("fp8:"))
    # 3 inputs: 4A = 0.125 MiB in bf16, 2A = 0.0625 MiB in fp8
    assert "3 inputs" in line and "0.06 MiB, not 0.12 MiB" in line, line
    titan = torchroof.Trace.of(single).estimate("h100-sxm", runtime="torchtitan")
    assert not any(a.startswith("fp8:") for a in titan.assumptions)
    bf16 = torchroof.Trace.of(single).estimate(
        "h100-sxm", runtime="megatron-te", save_fp8_inputs=False
    )
    assert bf16.memory.backward_saved_bytes - megatron.memory.backward_saved_bytes == 65_536


def test_a_shard_kept_in_fp8_is_gathered_again_in_fp8(sequence_parallel):
    from torchroof.kernels.regather import ALL_GATHER

    plan = plan_kernels(
        sequence_parallel, PricingOptions(sequence_parallel_regather=True, save_fp8_inputs=True)
    )
    gathers = {(k.phase, k.ops[0].index): k for k in plan.kernels if k.ops[0].name == ALL_GATHER}
    halved = 0
    for r in plan.regathers:
        # the re-gather sits at its first reader's index, in the backward
        forward, again = gathers[("forward", r.gather.index)], gathers[("backward", r.first_use)]
        # the attention's and the MLP's inputs are gathered in fp8 (half the bytes); the
        # lm_head's input is not an fp8 layer's: gathered in bf16 as in the forward
        fp8 = not r.gather.module.startswith("lm_head")
        assert again.cost.bytes_written == forward.cost.bytes_written // (2 if fp8 else 1)
        halved += fp8
    assert halved == 2 and len(plan.regathers) == 3


def test_a_bf16_step_has_nothing_to_narrow():
    trace = torchroof.trace_model(LlamaConfig(**CONFIG), "train", seq=64, batch=1)
    assert fp8_saved_inputs(trace.ops) == {}

"""Low-bit optimizer state: torchao's AdamW8bit and AdamW with bf16 moments, priced as the
one fused optimizer kernel (8-bit Adam about 16 B/param: Dettmers et al. 2022; every
optimizer sits far below the ridge, so its time is its bytes).

The model is conftest's small Llama (bf16 weights): hidden 128, MLP 256, 2 layers, 4 heads of
32 with 2 KV heads, vocabulary 512, untied head. Its 426,624 parameters split as torchao
splits them (``_new_buffer``: 8-bit state only for tensors of >= 4096 elements that are whole
256-element blocks):

    quantised  embedding and head 2 x 512·128 = 131,072
               per layer q, o 2 x 128·128 + k, v 2 x 64·128 + gate, up, down 3 x 256·128
               = 147,456, two layers 294,912                   -> Q = 425,984
    full       2 norms per layer + the final one, 5 x 128       -> S = 640

A quantised parameter's two moments are uint8 codes (1 B each) plus one fp32 scale per 256
elements, each scale read and written: 2 moments · 4 B · 2 / 256 = 1/16 B per parameter.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

import pytest
import torch
from conftest import PARALLEL_LLAMA, meta_causal_lm
from torchroof.counters import cost_of
from torchroof.counters.optimizers import ADAM_8BIT_FLOPS
from transformers import LlamaConfig

import torchroof
from torchroof.report.estimate import Estimate, KernelEstimate
from torchroof.workloads.train import FUSED_OPTIMIZERS, OPTIMIZERS

FUSED = "torchroof.fused_optimizer_step.default"
Q, S = 425_984, 640  # quantised and full-precision parameters (module docstring)
N = Q + S  # 426,624
SCALES = Fraction(2 * 4 * 2, 256)  # B per quantised parameter, read + written


@cache
def _estimate(optimizer: str, precision: str) -> Estimate:
    return torchroof.estimate(
        meta_causal_lm("llama"),
        "train",
        hardware="h100-sxm",
        batch=1,
        seq=16,
        optimizer=optimizer,
        precision=precision,
    )


def _step(est: Estimate) -> KernelEstimate:
    step = [k for k in est.kernels if k.phase == "optimizer"]
    assert [k.name for k in step] == [FUSED]
    return step[0]


def test_low_bit_optimizers_are_choices_of_the_model_counted_above():
    assert {"adamw8bit", "adamw-bf16-moments"} <= set(OPTIMIZERS)
    assert _estimate("adamw8bit", "fp32").metadata["parameters"] == N


@pytest.mark.parametrize(
    ("optimizer", "precision", "expected"),
    [
        # fp32: read master 4 + grad 4 + m 1 + v 1, write master 4 + m 1 + v 1 = 16 B, plus
        # 1/16 B of scales; the norms' fp32 moments as AdamW: 7 x 4 = 28 B.
        # 16.0625 · 425,984 + 28 · 640 = 6,842,368 + 17,920 = 6,860,288
        ("adamw8bit", "fp32", 6_860_288),
        # mixed: the bf16 weight is written too, 4+4+1+1 read, 4+1+1+2 written = 18 B (+1/16);
        # the norms as mixed AdamW, 30 B: 18.0625 · 425,984 + 30 · 640 = 7,694,336 + 19,200
        ("adamw8bit", "mixed", 7_713_536),
        # bf16: 2+2+1+1 read, 2+1+1 written = 10 B (+1/16); the norms' bf16 moments 7 x 2 = 14
        # 10.0625 · 425,984 + 14 · 640 = 4,286,464 + 8,960 = 4,295,424
        ("adamw8bit", "bf16", 4_295_424),
        # bf16 moments, mixed: 4+4+2+2 read, 4+2+2+2 written = 22 B: 22 · 426,624
        ("adamw-bf16-moments", "mixed", 9_385_728),
        # bf16 moments, fp32 weights: 4+4+2+2 read, 4+2+2 written = 20 B: 20 · 426,624
        ("adamw-bf16-moments", "fp32", 8_532_480),
        # what they save against: AdamW mixed, 16 read + 14 written = 30 B: 30 · 426,624
        ("adamw", "mixed", 12_798_720),
    ],
)
def test_optimizer_kernel_bytes(optimizer, precision, expected):
    step = _step(_estimate(optimizer, precision))
    assert step.bytes == expected
    if optimizer == "adamw8bit":
        per_param = {"fp32": (16, 28), "mixed": (18, 30), "bf16": (10, 14)}[precision]
        assert step.bytes == (per_param[0] + SCALES) * Q + per_param[1] * S
    assert step.bound == "memory"


def test_bf16_moments_save_8_of_30_bytes_per_parameter_under_mixed_precision():
    # DeepSeek-V3's recipe keeps fp32 masters and grads: only m and v shrink, 2 B each
    # read and written: 30 - 22 = 8 B per parameter
    saved = (
        _step(_estimate("adamw", "mixed")).bytes
        - _step(_estimate("adamw-bf16-moments", "mixed")).bytes
    )
    assert saved == 8 * N


def test_adamw8bit_flops_count_dequantise_and_requantise_only_where_quantised():
    # Adam 12 + 2 moments x (lookup, x scale, |x|, block max, / max, 8 compare-selects,
    # rounding) = 12 + 2 · 14 = 40 per quantised element; the norms plain Adam's 12:
    # 40 · 425,984 + 12 · 640 = 17,039,360 + 7,680 = 17,047,040
    assert ADAM_8BIT_FLOPS == 40
    assert _step(_estimate("adamw8bit", "fp32")).flops == 17_047_040
    # bf16 moments change no arithmetic: 12 · 426,624
    assert _step(_estimate("adamw-bf16-moments", "mixed")).flops == 12 * N


@pytest.mark.parametrize(
    ("optimizer", "precision", "expected"),
    [
        # codes 2 x 1 B · 425,984 = 851,968 + scales 2 x 4 B · 425,984/256 = 13,312
        # + the norms' fp32 moments 2 x 4 B · 640 = 5,120 -> 870,400
        ("adamw8bit", "fp32", 870_400),
        # the same + fp32 masters, 4 B · 426,624 = 1,706,496 -> 2,576,896
        ("adamw8bit", "mixed", 2_576_896),
        # fp32 masters 4 B + bf16 m, v 2 x 2 B = 8 B · 426,624
        ("adamw-bf16-moments", "mixed", 3_412_992),
        # AdamW mixed: masters and fp32 m, v, 12 B · 426,624
        ("adamw", "mixed", 5_119_488),
    ],
)
def test_optimizer_state_footprint(optimizer, precision, expected):
    est = _estimate(optimizer, precision)
    assert est.memory.optimizer_state_bytes == expected
    # gradients are untouched by the state's format: fp32 when mixed or fp32, 4 B · 426,624
    assert est.memory.gradients_bytes == 4 * N


def test_adamw8bit_step_time_is_its_bytes_share_of_fp32_adamw_on_h100():
    # both kernels are memory-bound, so time is proportional to bytes: fp32 AdamW reads
    # 4·4 and writes 3·4 = 28 B/param (11,945,472 B); AdamW8bit moves 16 B/param on the
    # quantised ones plus scales and 28 on the norms (6,860,288 B): 0.5743, near 16/28 = 0.5714
    eight_bit = _step(_estimate("adamw8bit", "fp32"))
    adamw = _step(_estimate("adamw", "fp32"))
    assert adamw.bytes == 28 * N == 11_945_472
    assert (eight_bit.bound, adamw.bound) == ("memory", "memory")
    expected = Fraction((16 + SCALES) * Q + 28 * S, 28 * N)
    assert eight_bit.time_s / adamw.time_s == pytest.approx(float(expected), rel=1e-12)
    assert float(expected) == pytest.approx(16 / 28, abs=0.003)
    # and it is the optimizer phase's whole time
    est = _estimate("adamw8bit", "fp32")
    assert est.phase_time_s("optimizer") == eight_bit.time_s


@pytest.mark.parametrize(
    ("numel", "quantised"),
    [
        (4096, True),  # 16 blocks, the smallest torchao quantises
        (17 * 256, True),
        (15 * 256, False),  # whole blocks, but under 4096 elements
        (4100, False),  # not a whole number of blocks
    ],
)
def test_torchao_quantises_only_large_whole_block_tensors(numel, quantised):
    param = torch.empty(numel, device="meta")
    assert FUSED_OPTIMIZERS["adamw8bit"].quantises(param) is quantised
    assert FUSED_OPTIMIZERS["adamw"].quantises(param) is False


def test_fsdp_shards_are_quantised_by_their_local_size():
    # PARALLEL_LLAMA (d 256, 4 heads of 64, 2 KV heads, MLP 512, vocab 1024, 2 layers) on 16
    # FSDP ranks, fp32: rank 0's shards are 1/16 of each parameter (torchao decides on the
    # local tensor). Quantised: embedding, head 1024·256/16 = 16,384 each; per layer q, o
    # 256·256/16 = 4,096 each, gate, up, down 512·256/16 = 8,192 each -> 2·(8,192 + 24,576)
    # = 65,536; Q = 98,304. Full: k, v 128·256/16 = 2,048 (< 4096) x 4 = 8,192 and the five
    # norms' 256/16 = 16 -> 80; S = 8,272.
    trace = torchroof.trace_model(
        LlamaConfig(**PARALLEL_LLAMA),
        "train",
        batch=2,
        seq=16,
        fsdp=16,
        optimizer="adamw8bit",
        precision="fp32",
    )
    q, s = 98_304, 8_272
    # rank 0's fp32 weights: 4 B · (98,304 + 8,272) = 4 B · 1,705,216 / 16 = 426,304
    assert trace.role_bytes["weights"] == 4 * (q + s) == 426_304
    # state: codes 2 · 98,304 + scales 2 · 4 · 98,304/256 = 3,072 + full 2 · 4 · 8,272
    # = 196,608 + 3,072 + 66,176 = 265,856
    assert trace.role_bytes["optimizer_state"] == 265_856
    (step,) = [op for op in trace.ops if op.name == FUSED]
    # 16.0625 · 98,304 + 28 · 8,272 = 1,579,008 + 231,616
    assert cost_of(step).bytes == 1_810_624
    # 40 · 98,304 + 12 · 8,272 = 3,932,160 + 99,264
    assert cost_of(step).flops == 4_031_424

"""Activations as the step's kernels hold them: fused kernels never write their
intermediates nor the forward tensors the backward rebuilds, and a pipelined rank holds
its stages' micro-batches as its own order keeps them, not each stage at its own peak."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import torchroof
from torchroof.config.pricing import PricingOptions
from torchroof.parallel.pipeline.schedule import action_order, simulate
from torchroof.pricing.price import plan_kernels
from torchroof.report.memory import backward_saved_bytes


class Gated(torch.nn.Module):
    """h = up(x); c = tanh(h / 2) · h; y = down(c): 8 tokens of 256 fp32 features, so each
    of h, tanh(h / 2) and c is 8 · 256 · 4 = 8,192 B."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256, bias=False)
        self.down = torch.nn.Linear(256, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(torch.tanh(h * 0.5) * h)


@pytest.fixture(scope="module")
def gated_step() -> torchroof.Trace:
    model = Gated().to("meta")
    x = torch.randn(8, 64, device="meta")  # made before the trace: an input, not transient
    with torchroof.trace() as traced:
        model(x).sum().backward()
    return traced


def test_fused_kernels_keep_only_what_the_backward_cannot_rebuild(gated_step) -> None:
    eager = plan_kernels(gated_step, PricingOptions(fusion="eager"))
    fused = plan_kernels(gated_step, PricingOptions(fusion="fused"))
    # eager keeps h (the product's backward reads it), t = tanh(h / 2) (tanh's backward
    # reads its output; so does the product's) and c (down's weight gradient reads it), and
    # the 4 B loss: 3 · 8,192 + 4 = 24,580 B
    assert backward_saved_bytes(gated_step, eager.roles, eager.residency) == 24_580
    assert eager.residency is None
    # fused, the backward kernel rebuilds t from h (one cheap pointwise op): h, c and the
    # loss remain, 2 · 8,192 + 4 = 16,388 B
    assert backward_saved_bytes(gated_step, fused.roles, fused.residency) == 16_388
    assert fused.backward_saved_bytes == 16_388 and eager.backward_saved_bytes == 24_580
    assert fused.peak is not None and eager.peak is not None
    assert fused.peak.total_bytes < eager.peak.total_bytes


@pytest.mark.parametrize("pp, virtual, microbatches", [(4, 2, 8), (8, 5, 64), (16, 4, 384)])
def test_an_interleaved_rank_holds_megatron_s_warm_up_plus_one(pp, virtual, microbatches):
    # Megatron-LM's interleaved schedule warms up 2(pp - 1) + (v - 1)·pp stage-micro-batches
    # on rank 0 before its first backward, then holds one more: pp 4, v 2: 6 + 4 + 1 = 11;
    # pp 8, v 5: 14 + 32 + 1 = 47; pp 16, v 4: 30 + 48 + 1 = 79. Torch's order holds the same.
    order = action_order("interleaved-1f1b", pp, microbatches, virtual)
    timeline = simulate(order, lambda a: 1.0 if a.kind == "F" else 2.0)
    stages = {a.stage for a in order[0]}
    held = timeline.held_peak(dict.fromkeys(stages, 1))
    assert held == 2 * (pp - 1) + (virtual - 1) * pp + 1
    # each stage's own peak, summed, would claim more: the first stage fills while the
    # last has not begun (pp 8, v 5: 16 + 16 + 15 + 8 + 8 = 63)
    if (pp, virtual) == (8, 5):
        assert sum(timeline.in_flight(s) for s in stages) == 63


def test_a_one_f_one_b_rank_holds_its_distance_from_the_end() -> None:
    # 1F1B: rank r warms up pp - r forwards; with weights, the rank's saved bytes scale
    order = action_order("1f1b", 4, 8)
    timeline = simulate(order, lambda a: 1.0 if a.kind == "F" else 2.0)
    assert [timeline.held_peak({r: 10}) for r in range(4)] == [40, 30, 20, 10]


TINY = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def test_parameters_kept_gathered_are_not_saved_per_micro_batch() -> None:
    # under pp torchtitan keeps each stage's gathered parameters from forward to backward
    # (reshard_after_forward off): one set of buffers for every micro-batch, so what a
    # micro-batch keeps is the same with FSDP over 2 ranks as without it
    base = dict(hardware="dgx-h100", seq=64, batch=1, pp=2, microbatches=4, runtime="torchtitan")
    for fusion in ("eager", "fused"):
        alone = torchroof.estimate(TINY, "train", fusion=fusion, **base)
        sharded = torchroof.estimate(TINY, "train", fsdp=2, fusion=fusion, **base)
        assert alone.pipeline is not None and sharded.pipeline is not None
        kept = [s.saved_bytes for s in sharded.pipeline.stages]
        assert kept == [s.saved_bytes for s in alone.pipeline.stages]
        assert all(k > 0 for k in kept) and sharded.memory.layer_buffers_bytes > 0
        # rank 0 holds stage 0, whose micro-batch keeps what its forward saved
        assert sharded.memory.backward_saved_bytes == kept[0]


MIB = 2**20


def test_a_llama_3_8b_layer_keeps_what_its_kernels_write() -> None:
    # one decoder layer's share: the step with 2 layers minus the step with 1, seq 2048, bf16
    from torchroof.api import load_config

    saved = {}
    for layers in (1, 2):
        config = load_config("llama-3-8b")
        config.num_hidden_layers = layers
        step = torchroof.trace_model(config, "train", seq=2048, batch=1)
        for fusion in ("eager", "fused"):
            memory = step.estimate("h100-sxm", fusion=fusion).memory
            saved[layers, fusion] = memory.backward_saved_bytes
    layer = {f: saved[2, f] - saved[1, f] for f in ("eager", "fused")}
    # op by op: gate, SiLU, up and their product (4 x 2048 x 14336 x 2 B = 224 MiB), each
    # RMSNorm's fp32 input (2 x 2048 x 4096 x 4 B = 64), unscaled bf16 output (32) and
    # output (32), q rotated (16), the attention output (16), k and v on their 8 heads as
    # attention reads them (2 x 2048 x 1024 x 2 B = 8), the logsumexp (32 x 2048 x 4 B =
    # 0.25) and each norm's rsqrt (2 x 8 KiB)
    assert layer["eager"] == (224 + 64 + 32 + 32 + 16 + 16 + 8 + 0.25) * MIB + 2 * 8192
    # compiled: gate, up and product (168: SiLU rebuilt from gate), the two residual sums
    # (32: each norm rebuilds its fp32 input from them), the norms' outputs (32), q rotated
    # (16), k and v (8), the attention output (16), the logsumexp and each norm's mean square
    assert layer["fused"] == (168 + 32 + 32 + 16 + 8 + 16 + 0.25) * MIB + 2 * 8192

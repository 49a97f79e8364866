"""Activation checkpointing: the forward re-run inside backward launches the same flash
attention kernel as the forward (not meta's math path: bmm + an S×S softmax), and the
backward still runs one flash backward per attention layer."""

from collections import Counter

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

import torchroof
from torchroof.api import trace_model
from torchroof.config.errors import WorkloadError

FLASH = "aten._scaled_dot_product_flash_attention.default"
FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_backward.default"
MATH_PATH = ("aten.bmm.", "aten.baddbmm.", "aten._softmax.", "aten._safe_softmax.")
MATH_PATH_BACKWARD = (*MATH_PATH, "aten._softmax_backward_data.")
LAYERS = 2


def _counts(trace: torchroof.Trace) -> Counter:
    return Counter((op.phase, op.name) for op in trace.ops)


def _math_ops(trace: torchroof.Trace, phase: str, names: tuple[str, ...]) -> list[str]:
    return [op.name for op in trace.ops if op.phase == phase and op.name.startswith(names)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_recompute_records_the_forward_flash_kernel(family, meta_lm):
    model = meta_lm(family, attn_implementation="sdpa")
    trace = trace_model(model, "train", batch=1, seq=128, checkpointing=True)
    counts = _counts(trace)
    flash = sum(n for (_phase, name), n in counts.items() if name == FLASH)
    assert flash == 2 * LAYERS  # forward + recompute
    assert counts["forward", FLASH] == counts["recompute", FLASH] == LAYERS
    assert sum(n for (_phase, name), n in counts.items() if name == FLASH_BACKWARD) == LAYERS
    assert counts["backward", FLASH_BACKWARD] == LAYERS
    assert _math_ops(trace, "recompute", MATH_PATH) == []
    assert _math_ops(trace, "backward", MATH_PATH_BACKWARD) == []
    # the recomputed kernel is the forward's: same module, shapes, causality
    forward = [op for op in trace.ops if op.name == FLASH and op.phase == "forward"]
    recompute = [op for op in trace.ops if op.name == FLASH and op.phase == "recompute"]
    assert sorted(op.module for op in forward) == sorted(op.module for op in recompute)
    for again in recompute:
        first = next(op for op in forward if op.module == again.module)
        assert again.synthetic and again.args["is_causal"] is True
        assert [t.shape for t in again.inputs] == [t.shape for t in first.inputs]
        assert [t.shape for t in again.outputs] == [t.shape for t in first.outputs]
    assert _get_current_function_mode_stack() == []  # nothing left pushed after the trace
    # the backward reads the recomputed q, k, v, o and log-sum-exp, not the forward's (which
    # checkpointing did not keep): grad_out, then the recompute's inputs and outputs
    for back in (op for op in trace.ops if op.name == FLASH_BACKWARD):
        again = next(op for op in recompute if op.module == back.module)
        first = next(op for op in forward if op.module == back.module)
        storages = [t.storage for t in back.inputs[1:]]
        assert storages == [t.storage for t in (*again.inputs[:3], *again.outputs)]
        assert not {t.storage for t in first.inputs} & set(storages)


def test_reentrant_checkpointing_runs_flash_forward_and_backward(meta_lm):
    """Reentrant checkpointing back-propagates through the recomputed graph itself: its
    attention must be the flash kernel, and its backward the one flash backward."""
    model = meta_lm("llama", attn_implementation="sdpa").train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    with torchroof.trace() as trace:
        model(ids, labels=ids).loss.backward()
    counts = _counts(trace)
    assert counts["forward", FLASH] == counts["recompute", FLASH] == LAYERS
    assert counts["backward", FLASH_BACKWARD] == LAYERS
    assert sum(n for (_phase, name), n in counts.items() if name == FLASH_BACKWARD) == LAYERS
    assert _math_ops(trace, "recompute", MATH_PATH) == []
    assert _math_ops(trace, "backward", MATH_PATH_BACKWARD) == []


WIDE_LAYERS = 32  # the whole 7B model: the recompute bound must hold over every layer


def _wide(family: str):
    from transformers import GPT2Config, LlamaConfig

    if family == "gpt2":
        return GPT2Config(n_embd=4096, n_layer=WIDE_LAYERS, n_head=32, n_positions=8192)
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=WIDE_LAYERS,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=8192,
    )


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_recompute_costs_no_more_than_the_forward_at_7b_width_8k(family):
    """The issue's case: 7B width at seq 8192 on H100. On the math path each layer's
    recompute wrote and read B·H·S² scores: 26-30 ms a layer here, against 4-5 ms of forward."""
    est = torchroof.estimate(
        _wide(family), "train", hardware="h100-sxm", batch=1, seq=8192, checkpointing=True
    )
    forward, recompute = est.phase_time_s("forward"), est.phase_time_s("recompute")
    assert 0 < recompute <= forward
    attention = {
        phase: [k.time_s for k in est.kernels if k.phase == phase and FLASH in k.ops]
        for phase in ("forward", "recompute")
    }
    assert len(attention["recompute"]) == WIDE_LAYERS
    assert attention["recompute"] == pytest.approx(attention["forward"])


def test_checkpointing_every_second_layer_recomputes_half_the_layers(meta_lm):
    """torchtitan's selective layer policy (checkpoint every 2nd block): with 4 layers,
    layers 0 and 2 re-run their forward in backward and 1 and 3 keep their activations, so
    the recompute is half of full checkpointing's (2 flash kernels of 4), exactly half its
    FLOPs, and the step keeps more activations than under full checkpointing."""
    model = meta_lm("llama", attn_implementation="sdpa", num_hidden_layers=4)
    every = trace_model(model, "train", batch=1, seq=128, checkpointing=True, checkpoint_every=2)
    full = trace_model(model, "train", batch=1, seq=128, checkpointing=True)
    recomputed = [op.module for op in every.ops if op.name == FLASH and op.phase == "recompute"]
    assert len(recomputed) == 2 and all(".layers.0." in m or ".layers.2." in m for m in recomputed)
    flops_every = torchroof.estimate_trace(every, "h100-sxm")
    flops_full = torchroof.estimate_trace(full, "h100-sxm")

    def recompute_flops(est: torchroof.Estimate) -> int:
        return sum(k.flops for k in est.kernels if k.phase == "recompute")

    assert recompute_flops(flops_full) > 0
    assert recompute_flops(flops_every) * 2 == recompute_flops(flops_full)
    assert flops_every.memory.activations_peak_bytes > flops_full.memory.activations_peak_bytes


def test_checkpoint_every_is_refused_without_checkpointing():
    with pytest.raises(WorkloadError, match="checkpoint_every=2 chooses which layers"):
        torchroof.estimate("gpt2", "train", seq=64, checkpoint_every=2)
    with pytest.raises(WorkloadError, match="must be a positive integer, got 0"):
        torchroof.estimate("gpt2", "train", seq=64, checkpointing=True, checkpoint_every=0)


def test_selective_policy_recomputes_every_second_matmul_and_keeps_attention(meta_lm):
    """torchtitan's per-op policy: a Llama layer runs 7 mm (q, k, v, o, gate, up, down);
    the 1st, 3rd, 5th and 7th outputs are kept, the 2nd, 4th and 6th (k, o, up) recomputed,
    with the norms, rope and activations between them; attention's output is kept, so no
    flash kernel runs again and its backward reads the forward's output."""
    model = meta_lm("llama", attn_implementation="sdpa", num_hidden_layers=2)
    trace = trace_model(
        model, "train", batch=1, seq=128, checkpointing=True, checkpoint_policy="selective"
    )
    for layer in (0, 1):
        where = f".layers.{layer}."
        forward = [op for op in trace.ops if op.phase == "forward" and where in op.module]
        again = [op for op in trace.ops if op.phase == "recompute" and where in op.module]
        mm = [op for op in forward if op.name == "aten.mm.default"]
        redone = [op for op in again if op.name == "aten.mm.default"]
        assert len(mm) == 7
        assert [op.module for op in redone] == [mm[i].module for i in (1, 3, 5)]
        assert [op.outputs[0].shape for op in redone] == [mm[i].outputs[0].shape for i in (1, 3, 5)]
        assert not [op for op in again if op.name == FLASH]
        first = next(op for op in forward if op.name == FLASH)
        back = next(op for op in trace.ops if op.name == FLASH_BACKWARD and where in op.module)
        assert back.inputs[4].storage == first.outputs[0].storage  # the kept output
        # q and k come out of rope, recomputed; v is the kept v projection's output
        forward_qkv = [t.storage for t in first.inputs[:3]]
        backward_qkv = [t.storage for t in back.inputs[1:4]]
        assert backward_qkv[0] != forward_qkv[0] and backward_qkv[1] != forward_qkv[1]
        assert backward_qkv[2] == forward_qkv[2]
    with pytest.raises(WorkloadError, match="checkpoint_policy=selective chooses what"):
        trace_model(model, "train", batch=1, seq=128, checkpoint_policy="selective")

"""Repeated layers traced once (torchroof.capture.replay): the copied trace is the trace that
runs every layer, op for op, and a layer whose call cannot be copied runs for real."""

import dataclasses
import re

import pytest
import torch
from conftest import small_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchroof
from torchroof.capture.replay import LayerReplay
from torchroof.records.equality import first_difference
from torchroof.workloads import run_workload


def traced(regime, full, **knobs):
    from torchroof.models.sources import build_model

    workload = torchroof.Workload(regime, full_trace=full, **knobs)
    return run_workload(build_model(small_llama(), torch.bfloat16), workload)


def test_a_decode_step_runs_two_layers_and_copies_two():
    copied = traced("decode", False, batch=2, context=64)
    full = traced("decode", True, batch=2, context=64)
    assert first_difference(full, copied) == ""
    # the first runs, the second runs and is held to it, the other two are copies
    assert copied.facts.repeated_layers == "4 repeated layers, 1 distinct kind: 2 traced, 2 copied"
    assert full.facts.repeated_layers == ""
    # the copies are under their own names: every layer's q_proj GEMM is there, once
    q = [op for op in copied.ops if op.module.endswith("q_proj") and op.name == "aten.mm.default"]
    assert [op.module for op in q] == [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    # and read their own weights: four distinct q_proj weight storages
    weights = {op.inputs[1].storage for op in q}
    assert {copied.parameters[s] for s in weights} == {
        f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)
    }


def test_each_layer_writes_its_own_cache():
    """Prefill writes each layer's K and V: 4 layers x 2 cache tensors, each written by its
    own layer, and the cache bytes of all four (2 x 4 x batch 1 x 2 KV heads x 32 dims x
    capacity 16 x 2 bytes = 16,384 B for a 16-token prefill)."""
    copied = traced("prefill", False, seq=16)
    cache = {sid for sid, role in copied.roles.items() if role == "kv_cache"}
    writers = {
        op.module.rsplit(".", 1)[0] for op in copied.ops for t in op.outputs if t.storage in cache
    }
    assert writers == {f"model.layers.{i}" for i in range(4)}
    assert len({t.storage for op in copied.ops for t in op.outputs if t.storage in cache}) == 8
    assert copied.role_bytes["kv_cache"] == 2 * 4 * 1 * 2 * 32 * 16 * 2


def test_copied_and_full_traces_price_the_same():
    a = torchroof.estimate(small_llama(), "decode", batch=4, context=128, full_trace=True)
    b = torchroof.estimate(small_llama(), "decode", batch=4, context=128)
    assert b.time_s == a.time_s and b.flops == a.flops
    assert [(k.name, k.flops, k.time_s) for k in a.kernels] == [
        (k.name, k.flops, k.time_s) for k in b.kernels
    ]
    assert a.memory.total_bytes == b.memory.total_bytes


@settings(max_examples=6, deadline=None)
@given(
    regime=st.sampled_from(["prefill", "decode"]),
    batch=st.integers(1, 9),
    length=st.integers(1, 300),
)
def test_copies_equal_a_full_trace_at_any_size(regime, batch, length):
    size = {"seq": length} if regime == "prefill" else {"context": length}
    full = traced(regime, True, batch=batch, **size)
    copied = traced(regime, False, batch=batch, **size)
    assert first_difference(full, copied) == ""
    assert copied.facts.repeated_layers.endswith("2 traced, 2 copied")


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class Stack(nn.Module):
    def __init__(self, blocks) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def trace_stack(model, replay=True, shape=(2, 8)):
    x = torch.empty(shape, device="meta")
    with torch.no_grad(), torchroof.trace() as t:
        if replay:
            with LayerReplay(model.layers) as layers:
                model(x)
        else:
            model(x)
    return t, (layers.counts_for(t) if replay else None)


def test_a_plain_stack_of_blocks_is_copied():
    """Three blocks of linear, relu, add: 4 ops each (t, addmm, relu, add), 12 in all: the
    first two run, the third is a copy."""
    model = Stack([Block() for _ in range(3)]).to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert len(copied.ops) == 12 and first_difference(full, copied) == ""
    assert (counts.traced, counts.replayed, counts.kinds) == (2, 1, 1)


def test_blocks_of_other_shapes_are_kinds_of_their_own():
    model = Stack([Block(8), Block(8), Nested(), Block(8)]).to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == ""
    assert (counts.traced, counts.replayed, counts.kinds) == (3, 1, 2)


class Nested(nn.Module):
    """A block of another class (another kind) with the same interface."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block(8)

    def forward(self, x):
        return self.inner(x) * 2


class ReadsNeighbour(nn.Module):
    """A block that reads another block's weight (not its own, not an argument)."""

    def __init__(self, neighbour: list[nn.Module]) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.neighbour = neighbour  # a list: not a registered submodule

    def forward(self, x):
        return self.linear(x) + self.neighbour[0].linear.weight.sum()


class KeepsState(Block):
    def forward(self, x):
        self.last = super().forward(x)
        return self.last


class ReturnsInput(Block):
    def forward(self, x):
        return x[:, :8]  # a view of its input: the copy would have to make it of its own


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: [KeepsState() for _ in range(3)], "a layer kept state of its own"),
        (lambda: [ReturnsInput() for _ in range(3)], "a layer returned a view of its input"),
    ],
)
def test_a_block_that_cannot_be_copied_runs_every_time(make, why):
    model = Stack(make()).to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == ""
    assert (counts.traced, counts.replayed) == (3, 0) and set(counts.not_replayed) == {why}


def test_a_block_reading_another_blocks_weights_runs_every_time():
    anchor = Block()
    shared = [anchor]  # one object every block holds: the blocks are alike
    blocks = [ReadsNeighbour(shared) for _ in range(3)]
    model = Stack(blocks)
    model.anchor = anchor
    model = model.to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == ""
    assert counts.replayed == 0
    assert counts.not_replayed == ["a layer read another layer's weights or cache"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_training_step_copies_forward_backward_and_recompute(checkpointing):
    """Four layers: the first runs (its forward is copied), the second runs (held to the
    first), the last runs (its backward and recompute are copied), the third is a copy; the
    step is the full one op for op, the copy's weights get gradients of their own, priced
    the same."""
    full = traced("train", True, seq=32, checkpointing=checkpointing)
    copied = traced("train", False, seq=32, checkpointing=checkpointing)
    assert first_difference(full, copied) == ""
    assert copied.facts.repeated_layers == "4 repeated layers, 1 distinct kind: 3 traced, 1 copied"
    if checkpointing:  # the copies' recompute ops are there, under their own names
        modules = {op.module.split(".")[2] for op in copied.ops if op.phase == "recompute"}
        assert modules == {"0", "1", "2", "3"}
    a = torchroof.estimate_trace(full, "h100-sxm").to_dict()
    b = torchroof.estimate_trace(copied, "h100-sxm").to_dict()
    for data in (a, b):
        data["metadata"].pop("repeated_layers", None)
        data["metadata"]["workload"].pop("full_trace")
    assert a == b


def test_training_with_micro_batches_copies_layers_unless_gradients_accumulate():
    """In fp32 a second micro-batch accumulates into the gradients the first left: the
    step is traced as it runs. Under mixed precision each micro-batch leaves the
    parameters' gradients empty, so its layers are copied: of 4 layers, 3 run a
    micro-batch at most (the first of a kind, the second held to it, the last) of the
    2 x 4 = 8 calls, so at least 2 are copies (how many kinds the calls fall in depends on
    whether each micro-batch's transformers cache is a new object); the step is the full
    one op for op."""
    fp32 = torchroof.estimate(small_llama(), "train", seq=32, microbatches=2, precision="fp32")
    assert fp32.facts.repeated_layers == ""
    mixed = torchroof.trace_model(small_llama(), "train", seq=32, microbatches=2)
    full = torchroof.trace_model(small_llama(), "train", seq=32, microbatches=2, full_trace=True)
    found = re.fullmatch(
        r"4 repeated layers \(8 calls\), \d distinct kinds?: (\d) traced, (\d) copied",
        mixed.facts.repeated_layers,
    )
    assert found, mixed.facts.repeated_layers
    traced, copied = map(int, found.groups())
    assert traced + copied == 8 and copied >= 2
    assert first_difference(full, mixed) == ""


def test_first_difference_names_what_differs():
    a = traced("decode", True, batch=1, context=8)
    b = traced("decode", True, batch=1, context=8)
    assert first_difference(a, b) == ""
    b.ops[5] = dataclasses.replace(b.ops[5], module="elsewhere")
    assert first_difference(a, b).endswith(": module paths differ")
    b.ops.pop()
    assert first_difference(a, b) == f"{len(a.ops)} ops against {len(a.ops) - 1}"


@pytest.mark.parametrize("architecture", ["mixtral", "deepseek_v3", "jamba", "qwen3_next", "t5"])
def test_copied_layers_price_as_running_them_all(architecture):
    """MoE, latent attention, hybrids (attention with SSM, with linear attention) and an
    encoder-decoder: the copied trace's decode estimate is the full trace's, every field."""
    from torchroof.validation.zoo import replay_check

    check = replay_check(architecture, "decode", price_both=True)
    assert check.difference == "" and "copied" in check.repeated_layers


def test_a_forward_patched_on_one_layer_makes_it_a_kind_of_its_own():
    """Layer 1's MLP runs other code than layer 0's: a kind of its own, traced; layers 0
    and 2 run, layer 3 is a copy."""
    model = Stack([Block() for _ in range(4)]).to("meta")
    model.layers[1].linear.forward = lambda x: x * 3  # one instance's forward replaced
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == ""
    assert (counts.kinds, counts.traced, counts.replayed) == (2, 3, 1)


class IndexScaled(Block):
    """A block whose forward reads its own index (ImageGPT's scale by 1 / (layer_idx + 1))."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index

    def forward(self, x):
        return self.linear(x) / (self.layer_idx + 1)


SCALE = torch.ones(8, device="meta")  # a constant every block reads


class ReadsConstant(Block):
    def forward(self, x):
        return self.linear(x) * SCALE


class KeepsBuffer(Block):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + 1  # a buffer rebound: state a copy would not leave
        return super().forward(x)


def test_a_forward_reading_its_index_is_not_copied():
    """The second block divides by 2, the first by 1: held to each other they differ."""
    model = Stack([IndexScaled(i) for i in range(4)]).to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == ""
    assert (counts.traced, counts.replayed) == (4, 0)
    assert counts.not_replayed == ["layers of one kind ran other ops"]


def test_a_constant_every_block_reads_stays_one_storage():
    model = Stack([ReadsConstant() for _ in range(4)]).to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == "" and counts.replayed == 2
    muls = [op for op in copied.ops if op.name == "aten.mul.Tensor"]
    assert len({op.inputs[1].storage for op in muls}) == 1  # SCALE, read by all four


def test_a_rebound_buffer_is_state_a_copy_would_not_leave():
    model = Stack([KeepsBuffer() for _ in range(3)]).to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == "" and counts.replayed == 0
    assert set(counts.not_replayed) == {"a layer kept state of its own"}


def test_hooks_on_a_submodule_run_every_call():
    model = Stack([Block() for _ in range(4)]).to("meta")
    calls = []
    for block in model.layers:
        block.linear.register_forward_hook(lambda *args: calls.append(1))
    copied, counts = trace_stack(model)
    assert len(calls) == 4 and counts is None  # every block ran as it is, so every hook did


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, residual):
        return self.linear(x) + residual


class AliasedStack(nn.Module):
    """The first two blocks are given x twice (an alias), the last two x and another
    tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Residual() for _ in range(4))
        self.register_buffer("other", torch.zeros(2, 8))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, x if i < 2 else self.other)
        return x


def test_calls_aliased_otherwise_are_kinds_of_their_own():
    model = AliasedStack().to("meta")
    full, _ = trace_stack(model, replay=False)
    copied, counts = trace_stack(model)
    assert first_difference(full, copied) == ""
    assert (counts.kinds, counts.traced, counts.replayed) == (2, 4, 0)

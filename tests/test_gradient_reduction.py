"""The dtype mixed precision reduces its gradients in over data-parallel ranks
(``reduce_dtype``): fp32 by default (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``, as
torchtitan and Megatron run), bf16 where a recipe says so (Megatron-Bridge's
``grad_reduce_in_fp32 = False``).

A tiny Llama (d 64, 2 layers, vocabulary 128): 90,432 trainable parameters
(embedding 8,192 + head 8,192 + per layer 4·64·64 attention projections less the GQA half
of k and v (12,288) + 3·64·128 MLP (24,576) + 2 norms of 64 = 36,992; + final norm 64)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TINY_LLAMA
from torchroof.counters import kind_of
from torchroof.counters.collectives import collective_kind
from transformers import LlamaConfig

import torchroof
from torchroof import Trace
from torchroof.config import Workload
from torchroof.config.errors import WorkloadError

TINY = TINY_LLAMA
PARAMS = 8192 + 8192 + 2 * 36992 + 64  # 90,432
SIZES = dict(batch=1, seq=32)


def _reduced(trace) -> dict[str, int]:
    """Elements of each dtype the step's gradient collectives carry (backward only)."""
    out: dict[str, int] = {}
    for op in trace.ops:
        if kind_of(op.packet) == "collective" and op.phase == "backward":
            assert collective_kind(op) in ("all_reduce", "reduce_scatter")
            for t in op.inputs:
                out[t.dtype] = out.get(t.dtype, 0) + t.numel
    return out


@pytest.mark.parametrize(("reduce_dtype", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_ddp_all_reduces_every_gradient_once_in_the_reduce_dtype(reduce_dtype, dtype):
    # DDP over dp 4: each of the 90,432 gradients all-reduced once, in fp32 by default
    # (361,728 B on each rank's input) or bf16 (180,864 B)
    knobs = {} if reduce_dtype == "fp32" else {"reduce_dtype": reduce_dtype}
    trace = torchroof.trace_model(LlamaConfig(**TINY), "train", dp=4, **SIZES, **knobs)
    assert _reduced(trace) == {dtype: PARAMS}
    assert trace.facts.workload.reduce_dtype == reduce_dtype


def test_fsdp_reduce_scatters_in_the_reduce_dtype_and_holds_fp32_shards():
    # FSDP over 4: each layer's gradients reduce-scattered in the reduce dtype (the
    # reduce-scatter's input is the whole gradient, 90,432 elements); the sharded fp32
    # gradients the optimizer reads are a quarter of 90,432 x 4 B = 90,432 B either way
    config = LlamaConfig(**TINY)
    fp32 = torchroof.estimate(config, "train", fsdp=4, hardware="dgx-h100", **SIZES)
    bf16 = torchroof.estimate(
        config, "train", fsdp=4, reduce_dtype="bf16", hardware="dgx-h100", **SIZES
    )
    scattered = {}
    for name, est in (("fp32", fp32), ("bf16", bf16)):
        sent = [
            k for k in est.kernels if k.unit == "network" and "reduce_scatter" in " ".join(k.ops)
        ]
        scattered[name] = sum(k.bytes for k in sent)
        assert est.memory.gradients_bytes == PARAMS * 4 // 4
    assert scattered["fp32"] == 2 * scattered["bf16"] > 0
    # more bytes on the wire never make the step shorter
    assert fp32.step_time_s >= bf16.step_time_s


def test_zero_one_holds_its_whole_gradient_buffer_in_the_reduce_dtype():
    # ZeRO-1 over dp 4 keeps every gradient whole until it is reduced: 90,432 x 4 B =
    # 361,728 B in fp32; in bf16 (Megatron's grad_reduce_in_fp32=False) 90,432 x 2 B =
    # 180,864 B, still more than the fp32 copy of the rank's shard (90,432 B)
    config = LlamaConfig(**TINY)
    base = dict(hardware="dgx-h100", dp=4, zero=1, **SIZES)
    fp32 = torchroof.estimate(config, "train", **base)
    bf16 = torchroof.estimate(config, "train", reduce_dtype="bf16", **base)
    assert fp32.memory.gradients_bytes == PARAMS * 4
    assert bf16.memory.gradients_bytes == PARAMS * 2
    assert fp32.memory.total_bytes - bf16.memory.total_bytes >= PARAMS * 2
    assert any(
        "in a bf16 buffer (Megatron's grad_reduce_in_fp32=False" in a for a in bf16.assumptions
    )
    assert not any("bf16 buffer" in a for a in fp32.assumptions)


def test_a_bf16_buffer_is_never_less_than_the_fp32_shard():
    # Mixtral-like, dp 2 and ep 2: the dense weights (41,792 parameters) are sharded over
    # the 2 dp ranks, each rank's experts (98,304 of 196,608) live on that rank alone. ZeRO-1
    # keeps (41,792 + 98,304) / (20,896 + 98,304) = 1.175 times the traced fp32 shards;
    # in bf16 half of that, 0.588, would be less than the fp32 shards the distributed
    # optimizer reads: the buffer held is those shards, 119,200 x 4 B = 476,800 B
    from transformers import MixtralConfig

    config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    sizes = dict(dp=2, ep=2, zero=1, **SIZES)
    fp32 = torchroof.trace_model(config, "train", **sizes)
    bf16 = torchroof.trace_model(config, "train", reduce_dtype="bf16", **sizes)
    assert fp32.facts.whole_gradients == pytest.approx(140_096 / 119_200)
    assert bf16.facts.whole_gradients == 1.0
    assert bf16.estimate("dgx-h100").memory.gradients_bytes == 119_200 * 4


def test_experts_are_reduced_in_the_reduce_dtype_too():
    # dp 4, ep 2, ZeRO-1: dense gradients reduce-scattered over the 4 ranks, each rank's
    # experts over the 2 ranks holding them (0 and 2), both in the reduce dtype; the
    # tokens' all-to-all stays bf16
    from transformers import MixtralConfig

    config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    for reduce_dtype, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        trace = torchroof.trace_model(
            config, "train", dp=4, ep=2, zero=1, reduce_dtype=reduce_dtype, **SIZES
        )
        sent: dict[tuple[str, tuple[int, ...]], set[str]] = {}
        for op in trace.ops:
            if kind_of(op.packet) == "collective" and op.phase == "backward":
                key = (collective_kind(op), tuple(op.arg("group_ranks")))
                sent.setdefault(key, set()).update(t.dtype for t in op.inputs)
        assert sent[("reduce_scatter", (0, 1, 2, 3))] == {dtype}
        assert sent[("reduce_scatter", (0, 2))] == {dtype}
        assert sent[("all_to_all", (0, 1))] == {"bfloat16"}


def test_the_reduction_is_stated():
    config = LlamaConfig(**TINY)
    fp32 = torchroof.estimate(config, "train", fsdp=4, hardware="dgx-h100", **SIZES)
    assert (
        "gradients reduced over the data-parallel ranks in fp32: the bf16 gradients cast to "
        "fp32 before each reduction (FSDP2's reduce_dtype)"
    ) in fp32.assumptions
    one_gpu = torchroof.estimate(config, "train", hardware="h100-sxm", **SIZES)
    assert not any("gradients reduced" in a for a in one_gpu.assumptions)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(regime="prefill", reduce_dtype="bf16"), "give it with --regime train"),
        (
            dict(regime="train", reduce_dtype="bf16"),
            "this step has none: give --fsdp, --dp or --cp",
        ),
        (
            dict(regime="train", fsdp=2, precision="bf16", reduce_dtype="bf16"),
            "precision=bf16 reduces them in bf16: give precision=mixed",
        ),
        (dict(regime="train", fsdp=2, reduce_dtype="fp16"), "reduce_dtype"),
    ],
)
def test_a_reduction_that_means_nothing_is_refused(fields, needle):
    with pytest.raises(WorkloadError, match=re.escape(needle)):
        Workload(**fields)


def test_a_trace_saved_before_the_choice_is_read_as_it_was_traced(tmp_path):
    # a file written before reduce_dtype existed carries bf16 reductions (what that
    # torchroof traced): it is read as reduce_dtype bf16, not relabelled fp32
    trace = torchroof.trace_model(
        LlamaConfig(**TINY), "train", fsdp=4, reduce_dtype="bf16", **SIZES
    )
    path = tmp_path / "old.json"
    trace.save(path)
    data = json.loads(path.read_text())
    workload = data["metadata"]["workload"]
    del workload["reduce_dtype"]
    path.write_text(json.dumps(data))
    assert Trace.load(path).facts.workload.reduce_dtype == "bf16"
    # a ZeRO-1 trace of then held its whole buffer in fp32 (4 x the shards over dp 4):
    # read as bf16, it holds it in bf16 (2 x), as its label says
    zero = torchroof.trace_model(LlamaConfig(**TINY), "train", dp=4, zero=1, **SIZES)
    assert zero.facts.whole_gradients == 4.0
    zero.save(path)
    data = json.loads(path.read_text())
    del data["metadata"]["workload"]["reduce_dtype"]
    path.write_text(json.dumps(data))
    old = Trace.load(path).facts
    assert (old.workload.reduce_dtype, old.whole_gradients) == ("bf16", 2.0)
    one_gpu = torchroof.trace_model(LlamaConfig(**TINY), "train", **SIZES)
    one_gpu.save(path)
    data = json.loads(path.read_text())
    del data["metadata"]["workload"]["reduce_dtype"]
    path.write_text(json.dumps(data))
    assert Trace.load(path).facts.workload.reduce_dtype == "fp32"


def test_megatron_reduces_once_per_step_unless_told():
    # Megatron-Core runs all micro-batches but the last under its DDP's no_sync: one
    # reduction per step; given False wins, and one micro-batch, a pipelined step (traced
    # one micro-batch a stage), no data ranks, torchtitan or serving leave it alone
    from torchroof.pricing.runtime import runtime_options, workload_defaults

    megatron = runtime_options("megatron-te")
    train = dict(regime="train")
    assert workload_defaults(megatron, {"dp": 8, "microbatches": 4}, **train)["defer_gradient_sync"]
    given = {"dp": 8, "microbatches": 4, "defer_gradient_sync": False}
    assert workload_defaults(megatron, given, **train)["defer_gradient_sync"] is False
    # Megatron-FSDP reduces its sharded gradients after every micro-batch
    for knobs in (
        {"dp": 8},
        {"dp": 8, "microbatches": 4, "pp": 2},
        {"microbatches": 4},
        {"fsdp": 8, "microbatches": 4},
    ):
        assert "defer_gradient_sync" not in workload_defaults(megatron, knobs, **train)
    titan = runtime_options("torchtitan")
    assert "defer_gradient_sync" not in workload_defaults(
        titan, {"fsdp": 8, "microbatches": 4}, **train
    )
    assert "defer_gradient_sync" not in workload_defaults(
        megatron, {"dp": 8, "microbatches": 4}, regime="prefill"
    )


def test_zero_one_deferred_holds_the_whole_gradient_once():
    # ZeRO-1 over dp 4, 3 micro-batches. Reduced after each: 4 FSDP units x 3 = 12
    # reduce-scatters, and the whole fp32 gradient (90,432 x 4 B = 361,728 B) held beside
    # the traced step. Deferred to the last: 4 reduce-scatters, and the traced program
    # itself holds every gradient unsharded (FSDP2 accumulates them in fp32) until then:
    # that is the whole buffer, the fp32 shards the optimizer reads are views of it
    # (Megatron's main_grad), so nothing is held beside it. Both steps hold every parameter
    # whole through the step (ZeRO-1) and the whole fp32 gradient once: they differ only by
    # transients (each reduce-scatter's fp32 copy, the last micro-batch's activations), less
    # than a quarter of that gradient (361,728 / 4 = 90,432 B); counted twice, it would be
    # 361,728 B more
    config = LlamaConfig(**TINY)
    base = dict(hardware="dgx-h100", dp=4, zero=1, microbatches=3, **SIZES)
    each = torchroof.estimate(config, "train", **base)
    once = torchroof.estimate(config, "train", defer_gradient_sync=True, **base)

    def reductions(est) -> int:
        return sum(1 for k in est.kernels if k.unit == "network" and k.phase == "backward")

    assert (reductions(each), reductions(once)) == (12, 4)
    assert each.memory.gradients_bytes == PARAMS * 4
    assert once.memory.gradients_bytes == 0
    assert abs(once.memory.total_bytes - each.memory.total_bytes) < PARAMS
    assert any("views of them, as Megatron's main_grad" in a for a in once.assumptions)


def test_zero_one_deferred_still_holds_the_gradients_fsdp_leaves_whole():
    # dp 2 = ep 2: each rank's 2 experts are held by no other rank, so FSDP2 does not shard
    # or accumulate them; deferred, their fp32 gradients are still held beside the traced
    # accumulation: 2 layers x 2 local experts x (2·64·128 gate_up + 128·64 down = 24,576)
    # = 98,304 elements x 4 B = 393,216 B, and none of the dense ones
    from transformers import MixtralConfig

    config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    base = dict(hardware="dgx-h100", dp=2, ep=2, zero=1, microbatches=2, **SIZES)
    once = torchroof.estimate(config, "train", defer_gradient_sync=True, **base)
    assert once.facts.whole_gradients_traced
    assert once.memory.gradients_bytes == 98_304 * 4


def test_ddp_deferred_holds_its_gradient_buffer_once():
    # DDP over dp 2, 3 micro-batches. Reduced after each: 3 all-reduces of every gradient,
    # the fp32 gradients (90,432 x 4 B = 361,728 B) held, and, while a layer's gradients
    # are reduced, their fp32 copy (a decoder layer's 36,992 x 4 B = 147,968 B at most).
    # Deferred to the last: one all-reduce; the traced program accumulates every gradient
    # unsharded in fp32 until then (FSDP2's replicate under no-sync), and that is the
    # gradient buffer (torch DDP's param.grad under no_sync, Megatron DDP's main_grad):
    # 361,728 B of unsharded buffers, and the fp32 gradients the optimizer reads are views
    # of it, so none is held beside it. Counted twice, the deferred step would hold
    # 361,728 B more than the other; it holds one layer's fp32 copy less, and activations
    # within 1% of the other's (the last micro-batch's transients)
    config = LlamaConfig(**TINY)
    base = dict(hardware="dgx-h100", dp=2, microbatches=3, **SIZES)
    each = torchroof.estimate(config, "train", **base)
    once = torchroof.estimate(config, "train", defer_gradient_sync=True, **base)

    def reductions(est) -> int:
        return sum(1 for k in est.kernels if k.unit == "network" and k.phase == "backward")

    assert reductions(once) * 3 == reductions(each)
    assert (each.memory.gradients_bytes, each.memory.layer_buffers_bytes) == (PARAMS * 4, 147_968)
    assert once.facts.whole_gradients_traced
    assert (once.memory.gradients_bytes, once.memory.layer_buffers_bytes) == (0, PARAMS * 4)
    activations = once.memory.activations_peak_bytes - each.memory.activations_peak_bytes
    assert abs(activations) < each.memory.activations_peak_bytes / 100
    assert each.memory.total_bytes - once.memory.total_bytes == 147_968 - activations
    assert sum(a.startswith("DDP over dp 2: gradients accumulated") for a in once.assumptions) == 1
    assert not any(a.startswith("DDP over dp") for a in each.assumptions)
    # reducing in bf16, the accumulation is bf16 (90,432 x 2 B = 180,864 B) and the optimizer
    # reads a whole fp32 copy of it: both are held
    bf16 = torchroof.estimate(
        config, "train", defer_gradient_sync=True, reduce_dtype="bf16", **base
    )
    assert not bf16.facts.whole_gradients_traced
    assert (bf16.memory.gradients_bytes, bf16.memory.layer_buffers_bytes) == (
        PARAMS * 4,
        PARAMS * 2,
    )


@pytest.mark.parametrize(("zero", "deferred"), [(0, True), (1, True), (2, False)])
def test_deepspeed_reduces_once_a_step_under_zero_0_and_1(zero, deferred):
    # DeepSpeed's engine reduces DDP's and ZeRO-1's gradients only at the gradient
    # accumulation boundary, ZeRO-2's after every micro-batch (allreduce_gradients): over
    # dp 2 and 3 micro-batches, one reduction per FSDP unit a step, or three
    config = LlamaConfig(**TINY)
    base = dict(hardware="dgx-h100", dp=2, zero=zero, microbatches=3, **SIZES)
    plain = torchroof.estimate(config, "train", **base)
    deepspeed = torchroof.estimate(config, "train", runtime="deepspeed", **base)

    def reductions(est) -> int:
        return sum(1 for k in est.kernels if k.unit == "network" and k.phase == "backward")

    assert deepspeed.facts.workload.defer_gradient_sync is deferred
    assert reductions(deepspeed) * (3 if deferred else 1) == reductions(plain)

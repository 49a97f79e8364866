"""ZeRO stages over data-parallel replicas (--zero): what each rank holds and sends.

ZeRO-0 is DDP (torch's replicate: every parameter whole, gradients all-reduced); 1 and 2
run as FSDP2 over the dp ranks keeping parameters gathered through the step (one all-gather,
one reduce-scatter); 3 is FSDP. A tiny Llama (d 64, 2 layers) over dp 4."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from conftest import TINY_LLAMA
from torchroof.counters import kind_of
from torchroof.counters.collectives import collective_kind
from transformers import LlamaConfig

import torchroof
from torchroof.config import Workload
from torchroof.config.errors import WorkloadError
from torchroof.pricing.runtime import runtime_options, workload_defaults
from torchroof.workloads import train

TINY = TINY_LLAMA
DP, LAYERS = 4, 2
BASE = dict(hardware="dgx-h100", batch=1, seq=32, dp=DP)


@pytest.fixture(scope="module")
def stages():
    config = LlamaConfig(**TINY)
    return {zero: torchroof.estimate(config, "train", zero=zero, **BASE) for zero in range(4)}


def _collectives(est) -> Counter:
    return Counter((collective_kind_of(k), k.phase) for k in est.kernels if k.unit == "network")


def collective_kind_of(kernel) -> str:
    """all_reduce, all_gather or reduce_scatter, from the c10d op's name."""
    for name in kernel.ops:
        flat = name.replace("_", "")
        for kind in ("allreduce", "allgather", "reducescatter"):
            if kind in flat:
                return {"allreduce": "all_reduce", "allgather": "all_gather"}.get(
                    kind, "reduce_scatter"
                )
    return "other"


def test_each_stage_shards_what_zero_says(stages):
    # per rank, against DDP (zero 0): optimizer state / 4 from ZeRO-1 on, gradients / 4
    # from ZeRO-2 on (ZeRO-1 keeps them all until reduced), parameters / 4 at rest from
    # ZeRO-3 on; 1 and 2 hold the gathered parameters through the step instead
    ddp = stages[0].memory
    for zero in (1, 2, 3):
        mem = stages[zero].memory
        assert mem.optimizer_state_bytes == pytest.approx(ddp.optimizer_state_bytes / DP, rel=0.02)
    assert stages[1].memory.gradients_bytes == pytest.approx(ddp.gradients_bytes, rel=0.02)
    for zero in (2, 3):
        assert stages[zero].memory.gradients_bytes == pytest.approx(
            ddp.gradients_bytes / DP, rel=0.02
        )
    # ZeRO-1 holds 3 more quarters of the gradients than ZeRO-2, nothing else differs
    diff = stages[1].memory.total_bytes - stages[2].memory.total_bytes
    assert diff == stages[2].memory.gradients_bytes * (DP - 1)
    # 1 and 2 keep every layer's gathered parameters from forward to backward; 3 frees them
    # (priced eager, every op's output kept, the peak falls where the forward ends; fused
    # kernels keep fewer activations and move this tiny model's peak into the backward, and
    # so do fp32 reductions, whose fp32 copy of a layer's gradients outweighs its gathered
    # parameters here: reduced in bf16 to compare the gathered parameters alone)
    eager = {
        zero: torchroof.estimate(
            LlamaConfig(**TINY), "train", zero=zero, fusion="eager", reduce_dtype="bf16", **BASE
        )
        for zero in (2, 3)
    }
    assert eager[2].memory.layer_buffers_bytes > eager[3].memory.layer_buffers_bytes


def test_each_stage_sends_what_zero_says(stages):
    # DDP: all-reduces of gradients in backward, nothing gathered; ZeRO-1/2: each layer's
    # parameters all-gathered once (forward) and its gradients reduce-scattered once;
    # ZeRO-3: gathered again in backward
    ddp = _collectives(stages[0])
    assert ddp[("all_reduce", "backward")] > 0
    assert not any(kind in ("all_gather", "reduce_scatter") for kind, _ in ddp)
    for zero in (1, 2):
        sent = _collectives(stages[zero])
        assert sent[("all_gather", "backward")] == 0
        assert sent[("all_gather", "forward")] == sent[("reduce_scatter", "backward")] > 0
        assert not any(kind == "all_reduce" for kind, _ in sent)
    three = _collectives(stages[3])
    assert three[("all_gather", "backward")] > 0
    assert three[("all_gather", "forward")] == _collectives(stages[2])[("all_gather", "forward")]


def test_sharded_optimizer_steps_a_quarter_of_the_parameters(stages):
    # each rank updates its quarter: the optimizer step's bytes are a quarter of DDP's
    def step_bytes(est) -> int:
        return sum(k.bytes for k in est.kernels if k.phase == "optimizer")

    for zero in (1, 2, 3):
        assert step_bytes(stages[zero]) == pytest.approx(step_bytes(stages[0]) / DP, rel=0.05)


def test_the_stage_is_stated(stages):
    workload = stages[1].facts.workload
    assert train.label("tiny", workload).endswith("rank 0 of dp 4 (4 GPUs), ZeRO-1")
    assert any(
        a.startswith("ZeRO-1 over dp 4: optimizer state sharded") for a in stages[1].assumptions
    )
    assert not any(a.startswith("ZeRO") for a in stages[0].assumptions)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(regime="prefill", dp=4, zero=1), "a prefill step has none"),
        (dict(regime="train", zero=2), "give dp > 1"),
        (dict(regime="train", dp=2, fsdp=2, zero=1), "give one (HSDP is --dp with --fsdp"),
        (dict(regime="train", dp=2, zero=4), "ZeRO stage, 0, 1, 2 or 3, got 4"),
    ],
)
def test_a_stage_that_cannot_run_is_refused(fields, needle):
    with pytest.raises(WorkloadError, match=re.escape(needle)):
        Workload(**fields)


def test_megatron_runs_its_distributed_optimizer_unless_told():
    # Megatron-Core's performance recipes run the distributed optimizer (ZeRO-1) over
    # their data-parallel replicas; a given --zero wins, and FSDP or serving is untouched
    megatron = runtime_options("megatron-te")
    assert workload_defaults(megatron, {"dp": 8}, regime="train")["zero"] == 1
    assert workload_defaults(megatron, {"dp": 8, "zero": 0}, regime="train")["zero"] == 0
    assert "zero" not in workload_defaults(megatron, {"fsdp": 8}, regime="train")
    assert "zero" not in workload_defaults(megatron, {"dp": 8}, regime="prefill")
    assert "zero" not in workload_defaults(runtime_options("torchtitan"), {"dp": 8}, regime="train")


def test_zero_one_keeps_expert_gradients_whole_over_the_ranks_that_hold_them():
    # Mixtral-like, dp 4 and ep 2: the dense weights (D parameters) are sharded over the
    # 4 dp ranks, each rank's experts (X/2 of the X expert parameters) over the 2 ranks
    # that hold them (efsdp = 4 / 2). ZeRO-1 keeps each gradient whole over those ranks:
    # (D + X/2) / (D/4 + X/4) times what the traced program holds
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    sizes = dict(batch=1, seq=32, dp=DP, ep=2)
    one = torchroof.trace_model(config, "train", zero=1, **sizes)
    assert one.facts.whole_gradients == pytest.approx(
        (dense + experts / 2) / (dense / DP + experts / DP)
    )
    two = torchroof.estimate(config, "train", zero=2, hardware="dgx-h100", **sizes)
    held = one.estimate("dgx-h100").memory.gradients_bytes
    assert held == pytest.approx(two.memory.gradients_bytes * one.facts.whole_gradients, rel=1e-3)


def test_ddp_replicates_the_experts_too():
    # dp 4, ep 2, zero 0: each expert lives whole on the 2 ranks that hold it (ranks 0 and
    # 2 for rank 0) and their gradients are all-reduced there, as the dense ones over all
    # 4; nothing is gathered or reduce-scattered
    from transformers import MixtralConfig

    config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    trace = torchroof.trace_model(config, "train", batch=1, seq=32, dp=DP, ep=2)
    kinds: dict[str, set[tuple[int, ...]]] = {}
    for op in trace.ops:
        if kind_of(op.packet) == "collective":
            kinds.setdefault(collective_kind(op), set()).add(tuple(op.arg("group_ranks")))
    assert kinds["all_reduce"] == {(0, 1, 2, 3), (0, 2)}
    assert "all_gather" not in kinds and "reduce_scatter" not in kinds


@pytest.mark.parametrize("zero", [1, 2])
def test_micro_batches_gather_the_parameters_once_a_step(stages, zero):
    # ZeRO-1/2 ranks hold whole parameters through the step: a second micro-batch gathers
    # none (FSDP2 keeps them after the first one's backward), where ZeRO-3 gathers them in
    # each micro-batch's forward and backward; each micro-batch's gradients are still
    # reduce-scattered unless the reduction is deferred (one after the last)
    def micro(zero: int, **knobs) -> Counter:
        config = LlamaConfig(**TINY)
        est = torchroof.estimate(config, "train", zero=zero, microbatches=2, **BASE, **knobs)
        return _collectives(est)

    one = _collectives(stages[zero])
    two = micro(zero)
    # one gather per FSDP unit: the decoder layers, the embedding, and the root (norm, head)
    assert two[("all_gather", "forward")] == one[("all_gather", "forward")] == LAYERS + 2
    assert two[("all_gather", "backward")] == 0
    assert two[("reduce_scatter", "backward")] == 2 * one[("reduce_scatter", "backward")]
    deferred = micro(zero, defer_gradient_sync=True)
    assert deferred[("reduce_scatter", "backward")] == one[("reduce_scatter", "backward")]
    assert (
        micro(3)[("all_gather", "forward")]
        == 2 * _collectives(stages[3])[("all_gather", "forward")]
    )


def test_each_stage_says_how_often_it_gathers():
    # ZeRO-1/2 gather once a step across micro-batches; ZeRO-3 keeping its parameters
    # gathered after forward still gathers in each micro-batch's forward
    config = LlamaConfig(**TINY)

    def said(zero: int, **knobs) -> str:
        est = torchroof.estimate(config, "train", zero=zero, microbatches=2, **BASE, **knobs)
        return next(a for a in est.assumptions if a.startswith(f"ZeRO-{zero}"))

    assert "one all-gather a step" in said(1)
    assert "a reduce-scatter after each of the 2 micro-batches" in said(1)
    assert "and one reduce-scatter" in said(1, defer_gradient_sync=True)
    three = said(3, reshard_after_forward=False)
    assert "one all-gather a micro-batch" in three and "a step" not in three

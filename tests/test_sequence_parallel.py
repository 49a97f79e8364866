"""Tensor parallel with sequence parallel and loss parallel (Korthikanti et al. 2022): the
``sequence_parallel`` knob applies torchtitan's Llama plan (``apply_tp``) instead of
transformers' TP plan, and a training step's cross-entropy runs under ``loss_parallel()``.

The model is test_parallel_workloads.py's tiny Llama: 2 layers, d = 256, 4 heads of 64
(2 KV heads), MLP 512, vocab 1024, bf16; B = 2 sequences of T = 16 tokens, tp = 2 (n = 2).
One (B, T, d) bf16 activation is S = 2 x 16 x 256 x 2 B = 16,384 B. Every expected number
is derived beside its assertion.
"""

from __future__ import annotations

import math

import pytest
from conftest import PARALLEL_LLAMA
from torchroof.counters import cost_of, kind_of
from torchroof.counters.collectives import collective_kind, message_bytes, wire_bytes
from transformers import Gemma2Config, LlamaConfig

import torchroof
from torchroof.config import Workload, WorkloadError
from torchroof.config.parallel_plan import ParallelPlan
from torchroof.parallel.mesh import build_mesh
from torchroof.parallel.program import fake_process_group
from torchroof.parallel.sequence import apply_sequence_parallel
from torchroof.records.ops import OpRecord
from torchroof.records.trace import Trace
from torchroof.workloads.registry import regime

B, T, D, V, TP = 2, 16, 256, 1024, 2
BF16 = 2  # bytes
S = B * T * D * BF16  # 16,384 B: one (B, T, d) bf16 activation
NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm")


def _trace(regime: str, config: LlamaConfig | None = None, **knobs) -> Trace:
    knobs = {"batch": B, "seq": T, "tp": TP, **knobs}
    return torchroof.trace_model(config or LlamaConfig(**PARALLEL_LLAMA), regime, **knobs)


def _collectives(trace: Trace, phase: str | None = None) -> list[OpRecord]:
    return [
        op
        for op in trace.ops
        if kind_of(op.packet) == "collective" and (phase is None or op.phase == phase)
    ]


def _in_layer(op: OpRecord, index: int) -> bool:
    return op.module.startswith(f"model.layers.{index}.")


def _gemm_flops(trace: Trace, phase: str) -> int:
    return sum(
        cost_of(op).flops
        for op in trace.ops
        if kind_of(op.packet) == "matmul" and op.phase == phase
    )


@pytest.fixture(scope="module")
def plain_train() -> Trace:
    return _trace("train")


@pytest.fixture(scope="module")
def sp_train() -> Trace:
    return _trace("train", sequence_parallel=True)


# -- the collectives: each all-reduce becomes a reduce-scatter and an all-gather -------------


def test_each_layer_all_gathers_its_inputs_and_reduce_scatters_its_outputs(sp_train, plain_train):
    for layer in range(2):
        sp = [op for op in _collectives(sp_train, "forward") if _in_layer(op, layer)]
        # the attention and the MLP all-gather their (B, T/tp, d) input, o_proj and
        # down_proj reduce-scatter their partial sums back to it
        assert [(op.module.split(".")[-1], collective_kind(op)) for op in sp] == [
            ("self_attn", "all_gather"),
            ("self_attn", "reduce_scatter"),
            ("mlp", "all_gather"),
            ("mlp", "reduce_scatter"),
        ]
        for op in sp:
            # message S = 16,384 B (the gathered, or the pre-scatter, activation); on the
            # wire (n-1)/n x S = 8,192 B per rank; a rank's shard is (B, T/tp, d) = (2, 8, 256)
            assert (message_bytes(op), wire_bytes(op)) == (S, S // 2) == (16_384, 8_192)
            assert op.arg("group_ranks") == [0, 1]
            assert op.inputs[0].dtype == "bfloat16"
            shard = op.inputs[0] if collective_kind(op) == "all_gather" else op.outputs[0]
            assert shard.shape == (B, T // TP, D)
        # plain TP: the row-wise o_proj and down_proj all-reduce the whole (B, T, d):
        # 2(n-1)/n x S = 16,384 B on the wire each
        plain = [op for op in _collectives(plain_train, "forward") if _in_layer(op, layer)]
        assert [collective_kind(op) for op in plain] == ["all_reduce", "all_reduce"]
        assert {(message_bytes(op), wire_bytes(op)) for op in plain} == {(16_384, 16_384)}
        # the same bytes cross the link: 2 x 16,384 = 4 x 8,192 = 32,768 per layer
        assert sum(map(wire_bytes, sp)) == sum(map(wire_bytes, plain)) == 32_768


def test_the_embedding_reduce_scatters_and_the_lm_head_gathers_the_tokens(sp_train):
    forward = _collectives(sp_train, "forward")
    # the vocabulary-parallel embedding's partial sums land sequence-split: a reduce-scatter
    # of S; the LM head all-gathers the final norm's (2, 8, 256) tokens: S again
    first, last_tp = forward[0], forward[-4]
    assert (collective_kind(first), message_bytes(first)) == ("reduce_scatter", S)
    assert (last_tp.module, collective_kind(last_tp), message_bytes(last_tp)) == (
        "lm_head",
        "all_gather",
        S,
    )
    # no all-reduce of activations in forward: only the loss's three (B·T, 1) fp32 ones
    reduces = [op for op in forward if collective_kind(op) == "all_reduce"]
    assert [op.inputs[0].shape for op in reduces] == [(B * T, 1)] * 3


def test_backward_mirrors_forward_and_all_reduces_the_norm_gradients(sp_train):
    backward = _collectives(sp_train, "backward")
    for layer in range(2):
        # an all-gather's gradient is a reduce-scatter and the other way round: per layer
        # again 2 of each, S each
        mine = [op for op in backward if _in_layer(op, layer)]
        kinds = sorted(collective_kind(op) for op in mine)
        assert kinds == ["all_gather"] * 2 + ["reduce_scatter"] * 2
        assert {message_bytes(op) for op in mine} == {S}
    # the norms' replicated weights get partial gradients from their T/tp tokens: 5 norms
    # of 256 (2 per layer, the final one) all-reduced, 256 x 2 B = 512 B each (Megatron
    # all-reduces its sequence-parallel norm gradients too)
    reduces = [op for op in backward if collective_kind(op) == "all_reduce"]
    assert [(op.inputs[0].shape, message_bytes(op)) for op in reduces] == [((D,), 512)] * 5


# -- what each rank computes --------------------------------------------------------------


def test_norms_run_on_the_ranks_tokens(sp_train, plain_train):
    def norm_rows(trace: Trace) -> set[tuple[int, ...]]:
        """The (B, tokens) of every forward rsqrt in a norm (one per token)."""
        return {
            op.inputs[0].shape[:2]
            for op in trace.ops
            if op.phase == "forward"
            and op.packet == "aten.rsqrt"
            and any(op.module.endswith(norm) for norm in NORMS)
        }

    # 5 norms x rsqrt over (B, T/tp, 1) = (2, 8, 1); under plain TP each rank normalises
    # all (2, 16) tokens
    assert norm_rows(sp_train) == {(B, T // TP)}
    assert norm_rows(plain_train) == {(B, T)}
    squares = [
        op
        for op in sp_train.ops
        if op.phase == "forward" and op.packet == "aten.pow" and "norm" in op.module
    ]
    # x^2 per element: 2 x 8 x 256 = 4,096 per norm, 5 norms
    assert [op.inputs[0].numel for op in squares] == [B * T // TP * D] * 5


def test_gemm_flops_are_plain_tensor_parallels(sp_train, plain_train):
    # per rank at tp = 2, N = B·T = 32 tokens: q 2*32*256*128 + k, v 2 x 2*32*256*64 + o
    # 2*32*128*256 = 6,291,456; MLP 3 x 2*32*256*256 = 12,582,912; x 2 layers = 37,748,736;
    # LM head 2*32*256*512 = 8,388,608: 46,137,344 (half of one GPU's)
    assert _gemm_flops(sp_train, "forward") == _gemm_flops(plain_train, "forward") == 46_137_344
    assert _gemm_flops(sp_train, "backward") == _gemm_flops(plain_train, "backward")
    assert _gemm_flops(sp_train, "backward") == 2 * 46_137_344


def test_the_loss_runs_on_the_local_vocabulary_shard(sp_train, plain_train):
    # after the LM head, loss_parallel's cross-entropy reads (B·T, V/tp) = (32, 512)
    # logits: the exp of the softmax and the gather of the target logit
    loss = [op for op in sp_train.ops if op.phase == "forward" and op.module == ""]
    for packet in ("aten.exp", "aten.gather", "aten.amax"):
        (op,) = [op for op in loss if op.packet == packet]
        assert op.inputs[0].shape == (B * T, V // TP)
    # no forward op sees the whole vocabulary; plain TP gathers the logits (its
    # "colwise_gather_output" LM head) and its log-softmax reads all 1,024 columns
    assert not [
        op for op in sp_train.ops if op.phase == "forward" for t in op.inputs if V in t.shape
    ]
    (softmax,) = [op for op in plain_train.ops if op.packet == "aten._log_softmax"]
    assert softmax.inputs[0].shape[-1] == V


# -- priced on a DGX H100 -------------------------------------------------------------------


def test_priced_on_dgx_h100_the_link_carries_plain_tps_bytes(sp_train, plain_train):
    sp = torchroof.Trace.of(sp_train).estimate("dgx-h100")
    plain = torchroof.Trace.of(plain_train).estimate("dgx-h100")
    assert math.isfinite(sp.time_s) and sp.time_s > 0
    assert sp.uncounted == {}

    def layer_wire(estimate, layer: int, phase: str) -> dict[str, int]:
        wire: dict[str, int] = {}
        for kernel in estimate.kernels:
            if kernel.module.startswith(f"model.layers.{layer}.") and kernel.phase == phase:
                for link, size in kernel.wire_by_link.items():
                    wire[link] = wire.get(link, 0) + size
        return wire

    for layer in range(2):
        # forward: 2 all-reduces x 2(n-1)/n x S = 2 x 16,384 (plain) against 2 all-gathers
        # and 2 reduce-scatters x (n-1)/n x S = 4 x 8,192 (a ring all-reduce is a
        # reduce-scatter then an all-gather), on NVLink (ranks 0 and 1 share a node)
        forward = {"nvlink": 32_768}
        assert layer_wire(sp, layer, "forward") == layer_wire(plain, layer, "forward") == forward
        # backward: again 4 x 8,192 under sequence parallel, where the attention's and the
        # MLP's inputs are redistributed once; transformers' plan converts each column-wise
        # projection's input on its own, so q, k, v, gate and up each all-reduce their
        # input gradient: 5 x 16,384 = 81,920
        assert layer_wire(sp, layer, "backward") == {"nvlink": 32_768}
        assert layer_wire(plain, layer, "backward") == {"nvlink": 5 * 16_384}


# -- prefill, composition, refusals -----------------------------------------------------------


def test_prefill_gathers_the_last_tokens_logits_and_caches_the_local_heads():
    sp = _trace("prefill", sequence_parallel=True)
    plain = _trace("prefill")
    for layer in range(2):
        kinds = [collective_kind(op) for op in _collectives(sp) if _in_layer(op, layer)]
        assert kinds == ["all_gather", "reduce_scatter"] * 2
    # the KV cache holds the rank's one KV head (of 2), as under plain TP: K and V x 2
    # layers x B = 2 x 16 slots x 1 head x 64 wide x 2 B = 16,384 B (half of one GPU's)
    kv = 2 * 2 * B * T * 1 * 64 * BF16
    assert sp.role_bytes["kv_cache"] == plain.role_bytes["kv_cache"] == kv == 16_384
    # generation samples from the whole vocabulary: the last token's (2, 1, 512) logits
    # shards are gathered, 2 x 1 x 1,024 x 2 B = 4,096 B
    last = _collectives(sp)[-1]
    assert (collective_kind(last), message_bytes(last)) == ("all_gather", 4_096)
    label = regime("prefill").label("tiny", Workload("prefill", tp=2, sequence_parallel=True))
    assert label.endswith(", rank 0 of tp 2 (2 GPUs), sequence parallel")


def test_fsdp_composes_with_sequence_parallel():
    trace = _trace("train", fsdp=2, sequence_parallel=True)
    # mesh (fsdp, tp) = (2, 2): the TP group is ranks [0, 1], the FSDP group [0, 2]
    groups = {
        (collective_kind(op), tuple(op.arg("group_ranks")))
        for op in _collectives(trace)
        if op.inputs[0].numel == B * T * D // TP or op.inputs[0].numel == B * T * D
    }
    assert ("all_gather", (0, 1)) in groups and ("reduce_scatter", (0, 1)) in groups
    assert {tuple(op.arg("group_ranks")) for op in _collectives(trace)} == {(0, 1), (0, 2)}


def test_tied_embeddings_stay_one_parameter():
    config = LlamaConfig(**PARALLEL_LLAMA, tie_word_embeddings=True)
    trace = _trace("train", config, sequence_parallel=True)
    # untied, a rank holds (1,705,216 - 1,280 norms) / 2 + 1,280 = 853,248 parameters; the
    # tied LM head shares the embedding's vocabulary half: 853,248 - 131,072 = 722,176, x 2 B
    assert trace.role_bytes["weights"] == 722_176 * BF16 == 1_444_352


def test_one_tensor_parallel_rank_leaves_the_step_alone():
    trace = _trace("prefill", tp=1, sequence_parallel=True)
    assert _collectives(trace) == []


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"regime": "decode", "context": 16}, "a decode step has one per sequence"),
        ({"regime": "train", "seq": 15}, "splits seq=15 over tp=2 ranks: seq must be a multiple"),
        # cp 2 cuts seq 12 into 2 x 2 = 4 chunks of 3: each cp rank holds 6 tokens, and tp 4
        # (4 KV heads, one a rank) cannot split 6 evenly, though 12 divides by tp: 12 is not
        # a multiple of cp x tp = 8
        (
            {
                "regime": "train",
                "seq": 12,
                "cp": 2,
                "tp": 4,
                "config": LlamaConfig(**{**PARALLEL_LLAMA, "num_key_value_heads": 4}),
            },
            r"each cp rank's seq / cp = 6 tokens over tp=4 ranks: seq must be a multiple of "
            r"cp x tp = 8",
        ),
    ],
)
def test_steps_that_cannot_split_their_tokens_are_refused(knobs, message):
    regime = knobs.pop("regime")
    with pytest.raises(WorkloadError, match=message):
        _trace(regime, sequence_parallel=True, **knobs)


def _per_layer(trace: Trace, phase: str) -> list[str]:
    """The collectives of the first decoder layer (``model.layers.0``, ``gpt_neox.layers.0``)."""
    return sorted(
        collective_kind(op) for op in _collectives(trace, phase) if ".layers.0." in op.module
    )


@pytest.mark.parametrize("family", ["gemma2", "gpt-neox", "phi3"])
def test_a_model_not_laid_out_as_llama_runs_its_own_plan_on_the_sequence(family):
    # from the model's transformers TP plan: Gemma 2's four norms a layer, GPT-NeoX's fused
    # query_key_value and parallel residual, Phi-3's fused projections (its "gather output"
    # / "split input" pair); each layer's two all-reduces of plain TP become, forward, two
    # all-gathers of the sequence (attention's and the MLP's input) and two reduce-scatters
    from transformers import GPTNeoXConfig, Phi3Config

    config = {
        # untied: transformers' own TP plan fails on Gemma 2's tied head (the plain baseline)
        "gemma2": Gemma2Config(**PARALLEL_LLAMA, head_dim=64, tie_word_embeddings=False),
        "gpt-neox": GPTNeoXConfig(
            hidden_size=D, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=V,
        ),
        "phi3": Phi3Config(
            hidden_size=D, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=V, pad_token_id=0,
        ),
    }[family]  # fmt: skip
    plain = _trace("prefill", config)
    sequence = _trace("prefill", config, sequence_parallel=True)
    # Phi-3's two fused column-wise projections gather their output columns under both
    fused = ["all_gather"] * 2 if family == "phi3" else []
    gathered = ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert _per_layer(sequence, "forward") == sorted(fused + gathered)
    assert _per_layer(plain, "forward") == sorted(fused + ["all_reduce"] * 2)
    # the norms run on the rank's T/tp tokens: an input norm's output is (B, T/2, d)
    norm = next(op for op in sequence.ops if op.module.endswith(".layers.0.input_layernorm"))
    assert norm.outputs[0].shape[:2] == (B, T // TP)


def test_a_model_whose_plan_shards_experts_is_refused():
    from transformers import MixtralConfig

    config = MixtralConfig(**PARALLEL_LLAMA, num_local_experts=4)
    with pytest.raises(WorkloadError, match=r"mlp.experts.gate_up_proj \(packed_colwise\)"):
        _trace("train", config, sequence_parallel=True)


def test_apply_sequence_parallel_names_the_missing_module():
    from torch import nn

    with fake_process_group(2):
        mesh = build_mesh(ParallelPlan(tp=2))
        with pytest.raises(ValueError, match="needs an nn.Embedding 'model.embed_tokens'"):
            apply_sequence_parallel(nn.Linear(4, 4), mesh["tp"])


def test_a_non_llama_plan_trains_tied_and_pipelined():
    # Gemma 2 tied (its head is the embedding: one vocabulary-sharded parameter), and
    # GPT-NeoX's second pipeline stage, which owns neither the embedding nor the layers
    # before it: backward mirrors forward (two all-gathers, two reduce-scatters a layer)
    from transformers import GPTNeoXConfig

    gemma = _trace("train", Gemma2Config(**PARALLEL_LLAMA, head_dim=64), sequence_parallel=True)
    assert _per_layer(gemma, "backward") == _per_layer(gemma, "forward")
    neox = GPTNeoXConfig(
        hidden_size=D, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=V,
    )  # fmt: skip
    staged = torchroof.trace_model(
        neox, "train", batch=B, seq=T, tp=TP, pp=2, microbatches=2, sequence_parallel=True
    )
    last = staged.traces[1]
    kinds = sorted(collective_kind(op) for op in _collectives(last, "forward")
                   if ".layers.2." in op.module)  # fmt: skip
    assert kinds == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]


def test_qwen3_s_head_norms_all_reduce_their_gradients():
    # q_norm and k_norm see only the rank's heads: transformers' plan all-reduces their
    # weight gradients (2 a layer), under sequence parallel as under plain TP
    from transformers import Qwen3Config

    config = Qwen3Config(**PARALLEL_LLAMA, head_dim=64)
    for knobs in ({}, {"sequence_parallel": True}):
        trace = _trace("train", config, **knobs)
        reduced = [op for op in trace.ops if op.name.startswith("c10d.allreduce_")]
        assert len(reduced) == 2 * 2, knobs  # 2 layers x (q_norm, k_norm)


def test_a_layer_its_plan_cannot_split_on_the_sequence_is_refused():
    from torch import nn

    from torchroof.parallel.sequence import _layer_plan

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.attn = nn.Module()
            self.attn.q = nn.Linear(8, 8)
            self.extra = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    styles = {"colwise": object(), "rowwise": object()}
    with pytest.raises(ValueError, match="attn has no row-wise layer"):
        _layer_plan(Layer(), {"attn.q": "colwise"}, styles, ValueError("not Llama"))
    layer = Layer()
    layer.attn.o = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="extra holds layers its plan does not shard"):
        _layer_plan(layer, {"attn.q": "colwise", "attn.o": "rowwise"}, styles, ValueError("x"))


# -- Megatron-Core's re-gather: the shard saved, the input all-gathered again in backward -----


def _plans(trace: Trace, fusion: str):
    from torchroof.config import PricingOptions
    from torchroof.pricing.price import plan_kernels

    return [
        plan_kernels(trace, PricingOptions(fusion=fusion, sequence_parallel_regather=flag))
        for flag in (False, True)
    ]


@pytest.mark.parametrize("fusion", ["fused", "eager"])
def test_megatron_saves_each_gathered_inputs_shard(sp_train, fusion):
    torch_plan, megatron = _plans(sp_train, fusion)
    # five column-wise inputs are gathered on the sequence and read again by the backward's
    # weight-gradient GEMMs: each layer's attention and MLP input, and the lm_head's
    assert len(megatron.regathers) == 5
    for r in megatron.regathers:
        assert r.gather.inputs[0].nbytes == S // TP  # the rank's 16 of 32 tokens: 8,192 B
        assert r.gather.outputs[0].nbytes == S  # gathered: 16,384 B
    # torch keeps 5 gathered inputs (5 x 16,384 B), Megatron their 5 shards (5 x 8,192 B);
    # the shard (a norm's output on the rank's tokens) was read by the all-gather only, so
    # torch frees it: the forward keeps 5 x 8,192 = 40,960 B less, whatever the kernels
    assert torch_plan.backward_saved_bytes - megatron.backward_saved_bytes == 5 * (S - S // TP)
    # the peak may fall in the backward, where a re-gathered input lives again: never higher
    assert megatron.peak.activations_bytes <= torch_plan.peak.activations_bytes


def test_each_re_gather_runs_just_before_the_first_backward_kernel_reading_its_result(sp_train):
    from torchroof.kernels.regather import ALL_GATHER

    torch_plan, megatron = _plans(sp_train, "fused")
    assert len(megatron.kernels) == len(torch_plan.kernels) + 5
    storages = {r.gathered: r for r in megatron.regathers}
    placed = [
        (i, k)
        for i, k in enumerate(megatron.kernels)
        if k.phase == "backward"
        and k.ops[0].name == ALL_GATHER
        and k.ops[0].outputs[0].storage in storages
    ]
    assert len(placed) == 5
    for i, kernel in placed:
        gathered = kernel.ops[0].outputs[0].storage
        after = megatron.kernels[i + 1]
        assert any(t.storage == gathered for op in after.ops for t in op.inputs)
        # the same collective as the forward's: its bytes, its group
        forward = next(k for k in megatron.kernels if k.ops[0] is storages[gathered].gather)
        assert kernel.cost == forward.cost
        assert kernel.ops[0].arg("group_ranks") == [0, 1]


def test_the_megatron_profile_re_gathers_and_says_so(sp_train, plain_train):
    from torchroof.pricing.runtime import runtime_options

    assert runtime_options("megatron-te").sequence_parallel_regather
    assert not runtime_options("torchtitan").sequence_parallel_regather
    megatron = torchroof.Trace.of(sp_train).estimate("dgx-h100", runtime="megatron-te")
    titan = torchroof.Trace.of(sp_train).estimate("dgx-h100", runtime="torchtitan")
    line = next(a for a in megatron.assumptions if a.startswith("sequence parallel:"))
    # 5 shards of 8,192 B = 0.04 MiB against 5 x 16,384 B = 0.08 MiB gathered
    assert "5 all-gathered inputs" in line and "0.04 MiB" in line, line
    assert not any(a.startswith("sequence parallel:") for a in titan.assumptions)
    # the re-gathers add collectives the step waits on or hides: never a shorter step than
    # the same runtime saving the gathered inputs
    keeps = torchroof.Trace.of(sp_train).estimate(
        "dgx-h100", runtime="megatron-te", sequence_parallel_regather=False
    )
    assert megatron.time_s >= keeps.time_s
    assert megatron.memory.backward_saved_bytes == keeps.memory.backward_saved_bytes - 5 * (
        S - S // TP
    )

    def backward_collectives(estimate) -> int:
        return len([k for k in estimate.kernels if k.phase == "backward" and k.unit == "network"])

    assert backward_collectives(megatron) == backward_collectives(keeps) + 5
    # plain tensor parallel gathers nothing on the sequence: nothing to re-gather
    plain = torchroof.Trace.of(plain_train).estimate("dgx-h100", runtime="megatron-te")
    assert not any(a.startswith("sequence parallel:") for a in plain.assumptions)


@pytest.mark.parametrize("regime", ["train", "prefill"])
def test_steps_without_gathered_inputs_to_keep_are_priced_as_before(plain_train, regime):
    from torchroof.config import PricingOptions
    from torchroof.pricing.price import plan_kernels

    # plain tensor parallel trains without sequence gathers; a prefill keeps nothing
    trace = plain_train if regime == "train" else _trace("prefill", sequence_parallel=True)
    on = plan_kernels(trace, PricingOptions(sequence_parallel_regather=True))
    off = plan_kernels(trace, PricingOptions())
    assert on.regathers == () and len(on.kernels) == len(off.kernels)
    assert on.peak == off.peak and on.backward_saved_bytes == off.backward_saved_bytes


def test_a_re_gather_keeps_every_other_kernels_copy_source():
    from torchroof.counters import Cost

    from torchroof.kernels.fusion import Kernel
    from torchroof.kernels.regather import ALL_GATHER, Regather, with_regathers
    from torchroof.records.tensors import TensorMeta

    def tensor(storage: int, tokens: int) -> TensorMeta:
        return TensorMeta((tokens, 8), (8, 1), "bfloat16", storage)

    shard, gathered = tensor(1, 2), tensor(2, 4)
    gather = OpRecord(0, ALL_GATHER, (shard,), (gathered,), {"group_ranks": [0, 1]}, "m", "forward")
    other = OpRecord(1, "aten.mm.default", (gathered,), (tensor(3, 4),), {}, "m", "forward")
    reader = OpRecord(2, "aten.mm.default", (gathered,), (tensor(4, 4),), {}, "m", "backward")
    last = OpRecord(3, "aten.mm.default", (tensor(4, 4),), (tensor(5, 4),), {}, "m", "backward")
    network = Cost(bytes_read=32, bytes_written=64, unit="network")
    kernels = [
        Kernel((op,), network if op is gather else Cost()) for op in (gather, other, reader, last)
    ]
    # the last kernel is timed as a copy of the second (a repeated layer's)
    out, sources = with_regathers(kernels, (0, 1, 2, 1), [Regather(gather, gathered, 2)])
    # the re-gather takes its first reader's index: a pipeline stage files it in the backward
    assert [k.ops[0].index for k in out] == [0, 1, 2, 2, 3]
    assert out[2].phase == "backward" and out[2].cost == network
    assert out[2].ops[0].outputs == (gathered,)
    # the re-gather is its own source; the old fourth kernel (now fifth) still copies the second
    assert sources == (0, 1, 2, 3, 1)

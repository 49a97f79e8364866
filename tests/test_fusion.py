"""Fusion policies (docs/concepts/fusion.md; Dao et al. 2022, FlashAttention; Wijmans et al.
2024, "Cut Your Losses"): W never changes, Q is the group's external traffic."""

import pytest
import torch
import torch.nn.functional as F
from torchroof.counters import OP_KINDS, cost_of, kind_of, registered_packets
from torchroof.counters.norms import NORM_FLOPS

import torchroof
from torchroof.config import DEFAULT_ON_CHIP_BUDGET_BYTES, PricingOptions
from torchroof.kernels import optimizer_step, recompute
from torchroof.kernels.fusion import FUSED_KINDS, build_kernels
from torchroof.kernels.recompute import recomputable_tensors
from torchroof.render import text


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _rmsnorm(hidden: int):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(hidden).to(device="meta", dtype=torch.bfloat16)


def test_hf_rmsnorm_eager_vs_fused():
    n, d = 8 * 1024, 4096
    x, norm = _meta(8, 1024, d), _rmsnorm(d)
    with torch.no_grad(), torchroof.trace() as t:
        norm(x)
    eager, fused = t.estimate("h100", fusion="eager"), t.estimate("h100", fusion="fused")
    # eager: cast, pow, mean, add, rsqrt, mul, cast, mul — with fp32 round trips
    assert len(eager.kernels) == 8
    assert eager.bytes > 8 * n * d
    # fused: one kernel reading x and writing y (2 + 2 bytes per element) plus the weight
    assert len(fused.kernels) == 1
    assert fused.bytes == 4 * n * d + 2 * d
    assert fused.flops == eager.flops  # fusion never changes W
    # with 5 FLOP/element for RMSNorm: I = 5/4 = 1.25
    assert NORM_FLOPS["_fused_rms_norm"] * n * d / fused.bytes == pytest.approx(1.25, rel=1e-3)


def test_residual_rmsnorm_swiglu_chain_moves_only_its_external_tensors():
    n, d = 4096, 2048
    x, residual, up = _meta(n, d), _meta(n, d), _meta(n, d)
    norm = _rmsnorm(d)
    with torch.no_grad(), torchroof.trace() as t:
        h = x + residual
        y = F.silu(norm(h)) * up
    est = t.estimate("h100", fusion="fused")
    assert len(est.kernels) == 1
    # reads x, residual, up (3 · 2n·d) and the weight (2d); writes y (2n·d). h and every
    # fp32 intermediate stay on chip: nothing outside reads them.
    assert est.bytes == 3 * 2 * n * d + 2 * d + 2 * n * d
    assert y.shape == (n, d)


def test_an_intermediate_read_outside_the_group_is_written():
    n, d = 1024, 1024
    x, residual, w, norm = _meta(n, d), _meta(n, d), _meta(d, d), _rmsnorm(d)
    with torch.no_grad(), torchroof.trace() as t:
        h = x + residual
        y = norm(h)
        z = h @ w  # h is also a matmul input: it must reach HBM
    est = t.estimate("h100", fusion="fused")
    norm_kernel = next(k for k in est.kernels if len(k.ops) > 1)
    # reads x, residual, weight; writes h (read by the matmul) and y
    assert norm_kernel.bytes == 2 * 2 * n * d + 2 * d + 2 * 2 * n * d
    assert y.shape == z.shape


def test_fused_training_forward_writes_exactly_what_backward_reads(meta_lm):
    model = meta_lm("llama").train()
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids, labels=ids).loss.backward()
    kernels, _ = build_kernels(t.ops, PricingOptions(fusion="fused"), t.roles)
    backward_reads = {x.storage for op in t.ops if op.phase == "backward" for x in op.inputs}
    written_forward = {x.storage for k in kernels if k.phase == "forward" for x, _ in k.cost.writes}
    made_in_trace = {x.storage for op in t.ops for x in op.outputs}
    costs = [cost_of(op) for op in t.ops]
    rebuildable = recomputable_tensors(t.ops, costs, t.roles)
    sources = {s.storage for r in rebuildable.values() for s in r.sources}
    saved = rebuilt = 0
    for kernel in kernels:
        if kernel.phase != "forward" or len(kernel.ops) == 1:
            continue
        members = {op.index for op in kernel.ops}
        produced = {x.storage for op in kernel.ops for x in op.outputs}
        written = {x.storage for x, _ in kernel.cost.writes}
        # every tensor of the group that backward reads is written, or rebuilt in backward
        # from sources that are written (or existed before the step)
        for storage in produced & backward_reads - written:
            assert all(
                s.storage in written_forward or s.storage not in made_in_trace
                for s in rebuildable[storage].sources
            )
            rebuilt += 1
        saved += len(produced & backward_reads & written)
        # ... and nothing else is, unless it is read later outside the group, held in a
        # role (weights, KV, ...), a source something is rebuilt from, or never read again
        last = max(members)
        read_outside = {
            x.storage
            for op in t.ops
            if op.index > last or op.index not in members
            for x in op.inputs
            if op.index > min(members) and op.index not in members
        }
        read_at_all = {x.storage for op in t.ops if op.index > min(members) for x in op.inputs}
        for storage in written:
            assert (
                storage in read_outside
                or storage in t.roles
                or storage in sources
                or storage not in read_at_all
                or storage < 0  # a softmax's row statistics
            )
    assert rebuilt > 0  # the compiled backward rebuilds pointwise work (SwiGLU, norms)
    assert saved > 0  # the forward does save activations for backward


def test_fusion_never_changes_w(meta_lm):
    model = meta_lm("gpt2").train()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids, labels=ids).loss.backward()
    flops = {
        (fusion, epilogue, loss): t.estimate(
            "h100", fusion=fusion, epilogue=epilogue, loss=loss
        ).flops
        for fusion in ("eager", "fused")
        for epilogue in (False, True)
        for loss in ("materialized", "chunked")
    }
    assert len(set(flops.values())) == 1
    fused = t.estimate("h100", fusion="fused")
    assert fused.bytes < t.estimate("h100", fusion="eager").bytes


def test_matmul_epilogue_absorbs_the_bias_and_activation():
    x, w, b = _meta(2048, 1024), _meta(1024, 4096), _meta(4096)
    with torch.no_grad(), torchroof.trace() as t:
        y = F.gelu(x @ w + b)
    plain = t.estimate("h100", fusion="fused")
    epilogue = t.estimate("h100", fusion="fused", epilogue=True)
    assert len(plain.kernels) == 2 and len(epilogue.kernels) == 1
    # the [2048, 4096] matmul output never reaches HBM: one write and one read fewer
    assert plain.bytes - epilogue.bytes == 2 * 2 * 2048 * 4096
    assert y.shape == (2048, 4096)


def test_math_attention_intensity_tends_to_d_over_s():
    N, d = 4096, 128
    q, k, v = (_meta(1, 1, N, d) for _ in range(3))
    with torch.no_grad(), torchroof.trace() as t:
        F.scaled_dot_product_attention(q, k, v)
    flash = t.estimate("h100", attention="flash").kernels[0]
    math = t.estimate("h100", attention="math").kernels[0]
    # naive: W = 4N²d, Q = 4s(Nd + N²) -> I = Nd / [s(N + d)] = 62.06 (tends to d/s = 64)
    assert math.flops == 4 * N * N * d
    assert math.bytes == 4 * 2 * (N * d + N * N)
    assert math.intensity == pytest.approx(N * d / (2 * (N + d)), rel=1e-6)
    assert round(math.intensity) == 62
    # flash: the same W, compulsory Q = q, k, v, o once (4·N·d·2 B) + the fp32 log-sum-exp
    # (4N B): I = 4N²d / (8Nd + 4N) = N·d / (2d + 1) = 2040.03, the compulsory N/s = 2048 less
    # the log-sum-exp
    assert flash.flops == 4 * N * N * d
    assert flash.bytes == 4 * N * d * 2 + 4 * N
    assert round(flash.intensity, 2) == 2040.03


def test_chunked_cross_entropy_removes_the_logits_traffic():
    n_t, d, vocab = 8192, 4096, 100_000
    x = _meta(n_t, d, grad=True)
    head = torch.nn.Linear(d, vocab, bias=False, device="meta", dtype=torch.bfloat16)
    labels = torch.zeros(n_t, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        F.cross_entropy(head(x).float(), labels).backward()
    eager = t.estimate("h100", fusion="eager")
    materialized = t.estimate("h100", fusion="fused")
    chunked = t.estimate("h100", fusion="fused", loss="chunked")
    gemm_bytes = 3 * 2 * (n_t * d + d * vocab + n_t * vocab)  # forward, dX and dW GEMMs
    # cross-entropy moves at least 4 · 4 · N_t · V bytes = 13.1 GB (read logits, write
    # the softmax, read it back, write the gradient, all fp32); eager moves more (the fp32
    # cast both ways, the one-hot gradient, the saved log-softmax read back)
    assert eager.bytes - gemm_bytes > 4 * 4 * n_t * vocab > 13.1e9
    # compiled (Inductor): the forward reads the bf16 logits once and writes two fp32 row
    # statistics; the backward rebuilds the log-softmax from the logits and the statistics
    # and writes the bf16 gradient: 3 passes of 2 B = 6 · N_t · V = 4.9 GB, plus the row
    # statistics written and read back (2 · 2 · 4 · N_t), the gathered rows, the targets
    loss_bytes = materialized.bytes - gemm_bytes
    assert loss_bytes == pytest.approx(3 * 2 * n_t * vocab, rel=1e-3)
    assert loss_bytes - 3 * 2 * n_t * vocab > 2 * 2 * 4 * n_t
    loss = [k for k in materialized.kernels if k.unit != "tensor"]
    forward = [k for k in loss if k.phase == "forward"]
    backward = [k for k in loss if k.phase == "backward"]
    # forward: the row-statistics kernel (reads the bf16 logits, writes 2 fp32 per row) and
    # the gather (x[t] at each target, its share of the statistics, rounded up, the int64
    # targets; writes the fp32 loss and total weight)
    assert [(k.bytes_read, k.bytes_written) for k in forward] == [
        (2 * n_t * vocab, 2 * 4 * n_t),
        (2 * n_t + 2 * 4 * n_t // vocab + 1 + 8 * n_t, 4 + 4),
    ]
    # backward: one kernel builds the one-hot gradient inline, rebuilds the log-softmax
    # from the logits and the statistics, and writes the bf16 gradient of the logits
    assert len(backward) == 1
    assert backward[0].bytes_written == 2 * n_t * vocab
    assert backward[0].bytes_read == pytest.approx(2 * n_t * vocab + 2 * 4 * n_t + 8 * n_t, abs=8)
    # chunked: one kernel; reads X and W, writes dX and dW; no N_t x V term at all
    assert len(chunked.kernels) == 1
    assert chunked.bytes == pytest.approx(2 * 2 * (n_t * d + d * vocab), rel=1e-3)
    assert chunked.flops == materialized.flops  # the head GEMMs' W is unchanged


def test_on_chip_budget_flags_wide_fused_rows():
    def flagged(hidden, budget=DEFAULT_ON_CHIP_BUDGET_BYTES):
        x, norm = _meta(64, hidden), _rmsnorm(hidden)
        with torch.no_grad(), torchroof.trace() as t:
            norm(x)
        est = t.estimate("h100", fusion="fused", on_chip_budget_bytes=budget)
        return bool(est.kernels[0].flags)

    # HF RMSNorm's widest moment holds two fp32 rows (the fp32 copy of x and its square
    # feeding the mean) and the mean: 2 · 4 B · d + 4 B = 32 KiB at d = 4096, just over the
    # 64 KiB budget at 8192, 128 KiB at 16384 (Llama-3.1-405B's width)
    assert not flagged(4096)
    assert flagged(8192)
    assert flagged(16384)
    assert flagged(1024, budget=4096)  # 8 KiB against a 4 KiB budget
    # the message states the figures exactly: 2 · 4 B · 8192 + 4 B = 65,540 B (rounded to
    # KiB both sides once read "64.0 KiB exceeds the 64.0 KiB budget")
    x, norm = _meta(64, 8192), _rmsnorm(8192)
    with torch.no_grad(), torchroof.trace() as t:
        norm(x)
    assert t.estimate("h100").kernels[0].flags == (
        "on-chip state 65,540 B per row exceeds the 65,536 B budget: may spill",
    )


def test_compare_prints_both_sides_with_the_speed_up(meta_lm):
    model = meta_lm("llama")
    eager = torchroof.estimate(model, "prefill", batch=2, seq=128, fusion="eager")
    fused = torchroof.estimate(model, "prefill", batch=2, seq=128, fusion="fused")
    table = text.comparison_table(eager, fused)
    assert "h100-sxm eager ms" in table and "h100-sxm fused ms" in table
    assert "model.layers.* (x2)" in table
    speed_up = eager.time_s / fused.time_s
    assert f"{speed_up:.2f}x" in table.splitlines()[-1]
    assert speed_up > 1


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown fusion policy"):
        PricingOptions(fusion="inductor")
    with pytest.raises(ValueError, match="unknown loss policy"):
        PricingOptions(loss="fast")


def test_the_kinds_fusion_reads_are_declared_kinds():
    # a misspelt kind in a stage's set would silently stop those ops fusing
    read_by_stages = [
        FUSED_KINDS,
        recompute._REBUILT_FROM_INPUTS,
        optimizer_step._ELEMENTWISE_KINDS,
        optimizer_step._INIT_KINDS,
    ]
    for kinds in read_by_stages:
        assert kinds <= set(OP_KINDS)
    # and every fused kind is declared by some registration
    assert FUSED_KINDS <= {kind_of(p) for p in registered_packets()}

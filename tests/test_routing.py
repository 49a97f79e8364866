"""Data-dependent routing on meta (nonzero, torch.where on a mask, tolist of counts) is
answered under balanced routing, and the answer is stated as an assumption."""

import torch
import torch.nn.functional as F

import torchroof


class EagerMoE(torch.nn.Module):
    """The per-expert loop many HF MoE blocks use (DBRX, JetMoE, LongCat): one_hot mask,
    experts hit via nonzero, each expert's tokens via torch.where."""

    def __init__(self, experts: int, top_k: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.w = torch.nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
        mask = F.one_hot(chosen, self.experts).permute(2, 1, 0)  # [E, top_k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        out = x.new_zeros(x.shape[0], self.w.shape[-1])
        for expert in hit:
            _, token = torch.where(mask[expert].squeeze(0))
            out.index_add_(0, token, x[token] @ self.w[expert[0]])
        return out


def test_eager_expert_loop_is_priced_under_balanced_routing():
    tokens, experts, top_k, hidden, ffn = 64, 8, 2, 32, 48
    with torch.device("meta"):
        moe = EagerMoE(experts, top_k, hidden, ffn)
        x = torch.empty(tokens, hidden)
    with torchroof.trace() as t, torch.no_grad():
        moe(x)
    est = t.estimate("h100-sxm")
    assert est.uncounted == {}
    expert_mms = [
        op
        for op in t.ops
        if op.name == "aten.mm.default" and op.tensor("mat2").shape == (hidden, ffn)
    ]
    # every expert is hit (64 tokens · 2 slots > 8 experts), each with 64 · 2 / 8 = 16 rows
    assert len(expert_mms) == experts
    assert all(op.tensor("self").shape == (16, hidden) for op in expert_mms)
    # so the experts' FLOPs are those of tokens · top_k rows: 2 · 128 · 32 · 48 = 393,216
    flops = sum(2 * op.tensor("self").shape[0] * hidden * ffn for op in expert_mms)
    assert flops == 2 * tokens * top_k * hidden * ffn == 393_216
    assert any("nonzero" in a and "8 of 8" in a for a in est.assumptions)


def test_decode_routes_each_token_slot_to_its_own_expert():
    # one token, top_k 2 of 8 experts: 2 experts hit, 1 row each
    with torch.device("meta"):
        moe = EagerMoE(8, 2, 32, 48)
        x = torch.empty(1, 32)
    with torchroof.trace() as t, torch.no_grad():
        moe(x)
    expert_mms = [
        op for op in t.ops if op.name == "aten.mm.default" and op.tensor("mat2").shape == (32, 48)
    ]
    assert [op.tensor("self").shape for op in expert_mms] == [(1, 32), (1, 32)]


def test_transformers_eager_expert_loop_runs_every_hit_expert():
    """transformers' own eager loop one-hots into E + 1 classes and skips the padding
    class with ``if expert_idx == num_experts``; on meta that comparison answers False, so
    the experts run (balanced: tokens·top_k/(E + 1) rows each, over E + 1 loop turns)."""
    from conftest import SMALL
    from transformers import AutoConfig

    def expert_flops(implementation):
        config = AutoConfig.for_model(
            "mixtral", **SMALL, num_local_experts=8, num_experts_per_tok=2
        )
        config._experts_implementation = implementation
        est = torchroof.estimate(config, "prefill", seq=64)
        assert est.uncounted == {}
        assert any("balanced routing" in a for a in est.assumptions)
        return sum(k.flops for k in est.kernels if "experts" in k.module and k.unit == "tensor")

    grouped, eager = expert_flops("grouped_mm"), expert_flops("eager")
    # 64 tokens · top-2 = 128 routed rows, each through gate-up (128 -> 2·256) and down
    # (256 -> 128): 2·(128·512 + 256·128) = 196,608 FLOPs per row, 2 layers
    assert grouped == 2 * 128 * 196_608 == 50_331_648
    # eager: 9 turns of ceil(128 / 9) = 15 rows = 135 rows per layer (+5.5%)
    assert eager == 2 * 135 * 196_608 == 53_084_160

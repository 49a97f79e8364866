"""Whole HF models on meta: every op priced, totals cross-checked against
``torch.utils.flop_counter.FlopCounterMode`` and the analytic 2·N·tokens count."""

import pytest
import torch
from conftest import FAMILY_CONFIGS
from torch.utils.flop_counter import FlopCounterMode
from torchroof.counters import cost_of

import torchroof
from torchroof.models.sources import load_config, shipped_models
from torchroof.render import text


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_forward_and_backward_have_zero_uncounted_ops(family, meta_lm):
    model = meta_lm(family).train()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids, labels=ids).loss.backward()
    est = t.estimate("h100")
    assert est.uncounted == {}, text.coverage_line(est)
    assert {op.phase for op in t.ops} == {"forward", "backward"}
    assert est.flops > 0 and est.time_s > 0


def test_linear_flops_equal_flop_counter_mode(meta_lm):
    model = meta_lm("llama").eval()
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids)
    ours = sum(cost_of(op).flops for op in t.ops if op.packet in ("aten.mm", "aten.addmm"))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    by_op = counter.get_flop_counts()["Global"]
    theirs = sum(v for k, v in by_op.items() if str(k) in ("aten.mm", "aten.addmm"))
    assert ours == theirs > 0
    # and both equal the analytic count: 2 · tokens · (linear parameters)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert ours == 2 * 2 * 64 * linear_params


def test_shipped_llama_3_8b_prefill_matches_analytic_count():
    """Llama-3-8B at 4096 tokens: W = 2·N_linear·T + causal attention, which keeps
    T(T + 1)/2 of the T² (query, key) pairs at 4·d FLOPs each: 2·L·h·T·(T + 1)·d."""
    est = torchroof.estimate("llama-3-8b", "prefill", batch=1, seq=4096, hardware="h100")
    assert est.uncounted == {}
    d, layers, ffn, kv = 4096, 32, 14336, 1024  # kv = 8 heads x 128
    per_layer_linear = d * d + 2 * d * kv + d * d + 3 * d * ffn  # q, k, v, o, gate/up/down
    linear = 2 * 4096 * per_layer_linear * layers + 2 * 1 * d * 128256  # lm_head: last token
    attention = layers * 2 * 32 * 4096 * 4097 * 128  # 32 heads of 128
    matmul = sum(k.flops for k in est.kernels if k.unit == "tensor")
    assert matmul == linear + attention
    # everything else (norms, SiLU, RoPE, residuals) is under 0.2% of the work
    assert 0 < est.flops - matmul < 0.002 * est.flops


def test_every_shipped_config_builds():
    for name in shipped_models():
        config = load_config(name)
        assert config.model_type, name
    with pytest.raises(KeyError, match="did you mean"):
        load_config("llama-3-8")

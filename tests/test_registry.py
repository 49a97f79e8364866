"""The rule registry: one rule per packet, every name real, and no silent zeros."""

import pytest
import torch
from torchroof.counters import DuplicateRuleError, cost_of, register, registered_packets, rule_for

import torchroof


def test_every_registered_packet_exists_in_this_torch():
    # torchroof.* are the synthetic kernels capture emits (the fused optimizer step)
    missing = [
        p
        for p in registered_packets()
        if not p.startswith("torchroof.")
        and not hasattr(getattr(torch.ops, p.split(".")[0]), p.split(".")[1])
    ]
    assert missing == []


def test_every_rule_has_a_docstring():
    undocumented = sorted(
        {
            rule_for(p).__name__
            for p in registered_packets()
            if not (rule_for(p).__doc__ or "").strip()
        }
    )
    assert undocumented == []


def test_second_registration_raises():
    with pytest.raises(DuplicateRuleError, match="aten.mm"):
        register("aten.mm")(lambda op: None)


def test_required_families_are_covered():
    required = {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.convolution",
        "aten.convolution_backward",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_flash_attention_backward",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_efficient_attention_backward",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_cudnn_attention_backward",
        "aten._scaled_dot_product_attention_math",
        "aten._to_copy",
        "aten.sum",
        "aten.mean",
        "aten.amax",
        "aten._softmax",
        "aten._log_softmax",
        "aten._safe_softmax",
        "aten._softmax_backward_data",
        "aten._log_softmax_backward_data",
        "aten.native_layer_norm",
        "aten.native_layer_norm_backward",
        "aten._fused_rms_norm",
        "aten._fused_rms_norm_backward",
        "aten.native_group_norm",
        "aten.native_group_norm_backward",
        "aten.embedding",
        "aten.embedding_dense_backward",
        "aten.index",
        "aten.gather",
        "aten.scatter",
        "aten.index_put_",
        "aten.index_copy_",
        "aten.cat",
        "aten.stack",
        "aten.clone",
        "aten.copy_",
        "aten.zeros",
        "aten.ones",
        "aten.full",
        "aten.arange",
        "aten.native_dropout",
        "aten.native_dropout_backward",
        "aten._foreach_add_",
        "aten._foreach_mul_",
        "aten._foreach_lerp_",
        "aten._foreach_addcdiv_",
        "aten._foreach_sqrt",
        "aten._fused_adamw_",
        "aten.nll_loss_forward",
        "aten.nll_loss_backward",
        "aten.topk",
        "aten.sort",
        "aten.cumsum",
        "aten.silu",
        "aten.gelu",
        "aten.rsqrt",
        "aten.pow",
        "aten.where",
    }
    assert required - registered_packets() == set()


@torch.library.custom_op("torchroof_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


def test_unknown_custom_op_is_charged_its_bytes_and_listed():
    x = torch.empty(1024, dtype=torch.bfloat16, device="meta")
    with torchroof.trace() as t:
        mystery(x)
    op = next(op for op in t.ops if op.name == "torchroof_test.mystery.default")
    cost = cost_of(op)
    assert not cost.counted
    assert cost.flops == 0 and cost.bytes == 2 * 1024 * 2  # 1024 bf16 in, 1024 bf16 out
    est = t.estimate("h100")
    assert est.uncounted == {"torchroof_test.mystery.default": 1}
    assert "torchroof_test.mystery.default x1" in est.coverage_line()
    assert est.to_dict()["uncounted"] == {"torchroof_test.mystery.default": 1}
    assert est.kernels[0].time_s == pytest.approx(4096 / 3.35e12)  # charged, not zero

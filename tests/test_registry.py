"""The rule registry: one rule per packet, every name real, no silent zeros, and one
declared kind per packet that fusion reads (no second list of packet names)."""

from typing import get_args

import pytest
import torch
from torchroof.counters import (
    OP_KINDS,
    Cost,
    DuplicateRuleError,
    OpKind,
    cost_of,
    kind_of,
    register,
    registered_packets,
    rule_for,
)
from torchroof.counters import registry as registry_module
from torchroof.counters.tensors import io_bytes

import torchroof
from torchroof.render import text


def test_every_registered_packet_exists_in_this_torch():
    # torchroof.* are the synthetic kernels capture emits (the fused optimizer step); the
    # fsdp.* copies are defined by FSDP2's module, which torchroof does not import at start-up
    import torch.distributed.fsdp  # noqa: F401

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
        register("aten.mm", kind="matmul")(lambda op: None)
    with pytest.raises(DuplicateRuleError, match="aten.add"):  # whatever kind it declares
        register("aten.add", kind="opaque")(lambda op: None)
    assert kind_of("aten.mm") == "matmul" and kind_of("aten.add") == "pointwise"


def test_every_registered_packet_has_a_documented_kind():
    assert set(OP_KINDS) == set(get_args(OpKind))  # each kind says how fusion treats it
    assert all(OP_KINDS[k].strip() for k in OP_KINDS)
    undeclared = sorted(p for p in registered_packets() if kind_of(p) not in OP_KINDS)
    assert undeclared == []


def test_a_registration_must_declare_a_known_kind():
    with pytest.raises(TypeError, match="kind"):
        register("torchroof_test.no_kind")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown op kind 'elementwise'"):
        register("torchroof_test.bad_kind", kind="elementwise")  # type: ignore[arg-type]
    assert "torchroof_test.bad_kind" not in registered_packets()


def test_an_op_without_a_rule_is_opaque():
    assert kind_of("torchroof_test.mystery") == "opaque"
    assert kind_of("aten.no_such_op") == "opaque"


@pytest.mark.parametrize(
    "packet, kind",
    [
        ("aten.mm", "matmul"),
        ("aten.add_", "pointwise"),
        ("aten._to_copy", "cast"),
        ("aten.clone", "copy"),
        ("aten.cat", "rearrange"),
        ("aten.index_select", "gather"),
        ("aten.zeros_like", "creation"),
        ("aten.sum", "sum"),
        ("aten.amax", "reduction"),
        ("aten._softmax", "softmax"),
        ("aten._softmax_backward_data", "reduction"),
        ("aten._fused_rms_norm", "norm"),
        ("aten.native_layer_norm_backward", "norm_backward"),
        ("aten.native_group_norm", "reduction"),
        ("aten.nll_loss_forward", "loss"),
        ("aten._scaled_dot_product_flash_attention", "attention"),
        ("aten.index_put_", "scatter"),
        ("aten._foreach_add_", "foreach"),
        ("aten._fused_adamw_", "optimizer"),
        ("aten.view", "view"),
        ("aten.empty_like", "metadata"),
        ("aten.cumsum", "opaque"),
        ("torchroof.column_partial", "column_reduction"),
    ],
)
def test_kinds_fusion_depends_on(packet, kind):
    assert kind_of(packet) == kind


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
    assert "torchroof_test.mystery.default x1" in text.coverage_line(est)
    assert est.to_dict()["uncounted"] == {"torchroof_test.mystery.default": 1}
    assert est.kernels[0].time_s == pytest.approx(4096 / 3.35e12)  # charged, not zero


@torch.library.custom_op("torchroof_test::tripled", mutates_args=())
def tripled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@tripled.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Rules registered in the test are gone after it: the registry is a copy until then."""
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


def _tripled_rule(op):
    """tripled: 1 FLOP per element, inputs read once, output written once (test op)."""
    read, written = io_bytes(op)
    return Cost(op.outputs[0].numel, read, written, "vector", op.outputs[0].dtype)


N = 1024 * 1024


@pytest.mark.parametrize(
    "kind, kernels, bytes_moved",
    [
        # one kernel reads x and writes the sum: (1 + 1) · 2 B · N
        ("pointwise", 1, 2 * 2 * N),
        # tripled reads x and writes y; the add reads y and x and writes the sum: 5 · 2 B · N
        ("opaque", 2, 5 * 2 * N),
    ],
)
def test_fusion_reads_the_kind_declared_at_registration(
    scratch_registry, kind, kernels, bytes_moved
):
    x = torch.empty(N, dtype=torch.bfloat16, device="meta")
    with torch.no_grad(), torchroof.trace() as t:
        torch.ops.torchroof_test.tripled(x) + x
    register("torchroof_test.tripled", kind=kind)(_tripled_rule)
    assert kind_of("torchroof_test.tripled") == kind
    fused = t.estimate("h100", fusion="fused")
    assert len(fused.kernels) == kernels
    assert fused.uncounted == {}
    assert fused.bytes == bytes_moved
    assert fused.flops == 2 * N  # one FLOP per element each, fused or not


def test_a_scratch_registration_is_undone(monkeypatch):
    with monkeypatch.context() as scratch:  # what the scratch_registry fixture does
        scratch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))
        register("torchroof_test.tripled", kind="pointwise")(_tripled_rule)
        assert kind_of("torchroof_test.tripled") == "pointwise"
    assert "torchroof_test.tripled" not in registered_packets()
    assert kind_of("torchroof_test.tripled") == "opaque"

"""Capture: op records, module paths, phases, .item() on meta, FakeTensor and CPU tensors,
and the JSON round trip of a trace."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torchroof.counters import cost_of

import torchroof
from torchroof import Trace


def _llama_forward(model, seq=16):
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids)
    return t


def test_records_carry_shapes_strides_dtypes_and_storage(tiny_llama):
    t = _llama_forward(tiny_llama)
    q_proj = next(
        op
        for op in t.ops
        if op.module == "model.layers.0.self_attn.q_proj" and op.name == "aten.mm.default"
    )
    x, w_t = q_proj.inputs
    assert x.shape == (16, 128) and x.dtype == "bfloat16"
    # the weight enters as a transposed view of the [128, 128] parameter: stride (1, 128)
    assert w_t.shape == (128, 128) and w_t.stride == (1, 128)
    assert t.parameters[w_t.storage] == "model.layers.0.self_attn.q_proj.weight"
    # the transpose view shares its storage with the parameter
    t_op = next(op for op in t.ops if op.name == "aten.t.default" and op.module.endswith("q_proj"))
    assert t_op.outputs[0].storage == t_op.inputs[0].storage


def test_module_paths_follow_execution_order(tiny_llama):
    t = _llama_forward(tiny_llama)
    proj_order = []
    for op in t.ops:
        if op.name == "aten.mm.default" and op.module not in proj_order:
            proj_order.append(op.module)
    assert proj_order[:7] == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert proj_order[-1] == "lm_head"
    assert all(op.phase == "forward" for op in t.ops)


def test_backward_ops_are_attributed_to_the_module_whose_forward_made_them(meta_lm):
    model = meta_lm("llama").train()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids, labels=ids).loss.backward()
    backward = [op for op in t.ops if op.phase == "backward"]
    assert backward, "backward ops must be recorded"
    # every Linear's backward is two matmuls: dX = dY·W and dW = dYᵀ·X
    q_proj_mms = [
        op
        for op in backward
        if op.module == "model.layers.1.self_attn.q_proj" and op.name == "aten.mm.default"
    ]
    assert len(q_proj_mms) == 2
    # backward runs in reverse: the last layer's gradients come before the first's
    first = next(i for i, op in enumerate(backward) if op.module.startswith("model.layers.1"))
    last = next(i for i, op in enumerate(backward) if op.module.startswith("model.layers.0"))
    assert first < last
    # the flash backward carries the attention module
    flash = [op for op in backward if "flash_attention_backward" in op.name]
    assert [op.module for op in flash] == ["model.layers.1.self_attn", "model.layers.0.self_attn"]
    # nothing in backward is left without a module except the loss (computed at top level)
    unattributed = {op.name for op in backward if op.module == ""}
    assert unattributed <= {
        "aten.ones_like.default",
        "aten.nll_loss_backward.default",
        "aten.detach.default",
        "aten._log_softmax_backward_data.default",
        "aten.view.default",
        "aten._to_copy.default",
    }


def test_backward_matmul_flops_are_twice_forward(meta_lm):
    model = meta_lm("llama").train()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids, labels=ids).loss.backward()

    def mm_flops(phase):
        return sum(
            cost_of(op).flops for op in t.ops if op.phase == phase and op.name == "aten.mm.default"
        )

    # every forward mm X·Wᵀ has two backward mms of the same size (dX and dW)
    assert mm_flops("backward") == 2 * mm_flops("forward")


def test_item_on_meta_is_answered_and_recorded():
    x = torch.empty(4, device="meta")
    with torchroof.trace() as t:
        flag = (x > 0).all().item()
        count = x.sum().item()
    assert flag is True and count == 1.0
    assert len(t.assumptions) == 2
    assert "item()" in t.assumptions[0].what and "True" in t.assumptions[0].what
    est = t.estimate("h100")
    assert any("answered" in a for a in est.assumptions)


def test_real_cpu_tensors_give_real_results_and_the_same_records():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    expected = torch.softmax(lin(x), -1)
    with torchroof.trace() as t:
        got = torch.softmax(lin(x), -1)
    torch.testing.assert_close(got, expected)
    names = [op.name for op in t.ops]
    assert "aten.addmm.default" in names and "aten._softmax.default" in names
    addmm = next(op for op in t.ops if op.name == "aten.addmm.default")
    assert cost_of(addmm).flops == 2 * 4 * 8 * 16 + 4 * 8
    assert addmm.module == ""  # the Linear is the root module here; its path is ""


def test_real_cpu_sdpa_values_unchanged_and_recorded_as_flash():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torchroof.trace() as t:
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, expected)
    assert [op.name for op in t.ops] == ["aten._scaled_dot_product_flash_attention.default"]


def test_fake_tensors_are_traced():
    with FakeTensorMode():
        lin = torch.nn.Linear(32, 64)
        x = torch.empty(8, 32)
        with torchroof.trace() as t:
            y = lin(x)
            flag = (y > 0).any().item()
    assert flag is True and len(t.assumptions) == 1
    addmm = next(op for op in t.ops if op.name == "aten.addmm.default")
    assert cost_of(addmm).flops == 2 * 8 * 64 * 32 + 8 * 64


def test_optimizer_step_is_recorded_in_the_optimizer_phase():
    lin = torch.nn.Linear(64, 64, device="meta")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    x = torch.empty(8, 64, device="meta")
    lin(x).sum().backward()
    opt.step()  # allocates the momentum buffers outside the trace
    with torchroof.trace() as t:
        lin(x).sum().backward()
        opt.step()
    phases = {op.phase for op in t.ops}
    assert phases == {"forward", "backward", "optimizer"}
    opt_ops = [op for op in t.ops if op.phase == "optimizer"]
    assert opt_ops and all(
        op.name.startswith("aten._foreach")
        or "add" in op.name
        or "mul" in op.name
        or "copy" in op.name
        for op in opt_ops
    )


def test_trace_json_round_trip_reestimates_on_other_hardware(tmp_path, tiny_llama):
    t = _llama_forward(tiny_llama, seq=64)
    path = tmp_path / "trace.json"
    t.save(path)
    loaded = Trace.load(path)
    assert len(loaded) == len(t)
    assert [op.to_json() for op in loaded.ops] == [op.to_json() for op in t.ops]
    assert loaded.parameters == t.parameters
    h100, a100 = t.estimate("h100"), loaded.estimate("a100")
    assert h100.flops == a100.flops and h100.bytes == a100.bytes
    # a memory-bound-dominated tiny model: A100's slower HBM makes it slower
    assert a100.time_s > h100.time_s
    again = loaded.estimate("h100")
    assert again.time_s == h100.time_s  # the same ops priced the same way, to the bit


def test_trace_loader_rejects_foreign_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"ops": []}')
    with pytest.raises(ValueError, match="not a torchroof trace"):
        Trace.load(path)

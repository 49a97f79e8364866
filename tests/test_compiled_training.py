"""Training bytes under ``fusion="fused"``, the policy torch.compile's Inductor refereed:
backward inputs charged, sibling fusion, save versus recompute, bare blocks, fusion across
the seam between blocks (fusion changes Q, never W; fusion is refereed by the compiler)."""

import pytest
import torch
import torch.nn.functional as F
from torchroof.counters import cost_of

import torchroof
from torchroof.config import PricingOptions
from torchroof.kernels.fusion import build_kernels


def _meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _kernels(trace, policy="fused"):
    kernels, _ = build_kernels(trace.ops, PricingOptions(fusion=policy), trace.roles)
    return [k for k in kernels if k.cost.flops or k.cost.bytes]


@pytest.mark.parametrize(
    ("forward", "backward_name"),
    [
        (lambda x: torch.softmax(x, -1), "aten._softmax_backward_data.default"),
        (lambda x: torch.log_softmax(x, -1), "aten._log_softmax_backward_data.default"),
        (torch.tanh, "aten.tanh_backward.default"),
        (torch.sigmoid, "aten.sigmoid_backward.default"),
    ],
)
def test_backward_reads_its_output_operand(forward, backward_name):
    # [1024, 1024] fp32: grad_output 4 MiB + output 4 MiB read, grad_input 4 MiB written
    x = _meta(1024, 1024, grad=True)
    with torchroof.trace() as t:
        forward(x).backward(_meta(1024, 1024))
    op = next(op for op in t.ops if op.name == backward_name)
    cost = cost_of(op)
    assert cost.bytes_read == 2 * 4 * 1024 * 1024 == 8_388_608
    assert cost.bytes_written == 4 * 1024 * 1024


def _swiglu(d=512, ff=1024):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=d, intermediate_size=ff)
    return LlamaMLP(config).to(device="meta", dtype=torch.bfloat16)


def test_a_bare_block_fuses_across_its_submodules():
    # silu lives in ``act_fn``, the mul in the MLP itself: one kernel, as inside ``layers.0``
    n, d, ff = 512, 512, 1024
    mlp, x = _swiglu(d, ff), _meta(n, d, dtype=torch.bfloat16)
    with torch.no_grad(), torchroof.trace() as t:
        mlp(x)
    kernels = _kernels(t)
    assert sorted(len(k.ops) for k in kernels) == [1, 1, 1, 2]  # gate, up, down, silu·up
    pointwise = next(k for k in kernels if len(k.ops) == 2)
    # reads gate and up, writes h: 3 · 2 B · n · ff
    assert pointwise.cost.bytes == 3 * 2 * n * ff == 3_145_728
    assert len(_kernels(t, "eager")) == 5


def test_swiglu_backward_is_one_sibling_fused_kernel_rebuilding_silu():
    # forward: gate = x·Wg, up = x·Wu, h = silu(gate)·up (one kernel), out = h·Wd
    # backward: g = dout·Wdᵀ; d_up = g·silu(gate) and d_gate = silu'(gate)·g·up read the
    # same g, gate and up: Inductor fuses them into one kernel that rebuilds silu(gate)
    n, d, ff = 512, 512, 1024
    mlp, x = _swiglu(d, ff), _meta(n, d, dtype=torch.bfloat16, grad=True)
    with torchroof.trace() as t:
        mlp(x).backward(_meta(n, d, dtype=torch.bfloat16))
    fused = _kernels(t)
    forward_pointwise = [k for k in fused if k.phase == "forward" and len(k.ops) > 1]
    backward_pointwise = [
        k for k in fused if k.phase == "backward" and k.cost.unit != "tensor" and len(k.ops) > 1
    ]
    # forward: silu(gate) is not saved: reads gate and up, writes h only (3 · 2 B · n · ff)
    assert [k.cost.bytes for k in forward_pointwise] == [3 * 2 * n * ff]
    # backward: one kernel reads g, gate, up; writes d_gate and d_up: 5 · 2 B · n · ff
    assert len(backward_pointwise) == 1
    assert backward_pointwise[0].cost.bytes == 5 * 2 * n * ff == 5_242_880
    # eager launches silu (reads gate, writes silu(gate) to save it: 2 · 2 B · n · ff), mul,
    # then mul, mul, silu_backward (each two reads and a write, 3 · 2 B · n · ff) and the add
    # of the two input gradients (3 · 2 B · n · d)
    eager = _kernels(t, "eager")
    eager_pointwise = [
        (k.phase, [op.name for op in k.ops], k.cost.bytes) for k in eager if k.cost.unit != "tensor"
    ]
    assert eager_pointwise == [
        ("forward", ["aten.silu.default"], 2 * 2 * n * ff),
        ("forward", ["aten.mul.Tensor"], 3 * 2 * n * ff),
        ("backward", ["aten.mul.Tensor"], 3 * 2 * n * ff),
        ("backward", ["aten.mul.Tensor"], 3 * 2 * n * ff),
        ("backward", ["aten.silu_backward.default"], 3 * 2 * n * ff),
        ("backward", ["aten.add.Tensor"], 3 * 2 * n * d),
    ]
    assert sum(k.cost.bytes for k in eager) > sum(k.cost.bytes for k in fused)
    assert sum(k.cost.flops for k in eager) == sum(k.cost.flops for k in fused)


def test_bf16_rmsnorm_saves_its_input_and_row_statistic_not_fp32_copies():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    n, d = 4096, 2048
    norm = LlamaRMSNorm(d).to(device="meta", dtype=torch.bfloat16)
    x = _meta(n, d, dtype=torch.bfloat16, grad=True)
    with torchroof.trace() as t:
        norm(x).backward(_meta(n, d, dtype=torch.bfloat16))
    forward = [k for k in _kernels(t) if k.phase == "forward"]
    # one kernel: reads x (2 B) and the weight, writes y (2 B) and the fp32 mean of squares
    # per row that backward rebuilds rsqrt from (4 B · n); eager also saves the fp32 upcast
    # (4 B) and the bf16 normalised copy (2 B)
    assert len(forward) == 1
    assert forward[0].cost.bytes == 2 * n * d + 2 * d + 2 * n * d + 4 * n
    eager_forward = sum(k.cost.bytes for k in _kernels(t, "eager") if k.phase == "forward")
    assert eager_forward > 2 * forward[0].cost.bytes


def test_rope_q_and_k_share_cos_and_sin_in_one_kernel():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, h, s, hd = 1, 8, 256, 64
    q, k = _meta(b, h, s, hd), _meta(b, h, s, hd)
    cos, sin = _meta(b, s, hd), _meta(b, s, hd)
    with torch.no_grad(), torchroof.trace() as t:
        apply_rotary_pos_emb(q, k, cos, sin)
    kernels = _kernels(t)
    assert len(kernels) == 1
    # reads q, k, cos, sin once; writes q', k': fp32
    qk = b * h * s * hd * 4
    assert kernels[0].cost.bytes == 2 * qk + 2 * b * s * hd * 4 + 2 * qk


def test_dependent_kernels_never_merge_as_siblings():
    # y = relu(x)·W and z = y + x: the add depends on relu through the matmul
    x, w = _meta(256, 256), _meta(256, 256)
    with torch.no_grad(), torchroof.trace() as t:
        y = F.relu(x) @ w
        _ = y + x
    assert [len(k.ops) for k in _kernels(t)] == [1, 1, 1]


def test_fusion_crosses_the_seam_between_blocks(meta_lm):
    # the residual add that ends layers.0 and the RMSNorm that starts layers.1 read and
    # write the same rows: one kernel under a whole-model compile
    model = meta_lm("llama", num_hidden_layers=2).eval()
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    with torch.no_grad(), torchroof.trace() as t:
        model(ids)
    modules = [
        {op.module.split(".")[2] for op in k.ops if "layers" in op.module} for k in _kernels(t)
    ]
    assert {"0", "1"} in modules


def test_split_factor_follows_inductor_outer_reduction_heuristic():
    from torchroof.kernels.column_reductions import mix_order, split_factor

    # 512 x 512: rows·cols = 262,144 < 32·132·2048 elements, split size 32 rows per thread
    # -> S = ceil(512 / (4·32)) = 4 (Inductor's partial buffer: 4 x 512 fp32 = 8,192 B)
    assert split_factor(512, 512) == 4
    # 8192 x 4096: 33.5 M elements; 1056 target blocks / 32 column blocks = 33;
    # ceil(8192 / (4·33)) = 63, nearest divisor of 8192 is 64 -> S = ceil(8192 / 256) = 32
    assert split_factor(8192, 4096) == 32
    assert split_factor(8192, 8448) == 1  # 132 SMs · 64 columns fill the device: no split
    assert mix_order(8192, 4096) and not mix_order(4096, 4096)  # rows >= 2·cols
    assert not mix_order(512, 512)  # < 4096 rows and < 5 Mi elements


@pytest.mark.parametrize(("rows", "hidden"), [(512, 512), (8192, 4096)])
def test_norm_weight_gradient_is_a_split_column_reduction(rows, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(hidden).to(device="meta", dtype=torch.bfloat16)
    x = _meta(rows, hidden, dtype=torch.bfloat16, grad=True)
    with torchroof.trace() as t:
        norm(x).backward(_meta(rows, hidden, dtype=torch.bfloat16))
    kernels = [(k.phase, k.cost.bytes_read, k.cost.bytes_written) for k in _kernels(t)]
    act, row, w = 2 * rows * hidden, 4 * rows, 2 * hidden  # bf16 x / dy, fp32 stat, bf16 w
    forward = ("forward", act + w, act + row)  # reads x, w; writes y and Σx² per row
    dx = ("backward", 2 * act + w + row, act)  # reads dy, x, w, the stat; writes dx
    if rows == 512:  # not mix-order: dW = Σ_rows dy·x̂ in a partial and a final kernel
        assert kernels == [
            forward,
            dx,
            ("backward", 2 * act + row, 4 * hidden * 4),  # S = 4 fp32 partial rows
            ("backward", 4 * hidden * 4, w),
        ]
        assert sum(r + wr for _, r, wr in kernels) == 3_695_616  # Inductor's, to the byte
    else:  # mix-order: the partial joins the dx kernel; the final is its own
        assert kernels == [
            forward,
            ("backward", 2 * act + w + row, act + 32 * hidden * 4),
            ("backward", 32 * hidden * 4, w),
        ]

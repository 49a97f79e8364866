"""A training step traced by hand (``loss.backward(); opt.step()`` under ``torchroof.trace()``)
on a plain ``nn.Module``: the optimizer step, its state and its memory, read from the trace.

The model throughout: Linear(64, 128) + Linear(128, 64), no bias, fp32, so
N = 2 · 64 · 128 = 16,384 parameters in P = 2 tensors of 8,192 elements (32,768 B each).
On meta ``torch.optim`` runs its single-tensor path (foreach needs CUDA tensors).
"""

from __future__ import annotations

import pytest
import torch

import torchroof
from torchroof import Trace

N = 2 * 64 * 128  # 16,384 parameters
P = 2  # parameter tensors, each with one fp32 step counter (4 B)
FUSED = "torchroof.fused_optimizer_step.default"


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _traced_steps(steps: int = 2, groups: bool = False, **optimizer: object) -> list[Trace]:
    """One trace per training step; the first allocates AdamW's state, later ones are the
    steady state."""
    model = MLP().to("meta")
    if groups:  # two parameter groups with different weight decay
        params: object = [
            {"params": [model.up.weight], "weight_decay": 0.1},
            {"params": [model.down.weight], "weight_decay": 0.0},
        ]
    else:
        params = model.parameters()
    opt = torch.optim.AdamW(params, **optimizer)
    x = torch.randn(8, 64, device="meta")
    traces = []
    for _ in range(steps):
        opt.zero_grad()
        with torchroof.trace() as t:
            loss = model(x).sum()
            loss.backward()
            opt.step()
        traces.append(t)
    return traces


@pytest.fixture(scope="module")
def first_and_steady() -> tuple[Trace, Trace]:
    first, steady = _traced_steps()
    return first, steady


def _optimizer(est):
    return [k for k in est.kernels if k.phase == "optimizer"]


def test_steady_adamw_fused_is_one_kernel_at_28_bytes_per_param(first_and_steady):
    _, steady = first_and_steady
    est = steady.estimate("h100-sxm", fusion="fused")
    step = _optimizer(est)
    assert [k.name for k in step] == [FUSED]  # one parameter group, one fused AdamW kernel
    # reads p, g, m, v (4 · 4 B) and writes p, m, v (3 · 4 B): 28 B/param ·16,384 = 458,752 B;
    # plus each step counter read and written (2 · (4 + 4) = 16 B), updated in the same kernel
    assert 28 * N == 458_752
    assert step[0].bytes == 458_752 + 16
    assert step[0].read_by == {
        "weights": 4 * N,  # 65,536
        "gradients": 4 * N,
        "optimizer_state": 8 * N + 4 * P,  # m, v: 131,072; steps: 8
    }
    # the moments are written back: 12 B/param, not the 4 B/param (p alone) of the bug
    assert step[0].written_by == {"weights": 4 * N, "optimizer_state": 8 * N + 4 * P}
    assert any("priced as 1 fused kernel(s)" in a for a in est.assumptions)
    assert not any("first step" in a for a in est.assumptions)


def test_steady_adamw_eager_prices_the_ops_as_launched(first_and_steady):
    _, steady = first_and_steady
    est = steady.estimate("h100-sxm", fusion="eager")
    step = _optimizer(est)
    assert FUSED not in {k.name for k in step}
    # per parameter: lerp_ writes m once, mul_ and addcmul_ write v twice: 3 · 4 B/param,
    # plus the two step counters' add_ (4 B each) = 196,608 + 8
    state_written = sum(k.written_by.get("optimizer_state", 0) for k in step)
    assert state_written == 3 * 4 * N + 4 * P
    assert any("per-parameter loop" in a for a in est.assumptions)


def test_each_parameter_group_is_one_fused_kernel():
    # different weight decay: two groups, two kernels; the bytes are still 28 B/param + 16
    (_, steady) = _traced_steps(groups=True)
    step = _optimizer(steady.estimate("h100-sxm"))
    assert [k.name for k in step] == [FUSED, FUSED]
    assert sum(k.bytes for k in step) == 458_752 + 16


def test_foreach_path_prices_the_same_fused_kernel():
    (_, steady) = _traced_steps(foreach=True)
    step = _optimizer(steady.estimate("h100-sxm"))
    assert [k.name for k in step] == [FUSED]
    # 458,752 + the step counters (16 B) + the tensor(1.0) the foreach add_ reads (4 B)
    assert step[0].bytes == 458_752 + 16 + 4


def test_first_step_states_its_state_initialisation(first_and_steady):
    first, _ = first_and_steady
    # zeros_like for m and v of both parameters: 4 · 8,192 · 4 B = 131,072 B written (the
    # step counters are torch.tensor(0.) constants lifted onto the trace, no device work)
    line = (
        "optimizer: first step traced: 131,072 B of state initialisation priced "
        "(4 tensors created in the step); trace a second step for the steady state"
    )
    eager = first.estimate("h100-sxm", fusion="eager")
    assert line in eager.assumptions
    zeros = [k for k in _optimizer(eager) if k.name == "aten.zeros_like.default"]
    assert len(zeros) == 4
    assert sum(k.bytes for k in zeros) == 131_072
    fused = first.estimate("h100-sxm", fusion="fused")
    assert line in fused.assumptions
    # the update itself is the steady-state kernel: it reads the freshly zeroed m and v
    assert [k.bytes for k in _optimizer(fused) if k.name == FUSED] == [458_752 + 16]


@pytest.mark.parametrize("which", [0, 1], ids=["first", "steady"])
@pytest.mark.parametrize("fusion", ["fused", "eager"])
def test_footprint_counts_gradients_and_optimizer_state(first_and_steady, which, fusion):
    memory = first_and_steady[which].estimate("h100-sxm", fusion=fusion).memory
    assert memory.weights_bytes == 4 * N  # 65,536
    assert memory.gradients_bytes == 4 * N  # the .grad AccumulateGrad wrote: 65,536
    # m and v (8 B/param = 131,072) and the two fp32 step counters (2 · 4 B): counted,
    # as fused=True keeps them on the device
    assert memory.optimizer_state_bytes == 8 * N + 4 * P == 131_080
    assert memory.total_bytes >= 16 * N + memory.activations_peak_bytes


def test_saved_trace_prices_the_same(first_and_steady, tmp_path):
    _, steady = first_and_steady
    steady.save(tmp_path / "step.json")
    again = Trace.load(tmp_path / "step.json").estimate("h100-sxm")
    est = steady.estimate("h100-sxm")
    assert again.bytes == est.bytes
    assert again.memory == est.memory


def test_mixed_precision_workload_is_left_as_it_was(meta_lm):
    # the workload route labels its own tensors; reading the trace adds nothing to it.
    # fp32 masters + bf16 copy (Micikevicius et al. 2018): 4 + 4 + 4 + 4 read, 4 + 4 + 4 + 2 written
    est = torchroof.estimate(meta_lm("llama"), "train", batch=1, seq=16, precision="mixed")
    params = est.metadata["parameters"]
    step = _optimizer(est)
    assert [k.name for k in step] == [FUSED]
    assert step[0].bytes == 30 * params
    memory = est.memory
    assert memory.weights_bytes == 2 * params  # the bf16 copy
    assert memory.gradients_bytes == 4 * params  # fp32 main gradients
    assert memory.optimizer_state_bytes == 12 * params  # fp32 masters, m, v
    assert not any(a.startswith("optimizer:") for a in est.assumptions)


def test_several_steps_in_one_trace():
    model = MLP().to("meta")
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 64, device="meta")
    with torchroof.trace() as t:
        for _ in range(3):
            opt.zero_grad()  # set_to_none: each step's backward makes new gradients
            model(x).sum().backward()
            opt.step()
    est = t.estimate("h100-sxm")
    fused = [k.bytes for k in _optimizer(est) if k.name == FUSED]
    assert fused == [458_752 + 16] * 3  # one kernel per step, each 28 B/param + counters
    # gradients are held one step at a time: 4 · 16,384 = 65,536, not three times that
    assert est.memory.gradients_bytes == 4 * N
    assert est.memory.optimizer_state_bytes == 8 * N + 4 * P

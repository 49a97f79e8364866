"""Adding a parallel strategy is one module exposing ``STRATEGY`` and one entry of
``torchroof.parallel.program.STRATEGIES``: a scratch strategy registered there is checked
before any model is built, applied after the real ones in the list's order for a traced
step (the step runs inside the context it returns), and its refusal is one line.

The model is the tiny Llama of test_parallel.py (4 heads, 2 KV heads), traced as rank 0 of
tp=2: each rank then holds 2 / 2 = 1 KV head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import PARALLEL_LLAMA
from transformers import LlamaConfig

import torchroof
from torchroof.config import WorkloadError
from torchroof.parallel import program
from torchroof.parallel.strategy import Strategy
from torchroof.parallel.tensor import KV_HEADS_PER_RANK

B, T = 2, 16
ORDER = ["tensor", "sequence", "expert", "fsdp", "context"]  # torchtitan's
REFUSAL = "the scratch strategy runs on an even batch, not batch=3"


def test_the_strategies_are_listed_once_in_torchtitans_order():
    assert [strategy.name for strategy in program.STRATEGIES] == ORDER


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What the strategies were asked to do, in order: each real one spied on, and a
    scratch one appended to the list."""
    calls: list[tuple[Any, ...]] = []

    def spy(strategy: Strategy) -> Strategy:
        def validate(workload: Any) -> None:
            calls.append(("validate", strategy.name))
            strategy.validate(workload)

        def apply(model: Any, mesh: Any, workload: Any) -> Any:
            calls.append(("apply", strategy.name))
            return strategy.apply(model, mesh, workload)

        return Strategy(strategy.name, validate, apply)

    def validate(workload: Any) -> None:
        calls.append(("validate", "scratch"))
        if workload.batch % 2:
            raise WorkloadError(
                f"the scratch strategy runs on an even batch, not batch={workload.batch}"
            )

    @contextlib.contextmanager
    def step() -> Iterator[None]:
        calls.append(("enter", "scratch"))
        yield
        calls.append(("exit", "scratch"))

    def apply(model: Any, mesh: Any, workload: Any) -> Any:
        # tensor parallel ran first: the model holds its rank's KV heads
        calls.append(("apply", "scratch", getattr(model, KV_HEADS_PER_RANK), mesh["tp"].size()))
        return step()

    scratch = Strategy("scratch", validate=validate, apply=apply)
    monkeypatch.setattr(program, "STRATEGIES", (*map(spy, program.STRATEGIES), scratch))
    return calls


def test_a_scratch_strategy_is_validated_then_applied_in_order(seen):
    trace = torchroof.trace_model(LlamaConfig(**PARALLEL_LLAMA), "prefill", batch=B, seq=T, tp=2)
    assert trace.ops
    validations = [("validate", name) for name in [*ORDER, "scratch"]]
    # checked before the model is built, and again as the parallel program begins
    assert seen[:12] == validations + validations
    assert seen[12:] == [
        *(("apply", name) for name in ORDER),
        ("apply", "scratch", 1, 2),  # 2 KV heads over tp=2: one each
        ("enter", "scratch"),
        ("exit", "scratch"),
    ]


def test_a_workload_the_scratch_strategy_refuses_is_one_line_before_building(seen):
    with pytest.raises(WorkloadError) as refused:
        torchroof.trace_model(LlamaConfig(**PARALLEL_LLAMA), "prefill", batch=3, seq=T, tp=2)
    assert str(refused.value) == REFUSAL
    assert "\n" not in str(refused.value)
    assert not [call for call in seen if call[0] == "apply"]  # nothing was built or sharded

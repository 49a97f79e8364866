"""The regime registry: one module per regime, nothing outside them tests a regime's name,
and a step that runs two models needs no change to the pipeline."""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from conftest import meta_causal_lm

import torchroof
from torchroof.capture.mode import Capture
from torchroof.config import Workload, WorkloadError, choices
from torchroof.workloads import REGIMES, TARGET, Regime, regime, run_workload
from torchroof.workloads.registry import REGIME_MODULES
from torchroof.workloads.spec import no_lines

PACKAGE = Path(torchroof.__file__).resolve().parent


def test_every_registered_regime_loads_under_its_own_name():
    assert REGIMES == ("prefill", "decode", "train")
    for name in REGIMES:
        assert regime(name).name == name
        assert REGIME_MODULES[name] == f"torchroof.workloads.{name}"


def test_tokens_and_positions_come_from_the_regime():
    # prefill and train process B·T tokens; decode one per sequence against its context,
    # and the context (not context + 1) is what is checked against the model's maximum
    assert Workload("prefill", batch=3, seq=10).tokens == 30
    assert Workload("train", batch=2, seq=10).tokens == 20
    decode = Workload("decode", batch=3, seq=10, context=50)
    assert decode.tokens == 3 and regime("decode").positions(decode) == 50
    assert regime("train").trains and not regime("prefill").trains


def test_an_unknown_regime_is_named_with_the_known_ones():
    with pytest.raises(WorkloadError, match="unknown regime 'serve'; choose one of prefill, "):
        Workload("serve")


def _regime_name_tests(path: Path, base: Path = PACKAGE.parent) -> list[str]:
    """Comparisons of anything with a regime's name (``x == "decode"``, ``in ("train",)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            names = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(n, ast.Constant) and n.value in REGIMES for n in names):
                found.append(f"{path.relative_to(base)}:{node.lineno}")
    return found


def test_no_module_outside_the_regimes_tests_a_regime_name():
    regime_modules = PACKAGE / "workloads"
    offenders = [
        where
        for path in sorted(PACKAGE.rglob("*.py"))
        if regime_modules not in path.parents
        for where in _regime_name_tests(path)
    ]
    assert offenders == []


def test_the_name_scan_sees_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(w):\n    return w.regime == "decode" or w in ("train",)\n')
    assert _regime_name_tests(probe, tmp_path) == ["probe.py:2", "probe.py:2"]


def _draft_then_verify(models: Mapping[str, torch.nn.Module], workload: Workload):
    """A two-model step: the draft proposes one token, the target reads it with the prompt.
    Each model's modules are named under its role."""
    capture = Capture()
    ids = torch.zeros(workload.batch, workload.seq, dtype=torch.long, device="meta")
    for role in ("draft", TARGET):
        capture.name_modules(models[role], role)
    with torch.no_grad(), capture as trace:
        models["draft"](ids, use_cache=False)
        models[TARGET](ids, use_cache=False)
    return trace


@pytest.fixture
def two_model_regime(monkeypatch):
    module = types.ModuleType("torchroof_test_two_models")
    module.REGIME = Regime(
        name="draft-verify",
        help="a draft and a target over the same tokens",
        trace=_draft_then_verify,
        tokens=lambda w: w.batch * w.seq,
        positions=lambda w: w.seq,
        compute_dtype=lambda w: torch.bfloat16,
        label=lambda model, w: f"{model} draft-verify",
        real_step=no_lines,
        roles=(TARGET, "draft"),
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(REGIME_MODULES, "draft-verify", module.__name__)
    monkeypatch.setitem(choices.REGIME_FACTS, "draft-verify", choices.RegimeFacts())
    return module.REGIME


def test_a_regime_with_a_draft_and_a_target_runs_through_the_same_pipeline(two_model_regime):
    target = meta_causal_lm("llama", num_hidden_layers=2).eval()
    draft = meta_causal_lm("llama", num_hidden_layers=1).eval()
    workload = Workload("draft-verify", batch=1, seq=16)
    trace = run_workload({TARGET: target, "draft": draft}, workload)
    assert trace.facts.tokens == 16 and trace.facts.workload.regime == "draft-verify"
    est = torchroof.Trace.of(trace).estimate("h100-sxm")
    modules = {k.module for k in est.kernels}
    # q_proj of 2 target layers and 1 draft layer, each under its role
    q_proj = sorted(m for m in modules if m.endswith("q_proj"))
    assert q_proj == [
        "draft.model.layers.0.self_attn.q_proj",
        "target.model.layers.0.self_attn.q_proj",
        "target.model.layers.1.self_attn.q_proj",
    ]
    with pytest.raises(WorkloadError, match="runs the models target, draft; given target"):
        run_workload(target, workload)

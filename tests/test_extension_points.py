"""The places a regime, a quantisation recipe or a pipeline schedule is added: config lists
the names and the facts its checks read (torchroof/config/choices.py), each owner defines
what they do, and the two agree; a scratch recipe and a scratch regime, registered for one
test, reach the checks, the registry and the trace."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from conftest import meta_causal_lm

from torchroof.config import Workload, WorkloadError, choices
from torchroof.parallel.pipeline import schedule
from torchroof.quant import recipes
from torchroof.workloads import prefill, run_workload, train
from torchroof.workloads.registry import REGIME_MODULES, regime
from torchroof.workloads.spec import Regime, no_lines


def test_each_regime_declares_the_facts_config_checks():
    assert tuple(REGIME_MODULES) == choices.REGIMES
    for name in choices.REGIMES:
        step, facts = regime(name), choices.REGIME_FACTS[name]
        assert (step.trains, step.knobs) == (facts.trains, facts.knobs), name
        for batch, seq, microbatches in ((1, 8, 1), (3, 16, 4)):
            w = Workload(name, batch=batch, seq=seq, microbatches=microbatches, pp=2)
            assert w.tokens == step.tokens(w) == facts.tokens(batch, seq, microbatches)


def test_the_owners_name_lists_are_configs():
    assert train.OPTIMIZERS == choices.OPTIMIZERS
    assert {r.name: r.trains for r in recipes.RECIPES.values()} == choices.RECIPE_TRAINS
    assert choices.QUANTS == (choices.NO_QUANT, *recipes.RECIPES)


def test_the_schedules_stages_per_rank_are_configs():
    assert tuple(schedule.SCHEDULES) == choices.PIPELINE_SCHEDULES
    for name in choices.PIPELINE_SCHEDULES:
        for virtual in (1, 2, 3):
            expected = schedule.stages_per_rank(name, virtual)
            assert choices.schedule_stages_per_rank(name, virtual) == expected
    for check in (schedule.stages_per_rank, choices.schedule_stages_per_rank):
        with pytest.raises(ValueError, match="unknown pipeline schedule 'x'; choose one of gpipe"):
            check("x", 1)


def _cast_weights(model: torch.nn.Module, filter_fn, trains: bool) -> None:
    """The scratch recipe: each accepted linear layer's weight stored as fp8 e5m2."""
    for fqn, module in model.named_modules():
        if filter_fn(module, fqn):
            module.weight = torch.nn.Parameter(
                module.weight.to(torch.float8_e5m2), requires_grad=False
            )


@pytest.fixture
def scratch_recipe(monkeypatch):
    recipe = recipes.Recipe(
        "e5m2-weight", False, True, "", "e5m2 weights (a scratch recipe)", _cast_weights
    )
    monkeypatch.setitem(recipes.RECIPES, recipe.name, recipe)
    monkeypatch.setitem(choices.RECIPE_TRAINS, recipe.name, recipe.trains)
    return recipe


def test_a_recipe_is_its_object_and_its_name_in_config(scratch_recipe, tiny_llama):
    assert "e5m2-weight" in choices.quant_names()
    assert Workload("decode", quant="e5m2-weight").quant == "e5m2-weight"
    # a serving recipe: a training step is refused, naming those it takes
    with pytest.raises(WorkloadError, match="a training step takes fp8, fp8-rowwise$"):
        Workload("train", quant="e5m2-weight")
    recipes.check_hardware("e5m2-weight", {"bf16": 1.0}, "A100")  # weight-only: any GPU
    quantised = recipes.quantize_model(tiny_llama, "e5m2-weight", trains=False)
    up = tiny_llama.model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.float8_e5m2
    assert tiny_llama.lm_head.weight.dtype == torch.bfloat16  # kept wide
    # 2 layers x (q, k, v, o, gate, up, down) = 14 linear layers inside the decoder
    assert quantised.layers == 14
    assert quantised.describe().endswith("e5m2 weights (a scratch recipe)")


def test_the_scratch_recipe_is_gone_after_its_test():
    assert "e5m2-weight" not in choices.quant_names()
    with pytest.raises(WorkloadError, match="unknown quant 'e5m2-weight'"):
        Workload(quant="e5m2-weight")


@pytest.fixture
def scratch_regime(monkeypatch):
    """A forward over B x seq tokens that keeps no cache: prefill's trace, no knobs."""
    module = types.ModuleType("torchroof_test_scratch_regime")
    module.REGIME = Regime(
        name="score",
        help="B x seq tokens through the model, no cache kept",
        trace=prefill.REGIME.trace,
        tokens=lambda w: w.batch * w.seq,
        positions=lambda w: w.seq,
        compute_dtype=lambda w: torch.bfloat16,
        label=lambda model, w: f"{model} score",
        real_step=lambda *_: no_lines,
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(REGIME_MODULES, "score", module.__name__)
    monkeypatch.setitem(choices.REGIME_FACTS, "score", choices.RegimeFacts())
    return module.REGIME


def test_a_regime_declares_what_it_reads(scratch_regime):
    assert regime("score") is scratch_regime
    workload = Workload("score", batch=2, seq=8)
    assert workload.tokens == 16 and not workload.trains
    # it reads no cache: a cache knob is refused, naming the steps that read it
    with pytest.raises(WorkloadError, match="applies to a prefill or decode step"):
        Workload("score", cache="dynamic")
    # it does not train: training sizes are refused, naming the step that does
    with pytest.raises(WorkloadError, match=r"fsdp=2 applies to a step that trains \(train\)"):
        Workload("score", fsdp=2)
    trace = run_workload(meta_causal_lm("llama").eval(), workload)
    assert trace.facts.tokens == 16 and trace.facts.workload.regime == "score"


def test_a_regime_whose_facts_disagree_is_caught(scratch_regime, monkeypatch):
    monkeypatch.setitem(choices.REGIME_FACTS, "score", choices.RegimeFacts(trains=True))
    with pytest.raises(AssertionError, match="disagree on 'score'"):
        regime("score")


def test_the_scratch_regime_is_gone_after_its_test():
    assert "score" not in REGIME_MODULES and "score" not in choices.REGIME_FACTS
    with pytest.raises(WorkloadError, match="unknown regime 'score'"):
        Workload("score")

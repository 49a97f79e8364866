"""Training layouts priced from shallow copies of the model (torchroof.planning.shallow): the
figures carried from copies with 2 and 3 layers equal the full model's, a search that
carries them finds the best plan a search at full depth finds and prices it at full depth,
and models whose layers differ are priced whole; on tests/conftest.py's small Llama with
12 layers (d = 128, 4 heads of 32, 2 K/V heads, MLP 352, vocab 1000)."""

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import small_llama
from transformers import Gemma2Config, Qwen2Config

from torchroof.cli.main import main
from torchroof.config import PricingOptions
from torchroof.planning import search, shallow
from torchroof.planning.layouts import TrainingLayout
from torchroof.planning.search import plan_training
from torchroof.planning.shallow import (
    alike_layers,
    offloaded,
    priced_from_copies,
    rank_memory,
    shallow_config,
    shallow_metrics,
)
from torchroof.prepared import prepare
from torchroof.report.compare import point_metrics

LAYERS = 12

# one layout of each kind of data and model split on 2 GPUs, with each recompute choice
LAYOUTS = [
    TrainingLayout(fsdp=2, batch=1, microbatches=2),
    TrainingLayout(dp=2, zero=1, batch=1, recompute="full"),
    TrainingLayout(tp=2, sequence_parallel=True, batch=2, recompute="selective"),
    TrainingLayout(cp=2, batch=1, microbatches=2, recompute="selective"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label())
def test_the_copies_carry_every_figure_to_the_full_depth(layout):
    config = small_llama(LAYERS)
    carried = shallow_metrics(config, layout, 128, "dgx-h100", {}, None, {})
    full = prepare(config, "train", seq=128, **layout.knobs()).metrics("dgx-h100")
    # f(12) = f(3) + 9 x (f(3) - f(2)): equal to the full model's step up to rounding
    figures = ("step_time_s", "exposed_communication_s", "mfu", "tokens_per_s")
    for name in (*figures, "tokens_per_s_per_gpu"):
        assert carried[name] == pytest.approx(full[name], rel=1e-6, abs=1e-12), name
    assert carried["weight_bytes"] == full["weight_bytes"]
    assert carried["kv_bytes"] == full["kv_bytes"] == 0
    assert carried["activation_bytes"] == pytest.approx(full["activation_bytes"], rel=1e-3)
    assert carried["memory_bytes"] == full["memory_bytes"]
    assert carried["fits"] == full["fits"] and carried["gpus"] == full["gpus"] == 2
    assert carried["shallow"] == [2, 3] and "shallow" not in full


# pipelines whose stages hold 8 layers (2 and 3 in the copies): 1F1B, interleaved 1F1B with
# two stages a rank (32 layers), FSDP beside the pipeline with selective recompute; 19
# layers over 2 stages, 10 and 9; and interleaved 1F1B over 20 layers, 4 stages of 5 (10
# a rank: carried from stages of 4 layers up, as 1F1B's of the same ranks)
PIPELINED = [
    (16, TrainingLayout(pp=2, batch=1, microbatches=4)),
    (32, TrainingLayout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)),
    (16, TrainingLayout(fsdp=2, pp=2, batch=1, microbatches=4, recompute="selective")),
    (19, TrainingLayout(pp=2, batch=1, microbatches=4)),
    (20, TrainingLayout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)),
]


def _named(value):
    return value.label() if isinstance(value, TrainingLayout) else f"{value} layers"


@pytest.mark.parametrize("layers, layout", PIPELINED, ids=_named)
def test_a_pipeline_is_carried_stage_by_stage(layers, layout):
    config = small_llama(layers)
    carried = shallow_metrics(config, layout, 128, "dgx-h100", {}, None, {})
    estimate = prepare(config, "train", seq=128, **layout.knobs()).price("dgx-h100")
    full = point_metrics(estimate)
    stages = 4 if layout.virtual_stages == 2 else 2
    # copies of 2 and 3 layers a stage, carried over layers // stages - 3 more; 19 layers
    # over 2 stages hold 10 and 9, so the copies 3 and 2, then 4 and 3: 2 x 2 + 1, 3 x 2 + 1
    extra = layers % stages
    assert carried["shallow"] == [2 * stages + extra, 3 * stages + extra]
    for name in ("step_time_s", "exposed_communication_s", "mfu", "tokens_per_s_per_gpu"):
        assert carried[name] == pytest.approx(full[name], rel=1e-6, abs=1e-12), name
    assert carried["weight_bytes"] == full["weight_bytes"]
    assert carried["activation_bytes"] == full["activation_bytes"]
    assert carried["memory_bytes"] == full["memory_bytes"]
    # each rank's floor (weights, gradients, optimizer state and the activations of the
    # micro-batches in flight) lies under its footprint, by the transients beside them
    for total, floor in rank_memory(estimate).values():
        assert 0 < floor <= total


def test_each_rank_carries_the_larger_of_its_footprint_and_its_floor(monkeypatch):
    # a 16-layer model over 2 stages: copies of 4 and 6 layers (2 and 3 a stage), carried
    # over 8 - 3 = 5 more layers a stage. Rank 0's footprint 10 -> 12 GB carries to
    # 12 + 5 x 2 = 22, its floor 9 -> 12 to 12 + 5 x 3 = 27 (its fullest moment changes
    # with the depth); rank 1's footprint 20 -> 21 to 26, its floor 5 -> 6 to 11: 27
    ranks = {4: [(10, 9), (20, 5)], 6: [(12, 12), (21, 6)]}

    class Copy:
        def __init__(self, config):
            self.layers = config.num_hidden_layers

        def price(self, *args, **kwargs):
            rows = [
                SimpleNamespace(rank=r, memory_bytes=m << 30, floor_bytes=f << 30)
                for r, (m, f) in enumerate(ranks[self.layers])
            ]
            step = SimpleNamespace(ranks=rows, slowest_rank=1)
            memory = SimpleNamespace(capacity_bytes=25 << 30)
            return SimpleNamespace(pipeline=step, memory=memory, layers=self.layers)

    def figures(estimate):
        k = estimate.layers
        return {
            name: float(k)
            for name in (
                "step_time_s",
                "exposed_communication_s",
                "weight_bytes",
                "kv_bytes",
                "activation_bytes",
                "tokens_per_s",
                "tokens_per_s_per_gpu",
                "mfu",
            )
        }

    monkeypatch.setattr(shallow, "prepare", lambda config, *a, **k: Copy(config))
    monkeypatch.setattr(shallow, "point_metrics", figures)
    layout = TrainingLayout(pp=2, batch=1, microbatches=4)
    carried = shallow_metrics(small_llama(16), layout, 128, "dgx-h100", {}, None, {})
    assert carried["memory_bytes"] == 27 << 30 and not carried["fits"]  # above 25 GiB
    assert carried["step_time_s"] == 6 + 5 * (6 - 4)  # 16 s: every figure on its line


def test_the_realistic_mode_is_carried_too():
    # launch overheads, achievable fractions and waves add the same to each layer's kernels
    config, layout = small_llama(LAYERS), TrainingLayout(dp=2, zero=1, batch=1)
    realistic = {"mode": "realistic"}
    carried = shallow_metrics(config, layout, 128, "dgx-h100", {}, None, realistic)
    prepared = prepare(config, "train", seq=128, **layout.knobs())
    full = prepared.metrics("dgx-h100", **realistic)
    assert carried["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    assert carried["mfu"] == pytest.approx(full["mfu"], rel=1e-9)
    roofline = prepared.metrics("dgx-h100")["step_time_s"]
    assert carried["step_time_s"] > roofline  # the realistic time, above the roofline


def test_which_layouts_are_carried_and_how_a_copy_is_cut():
    assert priced_from_copies(12, TrainingLayout(fsdp=2), {})
    assert not priced_from_copies(11, TrainingLayout(fsdp=2), {})  # as cheap to trace whole
    # a pipeline whose stages each hold 8 layers or more: 80 // (pp x v), the first
    # 80 % (pp x v) one more
    assert priced_from_copies(80, TrainingLayout(pp=2, microbatches=2), {})  # 40 a stage
    assert priced_from_copies(80, TrainingLayout(pp=8, microbatches=8), {})  # 10
    interleaved = TrainingLayout(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert priced_from_copies(80, interleaved, {})  # 8 stages of 10
    assert not priced_from_copies(80, TrainingLayout(pp=16, microbatches=16), {})  # 5
    # several stages a rank whose ranks hold 8 layers or more: stages of 4 or more, as
    # the same ranks' 1F1B copies (2 and 3 layers a stage), whose stages it shares
    assert priced_from_copies(80, replace(interleaved, pp=8), {})  # 16 stages of 5; 10 a rank
    assert priced_from_copies(64, replace(interleaved, pp=8), {})  # 4 a stage; 8 a rank
    three = replace(interleaved, pp=8, virtual_stages=3)  # 24 stages
    assert not priced_from_copies(72, three, {})  # 9 a rank, but 3 a stage
    assert priced_from_copies(48, replace(three, pp=4), {})  # 12 stages of 4; 12 a rank
    assert not priced_from_copies(80, replace(interleaved, pp=16), {})  # 5 a rank
    zero_bubble = TrainingLayout(pp=8, pp_schedule="zbv", virtual_stages=2)
    assert not priced_from_copies(80, zero_bubble, {})  # its backward split: other programs
    assert priced_from_copies(80, TrainingLayout(pp=3, microbatches=3), {})  # 27, 27, 26
    assert not priced_from_copies(80, TrainingLayout(pp=2), {"pp_split": (30, 50)})
    # every 2nd layer checkpointed: the figures step with the parity; fp8: the MFU's peak
    # is that of the dtype with the most FLOPs, which the depth can change
    assert not priced_from_copies(80, TrainingLayout(fsdp=2), {"checkpoint_every": 2})
    assert not priced_from_copies(80, TrainingLayout(fsdp=2), {"quant": "fp8"})
    assert priced_from_copies(80, TrainingLayout(fsdp=2), {"checkpoint_every": 1, "quant": "none"})
    # offloaded activations: a 2-layer copy cannot offload 4 layers' (priced whole)
    assert not priced_from_copies(
        80, TrainingLayout(fsdp=2), {}, offloaded(None, {"offload_activations": 4})
    )
    assert offloaded(PricingOptions(offload_activations=2), {}) == 2 and offloaded(None, {}) == 0
    assert offloaded(None, {"offload_activations": "two"}) == 0  # pricing says what is wrong
    config = Qwen2Config(num_hidden_layers=6, hidden_size=64, eos_token_id=list(range(6)))
    copied = shallow_config(config, 2)
    assert copied.num_hidden_layers == 2 and config.num_hidden_layers == 6
    assert copied.layer_types == ["full_attention"] * 2  # the per-layer list cut with it
    assert copied.eos_token_id == list(range(6))  # six token ids, not one a layer


def test_models_whose_layers_differ_are_priced_whole():
    assert alike_layers(small_llama(LAYERS)) is None
    # Gemma 2 alternates sliding-window and full attention layers
    gemma = Gemma2Config(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=256,
    )
    assert alike_layers(gemma) == "its decoder layers are not all alike"
    with torch.device("meta"):
        from torchroof.models.sources import build_model

        module = build_model(small_llama(LAYERS))
    whole = plan_training(
        module,
        2,
        seq=128,
        global_batch=2,
        space={"tp": (1,), "cp": (1,), "pp": (1,), "recompute": ("none",), "zero": (0,)},
    )
    assert whole.whole == "a module is traced as given"
    assert not any(plan.carried for plan in whole.ranked)


def test_a_carried_search_finds_the_best_and_prices_it_whole():
    # every layout of 2 GPUs without a pipeline: tp 2 or cp 2 with 2 x 1 or 1 x 2
    # micro-batches, fsdp 2, dp 2 with ZeRO 0, 1, 2: 8 layouts
    space = {"pp": (1,), "recompute": ("none",), "sequence_parallel": (False,)}
    args = (small_llama(LAYERS), 2, "dgx-h100")
    carried = plan_training(*args, seq=128, global_batch=2, space=space)
    whole = plan_training(*args, seq=128, global_batch=2, space=space, shallow=False)
    assert len(carried.ranked) == len(whole.ranked) == 8 and carried.whole is None
    assert whole.whole == "as asked (--whole, shallow=False)"
    best = carried.best
    assert not best.carried and best.layout == whole.best.layout
    assert best.metrics == whole.best.metrics  # the best priced at full depth, as a whole search
    assert sum(plan.carried for plan in carried.ranked) == 7
    assert carried.to_dict()["carried"] == 7 and whole.to_dict()["carried"] == 0
    assert carried.confirmed == 1 and whole.confirmed == 0
    by_layout = {plan.layout: plan for plan in whole.ranked}
    for plan in carried.ranked:
        assert plan.step_time_s == pytest.approx(by_layout[plan.layout].step_time_s, rel=1e-6)
        assert plan.memory_bytes == by_layout[plan.layout].memory_bytes
    # with confirm=0 nothing is priced again, and two processes carry the same floats
    unconfirmed = plan_training(*args, seq=128, global_batch=2, space=space, confirm=0, jobs=2)
    assert unconfirmed.to_dict()["carried"] == 8 and unconfirmed.best.carried
    assert unconfirmed.best.layout == best.layout
    assert unconfirmed.best.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
    kept = {plan.layout: plan.metrics for plan in carried.ranked if plan.carried}
    assert all(kept[p.layout] == p.metrics for p in unconfirmed.ranked if p.layout in kept)


def test_the_cli_says_what_was_carried_and_whole_prices_every_layout(tmp_path, capsys):
    model = tmp_path / "small"
    small_llama(LAYERS).save_pretrained(model)
    # 2 GPUs as data ranks only: fsdp 2, dp 2 with ZeRO 0, 1, 2: 4 layouts
    argv = ["plan", str(model), "--gpus", "2", "--seq", "128", "--global-batch", "2"]
    argv += ["--tp", "1", "--cp", "1", "--pp", "1", "--recompute", "none", "--quiet"]
    argv += ["--jobs", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # the fastest priced again at full depth, the other 3 carried
    assert (
        "3 priced from copies of the model with 2 and 3 layers (a stage, where pipelined), "
        "carried to its full depth (their memory within a few percent), 1 of the fastest "
        "priced again at full depth" in text
    )
    assert main([*argv, "--whole"]) == 0
    text = capsys.readouterr().out
    assert "every layout priced at full depth: as asked (--whole, shallow=False)" in text
    assert "priced from copies" not in text


def _carried(step_s: float) -> dict:
    return {"step_time_s": step_s, "memory_bytes": 1, "fits": True, "shallow": [2, 3]}


def test_a_confirmed_plan_that_no_longer_fits_or_fails_makes_way(monkeypatch):
    # carried: a 1.0 s, b 1.0 s (tied), c 2.0 s, d 3.0 s; at full depth a is over memory and
    # b fails, so the next round confirms c, which fits: d stays carried
    a, b, c, d = (TrainingLayout(fsdp=2, batch=n) for n in (1, 2, 3, 4))
    full = {
        a: {"step_time_s": 1.0, "memory_bytes": 9, "fits": False},
        b: "a refusal at full depth",
        c: {"step_time_s": 2.0, "memory_bytes": 2, "fits": True},
    }
    rounds = []

    def priced(jobs, processes=1, ray_address=None):
        assert not any(job.shallow for job in jobs)  # at full depth
        assert (processes, ray_address) == ((4, None) if len(jobs) > 1 else (1, None))
        rounds.append([job.layout for job in jobs])
        return [full[job.layout] for job in jobs]

    monkeypatch.setattr(search, "run_jobs", priced)
    ranked = [search.PricedPlan(x, _carried(t)) for x, t in ((d, 3.0), (c, 2.0), (b, 1.0))]
    ranked.insert(0, search.PricedPlan(a, _carried(1.0 + 1e-12)))  # a tie, up to rounding
    result = search.TrainingPlans(ranked, [], Counter(), 0)
    search._confirm("model", "dgx-h100", 128, ({}, None, {}), result, (4, None), 1)
    assert rounds == [[b, a], [c]]  # both tied plans at once (in a pool), then c here
    assert [plan.layout for plan in result.ranked] == [c, d]
    assert not result.ranked[0].carried and result.ranked[1].carried
    assert [plan.layout for plan in result.over_memory] == [a]
    assert result.failed == Counter({"a refusal at full depth": 1})
    assert result.confirmed == 3


def test_a_carried_plan_of_several_stages_a_rank_just_over_memory_is_priced_whole(
    monkeypatch,
):
    # a GPU of 100 bytes; carried: x (FSDP) 2.0 s in 50 fits; i, interleaved over 2 ranks
    # of 2 stages, 1.0 s in 103 (within 5%: such memory can lie above the full model's),
    # and j in 110 (beyond it), and o, 1F1B, 0.8 s in 101 (one stage a rank: its carried
    # memory is at most the full model's): the first round confirms x and i, which fits
    # at full depth (99) and now leads
    interleaved = TrainingLayout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)
    x, o = TrainingLayout(fsdp=2), TrainingLayout(pp=2)
    i, j = replace(interleaved, batch=2), replace(interleaved, batch=3)

    def carried(step_s, memory):
        return {"step_time_s": step_s, "memory_bytes": memory, "fits": memory <= 100}

    full = {x: carried(2.0, 50), i: carried(1.0, 99)}
    rounds = []

    def priced(jobs, processes=1, ray_address=None):
        rounds.append([job.layout for job in jobs])
        return [full[job.layout] for job in jobs]

    monkeypatch.setattr(search, "run_jobs", priced)
    plans = {
        p: {**carried(*m), "shallow": [2, 3]}
        for p, m in ((x, (2.0, 50)), (i, (1.0, 103)), (j, (0.5, 110)), (o, (0.8, 101)))
    }
    over = [search.PricedPlan(p, plans[p]) for p in (i, j, o)]
    result = search.TrainingPlans([search.PricedPlan(x, plans[x])], over, Counter(), 0)
    result.capacity_bytes = 100
    search._confirm("model", "dgx-h100", 128, ({}, None, {}), result, (1, None), 1)
    assert rounds == [[x, i]]
    assert [(plan.layout, plan.carried) for plan in result.ranked] == [(i, False), (x, False)]
    assert [plan.layout for plan in result.over_memory] == [j, o]
    assert result.confirmed == 2


def test_why_nothing_was_carried_is_said(monkeypatch):
    config = small_llama(LAYERS)
    flat = [TrainingLayout(fsdp=2)]
    assert search._why_whole(config, config, flat, {}) is None  # carried
    piped = [TrainingLayout(pp=2, microbatches=2)]  # 6 layers a stage
    assert search._why_whole(config, config, piped, {}) == (
        "every layout is pipelined with fewer than 8 layers a stage (4 under interleaved "
        "1F1B whose ranks hold 8)"
    )
    assert search._why_whole(small_llama(16), small_llama(16), piped, {}) is None
    assert search._why_whole(config, config, flat, {"quant": "fp8"}).startswith("a quantised")
    assert "fewer than 12 layers" in search._why_whole(small_llama(11), small_llama(11), flat, {})
    gemma = Gemma2Config(num_hidden_layers=12, hidden_size=64, intermediate_size=128)
    assert search._why_whole(gemma, gemma, flat, {}) == "its decoder layers are not all alike"

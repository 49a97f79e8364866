"""A prepared model (torchroof.prepare) and grids over several axes (torchroof.studies.
sweep_grid, ``torchroof sweep --over KEY=V1,V2``): a price equals a fresh estimate, a step
is traced once whatever it is priced on, and bad input is answered in one line."""

import csv
import json

import pytest

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.render.text import grid_tables
from torchroof.studies import sweep_grid


def same(a, b) -> bool:
    return json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_a_price_equals_a_fresh_estimate_and_shares_its_trace():
    prepared = torchroof.prepare("gpt2", "decode", context=64)
    h100 = prepared.price("h100-sxm", batch=4)
    a100 = prepared.price("a100-sxm", batch=4)
    realistic = prepared.price("h100-sxm", batch=4, mode="realistic")
    assert same(h100, torchroof.estimate("gpt2", "decode", context=64, batch=4))
    assert same(a100, torchroof.estimate("gpt2", "decode", context=64, batch=4, hardware="a100"))
    assert same(
        realistic, torchroof.estimate("gpt2", "decode", context=64, batch=4, mode="realistic")
    )
    # one step (batch 4, context 64) priced three ways: traced once, found twice, and
    # grouped into kernels once (the three share the kernel policy: fused, flash, ...)
    info = prepared.cache_info()
    assert (info.traced, info.reused, info.held, info.plans) == (1, 2, 1, 1)
    eager = prepared.price("a100-sxm", batch=4, fusion="eager")  # a second kernel policy
    fresh = torchroof.estimate(
        "gpt2", "decode", context=64, batch=4, fusion="eager", hardware="a100"
    )
    assert same(eager, fresh)
    assert prepared.cache_info().plans == 2
    assert same(prepared.price("a100-sxm", batch=4), a100)  # the first plan, kept
    # another size of the step: traced once more with its sizes as symbols, and this
    # point's trace made from that, equal to a fresh one
    batch8 = prepared.price("h100-sxm", batch=8)
    assert same(batch8, torchroof.estimate("gpt2", "decode", context=64, batch=8))
    info = prepared.cache_info()
    assert (info.traced, info.symbolic, info.substituted) == (1, 1, 1)
    # every further size it holds at is made, not traced
    batch6 = prepared.price("h100-sxm", batch=6, context=100)
    assert same(batch6, torchroof.estimate("gpt2", "decode", context=100, batch=6))
    info = prepared.cache_info()
    assert (info.traced, info.symbolic, info.substituted) == (1, 1, 2)


def test_each_price_makes_its_step_as_estimate_does():
    """Context left out follows seq at each price (not the prepared seq's), and a module is
    cast when a price asks for a dtype."""
    prepared = torchroof.prepare("gpt2", "decode", seq=64)
    longer = prepared.price(seq=128)
    assert longer.workload.context == 128
    assert same(longer, torchroof.estimate("gpt2", "decode", seq=128))
    from conftest import meta_causal_lm

    module = meta_causal_lm("llama")
    fp32 = torchroof.prepare(module, "prefill", seq=8).price(dtype="fp32")
    assert same(fp32, torchroof.estimate(module, "prefill", seq=8, dtype="fp32"))


def test_a_pipelined_step_priced_again_equals_a_fresh_estimate():
    """Each stage's kernels are kept: the second cluster prices the same stage plans."""
    from conftest import SMALL
    from transformers import LlamaConfig

    config = LlamaConfig(**{**SMALL, "num_hidden_layers": 4}, max_position_embeddings=64)
    knobs = dict(seq=32, batch=4, pp=2, microbatches=4)
    prepared = torchroof.prepare(config, "train", **knobs)
    first = prepared.price("dgx-h100")
    again = prepared.price("dgx-b200")
    assert first.pipeline is not None
    assert same(first, torchroof.estimate(config, "train", hardware="dgx-h100", **knobs))
    assert same(again, torchroof.estimate(config, "train", hardware="dgx-b200", **knobs))
    # one plan per distinct stage (two stages of two layers each: first and last differ)
    assert prepared.cache_info().plans == 2


def test_the_oldest_trace_is_dropped_past_max_traces():
    prepared = torchroof.prepare("gpt2", "decode", context=16, max_traces=1)
    prepared.price(batch=1)  # traced
    prepared.price(batch=2)  # the step's second size: traced with its sizes as symbols
    prepared.price(batch=1)  # dropped when batch 2 was made; a batch of 1 is another
    # symbolic trace (it broadcasts where larger batches do not)
    info = prepared.cache_info()
    assert (info.traced, info.reused, info.held, info.plans) == (1, 0, 1, 1)  # plans dropped too
    assert (info.symbolic, info.substituted) == (2, 2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: torchroof.prepare("gpt2", mode="realistic"), "pass them to PreparedModel.price"),
        (lambda: torchroof.prepare("gpt2", batchsize=2), "unknown option batchsize"),
        (lambda: torchroof.prepare("gpt2", max_traces=0), "max_traces must be a positive"),
        (lambda: torchroof.prepare("gpt2").price("h900"), "h900"),
        (lambda: torchroof.prepare("gpt2").price(bogus=1), "unknown option bogus"),
    ],
)
def test_bad_input_is_one_line(call, message):
    with pytest.raises((OptionError, ValueError, KeyError)) as error:
        call()
    text = str(error.value)
    assert message in text and "\n" not in text.strip()


def test_a_grid_prices_every_combination():
    """2 batches x 2 accelerators = 4 points, 2 traces (one per batch)."""
    grid = sweep_grid(
        "gpt2",
        {"batch": [1, 4], "hardware": ["h100-sxm", "a100-sxm"]},
        regime="decode",
        context=32,
    )
    assert [p.values for p in grid.points] == [
        {"batch": 1, "hardware": "h100-sxm"},
        {"batch": 1, "hardware": "a100-sxm"},
        {"batch": 4, "hardware": "h100-sxm"},
        {"batch": 4, "hardware": "a100-sxm"},
    ]
    fresh = torchroof.estimate("gpt2", "decode", batch=4, context=32, hardware="a100-sxm")
    assert same(grid.at(batch=4, hardware="a100-sxm"), fresh)
    text = grid_tables(grid)
    assert text.startswith("step ms: batch down, hardware across")
    row = text.splitlines()[4].split()  # batch 4's row: batch, the h100's and the a100's ms
    assert row == ["4", f"{grid.at(batch=4, hardware='h100-sxm').time_s * 1e3:.3f}",
                   f"{fresh.time_s * 1e3:.3f}"]  # fmt: skip


def test_a_grid_s_figures_equal_fresh_estimates():
    """An inference grid's points are priced from kernels planned once for every size
    (a batch of 1 with its own symbolic trace and plan): each point's figures are a
    fresh estimate's, to the last bit, and its estimate is made when asked for."""
    from conftest import small_llama

    from torchroof.report.compare import point_metrics

    config = small_llama(8)
    grid = sweep_grid(config, {"batch": [1, 2, 5], "context": [16, 300]}, regime="decode")
    for point in grid.points:
        fresh = torchroof.estimate(config, "decode", **point.values)
        assert point.metrics == point_metrics(fresh), point.values
    assert grid.notes == []
    assert same(
        grid.at(batch=5, context=300), torchroof.estimate(config, "decode", batch=5, context=300)
    )


def test_a_point_made_from_symbols_says_its_own_positions():
    """A symbolic trace taken past the model's maximum positions (allowed, with a note)
    makes points within them: those carry no note, as a fresh trace of them carries none."""
    from conftest import small_llama

    config = small_llama(8)  # 4,096 positions
    knobs = dict(allow_beyond_max_positions=True)
    prepared = torchroof.prepare(config, "decode", batch=3, context=5000, **knobs)
    prepared.price(batch=3, context=5000)
    beyond = prepared.price(batch=4, context=5001)  # the second size: traced on symbols
    within = prepared.price(batch=5, context=100)
    assert beyond.facts.positions and not within.facts.positions
    assert same(within, torchroof.estimate(config, "decode", batch=5, context=100, **knobs))
    assert prepared.cache_info().substituted == 2


def test_a_step_that_cannot_be_traced_on_symbols_is_priced_whole_and_says_why():
    from transformers import BloomConfig

    from torchroof.report.compare import point_metrics

    bloom = BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256)
    grid = sweep_grid(bloom, {"batch": [2, 3], "seq": [8, 16]}, regime="prefill")
    fresh = torchroof.estimate(bloom, "prefill", batch=3, seq=16)
    assert grid.points[3].metrics == point_metrics(fresh)
    assert len(grid.notes) == 1  # said once for the four points
    assert grid.notes[0] == (
        "4 points (the first batch=2, seq=16): traced at each size (the step does not trace "
        "on symbolic sizes: "
        "SymIntArrayRef expected to contain only concrete integers)"
    )


def test_grid_input_is_refused_before_tracing():
    with pytest.raises(ValueError, match="a grid of 6 points is more than max_points=5"):
        sweep_grid("gpt2", {"batch": [1, 2, 3], "context": [8, 16]}, max_points=5)
    with pytest.raises(ValueError, match="context: no values"):
        sweep_grid("gpt2", {"batch": [1], "context": []})
    with pytest.raises(ValueError, match="batch: a value is given twice"):
        sweep_grid("gpt2", {"batch": [1, 1]})
    with pytest.raises(ValueError, match="sweep over one of"):
        sweep_grid("gpt2", {"colour": [1]})
    with pytest.raises(ValueError, match="variant seq=0"):  # checked before any tracing
        sweep_grid("gpt2", {"batch": [1], "seq": [0]})
    # a size the step does not read: every point would be the same
    with pytest.raises(ValueError, match="a prefill step does not read context"):
        sweep_grid("gpt2", {"context": [8, 16]})
    with pytest.raises(ValueError, match="a decode step does not read seq"):
        sweep_grid("gpt2", {"seq": [8, 16]}, regime="decode", context=8)
    with pytest.raises(ValueError, match="a train step does not read context"):
        torchroof.sweep("gpt2", "context", [8, 16], regime="train")
    sweep_grid("gpt2", {"seq": [8, 16]}, regime="decode")  # context follows seq: it is read


def test_the_cli_sweeps_a_grid_to_csv_and_json(tmp_path, capsys):
    out_csv, out_json = tmp_path / "grid.csv", tmp_path / "grid.json"
    argv = ["sweep", "gpt2", "--regime", "decode", "--over", "batch=1,8", "--over",
            "context=16,32", "--csv", str(out_csv), "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "over batch (2) x context (2): 4 points" in printed
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["batch"], r["context"]) for r in rows] == [
        ("1", "16"), ("1", "32"), ("8", "16"), ("8", "32"),
    ]  # fmt: skip
    data = json.loads(out_json.read_text())
    assert data["axes"] == [
        {"key": "batch", "values": [1, 8]},
        {"key": "context", "values": [16, 32]},
    ]
    assert [p["step_time_s"] for p in data["points"]] == [float(r["step_time_s"]) for r in rows]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--over", "batch=1,2", "--values", "3"], "give every axis that way (no --values)"),
        (["--over", "batch=1", "--over", "batch=2"], "--over batch is given twice"),
        (["--over", "batch=1", "--over", "seq"], "give every axis that way"),
        # 11 x 10 = 110 points, past the page's 100: refused before anything is traced
        (
            ["--over", "batch=" + ",".join(map(str, range(1, 12)))]
            + ["--over", "context=" + ",".join(str(16 * i) for i in range(1, 11))]
            + ["--html", "x.html"],
            "a grid's page holds at most 100 points",
        ),
        (["--over", "batch=1,2", "--csv", "x.html"], "the suffix names another kind of output"),
        (["--over", "batch=1", "--plot", "x.png"], "a heat map needs two axes"),
        (["--over", "batch", "--json", "x.json"], "--json writes a grid"),
    ],
)
def test_cli_grid_errors_are_one_line(argv, message, capsys, monkeypatch):
    import torchroof.studies as studies

    def traced(*args, **kwargs):  # every refusal comes before any point is traced
        raise AssertionError("traced")

    monkeypatch.setattr(studies, "sweep_grid", traced)
    monkeypatch.setattr(studies, "sweep", traced)
    assert main(["sweep", "gpt2", *argv]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_compare_over_accelerators_shares_the_kernels_and_equals_fresh_estimates():
    """Three variants of one step (two accelerators, a timing mode) priced from one trace
    and its kernels: each variant's estimate is the fresh one of its settings, every field."""
    comparison = torchroof.compare(
        "gpt2",
        {"hardware": ["h100-sxm", "a100-sxm"], "mode": ["realistic"]},
        regime="decode",
        context=32,
    )
    assert len(comparison.variants) == 3
    for variant in comparison.variants:
        settings = dict(variant.settings)
        fresh = torchroof.estimate("gpt2", **settings)
        assert same(variant.estimate, fresh), variant.label


def test_the_kernel_policy_is_every_option_grouping_reads():
    """Grouping is handed the kernel policy alone (PricingOptions.kernels_only), so an
    option read in torchroof/kernels or the cost rules but left out of KERNEL_POLICY_FIELDS
    would be priced at its default: every ``options.<field>`` / ``pricing.<field>`` read
    there is in it."""
    import ast
    from dataclasses import fields
    from pathlib import Path

    from torchroof.config.pricing import KERNEL_POLICY_FIELDS, PricingOptions

    names = {f.name for f in fields(PricingOptions)}
    read = set()
    from torchroof import counters

    kernel_stage = [Path(torchroof.__file__).parent / "kernels", Path(counters.__file__).parent]
    # grouping in pricing/price.py (group_kernels, runtime_saves) reads the policy it was
    # handed under the name ``policy``
    grouping = [(p, ("options", "pricing")) for f in kernel_stage for p in f.glob("*.py")]
    grouping.append((Path(torchroof.__file__).parent / "pricing" / "price.py", ("policy",)))
    for path, holders in grouping:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in holders
                and node.attr in names
            ):
                read.add(node.attr)
    assert read == set(KERNEL_POLICY_FIELDS)


def test_a_rule_registered_after_a_price_is_read_by_the_next(monkeypatch):
    """Kept kernels are keyed on the rule registry's version: gpt2's Conv1D runs addmm;
    priced with no addmm rule it is uncounted, and once the rule is registered again the
    same prepared step counts it, as a fresh estimate does."""
    from torchroof.counters import registry as registry_module

    rules = dict(registry_module._REGISTRY)
    addmm = rules.pop("aten.addmm")
    monkeypatch.setattr(registry_module, "_REGISTRY", rules)
    prepared = torchroof.prepare("gpt2", "decode", context=16)
    assert "aten.addmm.default" in prepared.price().uncounted
    registry_module.register("aten.addmm", kind=addmm.kind)(addmm.rule)
    again = prepared.price()
    assert "aten.addmm.default" not in again.uncounted
    assert same(again, torchroof.estimate("gpt2", "decode", context=16))
    assert prepared.cache_info().plans == 2


def test_a_grid_page_embeds_every_point_at_its_place_on_each_axis(tmp_path):
    """2 batches x 2 contexts: the page's data holds four estimates, each the grid's own
    (its step time), and each point's index along each axis, the first axis slowest."""
    pytest.importorskip("plotly")
    from torchroof.render.html import grid_html

    grid = sweep_grid("gpt2", {"batch": [1, 8], "context": [16, 32]}, regime="decode")
    page = grid_html(grid, tmp_path / "grid.html")
    start = page.index('id="torchroof-data">') + len('id="torchroof-data">')
    data = json.loads(page[start : page.index("</script>", start)])
    assert data["kind"] == "grid"
    assert data["grid"]["axes"] == [
        {"key": "batch", "values": ["1", "8"]},
        {"key": "context", "values": ["16", "32"]},
    ]
    assert data["grid"]["points"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [e["time_s"] for e in data["estimates"]] == [p.estimate.time_s for p in grid.points]
    assert data["estimates"][3]["label"] == "batch=8, context=32"


def test_values_equal_as_numbers_are_one_value_of_an_axis():
    """1 and 1.0 are the same efficiency: a grid holding both could not find its points."""
    with pytest.raises(ValueError, match="compute_efficiency: a value is given twice"):
        sweep_grid("gpt2", {"compute_efficiency": [1, 1.0]}, regime="decode")


def test_a_prepared_model_prices_its_own_regime_and_makes_another():
    prepared = torchroof.prepare("gpt2", "decode", context=64)
    # a regime keyword other than the prepared one was once dropped silently (the decode
    # priced in its place): refused in one line, with the way to price it
    with pytest.raises(OptionError, match="prepared for decode steps, not prefill"):
        prepared.price(regime="prefill", seq=128)
    prefill = prepared.for_regime("prefill")
    assert prepared.for_regime("decode") is prepared
    assert same(prefill.price(seq=128), torchroof.estimate("gpt2", "prefill", seq=128))

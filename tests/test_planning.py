"""The training plan search (torchroof.plan, ``torchroof plan``): its enumeration counted by
hand, its best plan against an exhaustive loop of torchroof.estimate, its memory floor below
every priced footprint and pruning exactly where it says, and bad input in one line; on
tests/conftest.py's small Llama (d = 128, 4 heads of 32, 2 K/V heads, MLP 352, vocab 1000)."""

import itertools
import json
from collections import Counter

import pytest
from conftest import small_llama

import torchroof
from torchroof.cli.main import main
from torchroof.config.errors import OptionError
from torchroof.planning import TrainingLayout, TrainingSpace, enumerate_training
from torchroof.planning.memory_floor import LayerParameters, layer_parameters, memory_floor
from torchroof.planning.search import plan_training

# one decoder layer: q 128x128 + k, v 128x64 each + o 128x128 + gate, up, down 3 x 128x352
# + two norms of 128 = 16,384 + 16,384 + 16,384 + 135,168 + 256 = 184,576 parameters
LAYER = 184_576

# the smallest space with every family in it: 2 GPUs, 2 sequences a step, no recompute,
# no sequence parallel, 1F1B only
TWO_GPUS = {
    "recompute": ("none",),
    "sequence_parallel": (False,),
    "schedules": ("1f1b",),
    "max_micro_batch": 2,
}


def test_the_enumeration_counts_by_hand():
    # 8 GPUs, 16 sequences of 256 tokens, 4 layers; tp 4 and 8 split heads (2 K/V, 4 query),
    # pp 8 exceeds the layers. Data splits of D ranks: D=1: 1; D=2: fsdp, dp x zero 0/1/2 = 4;
    # D=4: those and HSDP 2x2 = 5; D=8: HSDP 2x4 and 4x2 too = 6. Micro-batches of 1 or 2.
    # pp 2: 1F1B and interleaved (2 x 2 = 4 stages); pp 4: 1F1B only (8 stages > 4 layers).
    # tp 1: cp1 (pp1 6x2 + pp2 5x2x2 + pp4 4x2) = 40, cp2 (5x2 + 4x2x2 + 1x2) = 28,
    #       cp4 (4x2 + 1x2x2) = 12, cp8 = 2: 82
    # tp 2 (with and without sequence parallel): cp1 (5x2 + 4x2x2 + 1x2) = 28,
    #       cp2 (4x2 + 1x2x2) = 12, cp4 = 2: 42 x 2 = 84
    space = TrainingSpace(gpus=8, seq=256, global_batch=16, recompute=("none",), max_micro_batch=2)
    found = enumerate_training(small_llama(4), space)
    assert len(found.layouts) == 82 + 84 == 166
    assert len(set(found.layouts)) == 166
    assert all(layout.gpus == 8 and layout.global_batch == 16 for layout in found.layouts)
    assert found.rejected == Counter(
        {
            "tp=4: num_key_value_heads=2 does not divide by tp=4: the column-wise k/v "
            "projections would split a head": 1,
            "tp=8: num_attention_heads=4 does not divide by tp=8": 1,
            "pp=8 exceeds the 4 decoder layers": 1,
            # (tp 1, cp 1), (tp 1, cp 2), (tp 2, cp 1) reach pp 4
            "pp=4 with 2 stages a rank (interleaved-1f1b) needs 8 stages, above the 4 "
            "decoder layers": 3,
        }
    )
    # every recompute choice multiplies the layouts
    three = enumerate_training(
        small_llama(4), TrainingSpace(gpus=8, seq=256, global_batch=16, max_micro_batch=2)
    )
    assert len(three.layouts) == 3 * 166


def test_choices_are_taken_once_and_what_cannot_apply_is_said():
    space = TrainingSpace(
        gpus=2, seq=64, global_batch=4, tp=(1,), cp=(1,), pp=(2,), ep=(2,), zero=(0,),
        schedules=("interleaved-1f1b",), virtual_stages=(1, 2, 2), recompute=("none", "none"),
        sequence_parallel=(False,), max_micro_batch=1,
    )  # fmt: skip
    assert space.recompute == ("none",) and space.virtual_stages == (1, 2)
    found = enumerate_training(small_llama(4), space)
    # one layout: pp 2 interleaved with 2 stages a rank, 4 micro-batches of 1
    assert [(layout.virtual_stages, layout.microbatches) for layout in found.layouts] == [(2, 4)]
    assert found.rejected["ep=2: the model has no routed experts to shard"] == 1
    assert any("at least 2 stages per rank" in reason for reason in found.rejected)


def test_micro_batch_sizes_given_are_the_only_ones_searched():
    """8 GPUs at tp 1, cp 1, pp 1, no recompute, 16 sequences a step: data splits of 8
    ranks = fsdp 8, dp 8 x zero 0/1/2, HSDP 2x4 and 4x2 = 6, each rank 2 sequences. Micro-
    batches of 2 only: 6 layouts of 1 micro-batch; of 1 and 4: 6 of 2 micro-batches, and 4
    is refused (it does not divide 2) once, for the one (tp, cp, pp) family."""
    base = dict(gpus=8, seq=256, global_batch=16, tp=(1,), cp=(1,), pp=(1,), recompute=("none",))
    two = enumerate_training(small_llama(4), TrainingSpace(**base, micro_batch=(2,)))
    assert [(lay.batch, lay.microbatches) for lay in two.layouts] == [(2, 1)] * 6
    mixed = enumerate_training(small_llama(4), TrainingSpace(**base, micro_batch=(1, 4)))
    assert [(lay.batch, lay.microbatches) for lay in mixed.layouts] == [(1, 2)] * 6
    reason = "a micro-batch of 4 sequences does not divide the 2 each data rank trains on"
    assert mixed.rejected == Counter({reason: 1})
    with pytest.raises(OptionError, match="micro_batch must list whole numbers >= 1"):
        TrainingSpace(**base, micro_batch=(0,))


def test_layouts_no_layout_can_price_are_said_as_failures():
    # Muon's step is not traced on sharded parameters yet: every layout fails when priced
    found = plan_training(
        small_llama(2), 2, "dgx-h100", seq=64, global_batch=2, optimizer="muon",
        space={**TWO_GPUS, "tp": (2,), "max_micro_batch": 1},
    )  # fmt: skip
    assert not found.ranked and sum(found.failed.values()) == 1
    with pytest.raises(OptionError, match="no layout could be priced: 1 failed"):
        _ = found.best


def test_checkpoint_every_narrows_the_recompute_the_search_chooses():
    """checkpoint_every=2 (every 2nd layer recomputed) goes with recompute: on 2 GPUs at
    tp 2 and one micro-batch, the one layout without recompute is refused with the
    workload's own reason and the one with full recompute is priced."""
    found = plan_training(
        small_llama(2), 2, "dgx-h100", seq=64, global_batch=1, checkpoint_every=2,
        space={**TWO_GPUS, "tp": (2,), "recompute": ("none", "full")},
    )  # fmt: skip
    assert [plan.layout.recompute for plan in found.ranked] == ["full"]
    (reason,) = found.rejected
    assert reason.startswith("checkpoint_every=2 chooses which layers activation checkpointing")


def test_knobs_only_some_layouts_take_are_searched_and_bad_ones_refused():
    """reduce_dtype needs ranks to reduce gradients over: on 2 GPUs the tp 2 and the pp 2
    layouts have none and are refused with the workload's reason; fsdp 2, dp 2 and cp 2
    (FSDP over the cp ranks) are priced. A precision no layout takes is refused before
    anything is searched."""
    found = plan_training(
        small_llama(2), 2, "dgx-h100", seq=64, global_batch=2, reduce_dtype="bf16",
        space={**TWO_GPUS, "tp": (1, 2), "zero": (0,), "max_micro_batch": 1},
    )  # fmt: skip
    assert sorted(plan.layout.label() for plan in found.ranked) == [
        "cp 2, batch 1 x 2 micro-batches",
        "dp 2, batch 1 x 1 micro-batches",
        "fsdp 2, batch 1 x 1 micro-batches",
    ]
    (reason,) = found.rejected
    assert reason.startswith("reduce_dtype=bf16 chooses what gradients are reduced")
    assert found.rejected[reason] == 2
    with pytest.raises(OptionError, match="precision"):
        plan_training(small_llama(2), 2, "dgx-h100", seq=64, global_batch=2, precision="fp7")


def test_a_global_batch_that_does_not_split_is_said():
    space = TrainingSpace(gpus=4, seq=64, global_batch=2, **TWO_GPUS)
    found = enumerate_training(small_llama(2), space)
    # 4 data ranks cannot share 2 sequences: every layout keeps at most 2 data ranks
    assert all(layout.data_ranks <= 2 for layout in found.layouts)
    assert (
        found.rejected["the global batch of 2 sequences does not split over 4 data-parallel ranks"]
        == 1
    )


def test_the_layer_parameters_count_by_hand():
    assert layer_parameters(small_llama(2)) == LayerParameters(2, 2 * LAYER)


def test_the_memory_floor_by_hand():
    counts = LayerParameters(2, 2 * LAYER)
    # mixed precision, AdamW: fp32 masters (4 B) + two fp32 moments (8 B) per parameter
    assert memory_floor(TrainingLayout(dp=2), counts) == 12 * 2 * LAYER
    assert memory_floor(TrainingLayout(fsdp=2), counts) == 12 * LAYER  # sharded over 2
    assert memory_floor(TrainingLayout(dp=2, zero=1), counts) == 12 * LAYER  # ZeRO shards them
    assert memory_floor(TrainingLayout(pp=2), counts) == 12 * LAYER  # one layer a stage
    # FSDP shards over the data and context ranks together: cp 2 holds half of each layer
    assert memory_floor(TrainingLayout(cp=2), counts) == 12 * LAYER
    assert memory_floor(TrainingLayout(dp=2, zero=1, cp=2), counts) == 12 * LAYER // 2
    # bf16 throughout: 2 B weights whole on each replica, moments 2 x 2 B sharded by ZeRO
    assert memory_floor(TrainingLayout(dp=2, zero=1), counts, "bf16") == 2 * 2 * LAYER + 4 * LAYER
    assert memory_floor(TrainingLayout(dp=2), counts, "mixed", "sgd") == 4 * 2 * LAYER


@pytest.fixture(scope="module")
def two_gpu_search():
    return plan_training(small_llama(2), 2, "dgx-h100", seq=128, global_batch=2, space=TWO_GPUS)


def test_the_best_plan_is_the_best_of_every_estimate(two_gpu_search):
    # every layout of 2 GPUs and 2 sequences, written out here as estimate knobs: tp 2, cp 2,
    # pp 2 (1F1B), fsdp 2, dp 2 with ZeRO 0, 1, 2; a single data rank takes its 2 sequences
    # as 1 x 2 or 2 x 1 micro-batches, two data ranks 1 each
    # (but 1F1B over 2 stages needs 2 micro-batches: torch refuses 1)
    loops = [{"pp": 2, "batch": 1, "microbatches": 2}]
    for name, batch in itertools.product(("tp", "cp"), (1, 2)):
        loops.append({name: 2, "batch": batch, "microbatches": 2 // batch})
    loops.append({"fsdp": 2, "batch": 1})
    for zero in (0, 1, 2):
        loops.append({"dp": 2, "zero": zero, "batch": 1})
    times = [
        torchroof.estimate(small_llama(2), "train", hardware="dgx-h100", seq=128, **knobs).time_s
        for knobs in loops
    ]
    search = two_gpu_search
    assert search.enumerated == len(loops) == 9 and not search.failed and not search.pruned
    assert len(search.ranked) == 9  # all fit in 80 GiB
    assert search.rejected == Counter(
        {
            "torch's Schedule1F1B refuses pp=2, 1 micro-batches and 2 stages: Number of "
            "microbatches (1) must be greater than or equal to the number of stages (2).": 1
        }
    )
    assert search.best.step_time_s == min(times)
    assert sorted(plan.step_time_s for plan in search.ranked) == sorted(times)
    assert [plan.step_time_s for plan in search.ranked] == sorted(times)  # fastest first


def test_processes_and_ray_give_the_same_plans(two_gpu_search):
    # each worker prices a layout from its own arguments: the same floats, in the same order
    pooled = plan_training(
        small_llama(2), 2, "dgx-h100", seq=128, global_batch=2, space=TWO_GPUS, jobs=2
    )
    assert pooled.to_dict() == two_gpu_search.to_dict()
    pytest.importorskip("ray", reason="the torchroof[ray] extra is not installed")
    on_ray = plan_training(
        small_llama(2),
        2,
        "dgx-h100",
        seq=128,
        global_batch=2,
        space=TWO_GPUS,
        jobs=2,
        ray_address="local",
    )
    assert on_ray.to_dict() == two_gpu_search.to_dict()


def test_the_front_keeps_only_plans_nothing_beats_on_both(two_gpu_search):
    front = two_gpu_search.pareto()
    assert front[0] is two_gpu_search.best
    for plan in two_gpu_search.ranked:
        beaten = any(
            other.step_time_s <= plan.step_time_s
            and other.memory_bytes < plan.memory_bytes
            or other.step_time_s < plan.step_time_s
            and other.memory_bytes <= plan.memory_bytes
            for other in two_gpu_search.ranked
        )
        assert (plan in front) == (not beaten)


def test_the_floor_is_below_every_priced_footprint(two_gpu_search):
    counts = layer_parameters(small_llama(2))
    for plan in two_gpu_search.ranked:
        assert memory_floor(plan.layout, counts) <= plan.memory_bytes, plan.layout.label()


SMALL_GPU = """\
name = "small-gpu"
hbm_bytes_per_s = { value = 3.35e12, source = "as an H100 SXM" }
hbm_capacity_bytes = { value = 4194304, source = "4 MiB, to make plans not fit" }
sfu_flops_per_s = { value = 1e13, source = "test" }
[tensor_flops_per_s]
bf16 = { value = 9.894e14, source = "as an H100 SXM" }
[vector_flops_per_s]
fp32 = { value = 6.7e13, source = "as an H100 SXM" }
"""
SMALL_BOX = """\
name = "small-box"
accelerator = "small-gpu.toml"
gpus_per_node = { value = 8, source = "test" }
[intra_node]
kind = "nvlink"
name = "NVLink 4"
line_bytes_per_s = { value = 4.5e11, source = "as a DGX H100" }
achieved_fraction = { value = 0.8, source = "test" }
latency_s = { value = 2.56e-5, source = "test" }
"""


@pytest.mark.filterwarnings("ignore:hbm_capacity_bytes")  # 4 MiB is meant
def test_plans_that_cannot_fit_are_pruned_or_kept_apart(tmp_path):
    (tmp_path / "small-gpu.toml").write_text(SMALL_GPU)
    box = tmp_path / "small-box.toml"
    box.write_text(SMALL_BOX)
    found = plan_training(small_llama(2), 2, box, seq=128, global_batch=2, space=TWO_GPUS)
    # floors at 4 MiB = 4,194,304 B: 12 B a parameter of the layers rank 0 holds
    # - dp 2 with ZeRO 0 holds both layers whole: 12 x 369,152 = 4,429,824 B > 4 MiB,
    #   pruned before pricing;
    # - the 8 others shard (fsdp, cp, tp, ZeRO) or stage them to 2,214,912 B and are
    #   priced, each over 4 MiB once its activations are counted
    assert found.pruned == 1 and len(found.over_memory) == 8 and not found.ranked
    with pytest.raises(OptionError, match="no layout fits: the least memory is"):
        _ = found.best


def test_the_cli_ranks_and_writes_json(tmp_path, capsys):
    model = tmp_path / "small"
    small_llama(2).save_pretrained(model)
    out = tmp_path / "plans.json"
    argv = ["plan", str(model), "--gpus", "2", "--seq", "128", "--global-batch", "2", "--jobs", "1"]
    argv += ["--recompute", "none", "--schedules", "1f1b", "--no-sequence-parallel"]
    argv += ["--max-micro-batch", "2", "--json", str(out), "--quiet"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "torchroof plan:" in text and "throughput vs memory front" in text
    data = json.loads(out.read_text())
    assert data["enumerated"] == 9 and data["priced"] == 9 and len(data["ranked"]) == 9
    # 2 GPUs: tp 2 splits 4 heads and 2 K/V heads, pp 2 two layers; torch's 1F1B refuses
    # 1 micro-batch over 2 stages
    assert list(data["rejected"]) == [next(iter(data["rejected"]))]
    assert "refuses pp=2, 1 micro-batches" in next(iter(data["rejected"]))
    assert data["ranked"][0]["step_time_s"] == min(p["step_time_s"] for p in data["ranked"])


def test_the_cli_draws_the_front_and_writes_the_best_plans_page(tmp_path):
    model = tmp_path / "small"
    small_llama(2).save_pretrained(model)
    png, page = tmp_path / "front.png", tmp_path / "best.html"
    argv = ["plan", str(model), "--gpus", "2", "--seq", "128", "--global-batch", "2", "--jobs", "1"]
    argv += ["--recompute", "none", "--schedules", "1f1b", "--no-sequence-parallel", "--quiet"]
    argv += ["--max-micro-batch", "2", "--tp", "1", "--plot", str(png), "--html", str(page)]
    argv += ["--json", str(tmp_path / "plans.json")]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the page is the best plan's own estimate: its title names the layout ranked first
    best = json.loads((tmp_path / "plans.json").read_text())["ranked"][0]["layout"]
    assert f"the best of the search, {best}" in page.read_text()


def test_the_cli_writes_the_best_plan_for_torchtitan(tmp_path):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    model = tmp_path / "small"
    small_llama(2).save_pretrained(model)
    job = tmp_path / "job.toml"
    argv = ["plan", str(model), "--gpus", "8", "--seq", "128", "--global-batch", "8", "--jobs", "1"]
    argv += ["--tp", "2", "--pp", "1", "--cp", "1", "--recompute", "none", "--quiet"]
    argv += ["--max-micro-batch", "1", "--emit", "torchtitan"]
    argv += ["--titan-model", "llama3:debugmodel", "-o", str(job)]
    assert main(argv) == 0
    written = tomllib.loads(job.read_text())
    # tp 2 leaves 4 data ranks for 8 sequences: 2 a rank, one at a time (2 micro-batches);
    # for torchtitan, sequence parallel only and no ZeRO-1/2, so the data ranks are all
    # replicas, all shards, or 2 x 2; whichever is fastest, they multiply to 4, the global
    # batch is 8, and no note about sequence parallel is written
    parallel = written["parallelism"]
    assert parallel["tensor_parallel_degree"] == 2
    assert parallel["data_parallel_shard_degree"] * parallel["data_parallel_replicate_degree"] == 4
    assert written["training"]["global_batch_size"] == 8 and written["training"]["seq_len"] == 128
    assert written["model"] == {"name": "llama3", "flavor": "debugmodel"}
    assert "sequence parallel" not in job.read_text()


def test_bad_input_is_one_line(capsys):
    cases = [
        (lambda: plan_training(small_llama(2), 2, seq=128), "give the global batch"),
        (
            lambda: plan_training(small_llama(2), 2, seq=128, tokens_per_step=200),
            "not a whole number of 128-token sequences",
        ),
        (lambda: plan_training(small_llama(2), 2, seq=128, global_batch=2, tp=2), "narrow it"),
        (lambda: TrainingSpace(gpus=0, seq=1, global_batch=1), "gpus must be a whole number"),
        (
            lambda: TrainingSpace(gpus=2, seq=1, global_batch=1, schedules=("x",)),
            "unknown pipeline",
        ),
        (
            lambda: TrainingSpace(gpus=2, seq=1, global_batch=1, recompute=("all",)),
            "recompute must",
        ),
        (lambda: torchroof.plan(small_llama(2), "decode"), "covers training layouts"),
        (lambda: torchroof.plan(small_llama(2), global_batch=2), "give gpus=N"),
        (
            lambda: plan_training(small_llama(2), 2, global_batch=2, checkpointing=True),
            "checkpointing: the search chooses it",
        ),
        (lambda: plan_training(small_llama(2), 2, global_batch=2, precision="fp8"), "fp8"),
        (lambda: plan_training(small_llama(2), 2, global_batch=2, space={"tpp": 1}), "not tpp"),
        (
            lambda: TrainingSpace(gpus=2, seq=1, global_batch=1, recompute="none"),
            "recompute takes a list of choices",
        ),
        (lambda: plan_training(small_llama(2), 2, global_batch=2, jobs=0), "jobs must be"),
        (  # a pricing option no layout could be priced with: refused once, not per layout
            lambda: plan_training(small_llama(2), 2, global_batch=2, offload_activations="two"),
            "^offload_activations counts decoder layers: an integer >= 0, got 'two'$",
        ),
        (
            lambda: plan_training(
                small_llama(2),
                64,
                seq=128,
                global_batch=64,
                space={"recompute": ("none",)},
                max_plans=5,
            ),
            "above max_plans=5",
        ),
    ]
    for call, message in cases:
        with pytest.raises(OptionError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    # a space with no layout the model runs: every family refused, said
    assert main(["plan", "gpt2", "--gpus", "3", "--global-batch", "1", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "no layout to price" in err and "tp=2 does not divide the 3 GPUs left for it" in err
    assert err.count("\n") == 1
    # --emit names checked before anything is traced
    assert main(["plan", "gpt2", "--gpus", "2", "--global-batch", "2", "--emit", "torchrun"]) == 2
    assert "give --titan-model NAME:FLAVOR" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--gpus", "2", "--global-batch", "2", "--emit", "x"]) == 2
    assert "invalid choice: 'x'" in capsys.readouterr().err


def test_the_cli_prices_in_a_process_per_worker_unless_told(monkeypatch, capsys):
    import torchroof.cli.plan as cli

    asked = []

    def searched(*args, **kwargs):
        asked.append(kwargs["jobs"])
        raise OptionError("stop here")

    monkeypatch.setattr(cli, "plan_training", searched)
    monkeypatch.setattr(cli, "worker_cap", lambda: 3)  # TORCHROOF_WORKERS, else the CPUs
    argv = ["plan", "gpt2", "--gpus", "2", "--global-batch", "2"]
    assert main(argv) == 2 and main([*argv, "--jobs", "1"]) == 2
    assert asked == [3, 1]
    assert "stop here" in capsys.readouterr().err

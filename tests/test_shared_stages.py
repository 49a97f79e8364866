"""Stage traces shared between pipelined layouts priced together
(torchroof.parallel.pipeline.shared, torchroof.planning.workers.price_group): a layout
priced beside another that traced the same stage programs gets the figures it gets priced
alone, the shared stages are counted by hand, and a search's jobs come back in order; on
tests/conftest.py's small Llama (d = 128, 4 heads of 32, 2 K/V heads, MLP 352, vocab 1000)."""

import pytest
import torch
from conftest import small_llama
from transformers import GPT2Config, LlamaForCausalLM

from torchroof.parallel.pipeline.shared import depthless_config, model_key, shared_stages
from torchroof.planning.layouts import TrainingLayout
from torchroof.planning.workers import (
    PricingJob,
    _groups,
    _in_order,
    price_group,
    price_layout,
    run_jobs,
    share_group,
)

ONE_F_ONE_B = TrainingLayout(pp=2, batch=1, microbatches=4)
INTERLEAVED = TrainingLayout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)


def _job(layout, layers=32, shallow=True):
    return PricingJob(small_llama(layers), layout, 128, "dgx-h100", {}, None, {}, shallow)


def test_a_layout_priced_beside_another_gets_what_it_gets_alone():
    # 32 layers: 1F1B over 2 stages holds 16 a stage, interleaved 1F1B 4 stages of 8, so
    # both are carried from copies with 2 and 3 layers a stage (4 and 6 layers for 1F1B,
    # 8 and 12 for interleaved). 1F1B traces its copies' first and last stages (2 + 2);
    # interleaved needs a first, a middle and a last stage of each copy (6), of which the
    # first and last of 2 and of 3 layers (4) are 1F1B's programs: 6 traced, 4 handed out
    alone = [price_layout(_job(ONE_F_ONE_B)), price_layout(_job(INTERLEAVED))]
    with shared_stages() as shared:
        together = [price_layout(_job(ONE_F_ONE_B)), price_layout(_job(INTERLEAVED))]
        assert (shared.traced, shared.reused) == (6, 4)
    assert together == alone
    assert together[0]["shallow"] == [4, 6] and together[1]["shallow"] == [8, 12]
    assert together[0]["step_time_s"] != together[1]["step_time_s"]  # not one layout twice


def test_stages_of_other_programs_are_not_shared():
    # FSDP over 2 ranks beside the pipeline: each stage's program gathers and reduces its
    # parameters' shards, so nothing of the plain pipeline's stages is handed out; and
    # outside a block each pricing traces its own
    with shared_stages() as shared:
        price_layout(_job(ONE_F_ONE_B))
        price_layout(_job(TrainingLayout(pp=2, fsdp=2, batch=1, microbatches=4)))
        assert (shared.traced, shared.reused) == (8, 0)
    assert price_group([_job(ONE_F_ONE_B)]) == [price_layout(_job(ONE_F_ONE_B))]


def test_a_config_without_its_depth():
    four, six = small_llama(4), small_llama(6)
    assert depthless_config(four) == depthless_config(six)
    six.layer_types = ["full_attention"] * 6  # one entry a layer, all alike: kept as one
    four.layer_types = ["full_attention"] * 4
    assert depthless_config(four) == depthless_config(six)
    four.layer_types = ["full_attention", "sliding_attention"] * 2  # entries that differ
    assert depthless_config(four) != depthless_config(six)
    gpt2 = [GPT2Config(n_layer=n, n_embd=64, n_head=4) for n in (2, 3)]  # its own name
    assert depthless_config(gpt2[0]) == depthless_config(gpt2[1])
    wider = small_llama(4)
    wider.intermediate_size = 704
    assert depthless_config(wider) != depthless_config(small_llama(4))


def test_jobs_are_grouped_by_what_their_stages_are_made_of_and_come_back_in_order():
    plain = TrainingLayout(fsdp=2, batch=1, microbatches=4)
    larger = TrainingLayout(fsdp=2, batch=2, microbatches=2)
    jobs = [_job(ONE_F_ONE_B), _job(plain), _job(INTERLEAVED), _job(larger)]
    assert share_group(INTERLEAVED) == share_group(ONE_F_ONE_B) != share_group(plain)
    assert share_group(plain) == plain  # without a pipeline, its own
    assert _groups(jobs) == [[0, 2], [1], [3]]
    # the groups' results as one sequence in the jobs' order: job 2 waits for job 1
    assert list(_in_order([[0, 2], [1], [3]], [["a", "c"], ["b"], ["d"]])) == list("abcd")
    with pytest.raises(ValueError):  # a group that lost a result is not silently short
        list(_in_order([[0, 2], [1]], [["a", "c"]]))


def test_a_search_prices_in_order_whatever_groups_it_makes():
    # the two pipelines one group, priced here and in a pool of two processes: each
    # layout's figures as priced alone, in the jobs' order
    jobs = [_job(ONE_F_ONE_B, 16), _job(TrainingLayout(batch=1, microbatches=4), 16)]
    jobs.append(_job(INTERLEAVED, 16))
    alone = [price_layout(job) for job in jobs]
    assert list(run_jobs(jobs)) == alone
    assert list(run_jobs(jobs, processes=2)) == alone


def test_a_parameter_sized_by_the_depth_keeps_two_depths_apart():
    # two depths of the small Llama have the same ends (embedding, final norm, head):
    # one key; a parameter outside the layers that grows with them (one entry a layer)
    # makes the two keys differ, so no stage of one stands for a stage of the other
    with torch.device("meta"):
        four, six = (LlamaForCausalLM(small_llama(n)) for n in (4, 6))
    assert model_key(four) == model_key(six)
    for model, layers in ((four, 4), (six, 6)):
        model.model.per_layer = torch.nn.Parameter(torch.empty(layers, device="meta"))
    assert model_key(four) != model_key(six)

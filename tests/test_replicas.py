"""A stage program over some data-parallel replicas carried to another number of them
(torchroof.parallel.replicas): held op for op to the program traced over them, its
all-reduce's group worked out by hand, refused where a group spanning the replicas is no
all-reduce or not all of them; and pipelines of several sizes over replicas of the same
shards priced together get what each gets alone, their stages counted by hand. On
tests/conftest.py's small Llama (d = 128, 4 heads of 32, 2 K/V heads, MLP 352, vocab 1000)."""

from dataclasses import replace

import pytest
from conftest import small_llama

from torchroof.config import Workload
from torchroof.parallel.pipeline.shared import shared_stages
from torchroof.parallel.replicas import _moved, regrouped, replica_free, replicated
from torchroof.planning.layouts import TrainingLayout
from torchroof.planning.workers import PricingJob, _groups, price_layout, share_group
from torchroof.prepared import prepare
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta

HSDP = (
    TrainingLayout(tp=2, pp=2, fsdp=2, dp=4, microbatches=4),
    TrainingLayout(tp=2, pp=4, fsdp=2, dp=2, microbatches=8),
)
DDP = (  # torch's replicate over the dp ranks: every parameter whole
    TrainingLayout(tp=2, pp=2, dp=8, microbatches=4),
    TrainingLayout(tp=2, pp=4, dp=4, microbatches=8),
)
HSDP_OVER_CP = (  # context parallel with sequence parallel: FSDP shards over the cp ranks
    TrainingLayout(tp=2, sequence_parallel=True, cp=2, pp=2, dp=4, microbatches=4),
    TrainingLayout(tp=2, sequence_parallel=True, cp=2, pp=4, dp=2, microbatches=8),
)


def _stages(layout):
    # 4 layers a stage whatever the pipeline's size: the stages run the same programs
    return prepare(small_llama(4 * layout.pp), "train", seq=128, **layout.knobs()).trace()


def _unplaced(op):
    """``op`` but where in the model it ran (its module, a profiler range's name)."""
    args = {k: v for k, v in op.args.items() if not (k == "name" and "model.layers" in str(v))}
    return (op.index, op.name, op.inputs, op.outputs, args, op.phase, op.synthetic)


def _spanning(trace):
    """The group of each collective that spans more than the ranks of one replica."""
    width = trace.facts.workload.parallel_plan.world // trace.facts.workload.dp
    return [
        op.args["group_ranks"]
        for op in trace.ops
        if any(rank >= width for rank in op.args.get("group_ranks", ()))
    ]


@pytest.mark.parametrize("layouts", [HSDP, DDP, HSDP_OVER_CP], ids=["hsdp", "ddp", "hsdp-cp"])
def test_a_stage_carried_to_other_replicas_is_the_stage_traced_over_them(layouts):
    more, fewer = (_stages(layout) for layout in layouts)
    for stage in (0, -1):  # the first stage (embedding) and the last (norm, head, loss)
        for source, traced in (
            (more.traces[more.traced_as[stage]], fewer.traces[fewer.traced_as[stage]]),
            (fewer.traces[fewer.traced_as[stage]], more.traces[more.traced_as[stage]]),
        ):
            carried = regrouped(source, traced.facts.workload)
            assert carried is not None and carried is not source
            # names, tensors, arguments and groups, op for op; the last stages hold layers
            # 4-7 of 8 and 12-15 of 16, which only their modules' names tell apart
            assert [_unplaced(op) for op in carried.ops] == [_unplaced(op) for op in traced.ops]
            assert stage == -1 or carried.ops == traced.ops
            assert (carried.roles, carried.role_bytes) == (traced.roles, traced.role_bytes)
            # one replica is 4 ranks (tp 2 x fsdp 2; tp 2 x cp 2) or 2 (DDP's tp 2), and rank
            # 0's replicas are its first rank and each replica's after it: 0, 4, 8, 12 over
            # four and 0, 4 over two; DDP's 0, 2, ..., 14 over eight and 0, 2, 4, 6 over
            # four. Only the gradients' all-reduces span them, one for each of the stage's
            # 4 layers and one for its ends (the embedding; the norm and the head)
            width = 2 if layouts is DDP else 4
            for trace in (source, carried):
                replicas = trace.facts.workload.dp
                spans = _spanning(trace)
                assert len(spans) == 5
                assert all(g == list(range(0, width * replicas, width)) for g in spans)
        assert regrouped(source, source.facts.workload) is source


def test_a_stage_is_not_carried_to_another_program():
    four = _stages(HSDP[0])
    source = four.traces[0]
    other = replace(source.facts.workload, dp=2, fsdp=4)  # shards of another size
    assert regrouped(source, other) is None
    assert regrouped(source, replace(source.facts.workload, dp=2, seq=64)) is None


def test_which_steps_are_carried_between_replicas():
    hsdp = Workload(regime="train", seq=128, tp=2, fsdp=2, dp=4)
    assert replicated(hsdp) and replica_free(hsdp) == Workload(
        regime="train", seq=128, tp=2, fsdp=2, dp=2
    )
    assert replicated(Workload(regime="train", seq=128, dp=8))  # DDP
    assert not replicated(Workload(regime="train", seq=128, dp=8, zero=1))  # shards by dp
    assert not replicated(Workload(regime="train", seq=128, fsdp=8))  # no replicas
    assert not replicated(Workload(regime="prefill", seq=128, dp=8))  # no gradients
    # FSDP2 divides fp16 gradients in kernels of its own, one fewer where a factor is 1
    assert not replicated(Workload(regime="train", seq=128, dp=8, precision="fp16"))


def _collective(name, ranks, tensor=(8,)):
    meta = TensorMeta(shape=tensor, stride=(1,), dtype="float32", storage=1)
    args = {"group_ranks": ranks, "group_size": len(ranks)}
    return OpRecord(0, name, (meta,), (meta,), args, "", "backward")


def test_a_group_spanning_the_replicas_is_carried_only_as_an_all_reduce_over_all_of_them():
    before, after = (1, 4, 2, 1, 2), (1, 2, 2, 1, 2)  # pp, dp, fsdp, cp, tp: strides 4 and 2
    all_reduce = "_c10d_functional.all_reduce.default"
    # within a replica (the fsdp ranks 0, 2): the same ranks
    assert _moved(_collective(all_reduce, [0, 2]), [0, 2], before, after) == [0, 2]
    # over the replicas: 0, 4, 8, 12 -> 0, 4; over replicas x fsdp: 0, 2, 4, ..., 14 -> 0..6
    assert _moved(_collective(all_reduce, [0, 4, 8, 12]), [0, 4, 8, 12], before, after) == [0, 4]
    spread = list(range(0, 16, 2))
    assert _moved(_collective(all_reduce, spread), spread, before, after) == [0, 2, 4, 6]
    # an all-gather's message grows with its group; a group of some of the replicas only
    gather = "_c10d_functional.all_gather_into_tensor.default"
    assert _moved(_collective(gather, [0, 4, 8, 12]), [0, 4, 8, 12], before, after) is None
    assert _moved(_collective(all_reduce, [0, 8]), [0, 8], before, after) is None


def _job(layout):
    return PricingJob(small_llama(32), layout, 128, "dgx-h100", {}, None, {}, True)


def test_pipelines_over_replicas_of_the_same_shards_priced_together_get_what_they_get_alone():
    # 32 layers from copies of 2 and 3 layers a stage: pp 2 traces the first and last
    # stages of each copy (4); pp 4 needs a first, a middle and a last of each (6), of
    # which the first and last (4) are pp 2's over other replicas: 6 traced, 4 carried
    alone = [price_layout(_job(layout)) for layout in HSDP]
    with shared_stages() as shared:
        together = [price_layout(_job(layout)) for layout in HSDP]
        assert (shared.traced, shared.reused, shared.carried) == (6, 4, 4)
    assert together == alone
    assert together[0]["step_time_s"] != together[1]["step_time_s"]


def test_pipelines_over_replicas_go_to_one_worker_and_shards_by_replicas_do_not():
    zero = [TrainingLayout(tp=2, pp=pp, dp=16 // pp, zero=1, microbatches=pp) for pp in (2, 4)]
    fsdp = [TrainingLayout(tp=2, pp=pp, fsdp=16 // pp, microbatches=pp) for pp in (2, 4)]
    unpipelined = TrainingLayout(tp=2, fsdp=2, dp=8, microbatches=2)
    layouts = [*HSDP, *zero, *fsdp, unpipelined]
    assert share_group(HSDP[0]) == share_group(HSDP[1])
    assert share_group(unpipelined) == unpipelined
    assert _groups([_job(layout) for layout in layouts]) == [[0, 1], [2], [3], [4], [5], [6]]

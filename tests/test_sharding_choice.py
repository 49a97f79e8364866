"""DTensor's choice of sharding on symbolic sizes, written down only where it matters
(torchroof/capture/sharding_choice.py): a split of a batch-long dimension over 8 ranks
needs batch >= 8; where the op chooses alike either way (the vocabulary-parallel
embedding of a decode) no decision is written, so one symbolic trace holds from a batch of
2 up; where the choice follows the answer (a matmul of a batch split over the ranks) the
decision is written as DTensor writes it. At every batch where the decisions hold, the
choice is the one DTensor makes on plain sizes."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from torchroof.api import trace_workload
from torchroof.capture.symbolic import SymbolicSizes
from torchroof.config import Workload
from torchroof.parallel.program import fake_process_group
from torchroof.symbolic import symbolic_point, trace_symbolic

RANKS = 8
MESHES = [(8,), (2, 4)]  # 8 ranks on one mesh dimension or two

# 8 heads and 8 KV heads, a vocabulary of 1024: every projection splits over 8 ranks
CONFIG = LlamaConfig(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=1024,
    max_position_embeddings=4096,
)


def _embed(batch, mesh):
    """A lookup of replicated token ids in a table of 64 rows split over every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ranks = mesh.ndim
    table = DTensor.from_local(torch.empty(8, 16), mesh, [Shard(0)] * ranks, run_check=False)
    ids = torch.zeros(batch, 1, dtype=torch.long)
    ids = DTensor.from_local(ids, mesh, [Replicate()] * ranks, run_check=False)
    return torch.nn.functional.embedding(ids, table)


def _multiply(batch, mesh):
    """Rows split over every rank times a replicated weight."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ranks = mesh.ndim
    rows = DTensor.from_local(torch.empty(batch, 16), mesh, [Replicate()] * ranks, run_check=False)
    weight = DTensor.from_local(torch.empty(16, 32), mesh, [Replicate()] * ranks, run_check=False)
    return torch.mm(rows.redistribute(mesh, [Shard(0)] * ranks), weight)


def _choices(step, shape):
    """(the decisions ``step`` writes down on a symbolic batch of 8, the placements it
    returns there, {batch: the placements it returns on plain sizes} for batches 2 to
    12), on a mesh of ``shape``."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(RANKS):
        mesh = init_device_mesh("cpu", shape)
        sizes = SymbolicSizes({"batch": RANKS})
        with sizes.active():
            placements = step(sizes.sizes["batch"], mesh).placements
        plain = {batch: step(batch, mesh).placements for batch in range(2, 13)}
        return sizes.guards(), placements, plain


def _holds(decisions, batch):
    return all(decision.at({"batch": batch}) for decision in decisions)


def test_an_embedding_that_never_splits_its_ids_decides_nothing_on_the_ranks():
    """The embedding lists a split of its (replicated) token ids over the 8 ranks, which
    it could take only where batch >= 8, but chooses the masked partial of its table at
    every batch: its decisions hold from 2 up, and at each batch its choice is the one on
    plain sizes."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    decisions, placements, plain = _choices(_embed, (RANKS,))
    assert all(_holds(decisions, batch) for batch in plain)
    assert all(isinstance(p, _MaskPartial) for p in placements)
    for chosen in plain.values():
        assert [type(p) for p in chosen] == [type(p) for p in placements]


@pytest.mark.parametrize("shape", MESHES)
def test_a_matmul_whose_choice_follows_the_length_decides_on_it(shape):
    """Rows split over the 8 ranks stay split where batch >= 8 and are gathered below:
    the decision is written down, holds at no batch below 8 (and at 8 only: the shards'
    own sizes are decided on too), and there the choice is the one on plain sizes (which
    below 8 is another)."""
    from torch.distributed.tensor import Shard

    decisions, placements, plain = _choices(_multiply, shape)
    assert any(  # batch >= 8, as DTensor writes it
        [decision.at({"batch": batch}) for batch in range(2, 100)] == [False] * 6 + [True] * 92
        for decision in decisions
    )
    held = [batch for batch in plain if _holds(decisions, batch)]
    assert held == [8]
    assert placements == (Shard(0),) * len(shape)
    assert all(plain[batch] == placements for batch in held)
    assert plain[4] != placements  # why the decision is needed


def test_the_length_test_answers_as_torch_s_on_plain_sizes():
    """On plain sizes the test is torch's: each dimension at least as long as the shards
    it is split into (the shards of both mesh dimensions where both split it, times a
    strided shard's split factor), a dimension the tensor has not got never split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._ops.utils import is_tensor_shardable
    from torch.distributed.tensor.placement_types import _StridedShard

    from torchroof.capture.sharding_choice import _Asked, _shardable

    with fake_process_group(RANKS):
        mesh = init_device_mesh("cpu", (2, 4))
        placements = [
            (Shard(0), Shard(0)),  # 8 shards of dim 0
            (Shard(0), Shard(1)),
            (Replicate(), Shard(1)),
            (Shard(2), Replicate()),  # a dimension a 2-d tensor has not got
            # 2 shards, each split 4 ways (at least 2 x 4 rows), then 8 shards of dim 0
            (_StridedShard(0, split_factor=4), Shard(0)),
        ]
        answers = []
        for chosen in placements:
            spec = DTensorSpec(mesh, chosen)
            for shape in [(1, 4), (2, 4), (4, 3), (7, 8), (8, 2), (16, 1), (32, 4)]:
                ours = _shardable(shape, spec, _Asked({}))
                assert ours == is_tensor_shardable(shape, spec)
                answers.append(ours)
        eight_rows = [False, False, False, False, True, True, True]
        assert answers[:7] == answers[28:] == eight_rows
        assert answers[7:14] == [False, True, False, True, False, False, True]  # 2 x 4
        assert answers[14:21] == [True, True, False, True, False, False, True]  # 4 columns
        assert answers[21:28] == [False] * 7


def test_torch_s_functions_come_back_after_a_capture_that_failed_or_was_nested():
    import torch.distributed.tensor._ops._matrix_ops as matrix_ops
    import torch.distributed.tensor._ops.utils as utils
    from torch.distributed.tensor import DTensor

    from torchroof.capture.sharding_choice import choices_on_open_sizes

    propagator = DTensor._op_dispatcher.sharding_propagator
    test = utils.is_tensor_shardable
    with pytest.raises(RuntimeError, match="the step failed"):
        with choices_on_open_sizes():
            inner_test = utils.is_tensor_shardable
            outer = propagator.propagate_op_sharding_non_cached
            with choices_on_open_sizes():
                assert propagator.propagate_op_sharding_non_cached is not outer
            assert propagator.propagate_op_sharding_non_cached is outer
            assert utils.is_tensor_shardable is inner_test is not test
            raise RuntimeError("the step failed")
    assert utils.is_tensor_shardable is test and matrix_ops.is_tensor_shardable is test
    assert "propagate_op_sharding_non_cached" not in vars(propagator)  # the class's own


def test_a_decode_at_tensor_parallel_8_traced_at_batch_8_holds_from_a_batch_of_2():
    """The decode's symbolic trace at batch 8 holds below the ranks too (batches 2 to 7
    were a second symbolic trace of their own), and each point made from it is the trace
    a fresh trace records, op for op."""
    decode = Workload(regime="decode", batch=RANKS, context=16, tp=RANKS)
    symbolic = trace_symbolic(CONFIG, decode)
    assert symbolic.holds({"batch": 2, "context": 16})
    assert not symbolic.holds({"batch": 1, "context": 16})  # a batch of 1 traces otherwise
    for batch in (3, 7, 9):
        point = replace(decode, batch=batch)
        made = symbolic_point(symbolic, CONFIG, point)
        fresh = trace_workload(CONFIG, point)
        assert made is not None and made == fresh and made.facts == fresh.facts

"""A traced training step keeps nothing of its model alive: autograd hooks and nodes that
held the model, the capture or the layers' activations (cycles through autograd's C++
nodes, which Python's collector does not see) are let go, so a search that traces
thousands of steps holds only their traces. On tests/conftest.py's small Llama (d = 128,
4 heads of 32, 2 K/V heads, MLP 352, vocab 1000)."""

import gc

import pytest
from conftest import small_llama

from torchroof.parallel.pipeline.workers import WORKERS_VARIABLE
from torchroof.prepared import prepare


def _models_alive():
    """LlamaForCausalLM models alive, FSDP2's subclasses of it included (``fully_shard``
    gives a module a class of its own, ``FSDPLlamaForCausalLM``)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__.endswith("LlamaForCausalLM"))


@pytest.mark.parametrize(
    ("knobs", "copied"),
    [
        # 8 layers on 2 stages of 4: each stage runs its first, second and last layers and
        # copies the third, whose autograd node held the job that reached its inputs, and
        # the last layer's node a hook that held its outputs; each stage's activations held
        # its graph (2 models kept before)
        ({"pp": 2, "fsdp": 2}, "3 traced, 1 copied"),
        # 4 stages of 2 layers, none copied: each stage's activations and the hook that
        # marks where its last layer's backward begins (3 distinct stages)
        ({"pp": 4, "fsdp": 2}, ""),
        # no pipeline: the copied layers alone, 3 of the 8 traced in each of the 3 micro-
        # batches run (the first, the second, the third held to it; the fourth a copy)
        # and 5 copied in each (1 model kept before)
        ({"fsdp": 2}, "9 traced, 15 copied"),
    ],
    ids=["pipeline-with-copies", "pipeline", "no-pipeline"],
)
def test_a_traced_step_keeps_no_model_alive(knobs, copied, monkeypatch):
    monkeypatch.setenv(WORKERS_VARIABLE, "1")  # every stage traced here, in this process
    before = _models_alive()
    trace = prepare(small_llama(8), "train", seq=128, microbatches=4, **knobs).trace()
    stages = getattr(trace, "traces", {0: trace})  # a pipeline's distinct stages, or the step
    assert all(len(stage.ops) > 100 for stage in stages.values())
    assert all(copied in stage.facts.repeated_layers for stage in stages.values())
    assert _models_alive() == before

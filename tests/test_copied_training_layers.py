"""Repeated layers copied in training steps across GPUs (torchroof.capture.replay_training):
under FSDP2 and HSDP, tensor and context parallelism and in pipeline stages, the copied
step is the step that runs every layer, op for op, and priced the same; what cannot be
copied runs every layer."""

import pytest
import torch
from conftest import small_llama
from torch import nn

import torchroof
from torchroof.capture.mode import Capture
from torchroof.capture.replay import LayerReplay
from torchroof.capture.replay_training import ReplayFallback, TrainingReplay
from torchroof.records.equality import first_difference


def full_and_copied(layers=8, regime="train", **knobs):
    """The small Llama's step under ``knobs``, every layer run and copied: (fulls, copies),
    one trace per distinct pipeline stage."""
    model = small_llama(layers)
    full = torchroof.trace_model(model, regime, seq=32, full_trace=True, **knobs)
    copied = torchroof.trace_model(model, regime, seq=32, **knobs)
    if isinstance(full, torchroof.PipelineTrace):
        return list(full.traces.values()), list(copied.traces.values())
    return [full], [copied]


def priced(trace):
    data = torchroof.estimate_trace(trace, "dgx-h100").to_dict()
    data["metadata"].pop("repeated_layers", None)
    data["metadata"]["workload"].pop("full_trace")
    return data


@pytest.mark.parametrize(
    "knobs",
    [
        dict(fsdp=2),
        dict(fsdp=4, reshard_after_forward=False),
        dict(dp=2, fsdp=2),  # HSDP
        dict(tp=2),
        dict(tp=2, fsdp=2),
        dict(cp=2, tp=2),
        dict(fsdp=2, checkpointing=False),
    ],
)
def test_a_training_step_across_gpus_copies_its_layers(knobs):
    """FSDP2's all-gathers and reduce-scatters are hooks around each layer, which run
    around a copy too; a tensor-parallel weight is a DTensor whose copy gets a DTensor
    gradient. Of 8 layers the first, the second (held to the first) and the last (whose
    backward is copied) run: 8 - 3 = 5 copies, and the step is the full one op for op
    (collectives, storages, phases), priced the same, every field."""
    (full,), (copied,) = full_and_copied(**knobs)
    assert first_difference(full, copied) == ""
    assert copied.facts.repeated_layers == "8 repeated layers, 1 distinct kind: 3 traced, 5 copied"
    assert priced(full) == priced(copied)
    # a fake parameter's device query is no work and is not recorded
    assert not any(op.name == "prim.device.default" for op in full.ops)


def test_a_pipeline_stage_copies_the_layers_it_owns():
    """pp 2 over 8 layers with FSDP and tensor parallel: each stage owns 4, of which 3 run
    and 1 is a copy (the other stage's layers are identities and are not counted); each
    stage's trace is the full one op for op."""
    fulls, copies = full_and_copied(pp=2, microbatches=4, fsdp=2, tp=2)
    assert len(copies) == 2
    for full, copied in zip(fulls, copies, strict=True):
        assert first_difference(full, copied) == ""
        assert copied.facts.repeated_layers == (
            "4 repeated layers, 1 distinct kind: 3 traced, 1 copied"
        )


def test_an_inference_pipeline_stage_counts_its_own_layers():
    """A decode stage of 4 owned layers: the first two run, two are copies (the other
    stage's 4 identity layers are not a kind of their own)."""
    fulls, copies = full_and_copied(regime="decode", pp=2, microbatches=2)
    for full, copied in zip(fulls, copies, strict=True):
        assert first_difference(full, copied) == ""
        assert copied.facts.repeated_layers == (
            "4 repeated layers, 1 distinct kind: 2 traced, 2 copied"
        )


@pytest.mark.parametrize(
    "knobs",
    [
        dict(tp=2, sequence_parallel=True),  # activations are DTensors
        dict(layers=16, pp=2, microbatches=4, pp_schedule="zbv"),  # 4 stages of 4 layers
    ],
)
def test_sequence_parallel_and_split_backward_steps_run_every_layer(knobs):
    """Sequence parallel hands layers DTensor activations, and a schedule that splits each
    backward in two runs each layer's backward twice: those steps run every layer, and are
    the full step."""
    fulls, copies = full_and_copied(**knobs)
    for full, copied in zip(fulls, copies, strict=True):
        assert first_difference(full, copied) == ""
        assert copied.facts.repeated_layers == ""


def test_a_stage_whose_backward_cannot_be_copied_runs_every_layer(monkeypatch):
    """Where a copied layer's backward turns out not to be copyable, the stage is traced
    again running every layer, and says why."""

    def refuse(self, key):
        raise ReplayFallback("a refusal made by this test")

    monkeypatch.setattr(TrainingReplay, "backward_of", refuse)
    fulls, copies = full_and_copied(pp=2, microbatches=4)
    for full, copied in zip(fulls, copies, strict=True):
        assert first_difference(full, copied) == ""
        assert copied.facts.repeated_layers == "every layer run: a refusal made by this test"


def test_a_layer_whose_output_a_submodule_made_is_not_copied_under_fsdp():
    """FSDP labels its hook ops with the module of the node that made the layer's output;
    BERT's output is its LayerNorm's, a copy's would be the layer's: not copied."""
    from torchroof.models.completions import default_config

    model = default_config("bert")
    model.num_hidden_layers = 4
    full = torchroof.trace_model(model, "train", seq=32, fsdp=2, full_trace=True)
    copied = torchroof.trace_model(model, "train", seq=32, fsdp=2)
    assert first_difference(full, copied) == ""
    assert copied.facts.repeated_layers == (
        "4 repeated layers, 1 distinct kind: 4 traced, 0 copied (a layer's output was made "
        "inside a submodule, where FSDP hooks it)"
    )


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, a, b):
        h = self.w1(a) + self.w2(b)
        return h, h * 2  # two outputs of two autograd nodes


def test_a_layer_with_outputs_of_several_nodes_is_refused():
    """Where such a layer's backward begins is not one node's start: its copies refuse
    (the step is then traced running every layer)."""
    with torch.device("meta"):
        layers = nn.ModuleList(TwoOutputs() for _ in range(6))
    a = torch.empty(4, 16, device="meta", requires_grad=True)
    b = torch.empty(4, 16, device="meta", requires_grad=True)
    with (
        Capture(),
        LayerReplay(list(layers), TrainingReplay(list(layers))),
        pytest.raises(ReplayFallback, match="several autograd nodes"),
    ):
        x, y = a, b
        for layer in layers:
            x, y = layer(x, y)
        (x.sum() + y.sum()).backward()

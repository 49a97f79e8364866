"""Micro-batches of a training step copied (torchroof.workloads.microbatches): on one GPU and
under FSDP2, HSDP, DDP, tensor, sequence and context parallelism, with and without
recompute, the step whose fourth micro-batch on are copies of the second is the step that
runs every micro-batch, op for op, and priced the same; a step whose micro-batches
accumulate differently runs each, and a third micro-batch that differs from the second
stops the copying."""

import pytest
import torch
from conftest import small_llama

import torchroof
from torchroof.capture.mode import Capture
from torchroof.capture.replay_training import ReplayFallback, TrainingReplay
from torchroof.config import Workload
from torchroof.config.errors import WorkloadError
from torchroof.records.equality import first_difference
from torchroof.workloads.microbatches import (
    alike_microbatches,
    alike_middle_microbatches,
    held_once,
    run_microbatches,
)


def full_and_copied(microbatches=5, **knobs):
    """The 4-layer small Llama's training step of ``microbatches`` micro-batches of one
    32-token sequence, every op run (``full_trace``) and as traced by default."""
    model = small_llama(4)
    full = torchroof.trace_model(
        model, "train", seq=32, microbatches=microbatches, full_trace=True, **knobs
    )
    copied = torchroof.trace_model(model, "train", seq=32, microbatches=microbatches, **knobs)
    return full, copied


def priced(trace):
    data = torchroof.estimate_trace(trace, "dgx-h100").to_dict()
    for note in ("repeated_layers", "repeated_microbatches"):
        data["metadata"].pop(note, None)
    data["metadata"]["workload"].pop("full_trace")
    return data


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(fsdp=2),
        dict(fsdp=2, dp=2),  # HSDP
        dict(dp=2),  # DDP
        dict(tp=2, sequence_parallel=True, fsdp=2),
        dict(cp=2, fsdp=2),
        dict(fsdp=2, checkpointing=True, checkpoint_policy="selective"),
    ],
)
def test_copied_microbatches_are_the_step_that_runs_them(knobs):
    """5 micro-batches: the first three run (the first is FSDP2's first gathers, the third
    is held to the second) and 5 - 3 = 2 are copies of the second; the trace is the full
    one op for op (storages, roles, role bytes, assumptions) and its estimate is the same
    in every field."""
    full, copied = full_and_copied(**knobs)
    assert first_difference(full, copied) == ""
    assert copied.facts.repeated_microbatches == "5 micro-batches: 3 traced, 2 copied"
    assert full.facts.repeated_microbatches == ""
    assert priced(full) == priced(copied)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(fsdp=2, defer_gradient_sync=True),  # one reduction, on the last
        dict(fsdp=2, precision="fp32"),  # the parameters' gradients accumulate
    ],
)
def test_microbatches_that_accumulate_otherwise_each_run(knobs):
    """Where one micro-batch leaves state the next one adds to, nothing is copied and the
    trace is the one every micro-batch ran (op count and every field priced)."""
    full, traced = full_and_copied(**knobs)
    assert not alike_microbatches(traced.facts.workload)
    assert traced.facts.repeated_microbatches == ""
    assert first_difference(full, traced) == ""
    assert priced(full) == priced(traced)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("microbatches, copied", [(5, 1), (7, 3)])
def test_zero_copies_the_middle_microbatches_and_runs_the_last(zero, microbatches, copied):
    """ZeRO-1/2 gathers the parameters in the first micro-batch and frees them in the
    last one's backward: the first three run (the third held to the second), the fourth
    to the one before the last are copies of the second (5 - 3 - 1 = 1, 7 - 3 - 1 = 3)
    and the last runs; the trace is the full one op for op and priced the same."""
    full, traced = full_and_copied(microbatches, dp=2, zero=zero)
    assert not alike_microbatches(traced.facts.workload)
    assert alike_middle_microbatches(traced.facts.workload)
    note = f"{microbatches} micro-batches: 3 and the last traced, {copied} copied"
    assert traced.facts.repeated_microbatches == note
    assert first_difference(full, traced) == ""
    assert priced(full) == priced(traced)


def test_four_zero_microbatches_are_each_traced():
    """Under ZeRO the first three and the last run: of four, none is copied."""
    full, traced = full_and_copied(4, dp=2, zero=2)
    assert traced.facts.repeated_microbatches == ""
    assert first_difference(full, traced) == ""


def test_three_microbatches_are_each_traced():
    """Three micro-batches are the three a copy needs run: none is copied, and the step is
    the full one."""
    full, copied = full_and_copied(microbatches=3, fsdp=2)
    assert copied.facts.repeated_microbatches == ""
    assert first_difference(full, copied) == ""


def test_a_layer_that_cannot_be_copied_leaves_the_microbatches_copied(monkeypatch):
    """Where a copied layer's backward turns out not to be copyable, the step is traced
    again running every layer, and its micro-batches are still copied (5 - 3 = 2): the
    step is the full one."""

    def refuse(self, key):
        raise ReplayFallback("a refusal made by this test")

    monkeypatch.setattr(TrainingReplay, "backward_of", refuse)
    full, copied = full_and_copied(fsdp=2)
    assert copied.facts.repeated_layers == "every layer run: a refusal made by this test"
    assert copied.facts.repeated_microbatches == "5 micro-batches: 3 traced, 2 copied"
    assert first_difference(full, copied) == ""


def _traced(microbatches, third_differs):
    """(the trace, the note, the micro-batches run) of ``microbatches`` micro-batches of
    three ops on meta: ``x`` made, ``weight * x`` (a weight made before), its sum; the
    third micro-batch (``third_differs``) adds instead of multiplying."""
    weight = torch.empty(8, device="meta")
    ran = []

    def run(micro):
        ran.append(micro)
        x = torch.empty(8, device="meta")
        y = weight + x if third_differs and micro == 2 else weight * x
        y.sum()

    capture = Capture()
    with capture as trace:
        note = run_microbatches(capture, Workload(regime="train", microbatches=microbatches), run)
    return trace, note, ran


def test_copies_get_fresh_storages_and_keep_those_from_before():
    """Of 6 alike micro-batches 3 run and 3 are copies of the second: 6 x 3 ops; each
    copy's own tensors (x, the product, the sum) are new storages, the weight made before
    the micro-batches is the same storage in every one."""
    trace, note, ran = _traced(6, third_differs=False)
    assert ran == [0, 1, 2]
    assert note == "6 micro-batches: 3 traced, 3 copied"
    made = ["aten.empty.memory_format", "aten.mul.Tensor", "aten.sum.default"]
    assert [op.name for op in trace.ops] == made * 6
    products = trace.ops[1::3]
    assert len({op.inputs[0].storage for op in products}) == 1  # one weight, read by all six
    assert len({op.inputs[1].storage for op in products}) == 6  # each micro-batch's own x
    assert len({op.outputs[0].storage for op in products}) == 6  # and product
    assert [op.index for op in trace.ops] == list(range(18))


def test_a_third_microbatch_unlike_the_second_stops_the_copying():
    """The third micro-batch adds where the second multiplied: every micro-batch runs and
    the note says where the third differed."""
    trace, note, ran = _traced(5, third_differs=True)
    assert ran == [0, 1, 2, 3, 4]
    assert len(trace.ops) == 15
    assert note == (
        "5 micro-batches, each traced: the third differs from the second (op 1 of the "
        "micro-batch, aten.add.Tensor: another op, phase or module)"
    )


def test_a_step_after_one_that_matched_runs_two_and_copies_the_rest():
    """Inside held_once, once a step's third micro-batch matched its second, the next
    step runs two of its 6 micro-batches and copies the second 6 - 2 = 4 times: the same
    6 x 3 ops, each copy with its own storages, as the first step's."""
    with held_once() as held:
        first, first_note, first_ran = _traced(6, third_differs=False)
        assert held.matched
        trace, note, ran = _traced(6, third_differs=False)
    assert (first_ran, first_note) == ([0, 1, 2], "6 micro-batches: 3 traced, 3 copied")
    assert (ran, note) == ([0, 1], "6 micro-batches: 2 traced, 4 copied")
    assert [op.name for op in trace.ops] == [op.name for op in first.ops]
    assert len({op.outputs[0].storage for op in trace.ops[1::3]}) == 6
    assert first_difference(first, trace) == ""


def test_a_step_after_one_whose_third_differed_holds_its_own():
    """Where the first step's third micro-batch differed (each of its 5 ran), nothing is
    trusted: the next step runs three and holds its third to its second."""
    with held_once() as held:
        _, note, ran = _traced(5, third_differs=True)
        assert not held.matched and ran == [0, 1, 2, 3, 4]
        _, note, ran = _traced(5, third_differs=False)
    assert (ran, note) == ([0, 1, 2], "5 micro-batches: 3 traced, 2 copied")


def test_a_step_whose_microbatches_each_run_still_holds_its_third():
    """Of 3 micro-batches (4 under ZeRO, whose last runs) none is copied, but the third is
    still held to the second: the next step runs 2 (and the last) and copies one. Under
    ZeRO with 3 the third is the last, held to nothing: nothing is trusted."""
    with held_once() as held:
        _, note, ran = _traced(3, third_differs=False)
        assert held.matched and (ran, note) == ([0, 1, 2], "")
        _, note, ran = _traced(3, third_differs=False)
    assert (ran, note) == ([0, 1], "3 micro-batches: 2 traced, 1 copied")
    with held_once() as held:
        _, note, ran = _traced(3, third_differs=True)
        assert not held.matched and ran == [0, 1, 2]
    with held_once() as held:
        _, note, ran = _zero_traced(4, last_reads_third=False)
        assert held.matched and (ran, note) == ([0, 1, 2, 3], "")
        _, note, ran = _zero_traced(4, last_reads_third=False)
    assert (ran, note) == ([0, 1, 3], "4 micro-batches: 2 and the last traced, 1 copied")
    with held_once() as held:
        _zero_traced(3, last_reads_third=False)
        assert not held.matched


@pytest.mark.parametrize(
    "microbatches, knobs, note",
    [
        (5, dict(fsdp=2), "5 micro-batches: 2 traced, 3 copied"),
        (5, dict(dp=2, zero=1), "5 micro-batches: 2 and the last traced, 2 copied"),
        (3, dict(fsdp=2), "3 micro-batches: 2 traced, 1 copied"),
        (4, dict(dp=2, zero=2), "4 micro-batches: 2 and the last traced, 1 copied"),
        (5, dict(tp=2, sequence_parallel=True, fsdp=2), "5 micro-batches: 2 traced, 3 copied"),
        (
            5,
            dict(fsdp=2, checkpointing=True, checkpoint_policy="selective"),
            "5 micro-batches: 2 traced, 3 copied",
        ),
    ],
)
def test_a_deeper_copy_after_a_shallower_one_is_the_step_that_runs_them(microbatches, knobs, note):
    """As a search prices copies of 2 and then 3 layers: the 3-layer step, its third
    micro-batch trusted from the 2-layer one's (of 5, 5 - 2 = 3 copies; under ZeRO the
    last runs too: 5 - 2 - 1 = 2; of 3, and of 4 under ZeRO, whose 2-layer step ran each,
    one), is the 3-layer step every micro-batch of which ran, op for op, and priced the
    same."""
    deeper = small_llama(3)
    step = dict(seq=32, microbatches=microbatches, **knobs)
    with held_once():
        torchroof.trace_model(small_llama(2), "train", **step)
        held = torchroof.trace_model(deeper, "train", **step)
    full = torchroof.trace_model(deeper, "train", full_trace=True, **step)
    assert held.facts.repeated_microbatches == note
    assert first_difference(full, held) == ""
    assert priced(full) == priced(held)


def _zero_traced(microbatches, last_reads_third, reads=2, ran=None):
    """(the trace, the note, the micro-batches run, into ``ran`` where given) of
    ``microbatches`` micro-batches of the three ops of :func:`_traced`, under ZeRO-2 (the
    last runs); the last also reads the product of the micro-batch run at index ``reads``
    (the third) where ``last_reads_third``."""
    weight = torch.empty(8, device="meta")
    ran = [] if ran is None else ran
    products = []

    def run(micro):
        ran.append(micro)
        x = torch.empty(8, device="meta")
        products.append(weight * x)
        if last_reads_third and micro == microbatches - 1:
            products[reads].sum()  # what a copy's own product stands for in the step
        else:
            products[-1].sum()

    capture = Capture()
    workload = Workload(regime="train", microbatches=microbatches, dp=2, zero=2)
    with capture as trace:
        note = run_microbatches(capture, workload, run)
    return trace, note, ran


def test_under_zero_the_middle_is_copied_and_the_last_runs():
    """Of 6 micro-batches the first three and the last run, 2 are copies of the second:
    6 x 3 ops in the step's order, the last's own storages after the copies' fresh ones."""
    trace, note, ran = _zero_traced(6, last_reads_third=False)
    assert ran == [0, 1, 2, 5]
    assert note == "6 micro-batches: 3 and the last traced, 2 copied"
    made = ["aten.empty.memory_format", "aten.mul.Tensor", "aten.sum.default"]
    assert [op.name for op in trace.ops] == made * 6
    products = trace.ops[1::3]
    assert len({op.outputs[0].storage for op in products}) == 6  # each its own product
    assert [op.index for op in trace.ops] == list(range(18))


def test_a_last_microbatch_that_reads_a_middle_ones_tensor_is_refused():
    """A last micro-batch that reads what the third made would read what the fifth made
    in the step, which a copy stands for: refused, in one line that says what to do."""
    with pytest.raises(WorkloadError, match="aten.sum.default touches a tensor a middle"):
        _zero_traced(6, last_reads_third=True)


def test_after_a_match_the_last_is_held_to_the_second_alone():
    """Under ZeRO after a step that matched, the first two and the last of 6 run (3
    copies); a last that reads the second's product is refused as before."""
    with held_once():
        _zero_traced(6, last_reads_third=False)
        _, note, ran = _zero_traced(6, last_reads_third=False)
        assert (ran, note) == ([0, 1, 5], "6 micro-batches: 2 and the last traced, 3 copied")
        ran = []
        with pytest.raises(WorkloadError, match="aten.sum.default touches a tensor a middle"):
            _zero_traced(6, last_reads_third=True, reads=1, ran=ran)
        assert ran == [0, 1, 5]  # the matched path: the third did not run


def test_after_a_match_a_full_trace_or_unlike_step_runs_each():
    """A match trusts copying, never forces it: after one, a step asked to run every
    micro-batch (``full_trace``) runs all 5, and so does one whose micro-batches
    accumulate otherwise (fp32)."""
    ran = []

    def run(micro):
        ran.append(micro)
        torch.empty(8, device="meta").sum()

    with held_once() as held:
        _traced(5, third_differs=False)
        for workload in (
            Workload(regime="train", microbatches=5, full_trace=True),
            Workload(regime="train", microbatches=5, precision="fp32"),
        ):
            ran.clear()
            capture = Capture()
            with capture as trace:
                assert run_microbatches(capture, workload, run) == ""
            assert ran == [0, 1, 2, 3, 4] and len(trace.ops) == 10
        assert held.matched


@pytest.mark.parametrize("refused", [False, True])
def test_a_deeper_step_with_copied_layers_after_a_shallower_one(monkeypatch, refused):
    """Models of 4 and then 5 layers, whose steps copy layers (the 2- and 3-layer copies
    of a search copy none): the 5-layer step, trusting the 4-layer one's third
    micro-batch, copies its layers in other places than the 4-layer one and is still the
    step that runs everything, op for op. Where a copied layer's backward cannot be
    copied (``refused``), each step is traced again running every layer, and the same
    holds."""
    if refused:

        def refuse(self, key):
            raise ReplayFallback("a refusal made by this test")

        monkeypatch.setattr(TrainingReplay, "backward_of", refuse)
    step = dict(seq=32, microbatches=5, fsdp=2)
    with held_once():
        shallow = torchroof.trace_model(small_llama(4), "train", **step)
        held = torchroof.trace_model(small_llama(5), "train", **step)
    full = torchroof.trace_model(small_llama(5), "train", full_trace=True, **step)
    assert shallow.facts.repeated_microbatches == "5 micro-batches: 3 traced, 2 copied"
    assert held.facts.repeated_microbatches == "5 micro-batches: 2 traced, 3 copied"
    every = "every layer run: a refusal made by this test"
    assert (held.facts.repeated_layers == every) == refused
    assert held.facts.repeated_layers != ""
    assert first_difference(full, held) == ""


def test_a_zero_step_whose_last_reads_a_middle_tensor_trusts_nothing():
    """Under ZeRO with 4 micro-batches each runs, so a last that reads the third's product
    is the step itself; but a later step would copy the third, so nothing is trusted: the
    next step runs three and its last is refused as without held_once."""
    with held_once() as held:
        _, note, ran = _zero_traced(4, last_reads_third=True)
        assert (ran, note, held.matched) == ([0, 1, 2, 3], "", None)
        ran = []
        with pytest.raises(WorkloadError, match="touches a tensor a middle"):
            _zero_traced(5, last_reads_third=True, ran=ran)
        assert ran == [0, 1, 2, 4]


def test_a_match_trusts_only_steps_of_the_same_workload():
    """A match on a step of 6 micro-batches trusts no step of 7 (another workload): that
    one runs three; the next step of 7 is trusted by it."""
    with held_once() as held:
        _traced(6, third_differs=False)
        _, note, ran = _traced(7, third_differs=False)
        assert (ran, note) == ([0, 1, 2], "7 micro-batches: 3 traced, 4 copied")
        assert held.matched.microbatches == 7
        _, note, ran = _traced(7, third_differs=False)
    assert (ran, note) == ([0, 1], "7 micro-batches: 2 traced, 5 copied")

"""The records' small facts, with the arithmetic beside each expected number."""

from __future__ import annotations

from torchroof.records.facts import BACKWARD_END, FORWARD_END, INPUT_END, StepFacts
from torchroof.records.tensors import TensorMeta, storage_extent_bytes
from torchroof.records.units import GIB, gib


def test_storage_extent_reaches_the_last_element_of_a_view() -> None:
    # a (4, 3) bf16 view with stride (8, 1) at offset 2: 2 + 3*8 + 2*1 + 1 = 29 elements, 2 B
    view = TensorMeta((4, 3), (8, 1), "bfloat16", storage=0, offset=2)
    assert storage_extent_bytes(view) == 29 * 2
    # an expanded (broadcast) dimension reaches no further: (1 + 0) elements of 4 B
    assert storage_extent_bytes(TensorMeta((5,), (0,), "float32", storage=1)) == 4
    assert storage_extent_bytes(TensorMeta((0, 3), (3, 1), "float32", storage=2)) == 0


def test_unique_bytes_read_a_broadcast_dimension_once() -> None:
    # (6, 4) fp16 expanded from (1, 4): 4 unique elements of 2 B
    assert TensorMeta((6, 4), (0, 1), "float16", storage=0).nbytes == 4 * 2


def test_gib_labels_bytes() -> None:
    assert GIB == 1024**3
    assert gib(80 * GIB) == "80.00 GiB"
    assert gib(GIB // 4) == "0.25 GiB"


def test_pipeline_marks_live_in_the_step_facts() -> None:
    marks = {FORWARD_END: 10, INPUT_END: 15, BACKWARD_END: 20}
    facts = StepFacts(pipeline={"marks": marks})
    assert StepFacts.from_dict(facts.to_dict()).pipeline["marks"] == marks
    assert (FORWARD_END, INPUT_END, BACKWARD_END) == ("forward_end", "input_end", "backward_end")

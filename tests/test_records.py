"""The records' small facts, with the arithmetic beside each expected number."""

from __future__ import annotations

import pytest

from torchroof.config import Workload
from torchroof.records.facts import (
    BACKWARD_END,
    FORWARD_END,
    INPUT_END,
    StageFacts,
    StageMarks,
    StepFacts,
)
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


def test_a_stage_trace_keeps_its_place_and_marks_through_a_save() -> None:
    marks = StageMarks(**{FORWARD_END: 10, INPUT_END: 15, BACKWARD_END: 20})
    stage = StageFacts(stage=1, stages=4, layers=(8, 16), marks=marks, activation_bytes=4096)
    saved = StepFacts(pipeline=stage).to_dict()
    assert saved["pipeline"]["layers"] == (8, 16) and saved["pipeline"]["marks"]["input_end"] == 15
    back = StepFacts.from_dict(saved).pipeline
    assert back == stage and back is not None and back.marks.backward_end == 20


def test_the_facts_hold_a_workload_saved_as_its_fields() -> None:
    workload = Workload("decode", batch=8, context=2048, tp=2)
    saved = StepFacts(workload=workload, tokens=8).to_dict()
    # saved flat, as a dict of every Workload field; read back as the same Workload
    assert saved["workload"] == workload.to_dict() and saved["workload"]["tp"] == 2
    back = StepFacts.from_dict(saved)
    assert back.workload == workload and back.workload.context == 2048
    # a step traced by hand has no workload, and none is written
    assert "workload" not in StepFacts(tokens=3).to_dict()
    assert StepFacts.from_dict({"tokens": 3}).workload is None
    with pytest.raises(ValueError, match=r"lacks: \['colour'\]"):
        StepFacts.from_dict({"workload": {**workload.to_dict(), "colour": "red"}})

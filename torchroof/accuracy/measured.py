"""The published measured runs the expected ranges are fitted on, as torchroof priced them.

Each run is one row of the runtime validation (``examples/runtime_validation.py``): a
published measurement of a training step, a prefill, a decode step or a single kernel, with
torchroof's pure-roofline and realistic predictions of the same work under the software
that ran it. ``examples/expected_ranges.py --write`` copies them, with the publication each
came from and the features a step is grouped by, into ``measured_runs.json`` beside this
module, so that an installed torchroof carries them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any

MODES = ("roofline", "realistic")
"""The timing modes a range is fitted for: measured / predicted in each."""

STEP_KINDS = ("train", "prefill", "decode")
"""The kinds of model step; a kernel microbenchmark is ``kernel``."""

KIND_NAMES = {
    "train": "training steps",
    "prefill": "prefills",
    "decode": "decode steps",
    "kernel": "kernel benchmarks",
}


@dataclass(frozen=True)
class MeasuredRun:
    """One published measurement and torchroof's two predictions of the same work."""

    run: str  # the run's id in examples/validation/*_runs.json
    source: str  # the publication or repository it came from (one source per document)
    kind: str  # train, prefill, decode or kernel
    benchmark: str  # a kernel's: gemm, attention, stream or latency ("" for a model step)
    runtime: str  # the software that ran it (a runtime profile name; none for kernels)
    accelerator: str  # the GPU's spec name (hardware/*.toml)
    hardware: str  # what it was priced on: the GPU's spec or a cluster's name
    gpus: int  # GPUs in the measured job
    quant: str  # the quantisation recipe (none where the weights keep the model's dtype)
    measured_s: float  # the measured time of the work, in seconds
    roofline_s: float  # torchroof's pure-roofline prediction of it
    realistic_s: float  # torchroof's realistic prediction under the run's runtime

    def predicted_s(self, mode: str) -> float:
        return self.roofline_s if mode == "roofline" else self.realistic_s

    def correction(self, mode: str) -> float:
        """measured / predicted in ``mode``: what the estimate must be multiplied by."""
        return self.measured_s / self.predicted_s(mode)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@cache
def shipped_data() -> dict[str, Any]:
    """``measured_runs.json`` as shipped: its runs, its fit and its evaluation."""
    text = resources.files("torchroof.accuracy").joinpath("measured_runs.json").read_text()
    return dict(json.loads(text))


@cache
def shipped_runs() -> tuple[MeasuredRun, ...]:
    """The measured runs the shipped fit was made from."""
    return tuple(MeasuredRun(**row) for row in shipped_data()["runs"])

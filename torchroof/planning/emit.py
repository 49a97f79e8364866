"""Plans that run: a chosen layout as the file or command a user runs.

``emit_training`` writes torchtitan's job TOML (``"torchtitan"``) or the ``torchrun`` line
that launches it (``"torchrun"``); ``emit_serving`` writes the ``vllm serve`` (``"vllm"``)
or ``sglang.launch_server`` (``"sglang"``) command, one per role for a disaggregated
layout. What a target has no setting for is refused with a one-line
:class:`~torchroof.config.errors.OptionError`; the keys and flags written are those in
:mod:`torchroof.planning.documented`, with the versions they were read from.
"""

from __future__ import annotations

from torchroof.config.errors import OptionError
from torchroof.planning.engines import sglang_commands, vllm_commands
from torchroof.planning.layouts import ServingLayout, TrainingLayout
from torchroof.planning.titan import TrainingRun, torchrun_lines, torchtitan_toml

TRAINING_EMITTERS = ("torchtitan", "torchrun")
SERVING_EMITTERS = ("vllm", "sglang")
EMITTERS = TRAINING_EMITTERS + SERVING_EMITTERS


def check_target(target: str, layout: object, wanted: tuple[str, ...], kind: type) -> None:
    """Refuse an unknown target, or a layout of the other kind, in one line."""
    if target not in EMITTERS:
        raise OptionError(f"unknown emitter {target!r}; choose one of {', '.join(EMITTERS)}")
    if target not in wanted or not isinstance(layout, kind):
        takes = "TrainingLayout" if target in TRAINING_EMITTERS else "ServingLayout"
        raise OptionError(
            f"emitter {target!r} takes a {takes}, "
            f"not a {type(layout).__name__}; training: {', '.join(TRAINING_EMITTERS)}, "
            f"serving: {', '.join(SERVING_EMITTERS)}"
        )


def emit_training(
    target: str,
    layout: TrainingLayout,
    *,
    model: str,
    flavor: str,
    seq: int,
    gpus_per_node: int,
    steps: int = 1000,
    hf_assets_path: str | None = None,
    num_layers: int | None = None,
    dtype: str = "bf16",
    quant: str = "none",
    compile: bool = False,
    async_tp: bool = False,
    job_file: str = "job.toml",
) -> str:
    """torchtitan's job TOML or its ``torchrun`` line for ``layout``. ``model`` and
    ``flavor`` are torchtitan's names (``llama3``, ``8B``), written as given; ``quant`` is
    torchroof's training recipe (``fp8``, ``fp8-rowwise``); ``num_layers`` is needed only
    for an interleaved schedule of more than 2 stages a rank."""
    check_target(target, layout, TRAINING_EMITTERS, TrainingLayout)
    run = TrainingRun(
        model, flavor, seq, gpus_per_node, steps, hf_assets_path, num_layers, dtype, quant,
        compile, async_tp, job_file,
    )  # fmt: skip
    if target == "torchtitan":
        return torchtitan_toml(layout, run)
    return torchrun_lines(layout, run)


def emit_serving(
    target: str, layout: ServingLayout, *, model: str, max_model_len: int | None = None
) -> str:
    """The vLLM or SGLang command(s) serving ``model`` (a Hugging Face id or a local path,
    passed through) with ``layout``."""
    check_target(target, layout, SERVING_EMITTERS, ServingLayout)
    if target == "vllm":
        return vllm_commands(layout, model, max_model_len)
    return sglang_commands(layout, model, max_model_len)

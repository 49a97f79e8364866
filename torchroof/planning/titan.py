"""A training layout as torchtitan runs it: the job TOML (torchtitan 0.2.x's ``JobConfig``)
and the ``torchrun`` line that launches it on every node.

torchtitan trains with FSDP2 (``data_parallel_shard_degree``), HSDP or DDP (its
``data_parallel_replicate_degree``), tensor, context, pipeline and expert parallel; the
layout's sizes map one to one. A data rank's ``batch`` x ``microbatches`` sequences are its
``local_batch_size`` when the layout pipelines (its micro-batches are the pipeline's, each
``pipeline_parallel_microbatch_size`` = ``batch``), and gradient accumulation otherwise
(``local_batch_size`` = ``batch``, ``global_batch_size`` = ``microbatches`` times the data
ranks' batch); either way ``global_batch_size`` = batch x microbatches x fsdp x dp.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from torchroof.config.choices import DEFAULT_VIRTUAL_STAGES, INTERLEAVED, V_SHAPED
from torchroof.config.errors import OptionError
from torchroof.planning.documented import PIPELINE_SCHEDULE_CLASSES, TORCHRUN_ENTRY
from torchroof.planning.layouts import TrainingLayout

FLOAT8_RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}
"""torchroof's training recipes as torchtitan's ``quantize.linear.float8.recipe_name``
(pytorch/torchtitan, torchtitan/config/job_config.py ``Float8Linear``, v0.2.2), applied by
the ``quantize.linear.float8`` converter (torchtitan/components/quantization/float8.py)."""
PARAM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""torchroof's dtype as torchtitan's ``training.mixed_precision_param`` (its only two)."""


@dataclass(frozen=True)
class TrainingRun:
    """What a torchtitan job needs besides the layout: the model as torchtitan names it
    (``name`` and ``flavor`` of its registry, e.g. ``llama3`` / ``8B``: passed through as
    given), the sequence length, GPUs per node, steps and the options a user asks for."""

    model: str
    flavor: str
    seq: int
    gpus_per_node: int
    steps: int = 1000
    hf_assets_path: str | None = None
    num_layers: int | None = None  # needed for an interleaved schedule past 2 stages a rank
    dtype: str = "bf16"
    quant: str = "none"  # "fp8" (tensorwise) or "fp8-rowwise": torchtitan's Float8 training
    compile: bool = False
    async_tp: bool = False
    job_file: str = "job.toml"


def check_trainable(layout: TrainingLayout) -> None:
    """Refuse, in one line naming the layout, what torchtitan has no setting for."""
    if layout.zero:
        raise OptionError(
            f"{layout.label()}: ZeRO-{layout.zero} over plain DDP has no torchtitan setting "
            "(torchtitan shards with FSDP2 or HSDP); choose fsdp instead"
        )
    if layout.ep > 1 and (layout.fsdp * layout.cp * layout.tp) % layout.ep:
        raise OptionError(
            f"{layout.label()}: torchtitan's expert parallel borrows fsdp x cp x tp ranks "
            f"({layout.fsdp * layout.cp * layout.tp}), which ep {layout.ep} does not divide"
        )
    if layout.ep > 1 and layout.ep % (layout.cp * layout.tp):
        raise OptionError(  # expert_tensor_parallel_degree 1: ep spans whole cp x tp groups
            f"{layout.label()}: torchtitan asks ep {layout.ep} to be a multiple of cp x tp "
            f"({layout.cp * layout.tp}) (torchtitan/distributed/parallel_dims.py)"
        )


def nodes(layout: TrainingLayout, gpus_per_node: int) -> tuple[int, int]:
    """``(nnodes, nproc_per_node)``: whole nodes, or one node's share when the layout is
    smaller than a node; a layout that leaves a node part-filled is refused."""
    if layout.gpus <= gpus_per_node:
        return 1, layout.gpus
    if layout.gpus % gpus_per_node:
        raise OptionError(
            f"{layout.label()}: {layout.gpus} GPUs do not fill whole nodes of {gpus_per_node}"
        )
    return layout.gpus // gpus_per_node, gpus_per_node


def batch_keys(layout: TrainingLayout) -> dict[str, int]:
    """``local_batch_size`` and ``global_batch_size`` (torchtitan's ``JobConfig.training``,
    pytorch/torchtitan torchtitan/config/job_config.py and train.py, v0.2.2: gradient
    accumulation steps = global / (local x data ranks))."""
    per_rank = layout.batch * layout.microbatches
    local = per_rank if layout.pp > 1 else layout.batch
    return {"local_batch_size": local, "global_batch_size": per_rank * layout.data_ranks}


def stage_keys(layout: TrainingLayout, num_layers: int | None) -> dict[str, Any]:
    """The pipeline's keys (``JobConfig.parallelism``, pytorch/torchtitan
    torchtitan/config/job_config.py and distributed/pipeline_parallel.py, v0.2.2). torchtitan
    gives a multi-stage schedule 2 stages a rank unless ``pipeline_parallel_layers_per_stage``
    says otherwise: its stage count is ceil((layers + 2) / layers_per_stage), the 2 being the
    embedding's and the head's default weight of one layer each."""
    out: dict[str, Any] = {
        "pipeline_parallel_degree": layout.pp,
        "pipeline_parallel_schedule": PIPELINE_SCHEDULE_CLASSES[layout.pp_schedule],
        "pipeline_parallel_microbatch_size": layout.batch,
    }
    if layout.pp_schedule in V_SHAPED or layout.pp_schedule not in INTERLEAVED:
        return out
    per_rank = layout.virtual_stages if layout.virtual_stages > 1 else DEFAULT_VIRTUAL_STAGES
    if per_rank == DEFAULT_VIRTUAL_STAGES:
        return out
    stages = layout.pp * per_rank
    if num_layers is None:
        raise OptionError(
            f"{layout.label()}: {per_rank} stages a rank need the model's layer count "
            "(num_layers=) to set torchtitan's pipeline_parallel_layers_per_stage"
        )
    per_stage = math.ceil((num_layers + 2) / stages)
    if math.ceil((num_layers + 2) / per_stage) != stages:
        raise OptionError(
            f"{layout.label()}: no layers_per_stage splits {num_layers} layers into {stages} "
            "torchtitan stages"
        )
    out["pipeline_parallel_layers_per_stage"] = per_stage
    return out


def parallelism_keys(layout: TrainingLayout, run: TrainingRun) -> dict[str, Any]:
    """The layout's sizes as torchtitan's ``JobConfig.parallelism`` (pytorch/torchtitan,
    torchtitan/config/job_config.py, v0.2.2): shard = fsdp, replicate = dp (DDP alone, HSDP
    beside a shard degree), every degree written, none left to torchtitan's -1."""
    out: dict[str, Any] = {
        "data_parallel_replicate_degree": layout.dp,
        "data_parallel_shard_degree": layout.fsdp,
        "tensor_parallel_degree": layout.tp,
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
        "expert_parallel_degree": layout.ep,
    }
    if run.async_tp:
        if layout.tp == 1:
            raise OptionError(f"{layout.label()}: async tensor parallel needs tp > 1")
        out["enable_async_tensor_parallel"] = True
    if layout.pp > 1:
        out.update(stage_keys(layout, run.num_layers))
    return out


def job_sections(layout: TrainingLayout, run: TrainingRun) -> dict[str, dict[str, Any]]:
    """The job TOML's sections, in torchtitan's order."""
    model: dict[str, Any] = {"name": run.model, "flavor": run.flavor}
    if run.hf_assets_path is not None:
        model["hf_assets_path"] = run.hf_assets_path
    if run.quant != "none":
        model["converters"] = ["quantize.linear.float8"]
    if run.dtype not in PARAM_DTYPES:
        raise OptionError(
            f"dtype={run.dtype!r}: torchtitan trains in {', '.join(PARAM_DTYPES)} only"
        )
    training: dict[str, Any] = {**batch_keys(layout), "seq_len": run.seq, "steps": run.steps}
    training["mixed_precision_param"] = PARAM_DTYPES[run.dtype]
    sections: dict[str, dict[str, Any]] = {
        "job": {"description": layout.label()},
        "model": model,
        "training": training,
        "parallelism": parallelism_keys(layout, run),
        "activation_checkpoint": {"mode": layout.recompute},
    }
    if layout.recompute == "selective":  # torchroof's selective policy is the per-op one
        sections["activation_checkpoint"]["selective_ac_option"] = "op"
    if run.compile:
        sections["compile"] = {"enable": True, "components": ["model", "loss"]}
    if run.quant != "none":
        if run.quant not in FLOAT8_RECIPES:
            raise OptionError(
                f"quant={run.quant!r}: torchtitan trains with {', '.join(FLOAT8_RECIPES)} only"
            )
        sections["quantize.linear.float8"] = {"recipe_name": FLOAT8_RECIPES[run.quant]}
    return sections


def toml_value(value: Any) -> str:
    """One TOML value: a bool, an int, a string or a list of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def torchtitan_toml(layout: TrainingLayout, run: TrainingRun) -> str:
    """The job TOML for torchtitan 0.2.x (``--job.config_file``)."""
    check_trainable(layout)
    lines = [
        f"# torchtitan job for {layout.gpus} GPUs: {layout.label()}",
        "# torchtitan 0.2.x reads this file (--job.config_file); 0.3 takes Python configs",
    ]
    if layout.tp > 1 and not layout.sequence_parallel:
        lines.append(
            "# NB: torchtitan applies sequence parallel with every tensor-parallel degree; "
            "this layout was estimated without it"
        )
    for section, keys in job_sections(layout, run).items():
        lines.append(f"\n[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


def torchrun_lines(layout: TrainingLayout, run: TrainingRun) -> str:
    """The ``torchrun`` line each node runs (torch.distributed.run's flags, torch 2.13; the
    entry point as torchtitan's run_train.sh at v0.2.2 has it). Several nodes meet at a c10d
    rendezvous on the head node: ``$HEAD_NODE_ADDR`` and ``$JOB_ID`` are the user's."""
    check_trainable(layout)
    nnodes, per_node = nodes(layout, run.gpus_per_node)
    args = ["torchrun", "--nnodes", str(nnodes), "--nproc_per_node", str(per_node)]
    if nnodes == 1:
        args.append("--standalone")
    else:
        args += ["--rdzv_backend", "c10d", "--rdzv_endpoint", '"$HEAD_NODE_ADDR:29500"']
        args += ["--rdzv_id", '"$JOB_ID"']
    args += [*TORCHRUN_ENTRY, run.job_file]
    head = f"# on each of {nnodes} nodes" if nnodes > 1 else "# on the one node"
    return f"{head}, with {run.job_file} from torchroof's torchtitan emitter\n{' '.join(args)}\n"

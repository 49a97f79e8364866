"""The keys and flags the emitters write, as each project documents them, with the file and
the version they were read from; ``tests/test_planning_emit.py`` checks every emitted key and
flag against these tables, and each engine value against its choices.

Only what the emitters write is listed: a key or flag that is not here is never emitted.
"""

from __future__ import annotations

TORCHTITAN_VERSION = "0.2.2"
TORCHTITAN_SOURCE = (
    "pytorch/torchtitan, torchtitan/config/job_config.py at v0.2.2 "
    "(73a0e6979dd10b6b1904098eb3c8f62c18ab87ce), the last release that reads a job TOML"
)
"""torchtitan 0.3.0 replaced the TOML job file with Python config functions chosen by
``--module``/``--config`` (pytorch/torchtitan#2386, torchtitan/config/README.md); the TOML
emitted here is for 0.2.x."""

TORCHTITAN_KEYS: dict[str, dict[str, type]] = {
    "job": {"description": str, "dump_folder": str},
    "model": {"name": str, "flavor": str, "hf_assets_path": str, "converters": list},
    "training": {
        "local_batch_size": int,
        "global_batch_size": int,
        "seq_len": int,
        "steps": int,
        "mixed_precision_param": str,
    },
    "parallelism": {
        "data_parallel_replicate_degree": int,
        "data_parallel_shard_degree": int,
        "tensor_parallel_degree": int,
        "enable_async_tensor_parallel": bool,
        "context_parallel_degree": int,
        "pipeline_parallel_degree": int,
        "pipeline_parallel_schedule": str,
        "pipeline_parallel_microbatch_size": int,
        "pipeline_parallel_layers_per_stage": int,
        "expert_parallel_degree": int,
    },
    "activation_checkpoint": {"mode": str, "selective_ac_option": str},
    "compile": {"enable": bool, "components": list},
    "quantize.linear.float8": {"recipe_name": str},
}
"""Sections (dotted: nested tables) and the keys of each, with their value types
(torchtitan's ``JobConfig`` dataclasses, torchtitan/config/job_config.py at v0.2.2)."""

TORCHTITAN_CHOICES: dict[str, tuple[str, ...]] = {
    "activation_checkpoint.mode": ("selective", "full", "memory_budget", "none"),
    "training.mixed_precision_param": ("bfloat16", "float32"),
    "quantize.linear.float8.recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "model.converters": ("quantize.linear.float8",),  # components/quantization/float8.py
}

PIPELINE_SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
"""torchroof's pipeline schedules by the names ``get_schedule_class`` takes (pytorch/pytorch,
torch/distributed/pipelining/schedules.py, torch 2.13.0), which torchtitan's
``parallelism.pipeline_parallel_schedule`` is passed to."""

TORCHRUN_ENTRY = ("-m", "torchtitan.train", "--job.config_file")
"""torchtitan's entry point and its job-file flag (pytorch/torchtitan, run_train.sh and
torchtitan/config/manager.py at v0.2.2)."""

VLLM_VERSION = "0.34.0"
VLLM_SOURCE = (
    "vllm-project/vllm 0.34.0 (the PyPI wheel): vllm/engine/arg_utils.py, "
    "vllm/config/cache.py, vllm/model_executor/layers/quantization/__init__.py, "
    "vllm/config/kv_transfer.py"
)
VLLM_FLAGS: dict[str, type | None] = {
    "--tensor-parallel-size": int,
    "--pipeline-parallel-size": int,
    "--data-parallel-size": int,
    "--enable-expert-parallel": None,  # a switch
    "--max-num-seqs": int,
    "--max-num-batched-tokens": int,
    "--enable-chunked-prefill": None,
    "--no-enable-chunked-prefill": None,  # argparse.BooleanOptionalAction's negation
    "--kv-cache-dtype": str,
    "--quantization": str,
    "--max-model-len": int,
    "--kv-transfer-config": str,  # JSON of KVTransferConfig
}
VLLM_CHOICES: dict[str, tuple[str, ...]] = {
    # CacheDType (vllm/config/cache.py), the part torchroof's names map to
    "--kv-cache-dtype": ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    # QuantizationMethods and the online shorthands (vllm/config/quantization.py)
    "--quantization": ("fp8", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block"),
}
VLLM_KV_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
"""vLLM's NIXL connector, the same config on prefill and decode instances
(docs/features/nixl_connector_usage.md; kv_role is one of KVRole in
vllm/config/kv_transfer.py)."""

SGLANG_VERSION = "0.5.23"
SGLANG_SOURCE = (
    "sgl-project/sglang 0.5.23 (the PyPI wheel): python/sglang/srt/arg_groups/fields/"
    "{model,parallel,schedule,disagg}.py and arg_groups/choices.py, which server_args.py "
    "registers (flag = '--' + field name with '-' for '_')"
)
SGLANG_FLAGS: dict[str, type | None] = {
    "--model-path": str,
    "--tp-size": int,
    "--pp-size": int,
    "--dp-size": int,
    "--enable-dp-attention": None,  # a switch
    "--moe-dense-tp-size": int,
    "--enable-dp-lm-head": None,
    "--ep-size": int,
    "--max-running-requests": int,
    "--chunked-prefill-size": int,  # -1 turns chunked prefill off
    "--max-prefill-tokens": int,
    "--kv-cache-dtype": str,
    "--quantization": str,
    "--context-length": int,
    "--disaggregation-mode": str,
}
SGLANG_CHOICES: dict[str, tuple[str, ...]] = {
    "--kv-cache-dtype": (
        "auto",
        "fp8_e5m2",
        "fp8_e4m3",
        "mxfp8",
        "bf16",
        "bfloat16",
        "nvfp4",
        "fp4_mx_block16",
    ),
    "--quantization": ("fp8",),  # the part of QUANTIZATION_CHOICES torchroof's names map to
    "--disaggregation-mode": ("null", "prefill", "decode"),
}

"""A serving layout as vLLM and SGLang start it: one command per engine, or one per role
(prefill, decode) of a disaggregated deployment.

Each engine's flags are the ones its argument parser registers (the versions and files in
:mod:`torchroof.planning.documented`). torchroof's KV cache dtypes and quantisation recipes
are mapped to an engine's own names only where the engine quantises the same way from an
unquantised checkpoint; any other is refused in one line naming the recipe and the engine.
"""

from __future__ import annotations

import json
import shlex

from torchroof.config.errors import OptionError
from torchroof.planning.documented import VLLM_KV_CONNECTOR
from torchroof.planning.layouts import ServingLayout

VLLM_KV_DTYPES = {"model": "auto", "fp8": "fp8_e4m3"}
"""torchroof's KV cache dtypes as vLLM's ``--kv-cache-dtype`` (CacheDType,
vllm-project/vllm vllm/config/cache.py, 0.34.0). torchroof's int8 cache (one scale a
tensor) is not vLLM's ``int8_per_token_head`` (a scale per token and head): refused."""
SGLANG_KV_DTYPES = {"model": "auto", "fp8": "fp8_e4m3"}
"""As SGLang's ``--kv-cache-dtype`` (sgl-project/sglang
python/sglang/srt/arg_groups/fields/model.py, 0.5.23); it has no int8 cache."""
VLLM_QUANTS = {"fp8": "fp8", "fp8-rowwise": "fp8_per_channel"}
"""torchroof's serving recipes as vLLM's ``--quantization`` (vllm-project/vllm
vllm/model_executor/layers/quantization/__init__.py and vllm/config/quantization.py, 0.34.0):
``fp8`` quantises a bf16 checkpoint's weights per tensor with dynamic activation scales,
``fp8_per_channel`` per output channel with per-token activation scales (torchao's per-row
granularity). vLLM's int8 and NVFP4 online shorthands quantise MoE experts only, and its
int4 and MXFP4 methods read pre-quantised checkpoints: those recipes are refused."""
SGLANG_QUANTS = {"fp8": "fp8"}
"""As SGLang's ``--quantization`` (QUANTIZATION_CHOICES, sgl-project/sglang
python/sglang/srt/arg_groups/choices.py, 0.5.23): ``fp8`` quantises linear and MoE layers
online; its other methods read quantised checkpoints, so the other recipes are refused."""
ROLES = ("prefill", "decode")


def split_disaggregated(layout: ServingLayout) -> tuple[int, int]:
    """``(prefill instances, decode instances)`` of an xPyD layout ("2P1D" -> (2, 1))."""
    assert layout.disaggregate is not None
    prefill, decode = layout.disaggregate.upper().rstrip("D").split("P")
    return int(prefill), int(decode)


def mapped(table: dict[str, str], name: str, what: str, engine: str) -> str:
    """``table[name]``, or a one-line refusal naming the recipe and the engine."""
    if name not in table:
        raise OptionError(
            f"{what} {name!r} has no {engine} flag; {engine} takes {', '.join(table)}"
        )
    return table[name]


def vllm_args(layout: ServingLayout, model: str, tp: int, max_model_len: int | None) -> list[str]:
    """One ``vllm serve`` of ``tp`` GPUs a pipeline stage (vllm/engine/arg_utils.py, 0.34.0).
    vLLM's expert parallel spans the tensor x data-parallel ranks, so ``ep`` must be their
    product (``--enable-expert-parallel`` takes no size)."""
    args = ["vllm", "serve", model, "--tensor-parallel-size", str(tp)]
    args += ["--pipeline-parallel-size", str(layout.pp)]
    replicas = layout.replicas if layout.disaggregate is None else 1
    if replicas > 1:
        args += ["--data-parallel-size", str(replicas)]
    if layout.ep > 1:
        if layout.ep != tp * replicas:
            raise OptionError(
                f"ep {layout.ep}: vLLM's expert parallel spans tp x dp = {tp * replicas} GPUs"
            )
        args.append("--enable-expert-parallel")
    args += ["--max-num-seqs", str(layout.max_num_seqs)]
    args += ["--max-num-batched-tokens", str(layout.max_num_batched_tokens)]
    args.append(
        "--enable-chunked-prefill" if layout.chunked_prefill else "--no-enable-chunked-prefill"
    )
    kv = mapped(VLLM_KV_DTYPES, layout.kv_dtype or "model", "kv_dtype", "vLLM")
    if kv != "auto":
        args += ["--kv-cache-dtype", kv]
    if layout.quant != "none":
        args += ["--quantization", mapped(VLLM_QUANTS, layout.quant, "quant recipe", "vLLM")]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    return args


def sglang_args(layout: ServingLayout, model: str, tp: int, max_model_len: int | None) -> list[str]:
    """One ``python -m sglang.launch_server`` (the fields sglang/srt/server_args.py
    registers, sgl-project/sglang 0.5.23). SGLang's expert parallel runs inside the tensor
    group, so ``ep`` must divide ``tp``; data-parallel attention is that group of dp x tp
    GPUs with ``--enable-dp-attention`` (attention's tensor parallel then tp_size / dp_size:
    arg_groups/fields/parallel.py), whose running requests and chunk are the server's,
    divided among its dp ranks (server_args.py), so each is given dp times a rank's; at tp 1
    the dense layers and the LM head stay whole on each rank, as simulated
    (``--moe-dense-tp-size 1 --enable-dp-lm-head``). Chunked prefill is
    ``--chunked-prefill-size`` tokens a chunk (-1: off, the prefill batch then bounded by
    ``--max-prefill-tokens``)."""
    dp = layout.attention_dp
    group = tp * dp  # SGLang's tp_size: the GPUs of one server
    args = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(group)]
    if layout.pp > 1:
        args += ["--pp-size", str(layout.pp)]
    if layout.replicas > 1 and layout.disaggregate is None:
        args += ["--dp-size", str(layout.replicas)]
    if dp > 1:
        args.append("--enable-dp-attention")
        args += ["--moe-dense-tp-size", "1", "--enable-dp-lm-head"] if tp == 1 else []
    if layout.ep > 1:
        if group % layout.ep:
            raise OptionError(f"ep {layout.ep}: SGLang's expert parallel divides tp {group}")
        args += ["--ep-size", str(layout.ep)]
    args += ["--max-running-requests", str(layout.max_num_seqs * dp)]
    if layout.chunked_prefill:
        args += ["--chunked-prefill-size", str(layout.max_num_batched_tokens * dp)]
    else:
        args += ["--chunked-prefill-size", "-1"]
        args += ["--max-prefill-tokens", str(layout.max_num_batched_tokens)]
    kv = mapped(SGLANG_KV_DTYPES, layout.kv_dtype or "model", "kv_dtype", "SGLang")
    if kv != "auto":
        args += ["--kv-cache-dtype", kv]
    if layout.quant != "none":
        args += ["--quantization", mapped(SGLANG_QUANTS, layout.quant, "quant recipe", "SGLang")]
    if max_model_len is not None:
        args += ["--context-length", str(max_model_len)]
    return args


def vllm_commands(layout: ServingLayout, model: str, max_model_len: int | None) -> str:
    """``vllm serve`` for the layout; disaggregated, one per role with the NIXL connector
    (vLLM's docs/features/nixl_connector_usage.md), a proxy in front routing each request."""
    if layout.disaggregate is None:
        return shlex.join(vllm_args(layout, model, layout.tp, max_model_len)) + "\n"
    counts = split_disaggregated(layout)
    connector = json.dumps(VLLM_KV_CONNECTOR, separators=(",", ":"))
    lines = ["# a proxy in front sends each request to a prefill, then a decode instance"]
    for role, count, tp in zip(ROLES, counts, (layout.prefill_tp, layout.decode_tp), strict=True):
        args = vllm_args(layout, model, tp, max_model_len) + ["--kv-transfer-config", connector]
        lines += [f"# {role}: {count} instance(s) of {tp} GPU(s), each", shlex.join(args)]
    return "\n".join(lines) + "\n"


def sglang_commands(layout: ServingLayout, model: str, max_model_len: int | None) -> str:
    """``sglang.launch_server`` for the layout; disaggregated, one per role with
    ``--disaggregation-mode prefill|decode`` (python/sglang/srt/arg_groups/fields/disagg.py,
    0.5.23; the KV moves over its default transfer backend), SGLang's router in front."""
    if layout.disaggregate is None:
        return shlex.join(sglang_args(layout, model, layout.tp, max_model_len)) + "\n"
    counts = split_disaggregated(layout)
    lines = ["# SGLang's router in PD mode sends each request to a prefill and a decode server"]
    for role, count, tp in zip(ROLES, counts, (layout.prefill_tp, layout.decode_tp), strict=True):
        args = sglang_args(layout, model, tp, max_model_len) + ["--disaggregation-mode", role]
        lines += [f"# {role}: {count} instance(s) of {tp} GPU(s), each", shlex.join(args)]
    return "\n".join(lines) + "\n"

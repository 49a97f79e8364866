"""Predict published multi-GPU runs with torchroof and set each prediction beside its
measurement (README "Checked against multi-GPU runs").

The runs and the collective anchors are ``examples/validation/multi_gpu_runs.json`` (sources:
``MULTI_GPU_SOURCES.md``). Every run is either mapped to a torchroof request here
(:data:`CHOICES`: the judgement calls; sizes are read from the run's own entry) or listed in
:data:`NOT_PREDICTED` with the reason torchroof cannot express it yet. Nothing is fitted.

    python examples/multi_gpu_validation.py            # tables and a summary (~3 min)
    python examples/multi_gpu_validation.py --write    # also refresh multi_gpu_predictions.json
    python examples/multi_gpu_validation.py --run gptfast-a100x8-llama31-8b-tp8-decode-bs1

Conventions:

- A prediction is a weighted sum of priced steps (:class:`Phase`): a training step once; a
  whole generate call as its prefill plus one decode step per further token.
- ratio = predicted time / measured time for the same work, so < 1 means torchroof predicts
  faster (as in the single-GPU table). For a rate (tokens/s) that is measured / predicted.
- Training tokens/s per GPU = tokens one rank's step processes (batch x seq x micro-batches)
  / step time / tp: the ranks of a tensor-parallel group share their tokens.
- MFU (training): the estimate's own FLOPs (what the traced kernels do: causal attention,
  recomputation under activation checkpointing) / (step time x the GPU's dense bf16 peak);
  the sources define theirs as 6N + attention per token, so the two differ by definition.
- Collective anchors: nccl-tests bus bandwidth = algorithm bandwidth (S / time) x bus factor
  (torchroof.counters.bus.bus_factor); torchroof's figure is collective_time's for the same S,
  kind and group on the named cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from tabulate import tabulate
from torchroof.counters.bus import bus_factor
from torchroof.hardware import get_cluster

import torchroof
from torchroof.models.sources import load_config
from torchroof.pricing.runtime import runtime_options, workload_defaults
from torchroof.progress import Reporter
from torchroof.progress import reporter as progress_reporter
from torchroof.report.analysis import communication
from torchroof.report.estimate import Estimate
from torchroof.timing.network import collective_time

HERE = Path(__file__).resolve().parent / "validation"
RUNS_JSON = HERE / "multi_gpu_runs.json"
PP_EP_RUNS_JSON = HERE / "pp_ep_runs.json"  # runs with pipeline or expert parallel
PREDICTIONS_JSON = HERE / "multi_gpu_predictions.json"
GIB = 2**30
GB = 1e9

# -- what each run is, in torchroof's terms ------------------------------------------------

EAGER_DEFAULT = (
    "not compiled: priced with torchroof's default kernels (fusion 'fused', what "
    "torch.compile would launch), and again with one kernel per op (eager_kernels)"
)
SAC_OP = (
    "selective AC (per op: torchtitan recomputes every 2nd matmul and the pointwise ops "
    "between, keeps attention): checkpoint_policy 'selective'"
)
SELECTIVE = {"checkpoint_policy": "selective"}
SAC_LAYER = (
    "selective AC (every 2nd layer fully recomputed, 0.5 of a forward): checkpointing with "
    "checkpoint_every=2"
)
TITAN_H100 = (
    "torchtitan's H100s are 96 GB HBM2e parts at 500 W, slower than an 80 GB 700 W SXM H100: "
    "priced on grand-teton-h100 (2.4 TB/s, its tensor rate bounded by torchtitan between the "
    "SXM's and the NVL's)"
)
SP = (
    "sequence + loss parallel, as the run (torchtitan's TP plan through parallelize_module: "
    "norms on T/tp tokens, reduce-scatter + all-gather for each all-reduce, the loss on "
    "vocabulary shards)"
)
FP32_REDUCE = "gradients reduced in fp32, torchtitan's mixed_precision_reduce default"
GPT_FAST = (
    "compiled decode (fusion 'fused'); gpt-fast attends over its whole 205-slot static "
    "cache every step (context 205); the node is 330 W A100s on a hybrid cube mesh, priced "
    "on dgx-a100 (NVSwitch, full clocks); all-reduce priced as NCCL (gpt-fast uses "
    "PyTorch's intra-node all-reduce)"
)
LLAMA2_70B: dict[str, Any] = {"vocab_size": 32000, "max_position_embeddings": 4096}
LLAMA2_NOTE = "Llama-2-70B = llama-3-70b with vocab 32000 and 4096 positions"
TRT = "TensorRT engine priced with fused kernels (fusion 'fused'); A100 80 GB SXM presumed"
LLAMA3_405B = (
    "Llama 3 paper, Table 4: interleaved 1F1B with V not published (priced with 2 stages per "
    "rank), micro-batches of one sequence (not published: the 32 sequences per DP group as "
    "32 micro-batches), FSDP keeping parameters gathered after forward (reshard_after_forward "
    "off), gradients reduced in fp32; model FLOP/s as PaLM's 6N + 12·L·H·Q·T per token "
    "(Chowdhery et al. 2022, appendix B, which the paper cites for MFU: N = 405e9, H·Q = d, "
    "attention not halved for causality); H100 SXM at 700 W as dgx-h100, RoCE as its "
    "400 Gb/s network"
)
# Llama-3.1-405B by PaLM's count: 6 x 405e9 + 12 x 126 layers x 16,384 (H·Q = d) x 8,192
# (T), FLOPs per token; the attention term is 8% of it
LLAMA3_405B_FLOPS = 6 * 405e9 + 12 * 126 * 16384 * 8192
# the same at the 131,072-token sequences of the context-parallel stage, where the
# attention term is 57% of the 5.68e12
LLAMA3_405B_128K_FLOPS = 6 * 405e9 + 12 * 126 * 16384 * 131072
CP_META = (
    "context parallel as torch's load-balanced attention on each pipeline stage's ranks, "
    "which gathers K and V once a layer as the paper's all-gather-based CP does"
)
CP_RING = (
    "context parallel priced as torch's load-balanced ring attention on each pipeline "
    "stage's ranks (Transformer Engine passes K and V round the ring point to point; torch "
    "gathers them once a layer: the same K and V bytes in the forward)"
)
MB_LLAMA31_REDUCE = (
    "gradients reduced in bf16 (Megatron-Bridge scripts/performance/configs/llama/"
    "llama31_llm_pretrain.py @0013c9a, set_llama31_common_configs: grad_reduce_in_fp32 = "
    "False)"
)
MB_DEEPSEEK = (
    "Megatron-Bridge 25.11 on DGX-GB200: interleaved 1F1B (PP 4 x VP 4), EP 64 over the 64 "
    "data-parallel ranks (torchroof's dp with ep: dense weights replicated, gradients "
    "all-reduced; Megatron's distributed optimizer shards the optimizer state: not "
    "modelled), selective recompute of the MLA up-projections not modelled (priced without "
    "checkpointing), flex/HybridEP dispatch priced as transformers' all-to-all; gb200-nvl72 "
    "uses the B200 chip file; gradients reduced in bf16 (the performance recipe's "
    "grad_reduce_in_fp32 = False: Megatron-Bridge scripts/performance/configs/deepseek/"
    "deepseek_v3_llm_pretrain.py, set_deepseek_v3_common_configs)"
)
MEGATRON_ONE_REDUCTION = (
    "gradients reduced once, after the last micro-batch (Megatron-Core runs the others under "
    "its DDP's no_sync: defer_gradient_sync)"
)


@dataclass(frozen=True)
class Choice:
    """What a run's entry does not say in torchroof's terms: the judgement calls. Sizes
    (batch, sequence, parallel degrees, tokens) are read from the entry itself."""

    hardware: str  # a cluster name
    note: str
    model: str | None = None  # a shipped config; default the entry's torchroof_config
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config fields changed
    checkpointing: bool = False
    dtype: str = "bf16"  # prefill / decode
    whole_cache: bool = False  # decode attends over the full static cache every step
    per_gpu: bool = True  # the measured rate is per GPU (else for the whole group)
    # sizes the source does not publish (micro-batch, accumulation steps, virtual stages)
    sizes: Mapping[str, Any] = field(default_factory=dict)
    workload: Mapping[str, Any] = field(default_factory=dict)  # other Workload knobs
    # a figure in model FLOP/s: the source's FLOPs per token (6N + attention)
    model_flops_per_token: float | None = None
    sequence_parallel: bool | None = None  # None: as the run says


FLOAT8 = "torchao Float8 tensorwise on the decoder's linear layers (quant 'fp8')"
CP_FSDP = "FSDP over the fsdp x cp ranks (torchtitan's dp_shard_cp), ring attention over cp"
FLOAT8_GATHER = (
    "FSDP all-gathers the bf16 weights (the run all-gathers fp8: half the bytes, not modelled)"
)
TT_405B_FP8 = (
    f"{FLOAT8}; full AC; compiled (fusion 'fused'); {SP}; parameters kept gathered across "
    f"micro-batches; async TP not modelled; {TITAN_H100}; {FLOAT8_GATHER}"
)
TT_405B_FP8_WORKLOAD = {"quant": "fp8", "reshard_after_forward": False}

CHOICES: dict[str, Choice] = {
    "tt-a100x64-llama3-8b-fsdp-sac-op": Choice(
        "dgx-a100",
        f"{SAC_OP}; {EAGER_DEFAULT}; {FP32_REDUCE}",
        checkpointing=True,
        workload=SELECTIVE,
    ),
    "tt-a100x64-llama3-8b-fsdp-sac-layer": Choice(
        "dgx-a100",
        f"{SAC_LAYER}; {EAGER_DEFAULT}; {FP32_REDUCE}",
        checkpointing=True,
        workload={"checkpoint_every": 2},
    ),
    "tt-a100x64-llama3-70b-fsdp-fullac": Choice(
        "dgx-a100", f"full AC; {EAGER_DEFAULT}; {FP32_REDUCE}", checkpointing=True
    ),
    "tt-h100x8-llama31-8b-fsdp": Choice(
        "grand-teton-h100",
        f"{SAC_OP}; {EAGER_DEFAULT}; {TITAN_H100}; {FP32_REDUCE}",
        checkpointing=True,
        workload=SELECTIVE,
    ),
    "tt-h100x8-llama31-8b-fsdp-compile": Choice(
        "grand-teton-h100",
        f"{SAC_OP}; compiled (fusion 'fused'); {TITAN_H100}; {FP32_REDUCE}",
        checkpointing=True,
        workload=SELECTIVE,
    ),
    "tt-h100x128-llama31-8b-fsdp": Choice(
        "grand-teton-h100",
        f"{SAC_OP}; {EAGER_DEFAULT}; {TITAN_H100}; {FP32_REDUCE}",
        checkpointing=True,
        workload=SELECTIVE,
    ),
    "tt-h100x128-llama31-8b-fsdp-compile": Choice(
        "grand-teton-h100",
        f"{SAC_OP}; compiled (fusion 'fused'); {TITAN_H100}; {FP32_REDUCE}",
        checkpointing=True,
        workload=SELECTIVE,
    ),
    "tt-h100x64-llama31-8b-fsdp8-tp8-bf16": Choice(
        "grand-teton-h100",
        f"{SAC_OP}; compiled (fusion 'fused'); {SP}; {TITAN_H100}",
        checkpointing=True,
        workload=SELECTIVE,
    ),
    "tt-h100x256-llama31-70b-fsdp32-tp8-bf16": Choice(
        "grand-teton-h100",
        f"full AC; compiled (fusion 'fused'); {SP}; {TITAN_H100}",
        checkpointing=True,
    ),
    "gptfast-a100x8-llama31-70b-tp8-decode-bs1": Choice(
        "dgx-a100", GPT_FAST, whole_cache=True, per_gpu=False
    ),
    "gptfast-a100x4-llama31-70b-tp4-decode-bs1": Choice(
        "dgx-a100", GPT_FAST, whole_cache=True, per_gpu=False
    ),
    "gptfast-a100x8-llama31-8b-tp8-decode-bs1": Choice(
        "dgx-a100", GPT_FAST, whole_cache=True, per_gpu=False
    ),
    "gptfast-a100x8-llama2-70b-tp8-decode-bs1": Choice(
        "dgx-a100",
        f"{LLAMA2_NOTE}; {GPT_FAST}",
        model="llama-3-70b",
        overrides=LLAMA2_70B,
        whole_cache=True,
        per_gpu=False,
    ),
    "trtllm090-a100x8-llama2-70b-tp8-prefill2048-bs1": Choice(
        "dgx-a100", f"{LLAMA2_NOTE}; fp16; {TRT}", "llama-3-70b", LLAMA2_70B, dtype="fp16"
    ),
    "trtllm090-h100x8-llama2-70b-tp8-prefill2048-bs1-fp8": Choice(
        "dgx-h100",
        f"{LLAMA2_NOTE}; fp16 with fp8 weights and activations (each rank quantises its "
        "shards) and an fp8 KV cache; TensorRT engine priced with fused kernels",
        "llama-3-70b",
        LLAMA2_70B,
        dtype="fp16",
        workload={"quant": "fp8", "kv_dtype": "fp8"},
    ),
    "llama3-405b-h100x8192-tp8-pp16-dp64": Choice(
        "dgx-h100",
        LLAMA3_405B,
        sizes={"micro_batch": 1, "grad_accum": 32, "virtual_stages": 2},
        workload={"pp_schedule": "interleaved-1f1b", "reshard_after_forward": False},
        model_flops_per_token=LLAMA3_405B_FLOPS,
    ),
    "llama3-405b-h100x16384-tp8-pp16-dp128": Choice(
        "dgx-h100",
        LLAMA3_405B.replace("32 sequences per DP group as 32", "16 sequences per DP group as 16"),
        sizes={"micro_batch": 1, "grad_accum": 16, "virtual_stages": 2},
        workload={"pp_schedule": "interleaved-1f1b", "reshard_after_forward": False},
        model_flops_per_token=LLAMA3_405B_FLOPS,
    ),
    "llama3-405b-h100x16384-tp8-cp16-pp16-dp8": Choice(
        "dgx-h100",
        LLAMA3_405B.replace(
            "32 sequences per DP group as 32", "16 sequences per DP group as 16"
        ).replace("12·L·H·Q·T per token", "12·L·H·Q·T per token at T = 131,072")
        + f"; {CP_META}; no activation checkpointing (the paper trains 8K sequences without; "
        "the 128K stage's setting is not published)",
        sizes={"micro_batch": 1, "grad_accum": 16, "virtual_stages": 2},
        workload={"pp_schedule": "interleaved-1f1b", "reshard_after_forward": False},
        model_flops_per_token=LLAMA3_405B_128K_FLOPS,
    ),
    "nemo2407-h100x64-llama3-70b-tp4-pp4-cp2-fp8": Choice(
        "dgx-h100",
        "Transformer Engine fp8 (quant 'fp8'); interleaved 1F1B with the table's VP 5; "
        f"sequence parallel (Megatron's with TP > 1); {CP_RING}; the distributed optimizer "
        "over the 2 replicas and the 2 context ranks (NeMo's default: zero 1); no "
        "activation recompute (not published)",
        sizes={"virtual_stages": 5},
        workload={"quant": "fp8", "zero": 1, "pp_schedule": "interleaved-1f1b"},
        sequence_parallel=True,
    ),
    "mb2511-h100x1024-llama31-405b-tp8-pp8-cp2-vp8-fp8": Choice(
        "dgx-h100",
        "Transformer Engine fp8 current scaling priced as torchao's Float8 tensorwise (quant "
        f"'fp8'); sequence parallel (Megatron's with TP > 1); {CP_RING}; the distributed "
        f"optimizer over the 8 replicas and the 2 context ranks (zero 1); {MB_LLAMA31_REDUCE}; "
        "no activation recompute (not published)",
        workload={"quant": "fp8", "zero": 1, "reduce_dtype": "bf16"},
        sequence_parallel=True,
    ),
    "mb2511-gb200x256-deepseekv3-pp4-vp4-ep64-bf16": Choice(
        "gb200-nvl72", MB_DEEPSEEK, workload={"reduce_dtype": "bf16"}
    ),
    "tt-h100x8-llama31-8b-fsdp4-cp2-fp8": Choice(
        "grand-teton-h100",
        f"full AC; compiled (fusion 'fused'); {FLOAT8}; {CP_FSDP}; {TITAN_H100}; "
        f"{FP32_REDUCE}; Llama 3.1's 131,072 positions",
        overrides={"max_position_embeddings": 131072},
        checkpointing=True,
        workload={"quant": "fp8"},
    ),
    "automodel-h100x64-llama31-70b-fsdp2-cp2": Choice(
        "dgx-h100",
        f"attention and MLP of every layer checkpointed (priced as full AC); compiled; "
        f"{CP_FSDP}; reshard after forward for every layer (the run keeps the last gathered)",
        checkpointing=True,
    ),
    "nemo2407-h100x8-llama3-8b-cp2-fp8": Choice(
        "dgx-h100",
        "Transformer Engine fp8 (quant 'fp8'); Megatron's context parallel priced as torch's "
        "ring attention; the distributed optimizer over the 4 replicas and the 2 context "
        f"ranks (NeMo's default: zero 1); {MEGATRON_ONE_REDUCTION}; no activation recompute "
        "(not published)",
        workload={"quant": "fp8", "zero": 1, "defer_gradient_sync": True},
    ),
    "tt-h200x32-llama31-8b-fsdp32-fp8": Choice(
        "dgx-h200",
        f"{SAC_OP}; compiled (fusion 'fused'); {FLOAT8}; {FLOAT8_GATHER}",
        checkpointing=True,
        workload={"quant": "fp8", **SELECTIVE},
    ),
    "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-1f1b-fp8": Choice(
        "grand-teton-h100",
        TT_405B_FP8,
        checkpointing=True,
        workload=TT_405B_FP8_WORKLOAD,
        sequence_parallel=True,
    ),
    "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-interleaved-fp8": Choice(
        "grand-teton-h100",
        TT_405B_FP8,
        checkpointing=True,
        workload=TT_405B_FP8_WORKLOAD,
        sequence_parallel=True,
    ),
    "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-1f1b-seq32k-fp8": Choice(
        "grand-teton-h100",
        TT_405B_FP8,
        checkpointing=True,
        workload=TT_405B_FP8_WORKLOAD,
        sequence_parallel=True,
    ),
    "trtllm090-a100x8-llama2-70b-tp8-bs512-in128-out2048": Choice(
        "dgx-a100",
        f"{LLAMA2_NOTE}; fp16; {TRT}; the KV cache grows from 128 to 2174 tokens over the "
        "2047 decode steps: each priced as the mean of the first and the last",
        "llama-3-70b",
        LLAMA2_70B,
        dtype="fp16",
    ),
}

_MPT = (
    "MPT-7B: no shipped config of its architecture (llm-foundry's benchmark model: LayerNorm "
    "without biases, GELU MLP, learned positions; transformers' MPT has ALiBi instead)"
)
_FP8_EXPERTS = (
    "FP8 expert weights: DeepSeek-V3's experts are 3-D grouped-GEMM weights, which "
    "torchroof's recipes leave in bf16 (and its 1x128 / 128x128 block scales are not a recipe)"
)
NOT_PREDICTED: dict[str, str] = {
    "foundry-h100x8-mpt7b-fsdp": _MPT,
    "foundry-h100x512-mpt7b-fsdp": _MPT,
    "foundry-a100-40gbx128-mpt7b-fsdp": _MPT,
    # pipeline and expert parallel runs (pp_ep_runs.json)
    "mb2511-gb200x256-qwen3-235b-a22b-pp8-vp3-ep32-bf16": (
        "Qwen3-235B-A22B: no shipped config (its config.json needs the network)"
    ),
    "mb2509-h100x1024-deepseekv3-tp2-pp8-vp4-ep64": (
        "precision not printed (fp8 presumed); TP 2 with EP 64 and sequence parallel "
        "on a MoE model (torchroof's sequence parallel is the Llama layout only)"
    ),
    "deepseekv3-h800x2048-pp16-dualpipe-ep64-zero1": (
        f"H800 NVLink (no cluster ships); a whole-run average; {_FP8_EXPERTS}"
    ),
    "deepseek-day6-h800x32-prefill-ep32-production": f"24 h average; {_FP8_EXPERTS}",
    "deepseek-day6-h800x144-decode-ep144-production": f"24 h average; {_FP8_EXPERTS}",
    "sglang-h100x32-deepseekv3-prefill-ep32-in4096": _FP8_EXPERTS,
    "sglang-h100x72-deepseekv3-decode-ep72-bs256-kv2000": _FP8_EXPERTS,
}


TT_405B_PAIR = (
    "torchtitan's two Llama-3.1-405B rows that differ only in their schedule (1F1B, "
    "interleaved 1F1B at 2 stages per rank), both Float8 (quant 'fp8'), with full "
    "activation checkpointing, parameters kept gathered across micro-batches, sequence + "
    "loss parallel (torchtitan's defaults; async TP not modelled): the ratio of the two "
    "schedules' throughputs"
)
SCHEDULE_PAIRS: dict[str, tuple[str, str, Choice]] = {
    "torchtitan 405B: 1F1B -> interleaved 1F1B": (
        "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-1f1b-fp8",
        "tt-h100x512-llama31-405b-fsdp8-tp8-pp8-interleaved-fp8",
        Choice(
            "grand-teton-h100",
            TT_405B_PAIR,
            checkpointing=True,
            workload=TT_405B_FP8_WORKLOAD,
            sequence_parallel=True,
        ),
    ),
}
"""Runs whose pair differs in one knob: the measured ratio between the two is set beside
torchroof's ratio for the same change."""


# -- requests: one or more priced steps ------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One step torchroof prices, and how many times the measured work runs it."""

    label: str
    model: str
    overrides: Mapping[str, Any]
    regime: str
    hardware: str
    workload: Mapping[str, Any]  # torchroof.config.Workload fields
    fusion: str
    weight: float
    runtime: str = ""  # a runtime profile: its kernels (fusion the profile's) and figures

    @property
    def traced(self) -> dict[str, Any]:
        """The workload as traced: its fields with the runtime's defaults for those not
        given (Megatron's distributed optimizer over dp, torchtitan's gathered parameters
        under a pipeline), as ``--runtime`` sets them."""
        if not self.runtime:
            return dict(self.workload)
        pricing = runtime_options(self.runtime)
        return workload_defaults(pricing, self.workload, regime=self.regime)

    @property
    def trace_key(self) -> str:
        """Equal keys trace the same step."""
        return json.dumps([self.model, self.overrides, self.regime, self.traced], sort_keys=True)

    @property
    def key(self) -> str:
        """Equal keys trace and price the same step (computed once)."""
        return f"{self.trace_key}|{self.hardware}|{self.fusion}|{self.runtime}"

    def pricing(self) -> dict[str, Any]:
        """The pricing keywords: the runtime's kernels where it names one, else its fusion."""
        return {"runtime": self.runtime} if self.runtime else {"fusion": self.fusion}


@dataclass(frozen=True)
class Figure:
    """How the measured figure relates to time: a rate of ``work`` items per second (tokens
    per GPU, say), or a time in units of ``seconds_per_unit``."""

    unit: str
    work: float | None = None  # rate figures: items the measured unit of work holds
    seconds_per_unit: float = 1.0  # time figures

    def seconds(self, value: float) -> float:
        """Time of the measured work, from a figure in this unit."""
        return self.work / value if self.work is not None else value * self.seconds_per_unit

    def value(self, seconds: float) -> float:
        """The figure in this unit for work that takes ``seconds``."""
        return self.work / seconds if self.work is not None else seconds / self.seconds_per_unit


@dataclass(frozen=True)
class Request:
    run_id: str
    phases: tuple[Phase, ...]
    figure: Figure
    note: str
    # a run that was not compiled, priced again with one kernel per op (fusion "eager")
    eager: tuple[Phase, ...] = ()


def sequence_parallel(run: dict[str, Any]) -> bool:
    """The run shards norms and the residual stream over its TP ranks (its parallelism's
    ``sequence_parallel`` is true). torchroof's ``sequence_parallel`` knob is torchtitan's
    plan, which also runs a training step's loss under loss parallel, so a run with one and
    not the other is not expressible."""
    par = run["parallelism"]
    sequence = par.get("sequence_parallel") is True
    if sequence and run["regime"] == "train" and par.get("loss_parallel") is not True:
        raise ValueError(
            f"{run['id']}: sequence parallel without loss parallel; torchroof's "
            "sequence_parallel runs a training step's loss on vocabulary shards as well"
        )
    return sequence


def _phase(run: dict[str, Any], choice: Choice, regime: str, weight: float, **sizes: Any) -> Phase:
    label = {"train": "train step", "prefill": "prefill"}.get(regime, "decode step")
    if regime == "decode":
        label += f" (context {sizes['context']})"
    workload = {"tp": run["parallelism"]["tp"], **sizes}
    sequence = choice.sequence_parallel
    if sequence is None:
        sequence = sequence_parallel(run)
    if sequence:  # written only when on: the other requests stay as they were
        workload["sequence_parallel"] = True
    if regime == "train":
        workload.update(precision="mixed", checkpointing=choice.checkpointing)
    else:
        workload["dtype"] = choice.dtype
        workload.update(choice.workload)  # a training step's are among its sizes
    return Phase(
        label=label,
        model=choice.model or run["model"]["torchroof_config"],
        overrides=dict(choice.overrides),
        regime=regime,
        hardware=choice.hardware,
        workload=workload,
        fusion="fused",  # every run; not compiled ones are priced eager as well
        weight=weight,
    )


def request(run: dict[str, Any], choice: Choice) -> Request:
    """The priced steps for ``run`` and how they become its measured figure.

    train: one step of ``micro_batch`` sequences per rank, ``grad_accum`` micro-batches, fp32
    masters (precision "mixed": bf16 compute), sequence parallel where the run has it
    (:func:`sequence_parallel`); tokens/s per GPU. prefill: time to first
    token. decode (a whole generate call, as measured): the prefill of the prompt, then one
    decode step per further token, at the cache the step attends over."""
    par, regime, unit = run["parallelism"], run["regime"], run["measured"]["unit"]
    if regime == "train":
        published = {**run, **choice.sizes}  # what the source does not say, chosen
        sizes = {
            "batch": published["micro_batch"],
            "seq": run["seq_len"],
            "fsdp": par["dp_shard"],
            "dp": par["dp_replicate"],
            "microbatches": published["grad_accum"],
        }
        pp = par.get("pp") or 1
        if pp > 1:  # pipeline: the schedule is the run's, or the choice's where unnamed
            sizes["pp"] = pp
            sizes["pp_schedule"] = par.get("pp_schedule")
            stages = choice.sizes.get("virtual_stages") or par.get("virtual_stages")
            if stages and stages > 1:
                sizes["virtual_stages"] = stages
        if (par.get("ep") or 1) > 1:
            sizes["ep"] = par["ep"]
        cp = par.get("cp") or 1
        if cp > 1:
            sizes["cp"] = cp
        sizes.update(choice.workload)
        # a pipeline's pp x tp x cp ranks share one replica's tokens
        shared = par["tp"] * pp * cp
        tokens_per_gpu = sizes["batch"] * sizes["seq"] * sizes["microbatches"] / shared
        phases = (_phase(run, choice, "train", 1.0, **sizes),)
        eager = tuple(replace(p, fusion="eager") for p in phases)
        per_token = choice.model_flops_per_token
        work = tokens_per_gpu * per_token / 1e12 if per_token else tokens_per_gpu
        figure = Figure(unit, work=work)
        compiled = run["torch_compile"] is True
        return Request(run["id"], phases, figure, choice.note, () if compiled else eager)
    if regime == "prefill":
        phases = (_phase(run, choice, "prefill", 1.0, batch=run["batch"], seq=run["seq_len"]),)
        return Request(run["id"], phases, Figure(unit, seconds_per_unit=1e-3), choice.note)
    batch, prompt = run["batch"], run["prompt_len"]
    new = run.get("new_tokens") or run["output_len"]
    steps = new - 1  # the prefill yields the first new token
    prefill = _phase(run, choice, "prefill", 1.0, batch=batch, seq=prompt)
    if choice.whole_cache:
        contexts = [prompt + new]
    else:  # the k-th decode step attends over prompt + k - 1 cached tokens
        contexts = [prompt, prompt + steps - 1]
    decodes = tuple(
        _phase(run, choice, "decode", steps / len(contexts), batch=batch, context=c)
        for c in contexts
    )
    generated = batch * new / (run["gpu_count"] if choice.per_gpu else 1)
    return Request(run["id"], (prefill, *decodes), Figure(unit, work=generated), choice.note)


# -- prediction --------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTimes:
    """Where one priced step's time goes (seconds): compute-stream kernels, communication
    the compute stream waited on (exposed) and communication behind compute (hidden). Step
    = compute + exposed on the two-stream schedule (torchroof.timing.streams)."""

    step_s: float
    compute_s: float
    exposed_s: float
    hidden_s: float
    memory_bytes: int | None
    capacity_bytes: int | None
    fits: bool | None
    mfu: float
    # a pipelined step: the slowest rank's idle time within the pipeline (its bubble) and
    # its work after the drain (gradient sync, optimizer); compute_s is then its busy time
    bubble_s: float = 0.0
    after_s: float = 0.0
    pipelined: bool = False


def step_times(est: Estimate) -> StepTimes:
    memory = est.memory
    if est.pipeline is not None:
        step = est.pipeline
        rank = step.ranks[step.slowest_rank]
        after = sum(step.stages[s].after_s for s in rank.stages)
        return StepTimes(
            step_s=est.time_s,
            compute_s=rank.busy_s,
            exposed_s=0.0,
            hidden_s=0.0,
            memory_bytes=memory.total_bytes if memory else None,
            capacity_bytes=memory.capacity_bytes if memory else None,
            fits=memory.fits if memory else None,
            mfu=est.mfu,
            bubble_s=rank.end_s - after - rank.busy_s,
            after_s=after,
            pipelined=True,
        )
    comm = communication(est)
    compute_s = sum(k.time_s for k in est.kernels if not k.communication)
    return StepTimes(
        step_s=est.time_s,
        compute_s=compute_s,
        exposed_s=comm.exposed_s,
        hidden_s=comm.hidden_s,
        memory_bytes=memory.total_bytes if memory else None,
        capacity_bytes=memory.capacity_bytes if memory else None,
        fits=memory.fits if memory else None,
        mfu=est.mfu,
    )


class Pricer:
    """Traces rank 0 of a phase's parallel program and prices it on its cluster, keeping the
    last trace: phases that differ only in their kernel policy (fused and eager) share it."""

    def __init__(self, mode: str = "roofline") -> None:
        self._key: str | None = None
        self._trace: Any = None
        self.mode = mode  # the timing mode: roofline (the pure floor) or realistic

    def __call__(self, phase: Phase) -> StepTimes:
        if phase.trace_key != self._key:
            model: Any = phase.model
            if phase.overrides:
                model = load_config(phase.model)
                for name, value in phase.overrides.items():
                    setattr(model, name, value)
            self._trace = None  # free the last one first
            self._trace = torchroof.trace_model(model, phase.regime, **phase.traced)
            self._key = phase.trace_key
        return step_times(self._trace.estimate(phase.hardware, mode=self.mode, **phase.pricing()))


def weighted_s(phases: tuple[Phase, ...], steps: tuple[StepTimes, ...]) -> float:
    """Time of the measured work: the phases' step times, weighted."""
    return sum(p.weight * s.step_s for p, s in zip(phases, steps, strict=True))


@dataclass(frozen=True)
class Prediction:
    request: Request
    measured: float
    steps: tuple[StepTimes, ...]  # one per phase
    eager_steps: tuple[StepTimes, ...] = ()  # one per request.eager phase

    @property
    def predicted_s(self) -> float:
        return weighted_s(self.request.phases, self.steps)

    @property
    def eager_ratio(self) -> float | None:
        """The ratio with one kernel per op, for a run that was not compiled."""
        if not self.request.eager:
            return None
        return weighted_s(self.request.eager, self.eager_steps) / self.measured_s

    @property
    def measured_s(self) -> float:
        return self.request.figure.seconds(self.measured)

    @property
    def predicted(self) -> float:
        return self.request.figure.value(self.predicted_s)

    @property
    def ratio(self) -> float:
        """predicted / measured time (< 1: torchroof predicts faster)."""
        return self.predicted_s / self.measured_s

    @property
    def main(self) -> tuple[Phase, StepTimes]:
        """The phase that holds most of the predicted time (a generate call's decode)."""
        pairs = zip(self.request.phases, self.steps, strict=True)
        return max(pairs, key=lambda pair: pair[0].weight * pair[1].step_s)

    @property
    def fits(self) -> bool | None:
        fits = [s.fits for s in self.steps]
        return None if None in fits else all(fits)


def predict(
    runs: Iterable[dict[str, Any]],
    progress: Callable[[str], None] = print,
    price_phase: Callable[[Phase], StepTimes] | None = None,
) -> list[Prediction]:
    """Every mapped run of ``runs`` predicted; a step shared by two runs is priced once."""
    price_phase = price_phase or Pricer()
    priced: dict[str, StepTimes] = {}
    out = []
    for run in runs:
        choice = CHOICES.get(run["id"])
        if choice is None:
            continue
        req = request(run, choice)
        for phase in (*req.phases, *req.eager):
            if phase.key not in priced:
                progress(f"  {run['id']}: {phase.label}, {phase.fusion} kernels")
                priced[phase.key] = price_phase(phase)
        steps = tuple(priced[p.key] for p in req.phases)
        eager = tuple(priced[p.key] for p in req.eager)
        out.append(Prediction(req, run["measured"]["value"], steps, eager))
    return out


@dataclass(frozen=True)
class PairPrediction:
    name: str
    first: Prediction
    second: Prediction

    @property
    def measured_ratio(self) -> float:
        """How much faster the second run's step is, as measured."""
        return self.first.measured_s / self.second.measured_s

    @property
    def predicted_ratio(self) -> float:
        return self.first.predicted_s / self.second.predicted_s


def predict_pairs(
    runs: Mapping[str, dict[str, Any]], progress: Callable[[str], None] = print
) -> list[PairPrediction]:
    """Each :data:`SCHEDULE_PAIRS` entry's two runs, priced with its choice."""
    pricer = Pricer()
    out = []
    for name, (first, second, choice) in SCHEDULE_PAIRS.items():
        predicted = []
        for run_id in (first, second):
            req = request(runs[run_id], choice)
            progress(f"  {run_id}: {req.phases[0].label} (pair: {name})")
            steps = tuple(pricer(phase) for phase in req.phases)
            predicted.append(Prediction(req, runs[run_id]["measured"]["value"], steps))
        out.append(PairPrediction(name, predicted[0], predicted[1]))
    return out


PAIR_HEADERS = ["pair", "measured", "ratio", "torchroof", "ratio", "note"]


def pair_rows(pairs: list[PairPrediction]) -> list[list]:
    rows = []
    for pair in pairs:
        unit = _unit(pair.first.request.figure.unit)
        rows.append(
            [
                pair.name,
                f"{_number(pair.first.measured)} -> {_number(pair.second.measured)} {unit}",
                f"{pair.measured_ratio:.2f}x",
                f"{_number(pair.first.predicted)} -> {_number(pair.second.predicted)}",
                f"{pair.predicted_ratio:.2f}x",
                pair.first.request.note,
            ]
        )
    return rows


# -- collective anchors ------------------------------------------------------------------


@dataclass(frozen=True)
class Anchor:
    """One measured collective point against torchroof.timing.network.collective_time."""

    anchor_id: str
    label: str
    kind: str
    size_bytes: int
    ranks: tuple[int, ...]
    cluster: str
    nvls: bool
    measured_busbw: float  # bytes/s, nccl-tests bus bandwidth
    note: str = ""

    @property
    def measured_s(self) -> float:
        return bus_factor(self.kind, len(self.ranks)) * self.size_bytes / self.measured_busbw

    def predicted(self) -> tuple[float, float, str]:
        """(time s, bus bandwidth B/s, algorithm) torchroof gives the same collective."""
        t = collective_time(
            self.kind, self.size_bytes, self.ranks, get_cluster(self.cluster), nvls=self.nvls
        )
        busbw = bus_factor(self.kind, len(self.ranks)) * self.size_bytes / t.time_s
        return t.time_s, busbw, t.algorithm


def _node_ranks(nodes: int, per_node: int, gpus_per_node: int = 8) -> tuple[int, ...]:
    """Ranks of ``per_node`` GPUs on each of ``nodes`` nodes (numbered node-major)."""
    return tuple(n * gpus_per_node + g for n in range(nodes) for g in range(per_node))


SELF_SOURCE = "the cluster spec's own source: agrees by construction"


def anchors(collectives: list[dict[str, Any]]) -> list[Anchor]:
    """The JSON's collective entries as comparable points (sizes 'large' taken as 16 GiB)."""
    by_id = {c["id"]: c for c in collectives}
    out: list[Anchor] = []

    def single(cid: str, kind: str, cluster: str, nvls: bool, note: str = "") -> None:
        c = by_id[cid]
        ranks = _node_ranks(c["nodes"], c["ranks"] // c["nodes"])
        label = f"{c['system'].split(' (')[0]}, {kind} {c['algorithm'].split(' (')[0]}"
        out.append(
            Anchor(cid, label, kind, c["size_bytes"], ranks, cluster, nvls,
                   c["busbw_GBps"] * GB, note)
        )  # fmt: skip

    single("c-h200x8-allreduce-nvls-16g", "all_reduce", "dgx-h200", True)
    single("c-h200x8-allreduce-ring-16g", "all_reduce", "dgx-h200", False)
    single("c-h200x8-allgather-16g", "all_gather", "dgx-h200", True)
    single("c-h200x8-reducescatter-16g", "reduce_scatter", "dgx-h200", True)
    single(
        "c-h200x32-p5en-allreduce-ring-4g", "all_reduce", "aws-p5", True,
        "p5en (H200, EFA v3) priced on aws-p5 (EFA v2, same 400 Gb/s per GPU)",
    )  # fmt: skip
    for cid, cluster, note, nvls_above in (
        ("c-h200x8-allreduce-small", "dgx-h200", "torch all_reduce_bench", 2**20),
        ("c-a100x8-allreduce-sweep", "dgx-a100", "", None),
        ("c-h100x16-2node-allreduce-8g", "dgx-h100",
         "A3 Mega (8x 200 Gb/s per node) priced on dgx-h100 (8x 400 Gb/s)", None),
    ):  # fmt: skip
        c = by_id[cid]
        ranks = _node_ranks(c["nodes"], c["ranks"] // c["nodes"])
        for point in c["points"]:
            size = point["size_bytes"]
            nvls = nvls_above is not None and size > nvls_above
            out.append(
                Anchor(cid, f"{c['system'].split(' (')[0]}, all_reduce {_size(size)}",
                       "all_reduce", size, ranks, cluster, nvls, point["busbw_GBps"] * GB, note)
            )  # fmt: skip
    maintainer = by_id["c-h100x8-maintainer-ring-nvls"]["busbw_GBps"]
    one_node = _node_ranks(1, 8)
    size = 16 * GIB
    out += [
        Anchor("c-h100x8-maintainer-ring-nvls", "8x H100, all_gather ring (size not stated)",
               "all_gather", size, one_node, "dgx-h100", True,
               maintainer["ring_effective"] * GB, SELF_SOURCE),
        Anchor("c-h100x8-maintainer-ring-nvls", "8x H100, all_reduce NVLS (size not stated)",
               "all_reduce", size, one_node, "dgx-h100", True,
               maintainer["nvls_allreduce_peak"] * GB, SELF_SOURCE),
    ]  # fmt: skip
    ndr = by_id["c-h100-ndr-per-nic"]["busbw_GBps"]
    low, high = (float(x) for x in ndr["per_ndr_400g_nic"].split("-"))
    out += [
        Anchor("c-h100-ndr-per-nic", "8x H100, all_reduce NVLS (size not stated)",
               "all_reduce", size, one_node, "dgx-h100", True,
               ndr["h100x8_single_node_nvls"] * GB),
        Anchor("c-h100-ndr-per-nic", "2 nodes, 1 GPU each, all_reduce over NDR 400 Gb/s",
               "all_reduce", size, _node_ranks(2, 1), "dgx-h100", True,
               (low + high) / 2 * GB, SELF_SOURCE),
    ]  # fmt: skip
    return out


def _size(size: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


# -- rendering -------------------------------------------------------------------------------


def _short_gpu(run: dict[str, Any]) -> str:
    return f"{run['gpu_count']}x {run['gpu']['type'].split(' (')[0].split(',')[0]}"


def parallelism(run: dict[str, Any]) -> str:
    """``TP 8 x FSDP 32`` from the run's degrees above one."""
    par = run["parallelism"]
    names = (
        ("tp", "TP"),
        ("cp", "CP"),
        ("pp", "PP"),
        ("ep", "EP"),
        ("dp_shard", "FSDP"),
        ("dp_replicate", "DP"),
    )
    dims = [f"{label} {par[key]}" for key, label in names if (par.get(key) or 1) > 1]
    return " x ".join(dims) or "1 GPU"


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _unit(unit: str) -> str:
    """The published unit without its parenthesis (``tokens/s (per GPU, inferred)`` keeps
    ``per GPU``)."""
    head, _, rest = unit.partition(" (")
    return f"{head} per GPU" if "per GPU" in rest and "per GPU" not in head else head


def _ratio(p: Prediction) -> str:
    """``0.34``, and for a run that was not compiled ``0.34 (eager 0.45)``."""
    eager = p.eager_ratio
    return f"{p.ratio:.2f}" + (f" (eager {eager:.2f})" if eager is not None else "")


def _where(p: Prediction) -> str:
    phase, s = p.main
    ms = 1e3
    if s.pipelined:  # the slowest rank: its actions, its bubble, its work after the drain
        return (
            f"{phase.label} (slowest rank): actions {s.compute_s * ms:,.1f} + bubble "
            f"{s.bubble_s * ms:,.1f} + after the drain {s.after_s * ms:,.1f}"
        )
    return (
        f"{phase.label}: {s.compute_s * ms:,.1f} / {s.exposed_s * ms:,.1f} / {s.hidden_s * ms:,.1f}"
    )


def prediction_rows(runs: dict[str, dict[str, Any]], predictions: list[Prediction]) -> list[list]:
    rows = []
    for p in predictions:
        run = runs[p.request.run_id]
        phase = p.request.phases[0]
        rows.append(
            [
                p.request.run_id,
                f"{_short_gpu(run)} ({phase.hardware})",
                parallelism(run),
                f"{_number(p.measured)} {_unit(p.request.figure.unit)}",
                _number(p.predicted),
                _ratio(p),
                _where(p),
            ]
        )
    return rows


PREDICTION_HEADERS = [
    "run",
    "hardware (priced on)",
    "parallelism",
    "measured",
    "predicted",
    "ratio",
    "where the time goes: compute / exposed / hidden comm, ms",
]


NOT_PREDICTED_HEADERS = ["not predicted", "hardware", "parallelism", "measured", "why"]


def not_predicted_rows(runs: dict[str, dict[str, Any]]) -> list[list]:
    return [
        [
            rid,
            _short_gpu(runs[rid]),
            parallelism(runs[rid]),
            f"{_number(runs[rid]['measured']['value'])} {_unit(runs[rid]['measured']['unit'])}",
            reason,
        ]
        for rid, reason in NOT_PREDICTED.items()
    ]


def anchor_rows(points: list[Anchor]) -> list[list]:
    rows = []
    for a in points:
        time_s, busbw, algorithm = a.predicted()
        rows.append(
            [
                a.label,
                _size(a.size_bytes),
                f"{len(a.ranks)} on {a.cluster} ({algorithm})",
                f"{a.measured_busbw / GB:.1f}",
                f"{busbw / GB:.1f}",
                f"{time_s / a.measured_s:.2f}",
                a.note,
            ]
        )
    return rows


ANCHOR_HEADERS = [
    "collective",
    "size",
    "ranks (torchroof)",
    "measured busbw GB/s",
    "torchroof busbw GB/s",
    "ratio (time)",
    "note",
]


def markdown(rows: list[list], headers: list[str]) -> str:
    """A table to paste into the README (cells kept as written: no number parsing)."""
    return tabulate(rows, headers, tablefmt="github", disable_numparse=True)


def summary(ratios: list[float]) -> str:
    return (
        f"{len(ratios)} runs predicted: median ratio {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f} (predicted / measured time)"
    )


# -- the checked-in file ---------------------------------------------------------------------


def _step_json(phase: Phase, s: StepTimes) -> dict[str, Any]:
    return {
        "phase": phase.label,
        "weight": phase.weight,
        "step_ms": s.step_s * 1e3,
        "compute_ms": s.compute_s * 1e3,
        "exposed_communication_ms": s.exposed_s * 1e3,
        "hidden_communication_ms": s.hidden_s * 1e3,
        "memory_per_rank_gb": s.memory_bytes / GB if s.memory_bytes is not None else None,
        "capacity_gb": s.capacity_bytes / GB if s.capacity_bytes is not None else None,
        "fits": s.fits,
        "mfu": s.mfu,
        **(
            {"bubble_ms": s.bubble_s * 1e3, "after_drain_ms": s.after_s * 1e3}
            if s.pipelined
            else {}
        ),
    }


def prediction_json(p: Prediction, run: dict[str, Any]) -> dict[str, Any]:
    req = p.request
    entry: dict[str, Any] = {
        "id": req.run_id,
        "request": [
            {
                "model": ph.model,
                "config_overrides": dict(ph.overrides),
                "regime": ph.regime,
                "hardware": ph.hardware,
                "fusion": ph.fusion,
                **ph.workload,
            }
            for ph in req.phases
        ],
        "note": req.note,
        "unit": req.figure.unit,
        "measured": p.measured,
        "predicted": p.predicted,
        "measured_s": p.measured_s,
        "predicted_s": p.predicted_s,
        "ratio": p.ratio,
        "fits": p.fits,
        "steps": [_step_json(ph, s) for ph, s in zip(req.phases, p.steps, strict=True)],
    }
    if p.eager_ratio is not None:
        entry["eager_kernels"] = {
            "predicted": req.figure.value(weighted_s(req.eager, p.eager_steps)),
            "ratio": p.eager_ratio,
        }
    published_mfu = run["measured"].get("also", {}).get("mfu_percent")
    if run["regime"] == "train":
        entry["mfu_torchroof_flops"] = p.steps[0].mfu
        entry["mfu_published"] = published_mfu / 100 if published_mfu else None
    return entry


def versions() -> dict[str, str]:
    """The library versions a predictions file was written with."""
    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}


def ratio_summary(ratios: list[float]) -> dict[str, Any]:
    """How many runs were predicted and the median and range of predicted / measured."""
    return {
        "predicted": len(ratios),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }


def write(
    path: Path,
    data: dict[str, Any],
    predictions: list[Prediction],
    pairs: list[PairPrediction] = (),  # type: ignore[assignment]
) -> None:
    runs = {r["id"]: r for r in data["runs"]}
    ratios = [p.ratio for p in predictions]
    out = {
        "description": "torchroof's predictions of examples/validation/multi_gpu_runs.json "
        "and pp_ep_runs.json, "
        "written by examples/multi_gpu_validation.py --write. ratio = predicted / measured "
        "time (< 1: torchroof predicts faster).",
        "versions": versions(),
        "summary": ratio_summary(ratios),
        "runs": [prediction_json(p, runs[p.request.run_id]) for p in predictions],
        "not_predicted": [{"id": rid, "reason": reason} for rid, reason in NOT_PREDICTED.items()],
        "schedule_pairs": [
            {
                "pair": pair.name,
                "runs": [pair.first.request.run_id, pair.second.request.run_id],
                "measured_ratio": pair.measured_ratio,
                "predicted_ratio": pair.predicted_ratio,
                "steps_ms": [pair.first.predicted_s * 1e3, pair.second.predicted_s * 1e3],
                "note": pair.first.request.note,
            }
            for pair in pairs
        ],
    }
    path.write_text(json.dumps(out, indent=1) + "\n")


def load_data() -> dict[str, Any]:
    """The runs of :data:`RUNS_JSON` then :data:`PP_EP_RUNS_JSON`, and the collective
    anchors of the first."""
    data = json.loads(RUNS_JSON.read_text())
    more = json.loads(PP_EP_RUNS_JSON.read_text())
    return {**data, "runs": [*data["runs"], *more["runs"]]}


def quiet() -> None:
    """FSDP2's per-module view warning and transformers' cache notice repeat for every
    trace; they say nothing about the numbers."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    transformers.logging.set_verbosity_error()
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def run_parser(doc: str, predictions: Path) -> argparse.ArgumentParser:
    """The validation scripts' shared flags: ``--write`` (refresh ``predictions``) and
    ``--run ID`` (repeatable)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"refresh {predictions.name}")
    parser.add_argument("--run", action="append", default=[], help="only this run id (repeat)")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress on stderr (each run priced, its time)"
    )
    return parser


def stage_lines(args: argparse.Namespace) -> tuple[Reporter, Callable[[str], None]]:
    """The script's progress: each run's step as one line on stderr with its time (a bar on
    a terminal), nothing with ``--quiet``; torchroof's own stages stay silent."""
    report = progress_reporter(not args.quiet)
    return report, lambda text: report.begin(text.strip())


def check_runs(
    parser: argparse.ArgumentParser, args: argparse.Namespace, ids: Iterable[str], source: Path
) -> None:
    """Refuse an unknown ``--run`` id (naming the file the ids are in), and ``--write`` with
    ``--run`` (a predictions file holds every run)."""
    known = set(ids)
    unknown = [rid for rid in args.run if rid not in known]
    if unknown:
        parser.error(f"unknown run id {', '.join(unknown)}; ids are in {source.name}")
    if args.write and args.run:
        parser.error("--write refreshes every run: leave out --run")


def main() -> None:
    parser = run_parser(__doc__, PREDICTIONS_JSON)
    parser.add_argument(
        "--mode",
        choices=("roofline", "realistic"),
        default="roofline",
        help="timing mode (--write stores the pure roofline's predictions only)",
    )
    parser.add_argument(
        "--markdown",
        metavar="PAGE",
        help="write this script's tables, from the checked-in predictions (no pricing), into "
        "the docs page PAGE (docs/validation/multi-gpu.md)",
    )
    args = parser.parse_args()
    if args.markdown:
        import validation_markdown

        tables = validation_markdown.multi_gpu_tables()
        validation_markdown.write_page(args.markdown, tables, Path(__file__).name)
        return
    data = load_data()
    runs = {r["id"]: r for r in data["runs"]}
    check_runs(parser, args, runs, RUNS_JSON)
    if args.write and args.mode != "roofline":
        parser.error("--write stores the pure roofline's predictions: leave out --mode")
    quiet()
    chosen = [runs[rid] for rid in args.run] if args.run else data["runs"]
    pairs: list[PairPrediction] = []
    print("pricing ...")
    report, stage = stage_lines(args)
    predictions = predict(chosen, progress=stage, price_phase=Pricer(args.mode))
    report.end()
    print()
    print(markdown(prediction_rows(runs, predictions), PREDICTION_HEADERS))
    if not args.run:
        print()
        print(markdown(not_predicted_rows(runs), NOT_PREDICTED_HEADERS))
        print()
        print(markdown(anchor_rows(anchors(data["collectives"])), ANCHOR_HEADERS))
        print("pricing the schedule pairs ...")
        pairs = predict_pairs(runs, progress=stage)
        report.end()
        print(markdown(pair_rows(pairs), PAIR_HEADERS))
    if predictions:
        print()
        print(summary([p.ratio for p in predictions]))
    if args.write:
        write(PREDICTIONS_JSON, data, predictions, pairs)
        print(f"wrote {PREDICTIONS_JSON}")


if __name__ == "__main__":
    main()

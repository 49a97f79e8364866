"""Every knob, defined once: what step to trace (:class:`Workload`) and how to price it
(:class:`PricingOptions`).

The Python API (``estimate``, ``trace_model``, ``estimate_trace``, ``compare``, ``sweep``),
the CLI (each flag's name, help, choices and default are generated from these fields) and
``compare --vary KEY=...`` all read these two dataclasses, so a knob added here reaches
every entry point. ``hardware`` (where the step runs) is the one other argument.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from torchroof.config.errors import OptionError, WorkloadError
from torchroof.config.limits import DEFAULT_MAX_OPS, MAX_WORLD_SIZE  # why 10M: see there
from torchroof.parallel.pipeline.schedule import (
    INTERLEAVED,
    SCHEDULES,
    SPLIT_BACKWARD,
    stages_per_rank,
)
from torchroof.parallel.program import ParallelPlan
from torchroof.quant.recipes import KV_DTYPES, QUANTS, check_recipe
from torchroof.workloads.inference import CACHES, MLA_DECODES
from torchroof.workloads.registry import REGIMES, regime
from torchroof.workloads.spec import DEFAULT_SEQ  # 4096, or the model's maximum if shorter
from torchroof.workloads.train import OPTIMIZERS, PRECISIONS

DTYPES = ("bf16", "fp16", "fp32")
# Workload fields that size the parallel program (issue 13), and those only a step that
# trains can have above 1.
PARALLEL_SIZES = ("tp", "fsdp", "dp", "cp", "pp", "ep", "virtual_stages", "microbatches")
TRAINING_SIZES = ("fsdp", "microbatches")

DEFAULT_PP_SCHEDULE = "1f1b"  # torchtitan's default
DEFAULT_VIRTUAL_STAGES = 2  # an interleaved schedule's stages per rank unless given

FUSION_POLICIES = ("eager", "fused")
LOSS_POLICIES = ("materialized", "chunked")
ATTENTION_POLICIES = ("flash", "math")
TIMING_MODES = ("roofline", "realistic")


def parse_gemm_tile(text: str) -> tuple[int, int] | None:
    """``"256x128"`` -> (256, 128); ``"auto"`` -> None (torchroof.timing.hierarchy's heuristic)."""
    if text == "auto":
        return None
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise OptionError(
            f"gemm_tile is TmxTn with positive whole numbers (e.g. 256x128) or auto, got {text!r}"
        )
    return int(parts[0]), int(parts[1])


# seed 000 Lab 3: real fused kernels start spilling past roughly 64 KB of live state per
# 256-thread block; a row-wise kernel keeps about one row per thread group in flight.
DEFAULT_ON_CHIP_BUDGET_BYTES = 64 * 1024


def knob(
    default: Any,
    help: str,  # noqa: A002 - argparse's word
    *,
    choices: tuple[str, ...] = (),
    flag: str | None = None,
    scale: float = 1.0,
    group: str = "workload",
    off: str = "",
) -> Any:
    """A dataclass field with what the CLI needs: its help text, its choices, the
    ``--help`` section it is listed in (a key of :data:`FLAG_GROUPS`), and for a flag in
    other units than the field (``--launch-overhead-us`` for seconds) the name and the
    factor that converts the flag's value to the field's. A boolean's ``help`` says what
    True does and ``off`` what False does, so ``--name`` and ``--no-name`` each say what
    they turn on whichever the default."""
    meta = {
        "help": help,
        "choices": choices,
        "flag": flag,
        "scale": scale,
        "group": group,
        "off": off,
    }
    return field(default=default, metadata=meta)


def _choose(
    name: str, value: Any, known: tuple[str, ...], error: type[OptionError] = OptionError
) -> None:
    if value not in known:
        raise error(f"unknown {name} {value!r}; choose one of {', '.join(known)}")


def _finite_numbers(options: Any, error: type[OptionError] = OptionError) -> None:
    """Every float field of ``options`` a finite number (nan and inf pass a comparison
    check the wrong way, or price as inf): the field and its flag named."""
    for f in fields(options):
        value = getattr(options, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{f.name} ({_flag(f)}) must be a finite number, got {value!r}")


def _positive_int(name: str, value: Any, error: type[OptionError] = OptionError) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """What step to trace.

    ``precision`` (train only): ``bf16`` / ``fp16`` / ``fp32`` keep parameters, gradients
    and optimizer state in that dtype; ``mixed`` is bf16 compute with fp32 master weights,
    fp32 gradients and fp32 optimizer state, the bf16 weights rewritten by the optimizer
    (seed 000 §16: 30 B/param for AdamW), the default, as most training stacks run.
    ``seq`` left out is :data:`DEFAULT_SEQ` (4096), or the model's maximum positions where
    that is shorter (GPT-2: 1024), resolved once the model's config is known
    (:func:`torchroof.api.resolve_seq`); ``context`` left out is ``seq``.

    Across GPUs (issue 13) the step is rank 0 of the real parallel program: ``tp`` ranks
    share each layer (the model's tensor-parallel plan), ``fsdp`` ranks share each
    parameter, ``dp`` replicas (HSDP with ``fsdp``) each hold their own data, ``cp`` ranks
    split each sequence (torch's ring attention exchanges their K/V). ``batch`` is
    the sequences one rank's replica processes per micro-batch; a training step runs
    ``microbatches`` of them before its one optimizer step.
    """

    regime: str = knob("prefill", "the step: " + ", ".join(REGIMES), choices=REGIMES)
    batch: int = knob(
        1,
        "sequences per rank per micro-batch (the global batch is batch x dp x fsdp x "
        "microbatches; tp and cp ranks share their sequences)",
    )
    seq: int | None = knob(
        None,
        f"tokens per sequence (prefill, train; default {DEFAULT_SEQ}, or the model's maximum "
        "positions if shorter)",
    )
    context: int | None = knob(None, "tokens already in the KV cache (decode; default --seq)")
    cache: str = knob(
        "static",
        "decode cache: static (in place) or dynamic (HF DynamicCache, cat)",
        choices=CACHES,
    )
    optimizer: str = knob("adamw", "train: the optimizer", choices=OPTIMIZERS)
    precision: str = knob(
        "mixed",
        "train: mixed (bf16 compute, fp32 master weights, gradients and state), or "
        "bf16/fp16/fp32 throughout",
        choices=PRECISIONS,
        group="precision",
    )
    checkpointing: bool = knob(False, "train: activation checkpointing (recompute in backward)")
    mla: str = knob(
        "absorbed",
        "decode of latent-attention models (DeepSeek): absorbed (FlashMLA) or expanded",
        choices=MLA_DECODES,
    )
    dtype: str = knob(
        "bf16", "prefill/decode: the model's dtype", choices=DTYPES, group="precision"
    )
    quant: str = knob(
        "none",
        "quantised linear layers (torchroof.quant.recipes): fp8 / fp8-rowwise (train: torchao "
        "Float8; serve: fp8 activations and weights), int8-weight, fp8-weight, int4-weight, "
        "mxfp4-weight (weight-only, dequantised inside the GEMM), nvfp4 (fp4 tensor cores)",
        choices=QUANTS,
        group="precision",
    )
    kv_dtype: str = knob(
        "model",
        "prefill/decode: the KV cache's dtype (model: the model's; fp8 / int8: quantised "
        "on write, read by the attention kernel at 1 B per element)",
        choices=KV_DTYPES,
        group="precision",
    )
    allow_beyond_max_positions: bool = knob(
        False, "price sequences longer than the model's maximum positions (an assumption line)"
    )
    max_ops: int = knob(
        DEFAULT_MAX_OPS, "stop a trace past this many aten ops (a data-dependent loop on meta)"
    )
    tp: int = knob(
        1,
        "tensor-parallel ranks (the model's own TP plan); rank 0 is traced",
        group="parallelism",
    )
    sequence_parallel: bool = knob(
        False,
        "with --tp: torchtitan's tensor + sequence parallel plan (Llama layout): norms on "
        "T/tp tokens, reduce-scatter + all-gather for each all-reduce, loss on vocab shards",
        group="parallelism",
    )
    fsdp: int = knob(
        1, "train: ranks each parameter is sharded over (FSDP2, ZeRO-3)", group="parallelism"
    )
    dp: int = knob(
        1,
        "data-parallel replicas (train: HSDP's replicate dimension with --fsdp; serving: "
        "each rank its own batch, e.g. attention beside --ep)",
        group="parallelism",
    )
    ep: int = knob(
        1,
        "expert-parallel ranks: routed experts sharded over them, tokens sent to their "
        "experts' ranks by all-to-all (transformers' all_to_all dispatch); ep divides "
        "dp x fsdp x tp and is a multiple of tp",
        group="parallelism",
    )
    cp: int = knob(
        1,
        "context-parallel ranks each sequence is split over (ring attention)",
        group="parallelism",
    )
    reshard_after_forward: bool = knob(
        True,
        "FSDP: free gathered parameters after forward, gather them again for backward",
        off="FSDP: keep parameters gathered in forward for backward (~ZeRO-2)",
        group="parallelism",
    )
    microbatches: int = knob(
        1,
        "train: forward+backward passes of --batch sequences per optimizer step; with --pp "
        "also prefill/decode: micro-batches of --batch sequences through the pipeline",
        group="parallelism",
    )
    pp: int = knob(
        1,
        "pipeline stages (torch.distributed.pipelining's schedules); one trace per distinct stage",
        group="parallelism",
    )
    pp_schedule: str = knob(
        DEFAULT_PP_SCHEDULE,
        "with --pp: the schedule whose action order is laid out",
        choices=tuple(SCHEDULES),
        group="parallelism",
    )
    virtual_stages: int = knob(
        DEFAULT_VIRTUAL_STAGES,
        "with --pp and an interleaved schedule: stages per rank (V schedules hold 2)",
        group="parallelism",
    )
    pp_split: str = knob(
        "",
        "with --pp: decoder layers per stage, e.g. 16,16,15,15 (default: an even split, the "
        "remainder to the first stages, as transformers splits)",
        group="parallelism",
    )
    defer_gradient_sync: bool = knob(
        False,
        "FSDP with micro-batches: reduce gradients on the last one only (unsharded ones held)",
        group="parallelism",
    )

    def __post_init__(self) -> None:
        bad = WorkloadError
        regime(self.regime)  # a WorkloadError naming the known regimes
        _positive_int("batch", self.batch, bad)
        if self.seq is not None:  # None: DEFAULT_SEQ, or the model's maximum if shorter
            _positive_int("seq", self.seq, bad)
        if self.context is None and self.seq is not None:
            object.__setattr__(self, "context", self.seq)
        if self.context is not None:
            _positive_int("context", self.context, bad)
        _choose("cache", self.cache, CACHES, bad)
        _choose("optimizer", self.optimizer, OPTIMIZERS, bad)
        _choose("precision", self.precision, PRECISIONS, bad)
        _choose("mla", self.mla, MLA_DECODES, bad)
        _choose("dtype", self.dtype, DTYPES, bad)
        _choose("quant", self.quant, QUANTS, bad)
        _choose("kv_dtype", self.kv_dtype, KV_DTYPES, bad)
        check_recipe(self.quant, regime(self.regime).trains, self.kv_dtype, self.tp)
        self._check_train_dtype()
        self._check_applies()
        _positive_int("max_ops", self.max_ops, bad)
        self._check_parallel()

    def _check_applies(self) -> None:
        """A knob set away from its default for a regime that never reads it (a KV cache
        for a training step, a latent-attention decode for a prefill) would be dropped
        silently: refused, naming what it needs. The training knobs (optimizer, precision)
        and those of a parallel degree (sequence parallel at tp=1) are left alone: one set
        of knobs is shared by the steps of a comparison."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in ("cache", "mla"):  # the knobs only some regimes read (Regime.knobs)
            value = getattr(self, name)
            if value != defaults[name] and name not in regime(self.regime).knobs:
                readers = [r for r in REGIMES if name in regime(r).knobs]
                raise WorkloadError(
                    f"{name}={value!r} applies to a {' or '.join(readers)} step (--regime); "
                    f"this {self.regime} step would ignore it"
                )

    def _check_train_dtype(self) -> None:
        """A training step computes in its precision's dtype; a dtype other than the default
        (or the precision's own) would be dropped silently: refused, naming the knob that
        does apply."""
        default = next(f.default for f in fields(self) if f.name == "dtype")
        if not regime(self.regime).trains or self.dtype in (default, self.precision):
            return
        raise WorkloadError(
            f"dtype={self.dtype} does not apply to a training step: it computes in its "
            f"precision's dtype (precision={self.precision}); use precision={self.dtype} "
            "(CLI: --precision)"
        )

    def _check_parallel(self) -> None:
        """Every size a positive integer; sharding parameters over data (fsdp) and
        micro-batches of an optimizer step are training concepts: an inference step takes
        tp, cp, pp (micro-batches through the pipeline), dp replicas (each its own batch)
        and ep; context parallel as :meth:`_check_context_parallel` allows."""
        for name in PARALLEL_SIZES:
            _positive_int(name, getattr(self, name), WorkloadError)
        world = self.tp * self.dp * self.fsdp * self.cp * self.pp
        if world > MAX_WORLD_SIZE:
            raise WorkloadError(
                f"tp x dp x fsdp x cp x pp = {world:,} GPUs is above the world-size budget "
                f"of {MAX_WORLD_SIZE:,} (torchroof.config.limits.MAX_WORLD_SIZE)"
            )
        if self.cp > 1:
            self._check_context_parallel()
        if self.pp > 1:
            self._check_pipeline()
        else:
            given = {
                "pp_schedule": self.pp_schedule != DEFAULT_PP_SCHEDULE,
                "virtual_stages": self.virtual_stages != DEFAULT_VIRTUAL_STAGES,
                "pp_split": bool(self.pp_split),
            }
            if any(given.values()):
                names = ", ".join(name for name, set_ in given.items() if set_)
                raise WorkloadError(f"{names} shape a pipeline: give pp > 1 with them")
        if self.ep > 1:
            self._check_expert_parallel()
        if not regime(self.regime).trains:
            for name in TRAINING_SIZES:
                if name == "microbatches" and self.pp > 1:
                    continue  # micro-batches through an inference pipeline
                if getattr(self, name) > 1:
                    trains = ", ".join(r for r in REGIMES if regime(r).trains)
                    raise WorkloadError(
                        f"{name}={getattr(self, name)} applies to a step that trains "
                        f"({trains}); a {self.regime} step takes tp, cp, pp (with micro-"
                        "batches), dp replicas and ep"
                    )

    def _check_expert_parallel(self) -> None:
        """EP groups are consecutive ranks of one stage holding different batches (dp,
        fsdp) or one batch (tp): ep must be a multiple of tp and divide dp x fsdp x tp
        (transformers' DistributedConfig asks the same); not with context parallel."""
        ep, tp = self.ep, self.tp
        if ep % tp or (self.dp * self.fsdp * tp) % ep:
            raise WorkloadError(
                f"ep={ep} must be a multiple of tp={tp} and divide dp x fsdp x tp = "
                f"{self.dp * self.fsdp * tp}: raise dp (serving) or fsdp (training)"
            )
        if self.cp > 1:
            raise WorkloadError(f"ep={ep} does not yet compose with context parallel")

    def _check_pipeline(self) -> None:
        """Pipeline stages compose with tensor (and sequence) parallel, FSDP / HSDP and EP (one
        stage's program); not (yet) with context parallel; torch's split backward (zero-bubble
        schedules) runs autograd.grad, which FSDP2's hooks do not reduce and which cannot
        separate the weight gradients of transformers' tensor-parallel layers."""
        if self.cp > 1:
            raise WorkloadError(f"pp={self.pp} does not yet compose with context parallel")
        if (
            self.pp_schedule in SPLIT_BACKWARD
            and self.fsdp * self.dp > 1
            and regime(self.regime).trains
        ):
            raise WorkloadError(
                f"the {self.pp_schedule} schedule splits each backward (torch's "
                "stage_backward_input / stage_backward_weight), which FSDP2's gradient "
                "reduction does not follow here: use 1f1b, gpipe or interleaved-1f1b with fsdp"
            )
        if self.pp_schedule in SPLIT_BACKWARD and self.tp > 1 and regime(self.regime).trains:
            raise WorkloadError(
                f"the {self.pp_schedule} schedule splits each backward into input and weight "
                "gradients (torch's stage_backward_input / stage_backward_weight), which "
                "cannot separate the weight gradients of transformers' tensor-parallel layers "
                "(they compute on local shards: W would be empty): use 1f1b, gpipe or "
                "interleaved-1f1b with tp"
            )
        _ = self.pipeline_split  # a WorkloadError for a malformed pp_split
        if not regime(self.regime).trains and self.pp_schedule != DEFAULT_PP_SCHEDULE:
            raise WorkloadError(
                f"pp_schedule={self.pp_schedule!r}: a {self.regime} step has no backward, so "
                "its pipeline runs the forwards in GPipe's order; schedules are for training"
            )
        interleaved = self.pp_schedule in INTERLEAVED
        if interleaved and self.virtual_stages < 2:
            raise WorkloadError(
                f"{self.pp_schedule} interleaves at least 2 stages per rank, got "
                f"virtual_stages={self.virtual_stages} (one stage per rank: pp_schedule=1f1b)"
            )
        if self.virtual_stages != DEFAULT_VIRTUAL_STAGES and not interleaved:
            raise WorkloadError(
                f"virtual_stages={self.virtual_stages} applies to an interleaved schedule "
                f"({', '.join(sorted(INTERLEAVED))}); {self.pp_schedule} holds "
                f"{stages_per_rank(self.pp_schedule, 1)} stage(s) per rank"
            )

    @property
    def pipeline_split(self) -> tuple[int, ...]:
        """``pp_split`` as layer counts (empty: the even split)."""
        if not self.pp_split:
            return ()
        try:
            counts = tuple(int(part) for part in self.pp_split.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            raise WorkloadError(
                f"pp_split must list each stage's decoder layers as positive integers "
                f"(16,16,15,15), got {self.pp_split!r}"
            )
        return counts

    def _check_context_parallel(self) -> None:
        """Context parallel (torch's load-balanced ring attention, torchroof.parallel.program
        .apply_context_parallel) splits each sequence of the step into 2·cp equal chunks;
        it composes with tensor (and sequence) parallel only, and an inference step keeps each
        rank's own K/V (a dynamic cache: a static one is built for the whole sequence)."""
        cp = self.cp
        if self.fsdp * self.dp > 1:
            raise WorkloadError(
                f"cp={cp} does not yet compose with fsdp or dp (torchtitan shards parameters "
                "over the dp x fsdp x cp ranks; not done here): use cp with tp"
            )
        # seq left out: checked again once the model's default is resolved
        if self.seq is not None and regime(self.regime).tokens(self) < self.batch * self.seq:
            raise WorkloadError(
                f"cp={cp} splits each sequence's seq new tokens over the cp ranks; a "
                f"{self.regime} step has fewer ({regime(self.regime).tokens(self)} for "
                f"{self.batch} sequences)"
            )
        if self.seq is not None and self.seq % (2 * cp):
            raise WorkloadError(
                f"cp={cp} splits each sequence into 2 x cp = {2 * cp} equal chunks (torch's "
                f"head-tail load balancing): seq={self.seq} does not divide"
            )
        if not regime(self.regime).trains and self.cache != "dynamic":
            raise WorkloadError(
                f"cp={cp}: each rank caches the K/V of its own seq/cp tokens, which a static "
                "cache (built for the whole sequence) does not: pass cache='dynamic'"
            )

    @property
    def parallel_plan(self) -> ParallelPlan:
        """The ranks the step's program spans (world = pp · dp · fsdp · cp · tp)."""
        return ParallelPlan(
            pp=self.pp, dp=self.dp, fsdp=self.fsdp, cp=self.cp, tp=self.tp, ep=self.ep
        )

    @property
    def trains(self) -> bool:
        """The step trains (forward, loss, backward, optimizer step): its regime says."""
        return regime(self.regime).trains

    @property
    def tokens(self) -> int:
        """Tokens processed by the step (decode: one per sequence). With ``seq`` left out,
        those of :data:`DEFAULT_SEQ`, before a model shorter than that shortens it
        (:func:`torchroof.api.resolve_seq`)."""
        resolved = self if self.seq is not None else replace(self, seq=DEFAULT_SEQ)
        return regime(self.regime).tokens(resolved)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PricingOptions:
    """How a trace becomes kernels (:mod:`torchroof.kernels.fusion`) and how each kernel is timed
    (:mod:`torchroof.timing.roofline`). Defaults are the compiled kernels on the seed's ideal
    roofline."""

    fusion: str = knob(
        "fused",
        "kernel policy: eager (one per op) or fused (what torch.compile launches)",
        choices=FUSION_POLICIES,
        group="pricing",
    )
    epilogue: bool = knob(
        False, "fused: matmuls absorb the elementwise ops that follow them", group="pricing"
    )
    dequantise_in_gemm: bool = knob(
        True,
        "fused, weight-only quant of linear layers: the GEMM widens the narrow weight in "
        "registers (a mixed-input GEMM)",
        off="fused, weight-only quant of linear layers: a cast kernel writes the wide weight "
        "before the GEMM, as Inductor lowers it (packed MoE experts always read their codes in "
        "the grouped GEMM)",
        group="pricing",
    )
    loss: str = knob(
        "materialized",
        "the loss kernel: materialized (the N x V logits written to HBM) or chunked (fused "
        "linear cross-entropy, no logits in HBM)",
        choices=LOSS_POLICIES,
        group="pricing",
    )
    attention: str = knob(
        "flash",
        "the attention kernel: flash (S and P stay on chip) or math (the naive kernel that "
        "writes S and P to HBM)",
        choices=ATTENTION_POLICIES,
        group="pricing",
    )
    on_chip_budget_bytes: int = knob(
        DEFAULT_ON_CHIP_BUDGET_BYTES,
        "bytes of live state per row a fused kernel may hold; past it the kernel is flagged "
        "as likely to spill (reported where that could change its verdict: compute-bound)",
        group="pricing",
    )
    allow_tf32: bool = knob(
        False, "fp32 matmuls on tf32 tensor cores", flag="--tf32", group="precision"
    )
    overlap: bool = knob(
        True,
        "T = max(W/pi, Q/beta): memory traffic and arithmetic overlap",
        off="T = W/pi + Q/beta: memory traffic and arithmetic do not overlap",
        group="timing",
    )
    overlap_communication: bool = knob(
        True,
        "collectives overlap compute as the program allows",
        off="each collective blocks the compute stream until it ends",
        group="timing",
    )
    routing_imbalance: float = knob(
        1.0,
        "MoE: routed tokens the busiest rank's experts get over the balanced share "
        "(measured or assumed, >= 1); scales its expert GEMMs and expert all-to-alls",
        group="pricing",
    )
    compute_efficiency: float = knob(
        1.0, "fraction of peak FLOP/s reached, in (0, 1]", group="pricing"
    )
    bandwidth_efficiency: float = knob(
        1.0, "fraction of peak HBM bandwidth reached, in (0, 1]", group="pricing"
    )
    launch_overhead_s: float = knob(
        0.0,
        "microseconds added to every kernel",
        flag="--launch-overhead-us",
        scale=1e-6,
        group="pricing",
    )
    mode: str = knob(
        "roofline",
        "roofline: the pure lower bound T = max(W/pi, Q/beta); realistic: adds the on-chip "
        "roofs, waves, the latency shelf, achievable fractions and launches (each switchable)",
        choices=TIMING_MODES,
        group="timing",
    )
    on_chip: bool = knob(
        True,
        "realistic: the L2 and shared-memory roofs bind (the hierarchical roofline)",
        off="realistic: only the HBM and compute roofs bind (no L2 or shared-memory roof)",
        group="timing",
    )
    waves: bool = knob(
        True,
        "realistic: tiled kernels run in whole waves over the SMs",
        off="realistic: a tiled kernel's work spreads evenly over the SMs (no wave quantisation)",
        group="timing",
    )
    latency_shelf: bool = knob(
        True,
        "realistic: a kernel with too few bytes in flight runs at C / latency",
        off="realistic: every kernel may reach full bandwidth, however few bytes it keeps "
        "in flight (no latency shelf)",
        group="timing",
    )
    achievable: bool = knob(
        True,
        "realistic: STREAM-like bandwidth and sustained tensor rate from the hardware file",
        off="realistic: the published peak bandwidth and tensor rate",
        group="timing",
    )
    launch: bool = knob(
        True,
        "realistic: each kernel pays the hardware file's launch overhead",
        off="realistic: kernels pay no launch overhead",
        group="timing",
    )
    softmax_pipes: bool = knob(
        True,
        "realistic: fused attention's exponentials run on the SFU and its softmax bookkeeping "
        "on the fp32 units, beside its matmuls",
        off="realistic: fused attention is timed by its matmuls alone (softmax free)",
        group="timing",
    )
    gemm_tile: str = knob(
        "auto",
        "GEMM threadblock tile TmxTn (e.g. 256x128), or auto (chosen per GEMM)",
        group="timing",
    )

    def __post_init__(self) -> None:
        _finite_numbers(self)
        _choose("fusion policy", self.fusion, FUSION_POLICIES)
        _choose("timing mode", self.mode, TIMING_MODES)
        parse_gemm_tile(self.gemm_tile)
        _choose("loss policy", self.loss, LOSS_POLICIES)
        _choose("attention policy", self.attention, ATTENTION_POLICIES)
        _positive_int("on_chip_budget_bytes", self.on_chip_budget_bytes)
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0 < value <= 1:
                raise OptionError(f"{name} must be in (0, 1], got {value!r}")
        if isinstance(self.routing_imbalance, bool) or not self.routing_imbalance >= 1.0:
            raise OptionError(
                "routing_imbalance is the busiest rank's routed tokens over the balanced "
                f"share: >= 1, got {self.routing_imbalance!r}"
            )
        if self.launch_overhead_s < 0:
            raise OptionError(f"launch_overhead_s must be >= 0, got {self.launch_overhead_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


WORKLOAD_KNOBS = tuple(f.name for f in fields(Workload))
PRICING_KNOBS = tuple(f.name for f in fields(PricingOptions))


def split_knobs(knobs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(workload fields, pricing fields) of ``knobs``; any other name is an error that
    lists every knob."""
    unknown = sorted(set(knobs) - set(WORKLOAD_KNOBS) - set(PRICING_KNOBS))
    if unknown:
        raise OptionError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"options are {', '.join(WORKLOAD_KNOBS + PRICING_KNOBS)}"
        )
    workload = {k: v for k, v in knobs.items() if k in WORKLOAD_KNOBS}
    pricing = {k: v for k, v in knobs.items() if k in PRICING_KNOBS}
    return workload, pricing


# -- the CLI's flags, from the fields ----------------------------------------------------------


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}

# The sections of a command's --help the flags are listed in: (title, description).
FLAG_GROUPS = {
    "workload": ("workload", "the model, the hardware and the step to trace"),
    "parallelism": (
        "parallelism",
        "ranks of each kind (one rank is traced and priced); --batch is per rank and per "
        "micro-batch, so the global batch is batch x dp x fsdp x microbatches",
    ),
    "precision": ("precision", "dtypes and quantisation"),
    "pricing": ("pricing", "how ops become kernels and what each kernel costs"),
    "timing": ("timing", "how a kernel's cost becomes time (--mode realistic and its effects)"),
    "output": ("output", "what is printed and which files are written"),
}


def value_type(f: Any) -> type:
    """A field's value type from its annotation (``int | None`` -> int)."""
    return _TYPES[f.type.split("|")[0].strip()]


def _flag(f: Any) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = (), **overrides: Any
) -> None:
    """One flag per field of ``cls`` (Workload or PricingOptions): ``--name`` with the
    field's help, choices and default; a boolean defaulting to False is ``--name``, one
    defaulting to True is ``--no-name``. ``overrides`` replace a field's argparse keywords
    (``fusion={"choices": None}`` for a comma list)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        default = None if f.default is MISSING else f.default
        meta = f.metadata
        help_text = meta.get("help") or ""
        kwargs: dict[str, Any] = {"dest": f.name}
        if isinstance(default, bool):
            name = _flag(f) if not default else "--no-" + f.name.replace("_", "-")
            kwargs.update(action="store_false" if default else "store_true", default=default)
            if default:  # --no-name: what False does, then what the default does
                off = meta.get("off") or f"turn off: {help_text}"
                qualifier = help_text.split(": ", 1)[0] + ": "
                if off.startswith(qualifier):  # "realistic: " said once
                    help_text = help_text.removeprefix(qualifier)
                help_text = f"{off} (default: {help_text})" if meta.get("off") else off
        else:
            name = _flag(f)
            kwargs.update(type=value_type(f), default=default)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            else:  # the flag's own word and unit: --launch-overhead-us US
                kwargs["metavar"] = name.removeprefix("--").replace("-", "_").upper()
            shown = None if default in (None, "") else default
            if meta.get("scale", 1.0) != 1.0 and shown is not None:
                shown = shown / meta["scale"]  # in the flag's unit
            if isinstance(shown, float) and shown.is_integer():
                shown = int(shown)
            if help_text and shown is not None and "default" not in help_text:
                help_text += f" (default {shown})"
        kwargs["help"] = help_text or None
        kwargs.update(overrides.get(f.name, {}))
        group = flag_group(parser, meta.get("group", "workload"))
        group.add_argument(name, **{k: v for k, v in kwargs.items() if v is not None})


def flag_group(parser: argparse.ArgumentParser, key: str) -> Any:
    """The ``--help`` section ``key`` of :data:`FLAG_GROUPS` on ``parser``, made the
    first time it is asked for."""
    title, description = FLAG_GROUPS[key]
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, description)


def from_flags(args: argparse.Namespace, cls: type, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The field values the flags of :func:`add_flags` parsed, in the fields' units."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in skip or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        scale = f.metadata.get("scale", 1.0)
        values[f.name] = value * scale if scale != 1.0 and value is not None else value
    return values

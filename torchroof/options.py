"""Every knob, defined once: what step to trace (:class:`Workload`) and how to price it
(:class:`PricingOptions`).

The Python API (``estimate``, ``trace_model``, ``estimate_trace``, ``compare``, ``sweep``),
the CLI (each flag's name, help, choices and default are generated from these fields) and
``compare --vary KEY=...`` all read these two dataclasses, so a knob added here reaches
every entry point. ``hardware`` (where the step runs) is the one other argument.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from torchroof.errors import OptionError, WorkloadError
from torchroof.limits import DEFAULT_MAX_OPS  # why 10M: see there
from torchroof.parallel import ParallelPlan
from torchroof.pp_schedule import INTERLEAVED, SCHEDULES, SPLIT_BACKWARD, stages_per_rank
from torchroof.quantize import KV_DTYPES, QUANTS, check_recipe
from torchroof.workloads.inference import CACHES, MLA_DECODES
from torchroof.workloads.registry import REGIMES, regime
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
    """``"256x128"`` -> (256, 128); ``"auto"`` -> None (torchroof.hierarchy's heuristic)."""
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
) -> Any:
    """A dataclass field with what the CLI needs: its help text, its choices, and for a
    flag in other units than the field (``--launch-overhead-us`` for seconds) the name and
    the factor that converts the flag's value to the field's."""
    meta = {"help": help, "choices": choices, "flag": flag, "scale": scale}
    return field(default=default, metadata=meta)


def _choose(
    name: str, value: Any, known: tuple[str, ...], error: type[OptionError] = OptionError
) -> None:
    if value not in known:
        raise error(f"unknown {name} {value!r}; choose one of {', '.join(known)}")


def _positive_int(name: str, value: Any, error: type[OptionError] = OptionError) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """What step to trace.

    ``precision`` (train only): ``bf16`` / ``fp16`` / ``fp32`` keep parameters, gradients
    and optimizer state in that dtype; ``mixed`` is bf16 compute with fp32 master weights,
    fp32 gradients and fp32 optimizer state, the bf16 weights rewritten by the optimizer
    (seed 000 §16: 30 B/param for AdamW). ``context`` left out is ``seq``.

    Across GPUs (issue 13) the step is rank 0 of the real parallel program: ``tp`` ranks
    share each layer (the model's tensor-parallel plan), ``fsdp`` ranks share each
    parameter, ``dp`` replicas (HSDP with ``fsdp``) each hold their own data, ``cp`` ranks
    split each sequence (torch's ring attention exchanges their K/V). ``batch`` is
    the sequences one rank's replica processes per micro-batch; a training step runs
    ``microbatches`` of them before its one optimizer step.
    """

    regime: str = knob("prefill", "the step: " + ", ".join(REGIMES), choices=REGIMES)
    batch: int = knob(1, "sequences in the step")
    seq: int = knob(4096, "tokens per sequence (prefill, train)")
    context: int | None = knob(None, "tokens already in the KV cache (decode; default --seq)")
    cache: str = knob(
        "static",
        "decode cache: static (in place) or dynamic (HF DynamicCache, cat)",
        choices=CACHES,
    )
    optimizer: str = knob("adamw", "train: the optimizer", choices=OPTIMIZERS)
    precision: str = knob(
        "bf16",
        "train: bf16/fp16/fp32 throughout, or mixed (fp32 master + state)",
        choices=PRECISIONS,
    )
    checkpointing: bool = knob(False, "train: activation checkpointing (recompute in backward)")
    mla: str = knob(
        "absorbed",
        "decode of latent-attention models (DeepSeek): absorbed (FlashMLA) or expanded",
        choices=MLA_DECODES,
    )
    dtype: str = knob("bf16", "prefill/decode: the model's dtype", choices=DTYPES)
    quant: str = knob(
        "none",
        "quantised linear layers (torchroof.quantize): fp8 / fp8-rowwise (train: torchao "
        "Float8; serve: fp8 activations and weights), int8-weight, fp8-weight, int4-weight, "
        "mxfp4-weight (weight-only, dequantised inside the GEMM), nvfp4 (fp4 tensor cores)",
        choices=QUANTS,
    )
    kv_dtype: str = knob(
        "model",
        "prefill/decode: the KV cache's dtype (model: the model's; fp8 / int8: quantised "
        "on write, read by the attention kernel at 1 B per element)",
        choices=KV_DTYPES,
    )
    allow_beyond_max_positions: bool = knob(
        False, "price sequences longer than the model's maximum positions (an assumption line)"
    )
    max_ops: int = knob(
        DEFAULT_MAX_OPS, "stop a trace past this many aten ops (a data-dependent loop on meta)"
    )
    tp: int = knob(1, "tensor-parallel ranks (the model's own TP plan); rank 0 is traced")
    sequence_parallel: bool = knob(
        False,
        "with --tp: torchtitan's tensor + sequence parallel plan (Llama layout): norms on "
        "T/tp tokens, reduce-scatter + all-gather for each all-reduce, loss on vocab shards",
    )
    fsdp: int = knob(1, "train: ranks each parameter is sharded over (FSDP2, ZeRO-3)")
    dp: int = knob(
        1,
        "data-parallel replicas (train: HSDP's replicate dimension with --fsdp; serving: "
        "each rank its own batch, e.g. attention beside --ep)",
    )
    ep: int = knob(
        1,
        "expert-parallel ranks: routed experts sharded over them, tokens sent to their "
        "experts' ranks by all-to-all (transformers' all_to_all dispatch); ep divides "
        "dp x fsdp x tp and is a multiple of tp",
    )
    cp: int = knob(1, "context-parallel ranks each sequence is split over (ring attention)")
    reshard_after_forward: bool = knob(
        True, "FSDP: free gathered parameters after forward (off: kept for backward, ~ZeRO-2)"
    )
    microbatches: int = knob(
        1,
        "train: forward+backward passes of --batch sequences per optimizer step; with --pp "
        "also prefill/decode: micro-batches of --batch sequences through the pipeline",
    )
    pp: int = knob(
        1,
        "pipeline stages (torch.distributed.pipelining's schedules); one trace per distinct stage",
    )
    pp_schedule: str = knob(
        DEFAULT_PP_SCHEDULE,
        "with --pp: the schedule whose action order is laid out",
        choices=tuple(SCHEDULES),
    )
    virtual_stages: int = knob(
        DEFAULT_VIRTUAL_STAGES,
        "with --pp and an interleaved schedule: stages per rank (V schedules hold 2)",
    )
    pp_split: str = knob(
        "",
        "with --pp: decoder layers per stage, e.g. 16,16,15,15 (default: even, the "
        "remainder to the first stages, as transformers splits)",
    )
    defer_gradient_sync: bool = knob(
        False,
        "FSDP with micro-batches: reduce gradients on the last one only (unsharded ones held)",
    )

    def __post_init__(self) -> None:
        bad = WorkloadError
        regime(self.regime)  # a WorkloadError naming the known regimes
        _positive_int("batch", self.batch, bad)
        _positive_int("seq", self.seq, bad)
        if self.context is None:
            object.__setattr__(self, "context", self.seq)
        _positive_int("context", self.context, bad)
        _choose("cache", self.cache, CACHES, bad)
        _choose("optimizer", self.optimizer, OPTIMIZERS, bad)
        _choose("precision", self.precision, PRECISIONS, bad)
        _choose("mla", self.mla, MLA_DECODES, bad)
        _choose("dtype", self.dtype, DTYPES, bad)
        _choose("quant", self.quant, QUANTS, bad)
        _choose("kv_dtype", self.kv_dtype, KV_DTYPES, bad)
        check_recipe(self.quant, regime(self.regime).trains, self.kv_dtype, self.tp)
        _positive_int("max_ops", self.max_ops, bad)
        self._check_parallel()

    def _check_parallel(self) -> None:
        """Every size a positive integer; sharding parameters over data (fsdp) and
        micro-batches of an optimizer step are training concepts: an inference step takes
        tp, cp, pp (micro-batches through the pipeline), dp replicas (each its own batch)
        and ep; context parallel as :meth:`_check_context_parallel` allows."""
        for name in PARALLEL_SIZES:
            _positive_int(name, getattr(self, name), WorkloadError)
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
        """Context parallel (torch's load-balanced ring attention, torchroof.parallel
        .apply_context_parallel) splits each sequence of the step into 2·cp equal chunks;
        it composes with tensor (and sequence) parallel only, and an inference step keeps each
        rank's own K/V (a dynamic cache: a static one is built for the whole sequence)."""
        cp = self.cp
        if self.fsdp * self.dp > 1:
            raise WorkloadError(
                f"cp={cp} does not yet compose with fsdp or dp (torchtitan shards parameters "
                "over the dp x fsdp x cp ranks; not done here): use cp with tp"
            )
        if regime(self.regime).tokens(self) < self.batch * self.seq:
            raise WorkloadError(
                f"cp={cp} splits each sequence's seq new tokens over the cp ranks; a "
                f"{self.regime} step has fewer ({regime(self.regime).tokens(self)} for "
                f"{self.batch} sequences)"
            )
        if self.seq % (2 * cp):
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
    def tokens(self) -> int:
        """Tokens processed by the step (decode: one per sequence)."""
        return regime(self.regime).tokens(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PricingOptions:
    """How a trace becomes kernels (:mod:`torchroof.fusion`) and how each kernel is timed
    (:mod:`torchroof.roofline`). Defaults are the compiled kernels on the seed's ideal
    roofline."""

    fusion: str = knob(
        "fused",
        "kernel policy: eager (one per op) or fused (what torch.compile launches)",
        choices=FUSION_POLICIES,
    )
    epilogue: bool = knob(False, "fused: matmuls absorb the elementwise ops that follow them")
    dequantise_in_gemm: bool = knob(
        True,
        "fused, weight-only quant of linear layers: the GEMM widens the narrow weight in "
        "registers (a mixed-input GEMM); off: Inductor's default, a cast kernel writes the "
        "wide weight (packed MoE experts always read their codes in the grouped GEMM)",
    )
    loss: str = knob(
        "materialized",
        "chunked: fused linear cross-entropy (no N x V logits in HBM)",
        choices=LOSS_POLICIES,
    )
    attention: str = knob(
        "flash", "math: the naive kernel that writes S and P to HBM", choices=ATTENTION_POLICIES
    )
    on_chip_budget_bytes: int = knob(
        DEFAULT_ON_CHIP_BUDGET_BYTES, "fused kernels holding more live state per row are flagged"
    )
    allow_tf32: bool = knob(False, "fp32 matmuls on tf32 tensor cores", flag="--tf32")
    overlap: bool = knob(True, "T = max(W/pi, Q/beta); off: W/pi + Q/beta (seed 000 §5)")
    overlap_communication: bool = knob(
        True, "collectives overlap compute as the program allows; off: each one blocks"
    )
    routing_imbalance: float = knob(
        1.0,
        "MoE: routed tokens the busiest rank's experts get over the balanced share "
        "(measured or assumed, >= 1); scales its expert GEMMs and expert all-to-alls",
    )
    compute_efficiency: float = knob(1.0, "fraction of peak FLOP/s reached, in (0, 1]")
    bandwidth_efficiency: float = knob(1.0, "fraction of peak HBM bandwidth reached, in (0, 1]")
    launch_overhead_s: float = knob(
        0.0, "added to every kernel, in microseconds", flag="--launch-overhead-us", scale=1e-6
    )
    mode: str = knob(
        "roofline",
        "roofline: the pure lower bound T = max(W/pi, Q/beta); realistic: adds the on-chip "
        "roofs, waves, the latency shelf, achievable fractions and launches (each switchable)",
        choices=TIMING_MODES,
    )
    on_chip: bool = knob(True, "realistic: the L2 and shared-memory roofs bind (seed Table 4)")
    waves: bool = knob(True, "realistic: tiled kernels run in whole waves over the SMs")
    latency_shelf: bool = knob(
        True, "realistic: a kernel with too few bytes in flight runs at C / latency"
    )
    achievable: bool = knob(
        True, "realistic: STREAM-like bandwidth and sustained tensor rate from the hardware file"
    )
    launch: bool = knob(True, "realistic: each kernel pays the hardware file's launch overhead")
    softmax_pipes: bool = knob(
        True,
        "realistic: fused attention's exponentials run on the SFU and its softmax bookkeeping "
        "on the fp32 units, beside its matmuls",
    )
    gemm_tile: str = knob("auto", "GEMM threadblock tile TmxTn (e.g. 256x128); auto: heuristic")

    def __post_init__(self) -> None:
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
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help")}
        if isinstance(default, bool):
            name = _flag(f) if not default else "--no-" + f.name.replace("_", "-")
            kwargs.update(action="store_false" if default else "store_true", default=default)
        else:
            name = _flag(f)
            kwargs.update(type=value_type(f), default=default)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if kwargs["help"] and default is not None and meta.get("scale", 1.0) == 1.0:
                kwargs["help"] += f" (default {default})"
        kwargs.update(overrides.get(f.name, {}))
        parser.add_argument(name, **{k: v for k, v in kwargs.items() if v is not None})


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

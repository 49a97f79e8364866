"""How a trace is priced: :class:`PricingOptions` (the kernel policy and how each kernel is
timed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torchroof.config.checks import choose, finite_numbers, positive_int
from torchroof.config.choices import (
    ATTENTION_POLICIES,
    FUSION_POLICIES,
    LOSS_POLICIES,
    TIMING_MODES,
)
from torchroof.config.errors import OptionError
from torchroof.config.flags import knob
from torchroof.config.routing import inline_routing


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


# Real fused kernels start spilling past roughly 64 KB of live state per
# 256-thread block; a row-wise kernel keeps about one row per thread group in flight.
DEFAULT_ON_CHIP_BUDGET_BYTES = 64 * 1024


@dataclass(frozen=True)
class PricingOptions:
    """How a trace becomes kernels (:mod:`torchroof.kernels.fusion`) and how each kernel is timed
    (:mod:`torchroof.timing.roofline`). Defaults are the compiled kernels on the ideal
    roofline."""

    runtime: str = knob(
        "",
        "the software that runs the step (a shipped runtime profile such as torchtitan, "
        "megatron-te, vllm or eager, or a profile TOML): it sets the kernels the step "
        "launches (fusion, loss, attention, unless given), small all-reduces, and in "
        "realistic mode its launches and host overhead per step",
        group="pricing",
    )
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
    sequence_parallel_regather: bool = knob(
        False,
        "training with sequence parallel: each column-wise linear layer saves the rank's "
        "shard of its all-gathered input and all-gathers it again in the backward "
        "(Megatron-Core), not the gathered input (torch)",
        off="training with sequence parallel: each column-wise linear layer saves its "
        "all-gathered input for the backward (torch)",
        group="pricing",
        runtime_sets=True,
    )
    save_fp8_inputs: bool = knob(
        False,
        "training with an fp8 recipe: each fp8 linear layer saves its input for the backward "
        "in fp8 (Transformer Engine), not in bf16 (torchao)",
        off="training with an fp8 recipe: each fp8 linear layer saves its input for the "
        "backward in bf16 (torchao)",
        group="pricing",
        runtime_sets=True,
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
    routing: str = knob(
        "balanced",
        "MoE: how routed tokens spread over the experts, for the expert weights each grouped "
        "GEMM reads: balanced (each expert an equal share: T·k rows reach min(E, T·k) "
        "experts), expected (uniform random top-k: E·(1 - (1 - k/E)^T) experts), or a "
        "measured histogram of the experts' shares (comma-separated, or a file of numbers)",
        group="pricing",
    )
    offload_activations: int = knob(
        0,
        "training: the first N decoder layers send what their forward saved to host memory "
        "and read it back before their backward, over the GPU's host link (Megatron-Core's "
        "cpu_offloading_num_layers)",
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
        "roofs, waves, the latency shelf, achievable fractions and launches (each switchable); "
        "calibrated: realistic times the median measured / realistic of the published runs "
        "of the step's kind",
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
        "realistic: each kernel pays a launch (the runtime's, the hardware file's eager "
        "launch under a runtime where it lists one, else its launch overhead)",
        off="realistic: kernels pay no launch overhead",
        group="timing",
    )
    cuda_graphs: bool = knob(
        True,
        "the steps the runtime captures replay a CUDA graph (its graph launch per kernel, "
        "NCCL's in-graph collectives)",
        off="every step launches its kernels eagerly, whatever the runtime captures (vLLM's "
        "--enforce-eager)",
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

    @property
    def realistic(self) -> bool:
        """Kernels are timed by the realistic mode (realistic, or calibrated on top of it)."""
        return self.mode in ("realistic", "calibrated")

    def __post_init__(self) -> None:
        finite_numbers(self)
        choose("fusion policy", self.fusion, FUSION_POLICIES)
        choose("timing mode", self.mode, TIMING_MODES)
        parse_gemm_tile(self.gemm_tile)
        choose("loss policy", self.loss, LOSS_POLICIES)
        choose("attention policy", self.attention, ATTENTION_POLICIES)
        positive_int("on_chip_budget_bytes", self.on_chip_budget_bytes)
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0 < value <= 1:
                raise OptionError(f"{name} must be in (0, 1], got {value!r}")
        if isinstance(self.routing_imbalance, bool) or not self.routing_imbalance >= 1.0:
            raise OptionError(
                "routing_imbalance is the busiest rank's routed tokens over the balanced "
                f"share: >= 1, got {self.routing_imbalance!r}"
            )
        object.__setattr__(self, "routing", inline_routing(self.routing))  # a file: read once
        offload = self.offload_activations
        if isinstance(offload, bool) or not isinstance(offload, int) or offload < 0:
            raise OptionError(
                f"offload_activations counts decoder layers: an integer >= 0, got {offload!r}"
            )
        if self.launch_overhead_s < 0:
            raise OptionError(f"launch_overhead_s must be >= 0, got {self.launch_overhead_s}")

    def kernel_policy(self) -> tuple[object, ...]:
        """The fields that choose the kernels (:data:`KERNEL_POLICY_FIELDS`), in order: two
        options with the same policy make the same kernels of a trace."""
        return tuple(getattr(self, name) for name in KERNEL_POLICY_FIELDS)

    def kernels_only(self) -> PricingOptions:
        """These options' kernel policy, every timing field at its default: what grouping a
        trace into kernels is given, so that nothing else can change the kernels."""
        policy: dict[str, Any] = {name: getattr(self, name) for name in KERNEL_POLICY_FIELDS}
        return PricingOptions(**policy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KERNEL_POLICY_FIELDS = (
    "fusion",
    "epilogue",
    "dequantise_in_gemm",
    "loss",
    "attention",
    "sequence_parallel_regather",
    "save_fp8_inputs",
    "on_chip_budget_bytes",
)
"""The :class:`PricingOptions` fields grouping a trace into kernels reads
(:func:`torchroof.kernels.fusion.build_kernels`, and
:func:`torchroof.pricing.price.runtime_saves` for what the runtime saves for the backward);
the others time the kernels."""

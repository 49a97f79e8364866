"""What the software running a step changes in timing its kernels, read off its runtime
profile (``torchroof.hardware.runtime``) for one step: the launch each kernel pays, whether
the attention kernel hides its softmax, the GEMM library's share of peak, the host's time
per step and the runtime's own all-reduce for small tensors."""

from __future__ import annotations

from dataclasses import dataclass

from torchroof.hardware.runtime import RuntimeProfile


@dataclass(frozen=True)
class CustomAllReduce:
    """A runtime's all-reduce kernel for small tensors inside one NVLink domain (vLLM's,
    TensorRT-LLM's): below ``max_bytes``, over an even number of at most ``max_ranks``
    ranks, ``latency_s`` fixed cost; one shot (every rank reads every peer's whole buffer)
    below ``one_shot_max_bytes``, two shots (a reduce-scatter, then an all-gather) above."""

    max_bytes: float
    one_shot_max_bytes: float
    latency_s: float
    max_ranks: int = 8


@dataclass(frozen=True)
class StepRuntime:
    """One step's timing under a runtime: ``launch_s`` per kernel (realistic mode; None
    keeps the accelerator file's), ``softmax_overlapped`` (FlashAttention-3 runs softmax under
    the matmuls), ``gemm_efficiency`` (GEMMs' share of peak; 1 where none is published),
    ``host_overhead_s`` per step (0 but in realistic mode), ``all_reduce`` (its small
    all-reduce), ``tp_comm_overlap`` (sequence parallel's all-gathers and reduce-scatters run
    beside the GEMMs they feed or drain: :mod:`torchroof.timing.tp_overlap`),
    ``fp16_accumulate`` (fp16 matmuls accumulate in fp16, at the accelerator's
    ``fp16_accumulate_tensor_flops_per_s`` where it lists one), ``attention_kernel`` (the
    fused attention kernel it launches: realistic mode times it at its measured share of the
    tensor peak where the accelerator file lists one)."""

    launch_s: float | None = None
    graph_replayed: bool = False
    softmax_overlapped: bool = False
    gemm_efficiency: float = 1.0
    host_overhead_s: float = 0.0
    all_reduce: CustomAllReduce | None = None
    tp_comm_overlap: bool = False  # sequence parallel's collectives beside their GEMMs
    fp16_accumulate: bool = False  # fp16 matmuls accumulate in fp16 (GeForce's faster rate)
    attention_kernel: str = ""  # the fused attention kernel it launches (fa2, fa3, cudnn, ...)


def step_runtime(
    profile: RuntimeProfile | None,
    regime: str,
    batch: int,
    realistic: bool = False,
    graphs_on: bool = True,
) -> StepRuntime:
    """What ``profile`` sets for a step of ``regime`` with ``batch`` sequences per rank,
    timed in ``realistic`` mode or not, with the runtime's CUDA graphs or every step
    launched eagerly (``graphs_on`` False); no profile: nothing, every figure the
    accelerator file's."""
    if profile is None:
        return StepRuntime()
    custom = None
    limit = profile.figure("custom_all_reduce_max_bytes")
    latency = profile.figure("custom_all_reduce_latency_s")
    if limit is not None and latency is not None:
        one_shot = profile.figure("custom_all_reduce_one_shot_max_bytes") or 0.0
        ranks = int(profile.figure("custom_all_reduce_max_ranks") or 8)
        custom = CustomAllReduce(limit, one_shot, latency, ranks)
    return StepRuntime(
        launch_s=profile.launch_s(regime, batch, graphs_on),
        graph_replayed=profile.graph_replayed(regime, batch, graphs_on),
        softmax_overlapped=profile.softmax_overlapped(),
        gemm_efficiency=profile.figure("gemm_efficiency") or 1.0,
        host_overhead_s=(profile.figure("host_overhead_s") or 0.0) if realistic else 0.0,
        all_reduce=custom,
        tp_comm_overlap=profile.setting("tp_comm_overlap") is True,
        fp16_accumulate=profile.setting("fp16_accumulate") is True,
        attention_kernel=str(profile.setting("attention_kernel") or ""),
    )

"""The hierarchical roofline (Yang, Kurth & Williams 2020), waves (NVIDIA, Matrix
Multiplication Background), Little's law (Little 1961) and the realistic mode, checked against
numbers worked by hand from the H100 datasheet."""

from __future__ import annotations

import math

import pytest
from torchroof.counters import Cost
from torchroof.hardware import boundary_table, get

import torchroof
from torchroof.config import PricingOptions
from torchroof.config.errors import OptionError
from torchroof.render.summary_parts import timing_lines
from torchroof.render.text import binds
from torchroof.timing.hierarchy import (
    GemmTile,
    Levels,
    attention_levels,
    choose_tile,
    gemm_levels,
    in_flight_bytes,
    split_k,
    waves,
)
from torchroof.timing.kernel_shape import KernelShape
from torchroof.timing.roofline import time_kernel

H100 = get("h100-sxm")
PEAK = H100.tensor_peak("bf16")  # 989.4e12
N = 4096
GEMM = KernelShape("gemm", 2, m=N, n=N, k=N)
GEMM_FLOPS = 2 * N**3  # 137.4 GFLOP
GEMM_HBM = 2 * 3 * N * N  # s·(MK + KN + MN) = 100.7 MB: compulsory, what the trace prices


def test_table_4_ridges_on_the_h100():
    """The boundary table: register file ~3, shared memory ~33, L2 ~110, HBM 295, NVLink 2198,
    PCIe 15459, EFA 19788 (ridge = 989.4 TFLOP/s / beta)."""
    ridges = {b.name.split(" (")[0]: b.ridge(PEAK) for b in boundary_table(H100).values()}
    assert ridges["register file"] == pytest.approx(989.4 / 300, rel=1e-3)  # 3.3
    # 128 B/clk/SM x 132 SMs x 1.83 GHz = 30.92 TB/s -> 32.0 (rounded to ~30 TB/s: ~33)
    assert ridges["shared memory"] == pytest.approx(32.0, rel=1e-3)
    assert ridges["L2 cache"] == pytest.approx(989.4 / 9, rel=1e-3)  # 109.9
    assert ridges["HBM"] == pytest.approx(989.4 / 3.35, rel=1e-3)  # 295.3
    assert ridges["NVLink 4 via NVSwitch"] == pytest.approx(989.4e12 / 450e9, rel=1e-3)  # 2198.7
    assert ridges["PCIe Gen5 x16"] == pytest.approx(989.4e12 / 64e9, rel=1e-3)  # 15459
    efa = [r for name, r in ridges.items() if name.startswith("EFA")]
    assert efa == [pytest.approx(989.4e12 / 50e9, rel=1e-3)]  # 19788
    table = boundary_table(H100)
    on_chip = [table["register file"], table["shared memory"]]
    assert all(b.figure.approximate for b in on_chip)  # derived, so labelled approximate


def test_seed_gemm_is_l2_bound_near_77_percent_with_256x128_tiles():
    """A 4096^3 bf16 GEMM with 256x128 tiles has I_L2 ~ 85 against an L2 ridge of
    ~110, capped near 77% of peak; its 64x64 warp tiles give I_smem ~ 32."""
    levels = gemm_levels(GEMM, GEMM_HBM, GemmTile(256, 128), H100, out_itemsize=2)
    # asymptote 2 / (s (1/256 + 1/128)) = 85.3; with the output's s·MN crossing L2 too:
    # L2 bytes = 512 tiles x (256 + 128) x 4096 x 2 B + 4096^2 x 2 B = 1.644 GB -> I = 83.6
    assert 2 / (2 * (1 / 256 + 1 / 128)) == pytest.approx(85.33, abs=0.01)
    assert GEMM_FLOPS / levels.l2 == pytest.approx(83.59, abs=0.01)
    assert GEMM_FLOPS / levels.smem == pytest.approx(32.0)  # 2 / (2 (1/64 + 1/64))
    assert GEMM_FLOPS / levels.hbm == pytest.approx(1365.3, abs=0.1)  # n / 3
    cap = (GEMM_FLOPS / levels.l2) * H100.l2_bytes_per_s.value / PEAK  # 83.6 x 9e12 / 989.4e12
    assert cap == pytest.approx(0.760, abs=0.001)  # roughly 77%
    pure = time_kernel(
        Cost(GEMM_FLOPS, 2 * 2 * N * N, 2 * N * N, "tensor", "bfloat16"),
        H100,
        PricingOptions(gemm_tile="256x128"),
        GEMM,
    )
    assert pure.boundary == "l2"  # named even in the pure mode...
    assert pure.time_s == pytest.approx(GEMM_FLOPS / PEAK)  # ...whose time ignores it
    assert pure.bound == "compute"  # compute-bound at HBM and L2-bound on chip: both true


def test_realistic_gemm_lands_at_the_l2_cap_plus_its_launch():
    cost = Cost(GEMM_FLOPS, 2 * 2 * N * N, 2 * N * N, "tensor", "bfloat16")
    options = PricingOptions(mode="realistic", gemm_tile="256x128")
    t = time_kernel(cost, H100, options, GEMM)
    l2_s = 1_644_167_168 / 9e12  # the L2 bytes above at 9 TB/s = 182.7 us
    assert t.time_s == pytest.approx(l2_s + 2e-6, rel=1e-6)  # + the file's 2 us launch
    assert GEMM_FLOPS / t.time_s / PEAK == pytest.approx(0.752, abs=0.001)
    # each effect switches off on its own: without the on-chip roofs the GEMM is compute
    # bound again, at the file's sustained 80% of peak and 4 waves of 132 (512 tiles: 97%
    # occupied): 138.9 us / 0.80 / 0.9697 + 2 us
    flat = time_kernel(
        cost, H100, PricingOptions(mode="realistic", on_chip=False, gemm_tile="256x128"), GEMM
    )
    assert flat.time_s == pytest.approx(GEMM_FLOPS / PEAK / 0.80 / (512 / 528) + 2e-6, rel=1e-6)
    no_launch = time_kernel(
        cost, H100, PricingOptions(mode="realistic", launch=False, gemm_tile="256x128"), GEMM
    )
    assert t.time_s - no_launch.time_s == pytest.approx(2e-6)


def test_140_tiles_on_132_sms_run_two_waves():
    """132 SMs and 140 tiles run two waves, the second 6% occupied, so the kernel takes twice
    as long as its FLOP count implies (wave quantisation)."""
    levels = Levels(hbm=1.0, l2=1.0, smem=None, registers=None, ctas=140, ctas_per_sm=1)
    w = waves(levels, H100)
    assert w.count == 2
    assert w.tail == pytest.approx(8 / 132)  # 6%
    assert w.efficiency == pytest.approx(140 / 264)  # 0.53: 1.89x the FLOP-implied time
    # a GEMM whose 128 x 256 tiles make 140 of them: 17,920 x 256 output, K = 8192
    shape = KernelShape("gemm", 2, m=140 * 128, n=256, k=8192)
    flops = 2 * 140 * 128 * 256 * 8192
    cost = Cost(flops, 2 * (140 * 128 + 256) * 8192, 2 * 140 * 128 * 256, "tensor", "bfloat16")
    off = PricingOptions(
        mode="realistic",
        on_chip=False,
        latency_shelf=False,
        achievable=False,
        launch=False,
        gemm_tile="128x256",
    )
    t = time_kernel(cost, H100, off, shape)
    assert (t.waves, t.time_s) == (2, pytest.approx(flops / PEAK * 264 / 140))


def test_little_law_two_megabytes_in_flight_on_an_h100():
    """Little's law: 3.35 TB/s x 600 ns = 2.0 MB in flight, ~15 KB per SM over 132 SMs."""
    needed = H100.hbm_bytes_per_s.value * H100.memory_latency_s.value
    assert needed == pytest.approx(2.01e6)
    assert needed / 132 == pytest.approx(15_227, rel=1e-3)
    # a kernel whose 4 CTAs reach 4 SMs keeps 4/132 of that in flight...
    few = Levels(hbm=64e6, l2=64e6, smem=None, registers=None, ctas=4, ctas_per_sm=8)
    assert in_flight_bytes(few, H100, H100.hbm_bytes_per_s.value) == pytest.approx(needed * 4 / 132)
    # ...and a kernel cannot have more in flight than it moves: 16 KB -> one round trip
    tiny = Levels(hbm=16_384, l2=16_384, smem=None, registers=None, ctas=16, ctas_per_sm=8)
    assert in_flight_bytes(tiny, H100, H100.hbm_bytes_per_s.value) == 16_384


def test_latency_shelf_sits_under_the_diagonal():
    """A 16 KB RMSNorm-sized kernel: Q/beta = 4.9 ns on the diagonal, but with at most 16 KB
    in flight it runs at 16 KB / 600 ns = 27 GB/s: one memory latency (0.6 us)."""
    shape = KernelShape("stream", 2, elements=4096)  # 4 CTAs of 1024 elements
    cost = Cost(4 * 4096, 8192, 8192, "vector", "bfloat16")
    pure = time_kernel(cost, H100, PricingOptions(), shape)
    assert pure.time_s == pytest.approx(16_384 / 3.35e12)
    shelf = time_kernel(
        cost, H100, PricingOptions(mode="realistic", launch=False, achievable=False), shape
    )
    assert shelf.time_s == pytest.approx(600e-9)
    assert shelf.boundary == "latency"
    assert binds(_estimate_kernel(shelf)) == "latency"


def _estimate_kernel(t):
    from torchroof.report.estimate import KernelEstimate

    return KernelEstimate(
        index=0,
        name="k",
        ops=("k",),
        module="",
        phase="forward",
        flops=1,
        bytes_read=1,
        bytes_written=1,
        unit="vector",
        dtype="bfloat16",
        counted=True,
        peak_flops_per_s=t.peak_flops_per_s,
        compute_s=t.compute_s,
        memory_s=t.memory_s,
        time_s=t.time_s,
        bound=t.bound,
        boundary=t.boundary,
        tile=t.tile,
        waves=t.waves,
        wave_efficiency=t.wave_efficiency,
    )


def test_achievable_fraction_is_the_seeds_85_percent_of_stream_bandwidth():
    shape = KernelShape("stream", 2, elements=2**28)
    cost = Cost(2**28, 2**29, 2**29, "vector", "bfloat16")  # 1 GiB: far past latency
    only = PricingOptions(
        mode="realistic", on_chip=False, waves=False, latency_shelf=False, launch=False
    )
    t = time_kernel(cost, H100, only, shape)
    assert t.time_s == pytest.approx(2**30 / (0.85 * 3.35e12))


def test_split_k_fills_the_sms_for_a_decode_gemv():
    """Batch-1 decode: 1 x 4096 @ 4096 x 1024 (k_proj). 1024 / 128 = 8 tiles of 128 x 128 on
    132 SMs: split K by min(132 // 8 = 16, 4096 / 128 = 32) = 16 -> 128 CTAs, one wave (a
    split of 17 would make 136: a second wave 3% full)."""
    assert split_k(8, 4096, H100) == 16
    shape = KernelShape("gemm", 2, m=1, n=1024, k=4096)
    levels = gemm_levels(shape, 2 * (4096 + 4096 * 1024 + 1024), GemmTile(128, 128), H100, 2)
    assert levels.ctas == 128
    # fp32 partial sums written and read back: 2 x 15 x 1 x 1024 x 4 B on top of the weights
    assert levels.hbm == 2 * (4096 + 4096 * 1024 + 1024) + 2 * 15 * 1024 * 4
    # a batch of such products already fills the SMs: 64 x 4 tiles of a bmm, no split
    assert split_k(64 * 4, 4096, H100) == 1
    batched = KernelShape("gemm", 2, batch=64, m=256, n=256, k=4096)
    assert gemm_levels(batched, 1.0, GemmTile(128, 128), H100, 2).ctas == 64 * 4


def test_co_resident_ctas_share_their_sm():
    """288 CTAs, two per SM on 132 SMs: dispatched in ceil(288 / 264) = 2 waves, but three
    CTAs land on some SMs and share them: busy 288 / (3 x 132) = 0.727, not 288 / 528."""
    w = waves(Levels(hbm=1.0, l2=1.0, smem=None, registers=None, ctas=288, ctas_per_sm=2), H100)
    assert (w.count, w.efficiency) == (2, pytest.approx(288 / 396))


def test_gqa_decode_streams_each_kv_head_once():
    """Decode, 32 query heads over 8 K/V heads, context 4096, d = 128: the 4 query rows of a
    group share one block, so L2 sees the K/V once (8 x 4096 x 256 x 2 B = 16.8 MB) plus q
    and o (32 x 256 x 2 B), whatever the layout of the query heads."""
    shape = KernelShape("attention", 2, batch=32, m=1, n=4096, k=128, kv_batch=8)
    levels = attention_levels(shape, 1.0, H100)
    assert levels.l2 == 8 * 4096 * 256 * 2 + 32 * 256 * 2
    # 8 blocks on 132 SMs split the keys min(4096 / 128 = 32, 132 // 8 = 16) ways
    assert levels.ctas == 8 * 16


def test_a_convolution_is_not_read_as_a_gemm():
    import torch

    with torchroof.trace() as t:
        x = torch.empty(32, 256, 14, 14, dtype=torch.bfloat16, device="meta")
        w = torch.empty(512, 256, 3, 3, dtype=torch.bfloat16, device="meta")
        torch.nn.functional.conv2d(x, w, padding=1)
    (kernel,) = t.estimate("h100-sxm", mode="realistic").kernels
    assert kernel.tile == "" and "smem" not in kernel.level_bytes


def test_empty_attention_prices_without_error():
    import torch

    with torchroof.trace() as t:
        q = torch.empty(1, 8, 0, 64, dtype=torch.bfloat16, device="meta")
        kv = torch.empty(1, 8, 128, 64, dtype=torch.bfloat16, device="meta")
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv)
    for mode in ("roofline", "realistic"):
        assert t.estimate("h100-sxm", mode=mode).time_s >= 0


def test_tile_heuristic_prefers_big_tiles_for_big_gemms():
    tile = choose_tile(GEMM, GEMM_HBM, H100, PEAK, 3.35e12, 2)
    assert (tile.m, tile.n) == (256, 128)
    # a tile that does not fit in 228 KB of shared memory is never chosen: 4 stages of
    # (256 + 256) x 64 x 4 B (fp32 operands) = 512 KiB
    assert GemmTile(256, 256).smem_bytes(4) > H100.shared_memory_bytes_per_sm.value


def test_flash_attention_l2_intensity_tends_to_2_br_over_s():
    """FlashAttention (Dao et al. 2022): I_tiled = 4N^2 d / (s (2Nd + 2N^2 d / B_r)) -> 2 B_r / s =
    128 for B_r = 128 in bf16; HBM sees the compulsory 4·s·N·d."""
    n, d = 65536, 128
    shape = KernelShape("attention", 2, batch=1, m=n, n=n, k=d)
    levels = attention_levels(shape, 4 * 2 * n * d, H100)
    flops = 4 * n * n * d
    exact = flops / (2 * (2 * n * d + 2 * n * n * d / 128))
    assert flops / levels.l2 == pytest.approx(exact)
    assert exact == pytest.approx(128, rel=0.01)
    assert flops / levels.smem == pytest.approx(2 * 64 / 2)  # 64-row warpgroups: 64


def test_gemm_tile_option_is_checked():
    with pytest.raises(OptionError, match="TmxTn"):
        PricingOptions(gemm_tile="256")
    with pytest.raises(OptionError, match="timing mode"):
        PricingOptions(mode="optimistic")


def test_realistic_mode_on_a_model_says_which_mode_and_is_slower_than_the_floor():
    """Llama-3-8B decode at batch 1 on an H100: every kernel at least as slow realistic as
    pure; the summary names the mode and where the time binds."""
    pure = torchroof.estimate("llama-3-8b", "decode", batch=1, context=1024, hardware="h100")
    real = torchroof.estimate(
        "llama-3-8b", "decode", batch=1, context=1024, hardware="h100", mode="realistic"
    )
    assert len(pure.kernels) == len(real.kernels)
    assert all(
        r.time_s >= p.time_s * (1 - 1e-9) for p, r in zip(pure.kernels, real.kernels, strict=True)
    )
    # the 15.01 GB of weights a step reads need 15.01 GB / (0.85 x 3.35 TB/s) = 5.27 ms,
    # plus 2 us per launch
    launches = 2e-6 * len(real.kernels)
    assert real.traffic()["weights"] == pytest.approx(15.01e9, rel=1e-3)
    assert real.time_s > 15.01e9 / (0.85 * 3.35e12) + launches
    assert timing_lines(pure)[0].startswith("timing: pure roofline")
    assert timing_lines(real)[0].startswith("timing: realistic mode (on_chip, waves,")
    assert real.options.mode == "realistic"
    assert math.isclose(sum(k.overhead_s for k in real.kernels), launches)


def test_softmax_runs_beside_the_attention_matmuls():
    """Compute ceilings below the tensor peak: FlashAttention-3's benchmark shape (batch 4, 16
    heads, N = 8448, d = 128, non-causal) keeps 64 x 8448^2 = 4.567e9 pairs; one exp each
    at the SFU's 16.725 TFLOP/s is 273.1 us, four fp32 ops each at 66.9 TFLOP/s another
    273.1 us, beside the matmuls' 2.3386e12 / (989.4e12 x the file's sustained 0.80) =
    2954.5 us: 3500.7 us + 2 us."""
    import torch

    with torchroof.trace() as t:
        q = torch.empty(4, 16, 8448, 128, dtype=torch.float16, device="meta")
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    pairs = 64 * 8448**2
    softmax_s = pairs / 16.725e12 + 4 * pairs / 66.9e12
    matmul_s = 4 * pairs * 128 / (989.4e12 * 0.80)
    real = t.estimate("h100-sxm", mode="realistic").time_s
    assert real == pytest.approx(matmul_s + softmax_s + 2e-6, rel=1e-6)
    off = t.estimate("h100-sxm", mode="realistic", softmax_pipes=False).time_s
    assert off == pytest.approx(matmul_s + 2e-6, rel=1e-6)
    # the paper measures 661 TFLOP/s: 3.538 ms; realistic predicts 0.990 of it
    assert real / 3.538e-3 == pytest.approx(0.990, abs=0.001)

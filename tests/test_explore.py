"""The explorers (roofline explorer, GEMM workbench, fusion bench, the FlashAttention and
chunked cross-entropy bounds, the hierarchical roofline): every number below is derived by
hand beside the assertion."""

import re

import pytest
from torchroof.hardware import get

from torchroof.cli.main import main
from torchroof.labs.explore import PRESETS, boundaries, find_pipe, roofline_point
from torchroof.labs.fusion_bench import fusion_bench, parse_boundaries
from torchroof.labs.gemm_workbench import gemm_workbench
from torchroof.labs.io_bounds import attention_bounds, chunked_cross_entropy

PNG = b"\x89PNG\r\n\x1a\n"
BF16_PEAK = 989.4e12  # H100 SXM dense bf16


def test_lab1_boundaries_are_table_4():
    def ridge(name):
        return roofline_point("h100", "bf16", 1, boundary=name).machine_balance

    # the boundary table, ridge = pi_bf16 / beta
    assert ridge("l2") == pytest.approx(989.4 / 9)  # 109.9
    assert ridge("shared memory") == pytest.approx(989.4 / 30.92)  # 32.0 (rounded: ~33)
    assert ridge("registers") == pytest.approx(989.4 / 300)  # 3.3 (~3)
    assert ridge("hbm") == pytest.approx(989.4 / 3.35)  # 295.3
    assert round(ridge("nvlink")) == 2199  # 989.4e12 / 450e9 = 2198.7 (truncated: 2198)
    assert round(ridge("pcie")) == 15459  # 989.4e12 / 64e9
    assert round(ridge("network")) == 19788  # 989.4e12 / 50e9 (AWS EFA on p5, 400 Gb/s per GPU)
    # the on-chip rows are approximate aggregates, HBM and the links are published figures
    assert roofline_point("h100", "bf16", 1, boundary="l2").approximate
    assert not roofline_point("h100", "bf16", 1, boundary="nvlink").approximate
    table = boundaries(get("h100"))
    assert list(table)[:4] == ["registers", "smem", "l2", "hbm"]
    assert "InfiniBand" in table["dgx-h100:network"].name and "EFA" in table["network"].name
    with pytest.raises(ValueError, match="no boundary 'l3'"):
        roofline_point("h100", "bf16", 1, boundary="l3")


def test_lab1_pipes_reach_every_ceiling():
    spec = get("h100")
    # compute ceilings: fp32 without FMA 66.9 / 2 = 33.45, SFU 66.9 / 4
    assert find_pipe(spec, "fp32-no-fma") == ("fp32 vector without FMA", 33.45e12)
    assert find_pipe(spec, "sfu")[1] == pytest.approx(16.725e12)
    assert find_pipe(spec, "fp8") == ("fp8 tensor core", 1978.9e12)
    r = roofline_point("h100", "bf16", 2, pipe="fp32 vector without FMA")
    # ridge 33.45e12 / 3.35e12 = 9.99; I = 2 reaches 2 x 3.35 / 33.45 = 20.03%
    assert r.machine_balance == pytest.approx(33.45 / 3.35)
    assert round(100 * r.fraction_of_peak, 2) == 20.03
    with pytest.raises(ValueError, match="no pipe"):
        roofline_point("h100", "bf16", 2, pipe="fp4")


def test_lab1_fp64_is_one_pipe_by_dtype_and_by_name():
    # the H100 lists fp64 tensor cores (66.9 TFLOP/s) and fp64 vector units (33.5): --dtype
    # fp64 and --pipe fp64 both name the tensor core, as tensor_peak("fp64") prices it
    h100 = get("h100")
    assert find_pipe(h100, "fp64") == ("fp64 tensor core", 66.9e12)
    assert find_pipe(h100, "fp64-vector") == ("fp64 vector", 33.5e12)
    by_dtype = roofline_point("h100", "fp64", 10)
    assert (by_dtype.pipe, by_dtype.peak_flops_per_s) == ("fp64 tensor core", 66.9e12)
    # the L4 has no fp64 tensor core: both name its fp64 vector line, 30.3 / 64 = 0.47 TFLOP/s
    l4 = get("l4")
    assert find_pipe(l4, "fp64") == ("fp64 vector", 4.7e11)
    by_dtype = roofline_point("l4", "fp64", 10)
    assert (by_dtype.pipe, by_dtype.peak_flops_per_s) == ("fp64 vector", 4.7e11)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_lab1_intensity_is_finite_and_positive(bad, capsys):
    with pytest.raises(ValueError, match="finite positive"):
        roofline_point("h100", "bf16", bad)
    assert main(["roofline", "--intensity", str(bad)]) == 2
    assert "finite positive" in capsys.readouterr().err


def test_lab1_presets_are_the_seeds_numbers():
    def at(name, dtype="bf16"):
        return roofline_point("h100", dtype, preset=name).intensity

    assert at("residual-add") == 1 / 6  # 1 FLOP / (3 tensors x 2 B)
    assert at("residual-add", "fp8") == 1 / 3  # the same op on 1-byte tensors
    assert at("decode-gemv") == 1.0  # 2/s
    # elementwise intensities (bf16): FLOP per element / bytes per element
    table_3 = {"adam": 0.40, "swiglu": 1.00, "rmsnorm": 1.25, "softmax": 1.50}
    table_3 |= {"layernorm": 2.25, "gelu": 3.00, "fused-norm-swiglu-residual": 3.00}
    assert {name: round(at(name), 2) for name in table_3} == table_3
    assert at("gemm-4096-compulsory") == pytest.approx(4096 / 3)  # 2n/(3s) = 1365.3
    assert at("gemm-tiled-128x128") == 64  # T/s
    assert at("gemm-tiled-256x128") == pytest.approx(256 / 3)  # 2/(2(3/256)) = 85.3
    assert at("flash-attention-tiled") == 128  # 2B_r/s
    assert at("flash-attention-compulsory") == 1024  # N/s at N = 2048
    assert round(at("decode-gemm-b64")) == 63  # 2·64·8192 / (2·(128 + 8192)) = 63.0
    assert round(at("prefill-gemm-32k")) == 3641  # 2·32768·8192 / (2·(65536 + 8192))
    assert round(at("lm-head"), -1) == 2660  # 6.71e12 / 2.52e9 = 2658
    assert at("cross-entropy") == 6 / 16
    # the remaining presets, bf16: 4/(2·2) = 1; 8 heads share K/V: 32/(2·2) = 8; d/s = 64
    assert at("decode-attention") == 1 and at("decode-attention-gqa8") == 8
    assert at("naive-attention") == 64
    assert list(PRESETS) == [
        "decode-gemv",
        "decode-gemm-b64",
        "prefill-gemm-32k",
        "residual-add",
        "adam",
        "swiglu",
        "rmsnorm",
        "softmax",
        "layernorm",
        "gelu",
        "fused-norm-swiglu-residual",
        "cross-entropy",
        "decode-attention",
        "decode-attention-gqa8",
        "naive-attention",
        "flash-attention-tiled",
        "flash-attention-compulsory",
        "gemm-4096-compulsory",
        "gemm-tiled-128x128",
        "gemm-tiled-256x128",
        "lm-head",
    ]
    with pytest.raises(ValueError, match="one of them"):
        roofline_point("h100", "bf16", 2, preset="rmsnorm")


def test_lab1_cli_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "lab1.png"
    argv = ["roofline", "--hardware", "h100", "--dtype", "bf16", "--boundary", "l2"]
    assert main([*argv, "--preset", "decode-gemv", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    # I = 1 at the L2 boundary: 1 x 9e12 / 989.4e12 = 0.91% of peak, ridge 110
    assert "L2 cache boundary (approximate)" in out
    assert re.search(r"^machine balance I\*: 110 FLOP/B \(approximate\)$", out, re.M)
    assert re.search(r"^fraction of peak: 0\.91%$", out, re.M)
    assert plot.read_bytes()[:8] == PNG and plot.stat().st_size > 10_000


def test_lab2_hierarchical_readout_is_the_seeds():
    g = gemm_workbench(4096, 4096, 4096, tile="256x128", hardware="h100")
    levels = {r.level: r for r in g.hierarchy()}
    w = 2 * 4096**3
    # L2: 16 x 32 tiles each stream (256 + 128) x 4096 x 2 B of panels, plus C once:
    # 512 x 384 x 8192 + 2 x 4096² = 1,644,167,168 B, I = 83.6; without the output term
    # 2/(s(1/256 + 1/128)) = 85.3 (~85)
    assert levels["l2"].bytes == 512 * 384 * 8192 + 2 * 4096**2 == 1_644_167_168
    assert levels["l2"].intensity(w) == pytest.approx(w / 1_644_167_168)
    assert round(levels["l2"].intensity(w), 1) == 83.6
    assert g.tiled_intensity_limit == pytest.approx(256 / 3)
    # L2 ridge 989.4 / 9 = 109.9; the cap 9e12 x 83.6 / 989.4e12 = 76.0% (often quoted ~77%, which
    # is 9 x 85.3 / 989.4 = 77.6% without the output write)
    assert BF16_PEAK / levels["l2"].bytes_per_s == pytest.approx(109.93, abs=0.01)
    assert g.binding == levels["l2"] and g.binding.name == "L2 cache"  # the boundary's name
    assert g.hierarchical_cap == pytest.approx(9e12 * w / 1_644_167_168 / BF16_PEAK)
    assert round(100 * g.hierarchical_cap, 1) == 76.0
    assert round(100 * 9e12 * g.tiled_intensity_limit / BF16_PEAK, 1) == 77.6
    # shared memory: 64 x 64 warp tiles, 2/(2(1/64 + 1/64)) = 32 against 989.4 / 30.92 = 32.0
    assert levels["smem"].intensity(w) == 32
    assert BF16_PEAK / levels["smem"].bytes_per_s == pytest.approx(32.0, abs=0.01)
    # the fit test: (256 + 128) x 128 x 2 B + 256 x 128 x 4 B = 224 KiB of 228 KiB, so one
    # CTA per SM; 16 x 32 = 512 tiles (512 >= 132 / 2: no split-K) on 132 SMs:
    # ceil(512 / 132) = 4 waves, 512 / 528 = 97.0% busy
    assert g.tile_bytes == 224 * 1024 and g.tile_fits and g.ctas_per_sm == 1
    assert g.split == 1 and g.partial_bytes == 0
    assert (g.waves.ctas, g.waves.slots, g.waves.count) == (512, 132, 4)
    assert g.waves.efficiency == pytest.approx(512 / 528)
    # HBM sees Q modelled: compulsory 2 x 3 x 4096² + 15% of the re-reads
    assert (
        levels["hbm"].bytes
        == g.modelled_bytes
        == pytest.approx(2 * 3 * 4096**2 + 0.15 * (1_644_167_168 - 2 * 3 * 4096**2))
    )


def test_lab2_tiles_and_cli(capsys, tmp_path):
    square = gemm_workbench(4096, 4096, 4096, tile=128)
    assert gemm_workbench(4096, 4096, 4096, tile="128").tile == square.tile
    assert (square.tile.m, square.tile.n) == (128, 128)
    with pytest.raises(ValueError, match="T_mxT_n"):
        gemm_workbench(64, 64, 64, tile="big")
    pytest.importorskip("matplotlib")
    plot = tmp_path / "lab2.png"
    argv = ["gemm", "4096", "4096", "4096", "--tile", "256x128", "--hardware", "h100"]
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^binds: L2 cache, 76\.0% of peak", out, re.M)
    assert re.search(r"^  shared memory: I = 32\.0 \(warp tile 64x64\), ridge ~32\.0", out, re.M)
    assert re.search(r"^  L2 cache: I = 83\.6 \(-> 85\.3 without the output write\)", out, re.M)
    assert "x 1 CTA/SM (228 KiB // 224 KiB) = 4 waves, 97.0% busy" in out
    assert "split-K" not in out
    assert plot.read_bytes()[:8] == PNG and plot.stat().st_size > 10_000


def test_lab2_split_k_is_in_q_modelled_so_every_line_agrees(capsys):
    g = gemm_workbench(1024, 1024, 8192, tile="256x128", hardware="h100")
    w = 2 * 1024 * 1024 * 8192  # 17,179,869,184
    # 4 x 8 = 32 tiles, 2 x 32 = 64 <= 132 SMs: split_k = min(132 // 32, 8192 // 128) = 4
    assert (g.tiles, g.split) == (32, 4)
    # compulsory 2 x (2 x 1024 x 8192 + 1024²) = 35,651,584; tiled panels
    # 2 x 8192 x (1024 x 8 + 1024 x 4) = 201,326,592 + C 2 x 1024² = 203,423,744; L2 lets
    # 15% of the 167,772,160 re-read through: 35,651,584 + 25,165,824 = 60,817,408
    assert g.compulsory_bytes == 35_651_584 and g.tiled_bytes == 203_423_744
    assert g.streamed_bytes == pytest.approx(60_817_408)
    # split-K: 2 x (4 - 1) x 1024² x 4 B = 25,165,824 B of fp32 partial sums
    assert g.partial_bytes == pytest.approx(25_165_824)
    assert g.modelled_bytes == pytest.approx(85_983_232)
    # one Q at HBM: the row, the predicted time and the binding level agree
    hbm = {r.level: r for r in g.hierarchy()}["hbm"]
    assert hbm.bytes == g.modelled_bytes
    assert g.intensity("modelled") == pytest.approx(w / 85_983_232)  # 199.8
    assert g.time_s == pytest.approx(85_983_232 / 3.35e12)  # 25.67 us, HBM-bound
    assert g.binding == hbm and g.hierarchical_time_s == pytest.approx(g.time_s)
    assert main(["gemm", "1024", "1024", "8192", "--tile", "256x128", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^split-K: 32 tiles fill at most half of 132 SMs, so K is split in 4 \(2048 of K "
        r"each\); fp32 partial sums 25\.2 MB written and read back$",
        out,
        re.M,
    )
    # 3.35e12 x 199.8 / 989.4e12 = 67.7% everywhere
    assert re.search(
        r"^Q modelled: 86\.0 MB \(I = 199\.8\): .* \+ the split-K partial sums$", out, re.M
    )
    assert re.search(r"^predicted time: 25\.7 us, 67\.7% of peak$", out, re.M)
    assert re.search(
        r"^  HBM: I = 199\.8 \(Q modelled\), ridge 295\.3, cap 67\.7% of peak$", out, re.M
    )
    assert re.search(r"^binds: HBM, 67\.7% of peak, floor 25\.7 us$", out, re.M)
    # 32 x 4 = 128 CTAs, one per SM: one wave, 128 / 132 = 97.0% busy
    assert "128 CTAs over 132 SMs x 1 CTA/SM (228 KiB // 224 KiB) = 1 wave, 97.0% busy" in out


def test_lab2_the_tile_limit_uses_the_rows_a_tile_holds(capsys):
    # M = 64 under T_m = 256: a tile holds 64 rows, so I -> 2/(2(1/64 + 1/128)) = 128/3 = 42.7
    # (not 85.3). 1 x 128 = 128 tiles >= 132 / 2: no split-K, so without C the L2 bytes are
    # the panels 2 x 8192 x (64 x 128 + 16384 x 1) and I = 2·64·16384·8192 / that = 42.7
    skinny = gemm_workbench(64, 16384, 8192, tile="256x128", hardware="h100")
    assert skinny.effective_tile == (64, 128) and skinny.split == 1
    assert skinny.tiled_intensity_limit == pytest.approx(128 / 3)
    assert main(["gemm", "64", "16384", "8192", "--tile", "256x128", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "-> 2/(s(1/64 + 1/128)) = 42.7 as K grows" in out
    assert "(-> 42.7 without the output write)" in out
    # a GEMV, M = 1 under 128 x 128 tiles: 2/(2(1/1 + 1/128)) = 128/129 = 0.99, not T/s = 64;
    # without C the L2 sees the panels 2 x 4096 x (32 + 4096) and split-K's
    # 2 x 3 x 4096 x 4 B of partials: 2 x 4096² / 33,914,880 = 0.99
    gemv = gemm_workbench(1, 4096, 4096, tile=128, hardware="h100")
    assert gemv.tiled_intensity_limit == pytest.approx(128 / 129)
    assert main(["gemm", "1", "4096", "4096", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "-> 2/(s(1/1 + 1/128)) = 1.0 as K grows" in out
    assert re.search(r"^  L2 cache: I = 1\.0 \(-> 1\.0 without the output write\)", out, re.M)


def test_lab2_a_tile_that_does_not_fit_gets_no_waves(capsys):
    # 512 x 512: (512 + 512) x 512 x 2 B + 512² x 4 B = 2048 KiB > 228 KiB
    big = gemm_workbench(4096, 4096, 4096, tile=512, hardware="h100")
    assert big.tile_bytes == 2048 * 1024 and not big.tile_fits
    assert big.ctas_per_sm == 0 and big.waves is None
    assert main(["gemm", "4096", "4096", "4096", "--tile", "512", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    assert re.search(r"^waves: none: the tile does not fit the local budget", out, re.M)
    # a 64 x 64 tile, (64 + 64) x 64 x 2 B + 64² x 4 B = 32 KiB: 228 // 32 = 7 CTAs per SM,
    # so 64 x 64 = 4096 tiles need ceil(4096 / 924) = 5 waves
    small = gemm_workbench(4096, 4096, 4096, tile=64, hardware="h100")
    assert (small.ctas_per_sm, small.waves.slots, small.waves.count) == (7, 924, 5)


@pytest.mark.parametrize("kib", ["0", "-3", "nan", "inf"])
def test_lab2_the_local_budget_is_positive(kib, capsys):
    with pytest.raises(ValueError, match="local budget"):
        gemm_workbench(64, 64, 64, local_budget_bytes=float(kib) * 1024)
    assert main(["gemm", "64", "64", "64", "--local-budget-kib", kib]) == 2
    assert "--local-budget-kib > 0" in capsys.readouterr().err


def test_fusion_bench_lab_3():
    n, s, d = 65536 * 8192, 2, 8192
    split = fusion_bench(65536, 8192, "bf16", "h100")
    fused = fusion_bench(boundaries_on=parse_boundaries("fused"))
    # all split: 6 kernels reading/writing (3+2+2+2+3+2) = 14 tensors of n, plus gamma once
    assert len(split.kernels) == 6 and split.bytes == s * (14 * n + d)
    # fused: reads x, r, u and writes h (the residual stream) and o: 5 tensors
    assert len(fused.kernels) == 1 and fused.bytes == s * (5 * n + d)
    # W never changes: 1 + 3 + 1 + 4 + 1 + 2 = 12 FLOP per element
    assert split.flops == fused.flops == 12 * n
    assert fused.intensity == 12 * n / (s * (5 * n + d))  # ~12 / (5 x 2 B) = 1.2
    # every kernel is memory-bound, so the speed-up is the byte ratio (14n + d) / (5n + d)
    assert fused.speedup == pytest.approx((14 * n + d) / (5 * n + d))
    assert round(fused.speedup, 2) == 2.80
    assert fused.time_s == pytest.approx(s * (5 * n + d) / 3.35e12)  # 1.603 ms
    # register check: the fused group holds a d = 8192 row, 32 elements per thread, 3
    # tensors live at the residual add (x, r, h): 32 x 3 x 4 B x 256 = 96 KiB > 64 KiB
    assert fused.kernels[0].live_state_bytes == 96 * 1024 and fused.warnings()
    assert not split.warnings()  # RMSNorm alone: 32 x 2 x 4 x 256 = 64 KiB, not over
    narrow = fusion_bench(65536, 4096, boundaries_on=parse_boundaries("00000"))
    assert narrow.kernels[0].live_state_bytes == 48 * 1024 and not narrow.warnings()
    # one boundary after the residual add: h written once and read back, 2 kernels
    two = fusion_bench(boundaries_on=parse_boundaries("10000"))
    assert len(two.kernels) == 2 and two.bytes == s * (3 * n + 3 * n + d)
    with pytest.raises(ValueError, match="5 digits"):
        parse_boundaries("101")


def test_flash_attention_tiled_bound():
    # I_tiled = 4N²d / [s(2Nd + 2N²d/B_r)] -> 2B_r/s = 128 for B_r = 128, bf16
    far = attention_bounds(2**20, 128, 128, "bf16")
    assert far.tiled_limit == 128
    assert far.intensity("tiled") == pytest.approx(4 * 2**20 / (2 * (2 + 2 * 2**20 / 128)))
    assert 127.9 < far.intensity("tiled") < 128
    assert far.intensity("naive") == pytest.approx(64, rel=1e-3)  # d/s
    b = attention_bounds(4096, 128, 128, "bf16")
    nd = 4096 * 128
    # Q_tiled = s·Nd + s·(N/B_r)·2Nd + s·Nd = 2 x (1 + 64 + 1) x Nd
    assert b.tiled_bytes == 2 * (nd + 32 * 2 * nd + nd)
    assert b.intensity("tiled") == pytest.approx(16384 / 132)  # 4N/(s(2 + 2N/B_r)) = 124.1
    assert b.intensity("compulsory") == 2048  # N/s
    assert b.intensity("naive") == pytest.approx(nd / (2 * (4096 + 128)))  # 62.1
    # hierarchy.attention_levels counts the same bytes at L2 (B_r = 128)
    from torchroof.timing.hierarchy import attention_levels
    from torchroof.timing.kernel_shape import KernelShape

    shape = KernelShape("attention", 2, batch=1, m=4096, n=4096, k=128)
    assert attention_levels(shape, b.compulsory_bytes, get("h100")).l2 == b.tiled_bytes


def test_chunked_cross_entropy_seed_numbers(capsys):
    ce = chunked_cross_entropy(8192, 100_000, 1024)
    # 4 B x 8192 x 100,000 = 3.28 GB of fp32 logits; chunks of 1024 rows keep 4 x 1024 x
    # 100,000 = 0.41 GB: N_t / C = 8x smaller
    assert ce.materialised_peak_bytes == 4 * 8192 * 100_000 == 3_276_800_000
    assert ce.chunked_peak_bytes == 4 * 1024 * 100_000
    assert ce.peak_ratio == 8
    # the cross-entropy kernel's 4 x 4 x N_t x V = 13.1 GB (about 13 GB) at 6/16
    assert ce.cross_entropy_bytes == 13_107_200_000
    assert ce.cross_entropy_intensity == 0.375
    # removed: that kernel plus the head GEMM's bf16 logits write, 2 x 8192 x 100,000
    assert ce.traffic_removed_bytes == 13_107_200_000 + 1_638_400_000
    # added: 7 more reads of the 4096 x 100,000 bf16 head weight
    assert ce.weight_reread_bytes == 7 * 2 * 4096 * 100_000
    assert main(["lab", "cross-entropy", "--tokens", "8192", "--chunk", "1024"]) == 0
    assert "(8.0x smaller)" in capsys.readouterr().out
    assert main(["lab", "flash", "--seq", "4096"]) == 0
    assert re.search(r"^tiled: .* I = 124\.1 \(-> 2B_r/s = 128\)$", capsys.readouterr().out, re.M)


def test_fusion_bench_cli(capsys):
    assert main(["fusion-bench", "--boundaries", "fused"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^kernels launched: 1$", out, re.M)
    assert re.search(r"^speed-up vs all-split: 2\.80x$", out, re.M)
    assert re.search(r"^warning: .* 96 KiB of live state per 256-thread block", out, re.M)
    assert main(["fusion-bench", "--boundaries", "12"]) == 2

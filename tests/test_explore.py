"""The seed's labs (seed 000 Labs 1-3, "FlashAttention", "The big-vocabulary logits crisis",
"The hierarchical roofline"): every number below is derived by hand beside the assertion."""

import re

import pytest
from torchroof.hardware import get

from torchroof.cli import main
from torchroof.explore import PRESETS, boundaries, find_pipe, gemm_workbench, roofline_point
from torchroof.fusion_bench import fusion_bench, parse_boundaries
from torchroof.io_bounds import attention_bounds, chunked_cross_entropy

PNG = b"\x89PNG\r\n\x1a\n"
BF16_PEAK = 989.4e12  # H100 SXM dense bf16


def test_lab1_boundaries_are_table_4():
    def ridge(name):
        return roofline_point("h100", "bf16", 1, boundary=name).machine_balance

    # seed 000 Table 4, ridge = pi_bf16 / beta
    assert ridge("l2") == pytest.approx(989.4 / 9)  # 109.9
    assert ridge("shared memory") == pytest.approx(989.4 / 30.92)  # 32.0 (seed: ~33)
    assert ridge("registers") == pytest.approx(989.4 / 300)  # 3.3 (seed: ~3)
    assert ridge("hbm") == pytest.approx(989.4 / 3.35)  # 295.3
    assert round(ridge("nvlink")) == 2199  # 989.4e12 / 450e9 = 2198.7 (seed: 2198)
    assert round(ridge("pcie")) == 15459  # 989.4e12 / 64e9
    assert round(ridge("network")) == 19788  # 989.4e12 / 50e9 (seed: EFA on p5)
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
    # seed 000 "pi is the top of a stack": fp32 without FMA 66.9 / 2 = 33.45, SFU 66.9 / 4
    assert find_pipe(spec, "fp32-no-fma") == ("fp32 vector without FMA", 33.45e12)
    assert find_pipe(spec, "sfu")[1] == pytest.approx(16.725e12)
    assert find_pipe(spec, "fp8") == ("fp8 tensor core", 1978.9e12)
    r = roofline_point("h100", "bf16", 2, pipe="fp32 vector without FMA")
    # ridge 33.45e12 / 3.35e12 = 9.99; I = 2 reaches 2 x 3.35 / 33.45 = 20.03%
    assert r.machine_balance == pytest.approx(33.45 / 3.35)
    assert round(100 * r.fraction_of_peak, 2) == 20.03
    with pytest.raises(ValueError, match="no pipe"):
        roofline_point("h100", "bf16", 2, pipe="fp4")


def test_lab1_presets_are_the_seeds_numbers():
    def at(name, dtype="bf16"):
        return roofline_point("h100", dtype, preset=name).intensity

    assert at("residual-add") == 1 / 6  # 1 FLOP / (3 tensors x 2 B)
    assert at("residual-add", "fp8") == 1 / 3  # the same op on 1-byte tensors
    assert at("decode-gemv") == 1.0  # 2/s
    # seed 000 Table 3 (bf16): FLOP per element / bytes per element
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
    assert len(PRESETS) >= 20
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
    # 2/(s(1/256 + 1/128)) = 85.3 (seed: ~85)
    assert levels["l2"].bytes == 512 * 384 * 8192 + 2 * 4096**2 == 1_644_167_168
    assert levels["l2"].intensity(w) == pytest.approx(w / 1_644_167_168)
    assert round(levels["l2"].intensity(w), 1) == 83.6
    assert g.tiled_intensity_limit == pytest.approx(256 / 3)
    # L2 ridge 989.4 / 9 = 109.9; the cap 9e12 x 83.6 / 989.4e12 = 76.0% (seed: ~77%, which
    # is 9 x 85.3 / 989.4 = 77.6% without the output write)
    assert BF16_PEAK / levels["l2"].bytes_per_s == pytest.approx(109.93, abs=0.01)
    assert g.binding is levels["l2"] or g.binding == levels["l2"]
    assert g.hierarchical_cap == pytest.approx(9e12 * w / 1_644_167_168 / BF16_PEAK)
    assert round(100 * g.hierarchical_cap, 1) == 76.0
    assert round(100 * 9e12 * g.tiled_intensity_limit / BF16_PEAK, 1) == 77.6
    # shared memory: 64 x 64 warp tiles, 2/(2(1/64 + 1/64)) = 32 against 989.4 / 30.92 = 32.0
    assert levels["smem"].intensity(w) == 32
    assert BF16_PEAK / levels["smem"].bytes_per_s == pytest.approx(32.0, abs=0.01)
    # waves: 512 CTAs, one per SM (4 stages x 384 x 64 x 2 B = 192 KiB of 228), 132 SMs:
    # ceil(512 / 132) = 4 waves, 512 / 528 = 97.0% busy
    assert (g.waves.ctas, g.waves.count) == (512, 4)
    assert g.waves.efficiency == pytest.approx(512 / 528)
    # seed 004 fit: (256 + 128) x 128 x 2 B + 256 x 128 x 4 B = 224 KiB of 228 KiB
    assert g.tile_bytes == 224 * 1024 and g.tile_fits


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
    assert re.search(r"^binds: L2, 76\.0% of peak", out, re.M)
    assert re.search(r"^  shared memory: I = 32\.0 \(warp tile 64x64\), ridge ~32\.0", out, re.M)
    assert "= 4 waves, 97.0% busy" in out
    assert plot.read_bytes()[:8] == PNG and plot.stat().st_size > 10_000


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
    # seed 000: I_tiled = 4N²d / [s(2Nd + 2N²d/B_r)] -> 2B_r/s = 128 for B_r = 128, bf16
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
    from torchroof.hierarchy import attention_levels
    from torchroof.kernel_shape import KernelShape

    shape = KernelShape("attention", 2, batch=1, m=4096, n=4096, k=128)
    assert attention_levels(shape, b.compulsory_bytes, get("h100")).l2 == b.tiled_bytes


def test_chunked_cross_entropy_seed_numbers(capsys):
    ce = chunked_cross_entropy(8192, 100_000, 1024)
    # 4 B x 8192 x 100,000 = 3.28 GB of fp32 logits; chunks of 1024 rows keep 4 x 1024 x
    # 100,000 = 0.41 GB: N_t / C = 8x smaller
    assert ce.materialised_peak_bytes == 4 * 8192 * 100_000 == 3_276_800_000
    assert ce.chunked_peak_bytes == 4 * 1024 * 100_000
    assert ce.peak_ratio == 8
    # the cross-entropy kernel's 4 x 4 x N_t x V = 13.1 GB (seed: "moves 13 GB") at 6/16
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

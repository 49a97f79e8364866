"""Variants, sweeps, the explorer and GEMM workbench, plots and the timeline (the explorers'
questions on real models)."""

import json
import re

import pytest

import torchroof
from torchroof.cli.main import main
from torchroof.labs.explore import roofline_point
from torchroof.labs.gemm_workbench import gemm_workbench
from torchroof.render import files, text
from torchroof.studies import compare, parse_value, sweep


def test_gqa_comparison_kv_bytes_differ_by_exactly_eight():
    result = compare(
        "llama-3-70b", {"num_key_value_heads": [64, 8]}, regime="decode", batch=1, context=8192
    )
    mha, gqa = (v.estimate for v in result.variants)
    # 2 · 2 B · 80 layers · h_kv · 128 · 8193 tokens: h_kv 64 vs 8
    assert mha.kv_bytes_read == 8 * gqa.kv_bytes_read
    assert gqa.kv_bytes_read == 2 * 2 * 80 * 8 * 128 * 8193 == 2_684_682_240
    rows = _table_rows(text.variants_table(result))
    assert rows["header"] == ["num_key_value_heads=64", "num_key_value_heads=8"]
    assert rows["KV vs first"] == ["1.000x", "0.125x"]


def test_decode_batch_sweep_reproduces_ridge_and_crossover(tmp_path):
    result = sweep(
        "llama-3-70b", "batch", [1, 64], regime="decode", context=8192, hardware="h100-sxm"
    )
    # both figures come from the first point, batch 1. Weights read: 2 B · (70,553,706,496
    # parameters − the 128,256 x 8192 embedding) + its one gathered row (8192 · 2 B) =
    # 139,006,083,072 B; the weight GEMMs' W = 2 · 1 token · 69,501,714,432 matmul
    # parameters (all but the embedding and the 80·2·8192 + 8192 norm weights).
    # B* = s · I* / 2 = 295 for bf16 weights on an H100; exactly, batch · I* /
    # (GEMM W / weights read) = 1 · (989.4e12 / 3.35e12) / (139,003,428,864 /
    # 139,006,083,072) = 295.349 (the norm weights and embedding row do no GEMM work)
    assert result.ridge_batch == (989.4e12 / 3.35e12) / (139_003_428_864 / 139_006_083_072)
    assert round(result.ridge_batch, 3) == 295.349
    # KV overtakes weights near 53 at 8k context; exactly, weights read / KV per
    # sequence = 139,006,083,072 / (327,680 B · 8193 tokens) = 51.777
    assert result.kv_crossover_batch == 139_006_083_072 / (327_680 * 8193)
    assert round(result.kv_crossover_batch, 3) == 51.777
    rows = result.rows()
    assert rows[1]["tokens_per_s"] > 20 * rows[0]["tokens_per_s"]  # nearly free until B*
    path = tmp_path / "sweep.csv"
    files.write_sweep_csv(result, path)
    assert path.read_text().splitlines()[0].startswith("batch,step_time_s,tokens_per_s")


def test_gemm_workbench_seed_numbers():
    g = gemm_workbench(
        4096, 4096, 4096, dtype="bf16", tile=128, l2_absorption=0.85, hardware="h100"
    )
    assert g.flops == 2 * 4096**3
    assert g.intensity("compulsory") == pytest.approx(4096 / 3)  # 1365.3
    # tiled: 2K / [s(2K/T + 1)] = 8192 / (2 · 65) = 63.0, tending to T/s = 64 as K grows
    assert g.intensity("tiled") == pytest.approx(8192 / 130)
    assert g.tiled_intensity_limit == 64
    deep = gemm_workbench(4096, 4096, 4096 * 64, tile=128)
    # K = 262,144: 2K / [s(2K/T + 1)] = 524,288 / (2 · 4097) = 63.98, approaching T/s = 64
    assert deep.intensity("tiled") == pytest.approx(524_288 / 8194)
    # modelled: compulsory + 15% of the re-reads
    assert g.modelled_bytes == pytest.approx(
        g.compulsory_bytes + 0.15 * (g.tiled_bytes - g.compulsory_bytes)
    )
    # the fit test: two bf16 128² tiles (64 KiB) + a 128² fp32 accumulator (64 KiB) do not fit
    # a 96 KiB budget
    assert g.tile_bytes == 2 * 128 * 128 * 2 + 128 * 128 * 4 == 131072
    small = gemm_workbench(4096, 4096, 4096, tile=128, local_budget_bytes=96 * 1024)
    assert not small.tile_fits and g.tile_fits


def test_roofline_explorer_rmsnorm_example():
    r = roofline_point("h100", "bf16", 2)
    # an RMSNorm at I = 2 on an H100 reaches 2 / 295 = 0.68% of bf16 peak
    assert r.fraction_of_peak == pytest.approx(2 * 3.35e12 / 989.4e12)
    assert round(100 * r.fraction_of_peak, 2) == 0.68
    assert r.regime == "memory-bound"
    assert roofline_point("h100", "bf16", 1365).regime == "compute-bound"
    with pytest.raises(ValueError, match="positive"):
        roofline_point("h100", "bf16", 0)


def test_plots_are_valid_images(tmp_path, meta_lm):
    pytest.importorskip("matplotlib")
    from torchroof.render.plots import layer_plot, roofline_plot, sweep_plot

    est = torchroof.estimate(meta_lm("llama"), "train", batch=2, seq=64)
    png = roofline_plot(est, tmp_path / "roofline.png")
    svg = layer_plot(est, tmp_path / "layers.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "<svg" in svg.read_text()[:2000] and svg.stat().st_size > 5_000
    curve = sweep(meta_lm("llama"), "batch", [1, 4, 16], regime="decode", context=128)
    out = sweep_plot(curve, tmp_path / "sweep.png")
    assert out.stat().st_size > 20_000
    with pytest.raises(ValueError, match="png or .svg"):
        roofline_plot(est, tmp_path / "roofline.jpg")


def test_timeline_is_a_chrome_trace(tmp_path, meta_lm):
    from torchroof.render.chrome_trace import write_chrome_trace

    est = torchroof.estimate(meta_lm("llama"), "train", batch=1, seq=32)
    path = tmp_path / "timeline.json"
    write_chrome_trace(est, path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(est.kernels)
    starts = [e["ts"] for e in events]
    assert starts == sorted(starts)
    assert sum(e["dur"] for e in events) == pytest.approx(est.time_s * 1e6)
    assert {e["tid"] for e in events} == {1, 2, 4}  # forward, backward, optimizer tracks


def test_compare_rejects_unknown_keys_and_parses_values():
    assert parse_value("batch", "64") == 64 and parse_value("hardware", "h100") == "h100"
    assert parse_value("rope_theta", "1e6") == 1e6 and parse_value("epilogue", "true") is True
    with pytest.raises(ValueError, match="unknown key 'num_heads_typo'"):
        compare("gpt2", {"num_heads_typo": [1, 2]}, seq=16)


def _table_rows(table: str) -> dict[str, list[str]]:
    """A tabulate "simple" table as {row label: cells}; the header row is "header"."""
    lines = [line for line in table.splitlines() if line.strip()]
    dashes = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "})
    rows = {"header": re.split(r"\s{2,}", lines[dashes - 1].strip())}
    for line in lines[dashes + 1 :]:
        label, *cells = re.split(r"\s{2,}", line.strip())
        rows[label] = cells
    return rows


def _field(pattern: str, text: str) -> str:
    found = re.search(pattern, text, re.MULTILINE)
    assert found, f"{pattern!r} not in:\n{text}"
    return found[1]


def test_cli_explorer_gemm_compare_and_sweep(capsys, tmp_path):
    assert main(["roofline", "--hardware", "h100", "--dtype", "bf16", "--intensity", "2"]) == 0
    out = capsys.readouterr().out
    # I = 2 reaches 2 / (989.4e12 / 3.35e12) = 0.677% of the bf16 peak
    assert float(_field(r"^fraction of peak: ([\d.]+)%$", out)) == 0.68
    assert float(_field(r"^machine balance I\*: (\d+) FLOP/B$", out)) == 295
    assert main(["gemm", "4096", "4096", "4096", "--tile", "128", "--hardware", "h100"]) == 0
    printed = capsys.readouterr().out
    # compulsory: 2·4096³ / (2 B · 3·4096²) = 4096/3 = 1365.3 over 100.7 MB
    compulsory = re.search(r"^Q compulsory: ([\d.]+) MB \(I = ([\d.]+)\)$", printed, re.M)
    assert compulsory and compulsory.groups() == ("100.7", "1365.3")
    # tiled: 8192 / (2 · 65) = 63.0, tending to T/s = 128 / 2 = 64
    tiled = re.search(
        r"^Q tiled: [\d.]+ MB \(I = ([\d.]+), -> T/s = (\d+) as K grows\)$", printed, re.M
    )
    assert tiled and tiled.groups() == ("63.0", "64")

    assert main(["compare", "gpt2", "--seq", "64", "--vary", "hardware=h100,a100"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert rows["header"] == ["hardware=h100", "hardware=a100"]
    # the CLI prints what the API computes for the same request
    api = compare("gpt2", {"hardware": ["h100", "a100"]}, seq=64)
    assert rows["step time ms"] == [f"{v.estimate.time_s * 1e3:.3f}" for v in api.variants]
    assert rows["vs first"][0] == "1.000x"

    plot = tmp_path / "sweep.png"
    argv = ["sweep", "gpt2", "--regime", "decode", "--context", "64", "--values", "1,8"]
    assert main([*argv, "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    curve = sweep("gpt2", "batch", [1, 8], regime="decode", context=64)
    rows = _table_rows(printed)
    assert rows["header"][:2] == ["batch", "step ms"]
    assert [rows[b][0] for b in ("1", "8")] == [
        f"{p.estimate.time_s * 1e3:.3f}" for p in curve.points
    ]
    ridge = _field(r"B\* \(weight GEMMs reach the ridge\): (\d+);", printed)
    crossover = _field(r"KV reads overtake weight reads at batch (\d+) ", printed)
    assert int(ridge) == round(curve.ridge_batch)
    assert int(crossover) == round(curve.kv_crossover_batch)
    assert plot.exists()

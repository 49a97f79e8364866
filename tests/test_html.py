"""The interactive HTML report without a browser: one self-contained file, the
data it embeds, which estimates it can re-price, and the commands that write it.
tests/test_html_browser.py drives the page in chromium."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

pytest.importorskip("plotly", reason="the HTML report needs plotly (pip install torchroof[html])")

from torchroof.hardware import available, get

from torchroof.api import estimate_trace, trace_model
from torchroof.cli.main import main
from torchroof.render.files import estimate_json
from torchroof.render.html import (
    REPORT_FORMAT,
    accelerators,
    estimate_data,
    estimate_html,
    peak_key,
    why_not_repriced,
)
from torchroof.report.estimate import Estimate


def page_json(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="torchroof-data">(.*?)</script>', page)
    assert match, "the page holds its data in one JSON script element"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def prefill_trace():
    from conftest import meta_causal_lm

    return trace_model(meta_causal_lm("llama"), regime="prefill", seq=64)


@pytest.fixture(scope="module")
def prefill(prefill_trace) -> Estimate:
    return estimate_trace(prefill_trace, "h100-sxm")


def test_the_page_is_one_offline_file(prefill):
    page = estimate_html(prefill)
    assert page.count("<script") == 3  # plotly.js, the data, the report's script, all inline
    assert not re.search(r"<script[^>]*\ssrc", page)
    # nothing else fetched: no stylesheet, image or font from anywhere (outside the scripts,
    # whose strings hold plotly.js's own credits link)
    markup = re.sub(r"<script[^>]*>.*?</script>", "", page, flags=re.DOTALL)
    assert not re.search(r"(src|href|url)\s*[=(]", markup)
    assert "<link" not in markup
    assert "Plotly" in page and "torchroofPrice" in page
    data = page_json(page)
    assert data["format"] == REPORT_FORMAT and data["kind"] == "estimate"
    view = data["estimates"][0]
    assert len(view["kernels"]["flops"]) == len(prefill.kernels)
    assert view["time_s"] == prefill.time_s
    assert view["kernels"]["flops"] == [k.flops for k in prefill.kernels]
    assert view["kernels"]["bytes"] == [k.bytes for k in prefill.kernels]
    # the size is plotly.js (~4.8 MB) plus the data
    assert len(page) < 6_000_000


def test_rows_partition_the_kernels_and_collapse_repeated_blocks(prefill):
    rows = estimate_data(prefill)["rows"]
    everything = sorted(i for row in rows for i in row["kernels"])
    assert everything == list(range(len(prefill.kernels)))  # each kernel in exactly one row
    names = [row["name"] for row in rows]
    assert names == [row.name for row in prefill.rows(collapse=True)]
    for row in rows:
        assert set(row["first"]) <= set(row["kernels"])
        # a run of N identical blocks lists the first block's kernels: 1/N of them
        assert len(row["kernels"]) == row["blocks"] * len(row["first"])
    # the per-row bytes by kind sum to the step's traffic
    total: dict[str, int] = {}
    for row in rows:
        for kind, size in row["traffic"].items():
            total[kind] = total.get(kind, 0) + size
    assert total == {k: v for k, v in prefill.traffic().items() if v}


def test_every_shipped_accelerator_is_embedded_with_its_ceilings(prefill):
    data = estimate_data(prefill)
    table = {acc["name"]: acc for acc in accelerators(set(data["keys"]))}
    assert set(table) == {spec.name for spec in available()}
    for spec in available():
        entry = table[spec.name]
        assert entry["hbm_bytes_per_s"] == spec.hbm_bytes_per_s.value
        for key in data["keys"]:
            unit, dtype = key.split("|")[:2]
            assert entry["peaks"][key] == spec.peak(unit, dtype)
    # the kernels' matmuls run in bf16 on the tensor cores: 989.4 TFLOP/s dense on an H100
    assert table["h100-sxm"]["peaks"]["tensor|bfloat16"] == pytest.approx(989.4e12, rel=1e-3)


def test_a_ceiling_the_part_lacks_is_null_with_the_reason():
    table = {a["name"]: a for a in accelerators({"tensor|float8_e4m3fn"})}
    assert table["a100-sxm"]["peaks"]["tensor|float8_e4m3fn"] is None
    assert "no fp8 tensor cores" in table["a100-sxm"]["unsupported"]["tensor|float8_e4m3fn"]
    assert table["h100-sxm"]["peaks"]["tensor|float8_e4m3fn"] == get("h100").tensor_peak("fp8")


def test_an_fp32_matmul_ceiling_follows_allow_tf32():
    # H100 SXM: fp32 on the vector units 66.9 TFLOP/s, tf32 tensor cores 494.7 (dense)
    key, tf32 = peak_key("tensor", "float32", False), peak_key("tensor", "float32", True)
    assert (key, tf32) == ("tensor|float32", "tensor|float32|tf32")
    table = {a["name"]: a for a in accelerators({key, tf32})}
    h100 = get("h100")
    assert table["h100-sxm"]["peaks"][key] == h100.vector_peak("fp32")
    assert table["h100-sxm"]["peaks"][tf32] == h100.tensor_peak("fp32", allow_tf32=True)


def test_what_the_page_cannot_reprice_says_why(prefill_trace, prefill):
    assert why_not_repriced(prefill) == ""
    realistic = estimate_trace(prefill_trace, "h100-sxm", mode="realistic")
    assert "realistic mode" in why_not_repriced(realistic)
    imbalanced = replace(prefill, options=replace(prefill.options, routing_imbalance=1.5))
    assert "routing_imbalance" in why_not_repriced(imbalanced)
    # a multi-GPU estimate read from a file older than format 3 has no waits to re-lay its
    # schedule with, and keeps none when it is saved again
    data = replace(prefill, step_time_s=prefill.time_s).to_dict()
    data["version"] = 2
    for kernel in data["kernels"]:
        del kernel["waits_on"]
    old = Estimate.from_dict(data)
    assert "before format 3" in why_not_repriced(old)
    assert "before format 3" in why_not_repriced(Estimate.from_json(estimate_json(old)))
    # an estimate read back from JSON keeps what the page needs
    assert why_not_repriced(Estimate.from_json(estimate_json(prefill))) == ""


MARKUP = ["</script><script>alert(1)</script>", "<!--<script>", "a & b > c"]


def test_text_that_looks_like_markup_stays_text(prefill):
    page = estimate_html(replace(prefill, assumptions=MARKUP))
    data = page_json(page)
    assert data["estimates"][0]["assumptions"] == MARKUP
    payload = page.split('id="torchroof-data">')[1].split("</script>")[0]
    assert "<" not in payload and ">" not in payload  # the browser test loads such a page


def test_estimate_compare_and_sweep_write_html_from_the_command_line(tmp_path, capsys):
    report = tmp_path / "gpt2.html"
    assert main(["estimate", "gpt2", "--seq", "8", "--kernels", "0", "--html", str(report)]) == 0
    data = page_json(report.read_text())
    assert data["title"].startswith("torchroof: gpt2 prefill")
    assert "wrote the interactive report (HTML)" in capsys.readouterr().err

    both = tmp_path / "fusion.html"
    argv = ["estimate", "gpt2", "--seq", "8", "--kernels", "0", "--fusion", "eager,fused"]
    assert main([*argv, "--html", str(both)]) == 0
    data = page_json(both.read_text())
    assert data["kind"] == "comparison"
    assert [e["label"] for e in data["estimates"]] == ["fusion=eager", "fusion=fused"]
    # eager launches more kernels than fused for the same ops
    eager, fused = (len(e["kernels"]["flops"]) for e in data["estimates"])
    assert eager > fused

    compared = tmp_path / "compare.html"
    argv = ["compare", "gpt2", "--seq", "8", "--vary", "hardware=h100-sxm,a100-sxm"]
    assert main([*argv, "--html", str(compared)]) == 0
    data = page_json(compared.read_text())
    assert data["kind"] == "comparison"
    assert [e["hardware"] for e in data["estimates"]] == ["h100-sxm", "a100-sxm"]

    swept = tmp_path / "sweep.html"
    argv = ["sweep", "gpt2", "--regime", "decode", "--context", "8", "--values", "1,4"]
    assert main([*argv, "--html", str(swept)]) == 0
    data = page_json(swept.read_text())
    assert data["kind"] == "sweep" and data["sweep"] == {"key": "batch", "values": [1, 4]}
    assert [e["batch"] for e in data["estimates"]] == [1, 4]


def test_a_bad_html_path_fails_before_any_tracing(tmp_path, capsys, monkeypatch):
    import torchroof.cli.estimate

    def no_tracing(*args, **kwargs):
        raise AssertionError("traced before checking the output path")

    monkeypatch.setattr(torchroof.cli.estimate, "trace_workload", no_tracing)
    assert main(["estimate", "gpt2", "--seq", "8", "--html", str(tmp_path / "r.txt")]) == 2
    assert "a .html file" in capsys.readouterr().err
    missing = tmp_path / "no" / "r.html"
    assert main(["compare", "gpt2", "--vary", "seq=8,16", "--html", str(missing)]) == 2
    assert "no folder" in capsys.readouterr().err


def test_a_pipelined_step_is_not_repriced():
    from transformers import LlamaConfig

    import torchroof

    tiny = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    est = torchroof.estimate(tiny, "train", hardware="dgx-h100", seq=32, pp=2, microbatches=2)
    assert "pipelined step" in why_not_repriced(est)
    view = estimate_data(est)
    assert view["pipelined"] and not view["scheduled"]


def test_the_page_groups_rows_as_the_text_table_does(tmp_path):
    # --depth 1 --all-layers: GPT-2's rows are its top-level modules, none collapsed
    report = tmp_path / "d1.html"
    argv = ["estimate", "gpt2", "--seq", "8", "--kernels", "0", "--depth", "1", "--all-layers"]
    assert main([*argv, "--html", str(report)]) == 0
    rows = page_json(report.read_text())["estimates"][0]["rows"]
    assert [row["name"] for row in rows] == ["transformer", "lm_head"]
    assert all(row["blocks"] == 1 for row in rows)

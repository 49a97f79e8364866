"""The estimate: per-layer rows, totals, MFU, JSON / CSV round trips."""

import csv

import pytest
import torch

import torchroof
from torchroof.report import Estimate, collapse_repeats, layer_key


@pytest.fixture
def llama_estimate(meta_lm):
    model = meta_lm("llama", num_hidden_layers=4).eval()
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    with torchroof.trace() as t:
        model(ids)
    return t.estimate("h100-sxm")


def test_layer_keys():
    assert layer_key("model.layers.3.self_attn.q_proj", "forward") == "model.layers.3"
    assert (
        layer_key("model.layers.3.self_attn.q_proj", "forward", depth=4)
        == "model.layers.3.self_attn"
    )
    assert layer_key("lm_head", "backward") == "lm_head"
    assert layer_key("", "forward") == "(top level)"
    assert layer_key("model.layers.0", "optimizer") == "optimizer"


def test_rows_are_blocks_in_execution_order_and_sum_to_the_total(llama_estimate):
    rows = llama_estimate.rows()
    names = [r.name for r in rows]
    blocks = [n for n in names if n.startswith("model.layers.")]
    assert blocks == ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]
    assert (
        names.index("model.embed_tokens") < names.index("model.layers.0") < names.index("lm_head")
    )
    assert sum(r.time_s for r in rows) == pytest.approx(llama_estimate.time_s)
    assert sum(r.flops for r in rows) == llama_estimate.flops
    assert sum(r.kernels for r in rows) == len(llama_estimate.kernels)
    # identical blocks cost the same, except where a kernel spans a seam (booked to the block
    # its first op ran in, as Inductor fuses the first block's RoPE with the rotary cos/sin
    # kernel and the last block's residual add with the final norm)
    layer_rows = [r for r in rows if r.name in blocks]
    assert len({(r.flops, r.bytes) for r in layer_rows[1:3]}) == 1
    assert (layer_rows[0].flops, layer_rows[0].bytes) != (layer_rows[1].flops, layer_rows[1].bytes)
    collapsed = collapse_repeats(rows)
    assert "model.layers.1-2 (x2)" in [r.name for r in collapsed]
    assert sum(r.time_s for r in collapsed) == pytest.approx(llama_estimate.time_s)


def test_totals_and_mfu(llama_estimate):
    est = llama_estimate
    assert est.time_s == pytest.approx(sum(k.time_s for k in est.kernels))
    assert est.mfu == pytest.approx(est.flops / (est.time_s * 989.4e12))
    assert 0 < est.memory_bound_share <= 1
    table = est.table()
    assert "model.layers.1" in table and "total" in table
    summary = est.summary()
    assert "MFU" in summary and "coverage" in summary


def test_json_round_trip(tmp_path, llama_estimate):
    path = tmp_path / "est.json"
    llama_estimate.to_json(path)
    back = Estimate.from_json(path)
    assert back.kernels == llama_estimate.kernels
    assert back.time_s == pytest.approx(llama_estimate.time_s)
    assert back.table() == llama_estimate.table()
    assert back.options["fusion"] == "fused"  # the default policy


def test_csv_has_one_row_per_kernel(tmp_path, llama_estimate):
    path = tmp_path / "kernels.csv"
    llama_estimate.to_csv(path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(llama_estimate.kernels)
    assert sum(float(r["time_s"]) for r in rows) == pytest.approx(llama_estimate.time_s)

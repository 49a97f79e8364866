"""Repeated layers copied against every layer run, on the zoo's 29 diverse architectures in
every regime: the checked-in results of examples/copied_layers_check.py (all 87 steps the
same op for op, every op priced), and three of them rerun live so the file cannot drift
from the code."""

import json
import re
from pathlib import Path

import pytest

from torchroof.validation.zoo import replay_check

RESULTS = json.loads((Path(__file__).parent / "data" / "copied_layers.json").read_text())
ROWS = {(r["architecture"], r["regime"]): r for r in RESULTS}
# Where layers of one kind are not copied, and why: two layers only (the first and the
# second run, held to each other; training also runs the last), a cache that grows as its
# layers run, a model whose layers are not in one list, a layer's backward that turned out
# not to be copyable (the step ran every layer again).
NOT_COPIED = {
    ("bloom", "prefill"), ("bloom", "decode"), ("bloom", "train"),
    ("zamba2", "prefill"), ("zamba2", "decode"), ("zamba2", "train"),
    ("minimax", "prefill"), ("minimax", "train"),
}  # fmt: skip


def copies(line: str) -> int:
    """The copies a ``repeated_layers`` line counts (``... 2 traced, 30 copied``), summed
    over its stacks."""
    return sum(int(n) for n in re.findall(r"(\d+) copied", line))


def test_the_checked_in_results_cover_every_step_and_agree():
    assert len(RESULTS) == 29 * 3
    assert [k for k, r in ROWS.items() if r["difference"]] == []
    assert [k for k, r in ROWS.items() if r["uncounted"]] == []


def test_layers_are_copied_where_they_can_be():
    copied = {k for k, r in ROWS.items() if copies(r["repeated_layers"]) > 0}
    assert set(ROWS) - copied <= NOT_COPIED | {("bart", "train"), ("t5", "train")}
    # Llama-style: 32 layers, the first two traced, 30 copied; training runs the last too
    assert ROWS[("llama", "decode")]["repeated_layers"].endswith("2 traced, 30 copied")
    assert ROWS[("llama", "train")]["repeated_layers"].endswith("3 traced, 29 copied")


@pytest.mark.parametrize(
    "architecture, regime", [("llama", "decode"), ("mixtral", "train"), ("jamba", "prefill")]
)
def test_a_rerun_matches_the_checked_in_result(architecture, regime):
    check = replay_check(architecture, regime)
    row = ROWS[(architecture, regime)]
    assert check.difference == "" and check.repeated_layers == row["repeated_layers"]


# Training steps across GPUs: examples/copied_layers_check.py --plan fsdp=2 and --plan tp=2
PLANS = {
    plan: json.loads((Path(__file__).parent / "data" / f"copied_layers_{plan}.json").read_text())
    for plan in ("fsdp2", "tp2")
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_training_across_gpus_agrees_with_running_every_layer(plan):
    """Every zoo architecture the plan runs gives the full step, op for op, every op priced;
    the ones it cannot run say why (tied embeddings FSDP cannot group here, no tensor-
    parallel plan)."""
    rows = PLANS[plan]
    assert len(rows) == 29
    ran = [r for r in rows if r.get("runs", True)]
    assert [r["architecture"] for r in ran if r["difference"] or r["uncounted"]] == []
    assert all(r["why"] for r in rows if not r.get("runs", True))
    copied = {r["architecture"] for r in ran if copies(r["repeated_layers"]) > 0}
    assert {"llama", "mixtral", "deepseek_v3"} <= copied


def test_a_sharded_rerun_matches_the_checked_in_result():
    row = next(r for r in PLANS["fsdp2"] if r["architecture"] == "mixtral")
    check = replay_check("mixtral", "train", plan={"fsdp": 2})
    assert check.difference == "" and check.repeated_layers == row["repeated_layers"]

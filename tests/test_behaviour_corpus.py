"""A few cases of the behaviour corpus, live: their JSON and text match the checked-in digests.

``examples/behaviour_corpus.py digest`` runs all 52 (about five minutes here); these three
cover a shipped config's prefill, a small model's decode and a pipelined training step, in a
few seconds each. A change that moves any number, or any word a user reads, of these
estimates fails here; a deliberate change regenerates the digests with ``write``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "behaviour_corpus", ROOT / "examples" / "behaviour_corpus.py"
)
assert spec and spec.loader
corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(corpus)


def test_the_corpus_covers_every_regime_strategy_recipe_and_mode() -> None:
    names = set(corpus.CASES)
    assert len(names) >= 40
    for needle in (
        "prefill",
        "decode",
        "train",
        "realistic",
        "compare",
        "sweep",
        "fp8",
        "int4",
        "tp2",
        "fsdp",
        "hsdp",
        "cp2",
        "ep2",
        "pp2",
        "deepseek",
    ):
        assert any(needle in n for n in names), needle
    saved = json.loads(corpus.DIGESTS.read_text())
    assert set(saved) == names  # every case has its digests


@pytest.mark.parametrize("name", ["gpt2-prefill", "llama-decode", "llama-train-pp2-1f1b"])
def test_case_matches_its_checked_in_digest(name: str) -> None:
    saved = json.loads(corpus.DIGESTS.read_text())[name]
    now = corpus.digests(corpus.run_cases([name]))[name]
    assert now == saved

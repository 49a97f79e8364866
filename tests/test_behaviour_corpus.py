"""The behaviour corpus, live: every case's JSON and text match the checked-in digests.

52 estimates (every regime, parallel strategy, quantisation recipe and timing mode, two
compares and two sweeps; ``examples/behaviour_corpus.py``), about 40 seconds here in all. A
change that moves any number, or any word of the summary and tables a user reads, of any of
them fails here; a deliberate change rewrites the digests with
``python examples/behaviour_corpus.py write DIR``.
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


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_case_matches_its_checked_in_digest(name: str) -> None:
    saved = json.loads(corpus.DIGESTS.read_text())[name]
    now = corpus.digests(corpus.run_cases([name]))[name]
    assert now == saved

"""The validation pages' tables, rendered from the checked-in predictions (no pricing).

Each validation script's ``--markdown PATH`` writes its tables into the page at PATH,
between the page's ``<!-- begin: NAME ... -->`` and ``<!-- end: NAME -->`` lines (the
prose around them is the page's own); ``docs/generate.py --check`` renders the same tables
to find a page that is out of date.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import multi_gpu_validation as mgv

VALIDATION = Path(__file__).resolve().parent / "validation"
DOCS_VALIDATION = Path(__file__).resolve().parent.parent / "docs" / "validation"


def splice(page: str, tables: dict[str, str], script: str) -> str:
    """``page`` with each named block replaced by its table; a block the page lacks is an
    error (the page says where each table goes)."""
    for name, table in tables.items():
        pattern = re.compile(
            rf"(<!-- begin: {re.escape(name)} .*?-->\n).*?(<!-- end: {re.escape(name)} -->)",
            re.S,
        )
        if pattern.search(page) is None:
            raise ValueError(f"the page has no <!-- begin: {name} ... --> block for {script}")
        match = pattern.search(page)
        assert match is not None
        marker = f"<!-- begin: {name} (python examples/{script} --markdown PAGE) -->\n"
        block = marker + table.rstrip("\n") + "\n" + match[2]
        page = page[: match.start()] + block + page[match.end() :]
    return page


def write_page(path: str | Path, tables: dict[str, str], script: str) -> None:
    """Splice ``tables`` into the page at ``path`` and write it back."""
    page = Path(path)
    page.write_text(splice(page.read_text(), tables, script))
    print(f"wrote {page}")


def _stored(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((VALIDATION / name).read_text())
    return data


# -- single GPU -------------------------------------------------------------------------------


def single_gpu_tables() -> dict[str, str]:
    import single_gpu_validation as sgv

    return {"single-gpu": sgv.readme_table(_stored("single_gpu_predictions.json"))}


# -- multi GPU --------------------------------------------------------------------------------


def _main_step(entry: dict[str, Any]) -> dict[str, Any]:
    """The step that holds most of the predicted time (a generate call's decode)."""
    steps: list[dict[str, Any]] = entry["steps"]
    return max(steps, key=lambda s: s["weight"] * s["step_ms"])


def _where(entry: dict[str, Any]) -> str:
    s = _main_step(entry)
    if "bubble_ms" in s:  # the slowest rank: its actions, its bubble, its work after the drain
        return (
            f"{s['phase']} (slowest rank): actions {s['compute_ms']:,.1f} + bubble "
            f"{s['bubble_ms']:,.1f} + after the drain {s['after_drain_ms']:,.1f}"
        )
    return (
        f"{s['phase']}: {s['compute_ms']:,.1f} / {s['exposed_communication_ms']:,.1f} / "
        f"{s['hidden_communication_ms']:,.1f}"
    )


def _ratio(entry: dict[str, Any]) -> str:
    eager = entry.get("eager_kernels")
    return f"{entry['ratio']:.2f}" + (f" (eager {eager['ratio']:.2f})" if eager else "")


def _prediction_rows(runs: dict[str, dict[str, Any]], stored: dict[str, Any]) -> list[list[str]]:
    return [
        [
            e["id"],
            f"{mgv._short_gpu(runs[e['id']])} ({e['request'][0]['hardware']})",
            mgv.parallelism(runs[e["id"]]),
            f"{mgv._number(e['measured'])} {mgv._unit(e['unit'])}",
            mgv._number(e["predicted"]),
            _ratio(e),
            _where(e),
        ]
        for e in stored["runs"]
    ]


def _pair_rows(stored: dict[str, Any]) -> list[list[str]]:
    by_id = {e["id"]: e for e in stored["runs"]}
    rows = []
    for pair in stored["schedule_pairs"]:
        first, second = (by_id[rid] for rid in pair["runs"])
        rows.append(
            [
                pair["pair"],
                f"{mgv._number(first['measured'])} -> {mgv._number(second['measured'])} "
                f"{mgv._unit(first['unit'])}",
                f"{pair['measured_ratio']:.2f}x",
                f"{mgv._number(first['predicted'])} -> {mgv._number(second['predicted'])}",
                f"{pair['predicted_ratio']:.2f}x",
                pair["note"],
            ]
        )
    return rows


def multi_gpu_tables() -> dict[str, str]:
    data = mgv.load_data()
    runs = {r["id"]: r for r in data["runs"]}
    stored = _stored("multi_gpu_predictions.json")
    ratios = [e["ratio"] for e in stored["runs"]]
    predictions = mgv.markdown(_prediction_rows(runs, stored), mgv.PREDICTION_HEADERS)
    return {
        "multi-gpu": predictions + "\n\n" + mgv.summary(ratios),
        "multi-gpu-not-predicted": mgv.markdown(
            mgv.not_predicted_rows(runs), mgv.NOT_PREDICTED_HEADERS
        ),
        "collectives": mgv.markdown(
            mgv.anchor_rows(mgv.anchors(data["collectives"])), mgv.ANCHOR_HEADERS
        ),
        "schedule-pairs": mgv.markdown(_pair_rows(stored), mgv.PAIR_HEADERS),
    }


# -- quantised --------------------------------------------------------------------------------


def quant_tables() -> dict[str, str]:
    import quant_validation as qv

    stored = _stored("quant_predictions.json")
    by_id = {e["id"]: e for e in stored["runs"]}
    rows = []
    within = []
    for e in stored["runs"]:
        pair = e.get("speedup")
        if pair is None:
            continue
        baseline = by_id[pair["baseline_id"]]
        within.append(pair["predicted"] / pair["measured"])
        rows.append(
            [
                e["id"],
                baseline["id"],
                f"{baseline['quant']} -> {e['quant']}",
                f"{pair['measured']:.2f}x",
                f"{pair['predicted']:.2f}x",
                f"{within[-1]:.2f}",
            ]
        )
    line = mgv.summary([e["ratio"] for e in stored["runs"]])
    if within:
        line += (
            f"; {len(within)} speedups: torchroof / measured median "
            f"{statistics.median(within):.2f}, range {min(within):.2f}-{max(within):.2f}"
        )
    return {"quant-speedups": mgv.markdown(rows, qv.SPEEDUP_HEADERS) + "\n\n" + line}


def runtime_tables() -> dict[str, str]:
    import runtime_validation as rv

    tables: dict[str, str] = rv.markdown_tables(_stored("runtime_predictions.json"))
    return tables


def serving_tables() -> dict[str, str]:
    import serving_validation as servv

    tables: dict[str, str] = servv.markdown_tables(
        _stored("serving_predictions.json")["predictions"]
    )
    return tables


def expected_range_tables() -> dict[str, str]:
    import expected_ranges

    return expected_ranges.tables(expected_ranges.shipped_file())


PAGES: dict[str, tuple[str, Callable[[], dict[str, str]]]] = {
    "single-gpu.md": ("single_gpu_validation.py", single_gpu_tables),
    "multi-gpu.md": ("multi_gpu_validation.py", multi_gpu_tables),
    "quantised.md": ("quant_validation.py", quant_tables),
    "runtimes.md": ("runtime_validation.py", runtime_tables),
    "serving.md": ("serving_validation.py", serving_tables),
    "expected-ranges.md": ("expected_ranges.py", expected_range_tables),
}
"""Each validation page under docs/validation/: the script that writes it and its tables."""


def rendered_pages() -> dict[Path, str]:
    """Every validation page as its script would write it now."""
    out = {}
    for name, (script, tables) in PAGES.items():
        path = DOCS_VALIDATION / name
        out[path] = splice(path.read_text(), tables(), script)
    return out

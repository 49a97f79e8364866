"""What torchroof prints speaks the user's language: no shorthand for the project's internal
notes (seed documents, their tables and labs, issue numbers, section signs) in --help, the
summaries and tables, the explorers' readouts, ``torchroof hardware`` or the HTML page; one
verdict per kernel, capacities in GiB, rows that say what they hold."""

from __future__ import annotations

import json
import re

import pytest

from torchroof.cli.main import _parser, main

SHORTHAND = re.compile(r"seed|Table \d|Lab \d|issue \d|§", re.IGNORECASE)

# A two-layer Llama (tests/conftest.py SMALL) as a config file the CLI reads.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("wording") / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def _run(argv: list[str], capsys) -> str:
    try:
        main(argv)
    except SystemExit:  # --help
        pass
    captured = capsys.readouterr()
    return captured.out + captured.err


def _no_shorthand(text: str, what: str) -> None:
    found = [m.group(0) for m in SHORTHAND.finditer(text)]
    lines = [line for line in text.splitlines() if SHORTHAND.search(line)]
    assert not found, f"{what} says {found}: {lines[:5]}"


def _subcommands() -> list[list[str]]:
    """Every subcommand of ``torchroof`` (and of ``torchroof lab``)."""
    commands = _parser()._subparsers._group_actions[0].choices  # argparse's own record
    return [*([name] for name in commands), ["lab", "flash"], ["lab", "cross-entropy"]]


@pytest.mark.parametrize(
    "argv",
    [["--help"], *([*command, "--help"] for command in _subcommands())],
    ids=lambda argv: " ".join(argv),
)
def test_help_has_no_shorthand(argv, capsys):
    out = _run(argv, capsys)
    _no_shorthand(out, f"torchroof {' '.join(argv)}")
    # each flag's help states its default once and says what the flag turns on
    for entry in re.split(r"\n  (?=-)", out):
        flat = " ".join(entry.split())
        assert flat.count("default") <= 1 and "(default )" not in flat, flat
        assert "off:" not in flat, flat


@pytest.mark.parametrize(
    "argv",
    [
        ["roofline", "--preset", "list"],
        ["roofline", "--preset", "decode-gemv"],
        ["roofline", "--intensity", "100", "--boundary", "l2"],
        ["gemm", "4096", "4096", "4096"],
        ["fusion-bench"],
        ["lab", "flash"],
        ["lab", "cross-entropy"],
        ["hardware"],
        ["hardware", "h100-sxm"],
        ["hardware", "dgx-h100"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_readouts_have_no_shorthand(argv, capsys):
    out = _run(argv, capsys)
    assert out.strip()
    _no_shorthand(out, f"torchroof {' '.join(argv)}")


def test_estimate_speaks_plainly_and_gives_one_verdict_per_kernel(tiny, tmp_path, capsys):
    page = tmp_path / "page.html"
    out = _run(["estimate", tiny, "--seq", "64", "--html", str(page)], capsys)
    _no_shorthand(out, "torchroof estimate")
    assert "hierarchical verdict, the memory level that would bind each kernel" in out
    # the kernel table: one verdict column named by the mode that made it, the tile apart
    header = next(line for line in out.splitlines() if line.startswith("#  "))
    assert "bound (pure roofline)" in header and "tile / waves" in header
    assert "binds" not in header
    # capacities in GiB: an H100's 80 GB are 80 GiB
    assert re.search(r"^memory: [\d.]+ GiB of 80\.00 GiB \(weights", out, re.M)
    # the HTML page: its markup, the data it embeds and its own script (not plotly.js's)
    text = page.read_text()
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", text, flags=re.DOTALL)
    markup = re.sub(r"<script[^>]*>.*?</script>", "", text, flags=re.DOTALL)
    _no_shorthand(markup + "".join(scripts[1:]), "the HTML page")
    assert "GiB" in scripts[-1]


def test_train_rows_say_what_they_hold(tiny, capsys):
    out = _run(
        ["estimate", tiny, "--regime", "train", "--seq", "64", "--mode", "realistic"], capsys
    )
    _no_shorthand(out, "torchroof estimate --regime train")
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert "outside any module: the loss" in rows  # was "(top level)"
    assert "model (rotary embedding)" in rows  # was "model"
    assert "(top level)" not in out
    assert "bound (realistic)" in out
    # a single-GPU step: no global-batch line, phases as they are
    assert "global batch" not in out and "by phase: forward" in out


def test_decode_where_the_weights_alone_do_not_fit():
    from torchroof.report.memory import MemoryFootprint
    from torchroof.workloads.decode import memory_summary

    gib = 2**30

    class Decode:  # what memory_summary reads of an estimate whose weights do not fit
        memory = MemoryFootprint(
            weights_bytes=int(140.2 * gib),
            gradients_bytes=0,
            optimizer_state_bytes=0,
            kv_cache_bytes=gib,
            activations_peak_bytes=0,
            capacity_bytes=80 * gib,
        )

    assert memory_summary(Decode()) == [
        "no decode batch fits: the weights alone (140.20 GiB) do not fit in 80.00 GiB: "
        "60.20 GiB short"
    ]
    assert Decode.memory.line().startswith("memory: 141.20 GiB of 80.00 GiB (weights 140.20 GiB")


def test_help_states_each_default_once_and_groups_flags(capsys):
    out = _run(["estimate", "--help"], capsys)
    for title in ("workload:", "parallelism:", "precision:", "pricing:", "timing:", "output:"):
        assert f"\n{title}\n" in out
    flat = " ".join(out.split())
    assert "(default )" not in flat
    assert not re.search(r"\(default[^()]*(\([^()]*\))?[^()]*\) \(default", flat)
    assert "off:" not in flat  # each flag says what it turns on
    assert "--launch-overhead-us LAUNCH_OVERHEAD_US" in flat
    assert "per rank per micro-batch" in flat  # what --batch counts
    assert "--no-overlap T = W/pi + Q/beta" in flat

"""Long work shows what it is doing: one line per finished stage on stderr (a bar on a
terminal), nothing from the Python API unless asked, nothing with --quiet."""

from __future__ import annotations

import io
import json
import re

import pytest
from conftest import SMALL

import torchroof
from torchroof import progress
from torchroof.cli.main import main

# "torchroof: tracing the forward pass (123 ops) ... 0.4 s", "torchroof: point 2 of 3: batch=2"
STAGE = re.compile(r"^torchroof: ( {2})?[a-z][^\n]* \.\.\. (\d+\.\d s|\d+ min \d\d s)$")
POINT = re.compile(r"^torchroof: [a-z]+ \d+ of \d+(: .+)?$")


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**SMALL)


def _progress_only(err: str) -> list[str]:
    lines = err.splitlines()
    assert lines, "no progress at all"
    strays = [line for line in lines if not (STAGE.match(line) or POINT.match(line))]
    assert not strays, f"stderr holds more than progress lines: {strays}"
    return lines


@pytest.fixture
def tiny_config_file(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps({"model_type": "llama", **SMALL}))
    return str(path)


def test_the_api_is_silent_unless_asked(capsys):
    torchroof.estimate(_config(), seq=32)
    assert capsys.readouterr().err == ""


def test_progress_true_shows_each_stage(capsys):
    torchroof.estimate(_config(), "train", seq=32, progress=True)
    lines = _progress_only(capsys.readouterr().err)
    said = "\n".join(lines)
    for stage in (
        "building the model on the meta device",
        "tracing the forward pass",
        "tracing the backward pass",
        "tracing the optimizer step",
        "pricing",
        "fusing ops into kernels",
        "timing",
    ):
        assert stage in said, stage
    # in the order they ran
    assert said.index("forward pass") < said.index("backward pass") < said.index("pricing")


def test_trace_model_takes_progress_too(capsys):
    torchroof.trace_model(_config(), seq=32)
    assert capsys.readouterr().err == ""
    torchroof.trace_model(_config(), seq=32, progress=True)
    assert "tracing the forward pass" in "\n".join(_progress_only(capsys.readouterr().err))


def test_compare_says_which_point_runs(capsys):
    torchroof.compare(_config(), {"batch": [1, 2, 3]}, seq=16, progress=True)
    lines = _progress_only(capsys.readouterr().err)
    assert "torchroof: point 2 of 3: batch=2" in lines
    # a point's stages are indented under it
    after = lines[lines.index("torchroof: point 2 of 3: batch=2") + 1]
    assert after.startswith("torchroof:   ")


def test_sweep_says_which_point_runs(capsys):
    torchroof.sweep(_config(), "batch", [1, 2], seq=16, progress=True)
    assert "torchroof: point 2 of 2: batch=2" in _progress_only(capsys.readouterr().err)
    torchroof.sweep(_config(), "batch", [1, 2], seq=16)
    assert capsys.readouterr().err == ""


def test_the_cli_writes_plain_lines_when_stderr_is_not_a_terminal(tiny_config_file, capsys):
    assert main(["estimate", tiny_config_file, "--seq", "32", "--kernels", "0"]) == 0
    captured = capsys.readouterr()
    lines = _progress_only(captured.err)
    assert lines[0].startswith("torchroof: building the model on the meta device ... ")
    assert "\r" not in captured.err  # no bar: a log file gets lines
    assert "torchroof" in captured.out  # the estimate itself goes to stdout


def test_quiet_turns_it_off(tiny_config_file, capsys):
    assert main(["estimate", tiny_config_file, "--seq", "32", "--kernels", "0", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "torchroof" in captured.out


def test_compare_on_the_cli_shows_points(tiny_config_file, capsys):
    argv = ["compare", tiny_config_file, "--seq", "16", "--vary", "batch=1,2,3"]
    assert main(argv) == 0
    assert "torchroof: point 2 of 3: batch=2" in _progress_only(capsys.readouterr().err)
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_failed_stage_leaves_the_error_alone(capsys):
    with pytest.raises(RuntimeError), progress.reporting() as report:
        with report.stage("building the model"):
            raise RuntimeError("broken")
    assert capsys.readouterr().err == ""


def test_nested_calls_keep_the_outer_reporter(capsys):
    with progress.reporting() as outer:
        with progress.reporting(False) as inner:  # progress=False inside a command
            assert inner is outer and progress.current() is outer
        with progress.silenced():
            progress.current().begin("hidden")
            progress.current().end()
    assert capsys.readouterr().err == ""
    assert progress.current() is progress.SILENT


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_and_the_finished_lines():
    stream = _Terminal()
    with progress.reporting(stream=stream) as report:
        report.begin("pricing 2,000 ops", total=2000, unit="ops")
        for _ in report.track(range(2000)):
            pass
        report.begin("tracing the forward pass", unit="ops")
        report.advance(5)
    written = stream.getvalue()
    assert "\r" in written  # tqdm redraws its bar in place
    assert re.search(r"torchroof: pricing 2,000 ops \.\.\. \d+\.\d s\n", written)
    assert re.search(r"torchroof: tracing the forward pass \(5 ops\) \.\.\. \d+\.\d s\n", written)


def test_stage_lines_read_as_plain_language():
    stream = io.StringIO()
    with progress.reporting(stream=stream) as report:
        report.begin("tracing the optimizer step", unit="ops")
        report.advance()
        report.point(1, 2, "batch=1")
        report.begin("pricing 10 ops", total=10, unit="ops")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("torchroof: tracing the optimizer step (1 op) ... ")
    assert lines[1] == "torchroof: point 1 of 2: batch=1"
    assert lines[2].startswith("torchroof:   pricing 10 ops ... ")

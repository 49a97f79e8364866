"""No other library's warnings or log lines reach the user from torchroof's own calls:
FSDP2's view warnings, transformers' notes on caching and the loss type, torchao's
extension-loading lines and torch's enum registration at import, kineto's profiler lines.
Each is silenced narrowly: a user's own warnings and log lines still show.

The cases run in fresh processes: a line a library prints once per process (transformers'
``warning_once``, an import) would not show again in this one."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import PARALLEL_LLAMA, SMALL

import torchroof
from torchroof import quiet

ROOT = Path(__file__).resolve().parents[1]
STAGE = re.compile(r"^torchroof: ( {2})?[a-z][^\n]* \.\.\. (\d+\.\d s|\d+ min \d\d s)$")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # show what a user's Python shows
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def _only_progress(err: str) -> None:
    strays = [line for line in err.splitlines() if not STAGE.match(line)]
    assert not strays, f"stderr holds more than torchroof's progress lines: {strays}"


@pytest.fixture
def parallel_llama(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", **PARALLEL_LLAMA}))
    return str(path)


def test_an_fsdp_training_estimate_on_the_cli_prints_only_progress(parallel_llama):
    # FSDP2 warns "returned a view tensor" per module; checkpointing makes transformers say
    # use_cache is incompatible; the config's unset loss_type makes it name its default loss
    argv = ["-m", "torchroof", "estimate", parallel_llama, "--regime", "train", "--seq", "64"]
    argv += ["--tp", "2", "--fsdp", "2", "--checkpointing", "--hardware", "dgx-h100"]
    done = _run(*argv, "--kernels", "0")
    assert done.returncode == 0, done.stderr
    _only_progress(done.stderr)
    assert "tracing the backward pass" in done.stderr


def test_the_api_prints_nothing_and_with_progress_only_progress(parallel_llama):
    code = f"""
import torchroof
kw = dict(regime="train", seq=64, tp=2, fsdp=2, checkpointing=True, hardware="dgx-h100")
torchroof.estimate({parallel_llama!r}, **kw)
import sys; print("--- progress", file=sys.stderr)
torchroof.estimate({parallel_llama!r}, progress=True, **kw)
"""
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    silent, _, shown = done.stderr.partition("--- progress\n")
    assert silent == ""
    _only_progress(shown)
    assert "tracing the forward pass" in shown


def test_importing_torchao_through_torchroof_prints_nothing():
    # torchao logs "Failed to load ..._C_cutlass_90a.abi3.so" / "_C_mxfp8" without its CUDA
    # extensions, and torch's pytree "Enum subclass ... register_constant()" W-lines
    code = """
import torchroof.quant.recipes
from torchroof.quant.recipes import quiet_imports
with quiet_imports():
    import torchao.quantization
    import torchao.float8
"""
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_quantised_estimate_prints_only_progress(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", **SMALL}))
    # int8 weights: torchao's serving recipe, imported (and applied) during the estimate
    argv = ["-m", "torchroof", "estimate", str(path), "--quant", "int8-weight", "--seq", "32"]
    done = _run(*argv, "--kernels", "0")
    assert done.returncode == 0, done.stderr
    _only_progress(done.stderr)
    assert "applying the int8-weight quantisation recipe" in done.stderr


def test_profiler_lines_are_dropped_and_everything_else_is_kept(capfd):
    with quiet.drop_native_lines():
        kineto = b"USDT:2026-12-01 18:46:08 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start"
        os.write(2, kineto + b"\n")
        os.write(2, b"a line of someone else's\n")
        print("python's own stderr", file=sys.stderr)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.ones(4).mul(2)
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err and "profiler_stop" not in err
    assert "a line of someone else's\n" in err and "python's own stderr\n" in err


def test_a_users_own_warning_inside_trace_still_reaches_them():
    with pytest.warns(UserWarning, match="the user's own note"):
        with torchroof.trace():
            torch.ones(2, device="meta") * 2
            warnings.warn("the user's own note", UserWarning, stacklevel=1)


def test_a_users_module_warning_reaches_them_through_estimate():
    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            warnings.warn("Noisy returned a view tensor of its own", UserWarning, stacklevel=1)
            return self.proj(x)

    with pytest.warns(UserWarning, match="Noisy returned a view tensor of its own"):
        torchroof.estimate(Noisy(), "prefill", inputs=(torch.ones(2, 8),))


def test_the_filters_are_narrow():
    # inside the quiet block: FSDP2's view warning is dropped, a user's warning is not
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet.quiet_trace():
            warnings.warn_explicit(
                "FSDP2-wrapped module (FSDPEmbedding) returned a view tensor.",
                UserWarning,
                "_fsdp_state.py",
                331,
                module="torch.distributed.fsdp._fully_shard._fsdp_state",
            )
            warnings.warn("returned a view tensor, says the user", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["returned a view tensor, says the user"]

    # transformers' known lines are dropped; its other lines, and the user's, pass
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    library = logging.getLogger("transformers")
    keep = Keep()
    library.addHandler(keep)
    try:
        with quiet.quiet_trace():
            child = logging.getLogger("transformers.models.llama.modeling_llama")
            child.warning("`use_cache=True` is incompatible with gradient checkpointing.")
            child.warning("`loss_type=None` was set in the config but it is unrecognized.")
            child.warning("something else transformers says")
        child.warning("`use_cache=True` is incompatible with gradient checkpointing.")
    finally:
        library.removeHandler(keep)
    assert records == [
        "something else transformers says",
        "`use_cache=True` is incompatible with gradient checkpointing.",  # outside the block
    ]
    # nothing is left attached once the block is over
    assert not any(isinstance(f, quiet._DropRecords) for f in library.filters)

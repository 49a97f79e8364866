"""Every bad input answered: a sweep over every surface — each knob, each
file format (trace JSON, estimate JSON, hardware TOML, cluster TOML, config.json), each model
config field, parallel and quant combinations, output paths and traced code. Each case
asserts its outcome: a one- or two-line error naming the problem (exit code 2 on the CLI), a
warning naming the figure and the unit it looks typed in, or a correct number; never a
traceback, never a hang, and nothing run from a model directory.

Cases are refused before tracing or use a 2-layer Llama of d = 128 (tests/conftest.py's
SMALL); the CLI is called in process (``torchroof.cli.main.main``) except where a real process
matters (the security case and one end-to-end exit code).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torchroof.hardware import HardwareFigureWarning, available, available_clusters, get
from torchroof.hardware.cluster import load_cluster_file

import torchroof
from torchroof.capture.budget import OpBudgetExceeded
from torchroof.cli.main import main
from torchroof.config.errors import OptionError, WorkloadError
from torchroof.models.sources import load_config
from torchroof.pricing.trace_checks import unpriceable_op
from torchroof.records.ops import OpRecord
from torchroof.records.tensors import TensorMeta
from torchroof.records.trace import Trace
from torchroof.records.trace_file import TraceFileError
from torchroof.render.files import estimate_json
from torchroof.report.estimate import Estimate

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


# -- shared files --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model's config, a prefill trace of it (seq 16), its estimate, and a trace
    of it over 16 ranks (tp = 2 x dp = 8) for the cluster cases."""
    root = tmp_path_factory.mktemp("bad-input")
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY))
    trace = torchroof.trace_model(str(config), "prefill", seq=16)
    trace.save(root / "prefill.json")
    estimate_json(torchroof.estimate_trace(trace, "h100-sxm"), root / "estimate.json")
    wide = torchroof.trace_model(str(config), "prefill", seq=16, tp=2, dp=8)
    wide.save(root / "wide.json")
    return {
        "root": root,
        "config": config,
        "trace": root / "prefill.json",
        "estimate": root / "estimate.json",
        "wide": root / "wide.json",
    }


def _cli(capsys: pytest.CaptureFixture[str], argv: list[Any]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys: pytest.CaptureFixture[str], argv: list[Any], *needles: str) -> str:
    """Exit code 2 and one error of at most two lines containing every needle."""
    code, out, err = _cli(capsys, argv)
    assert "Traceback" not in err + out
    assert code == 2, err
    assert err.count("torchroof: error:") == 1, err
    message = err[err.index("torchroof: error:") :].strip()
    assert len(message.splitlines()) <= 2, message
    for needle in needles:
        assert needle in message, message
    return message


def _one_line(error: BaseException, *needles: str) -> None:
    text = str(error)
    assert len(text.strip().splitlines()) <= 2, text
    for needle in needles:
        assert needle in text, text


# -- every knob: refused before tracing ----------------------------------------------------
# The default model (llama-3-8b) is never built: each of these is refused by the Workload or
# PricingOptions validators, argparse, the hardware lookup or the output checks first.
KNOBS: list[tuple[str, str]] = [
    ("--batch 0", "batch must be a positive integer"),
    ("--batch -3", "batch must be a positive integer"),
    ("--batch many", "--batch: invalid int value"),
    ("--seq 0", "seq must be a positive integer"),
    ("--seq 1.5", "--seq: invalid int value"),
    ("--context 0", "context must be a positive integer"),
    ("--regime bogus", "--regime: invalid choice"),
    ("--cache bogus", "--cache: invalid choice"),
    ("--optimizer bogus", "--optimizer: invalid choice"),
    ("--precision bogus", "--precision: invalid choice"),
    ("--dtype fp64", "--dtype: invalid choice"),
    ("--quant bogus", "--quant: invalid choice"),
    ("--kv-dtype bogus", "--kv-dtype: invalid choice"),
    ("--mla bogus", "--mla: invalid choice"),
    ("--max-ops 0", "max_ops must be a positive integer"),
    ("--max-ops -5", "max_ops must be a positive integer"),
    ("--tp 0", "tp must be a positive integer"),
    ("--dp 0", "dp must be a positive integer"),
    ("--ep 0", "ep must be a positive integer"),
    ("--cp 0", "cp must be a positive integer"),
    ("--pp 0", "pp must be a positive integer"),
    ("--regime train --fsdp 0", "fsdp must be a positive integer"),
    ("--regime train --microbatches 0", "microbatches must be a positive integer"),
    ("--fsdp 2", "fsdp=2 applies to a step that trains"),
    ("--microbatches 2", "microbatches=2 applies to a step that trains"),
    ("--virtual-stages 3", "virtual_stages shape a pipeline"),
    ("--pp-schedule zbv", "pp_schedule shape a pipeline"),
    ("--pp-schedule bogus", "--pp-schedule: invalid choice"),
    ("--pp-split 1,2", "pp_split shape a pipeline"),
    ("--tp 8 --dp 1000000", "world-size budget of 131,072"),
    ("--regime train --fsdp 4096 --tp 64", "world-size budget"),
    # knobs a step would silently ignore
    ("--regime train --dtype fp32", "dtype=fp32 does not apply to a training step"),
    ("--regime train --dtype fp16 --precision bf16", "use precision=fp16"),
    ("--regime train --cache dynamic", "cache='dynamic' applies to a prefill or decode step"),
    ("--mla expanded", "mla='expanded' applies to a decode step"),
    # parallel and quant combinations
    ("--regime train --kv-dtype fp8", "a training step keeps no KV cache"),
    ("--regime decode --cp 2", "cp=2"),
    ("--regime train --cp 3 --seq 100", "seq=100 does not divide"),
    ("--regime train --ep 2", "ep=2 must be a multiple of tp=1"),
    ("--regime train --ep 3 --fsdp 2", "ep=3"),
    ("--quant int4-weight --regime train", "is a serving recipe"),
    ("--quant nvfp4 --regime train", "is a serving recipe"),
    ("--quant fp8 --hardware a100-sxm", "fp8"),
    ("--quant nvfp4 --hardware h100-sxm", "nvfp4"),
    ("--pp 2 --save-trace {root}/pp.json", "saving it is not supported"),
    # pricing knobs: nan and inf are refused, like out-of-range numbers
    ("--fusion bogus", "unknown fusion policy 'bogus'"),
    ("--fusion eager,fused,eager", "--fusion takes one policy or two"),
    ("--fusion ,", "--fusion takes one policy or two"),
    ("--loss bogus", "--loss: invalid choice"),
    ("--attention bogus", "--attention: invalid choice"),
    ("--mode bogus", "--mode: invalid choice"),
    ("--gemm-tile 7x", "gemm_tile is TmxTn"),
    ("--gemm-tile 0x128", "gemm_tile is TmxTn"),
    ("--gemm-tile big", "gemm_tile is TmxTn"),
    ("--compute-efficiency 0", "compute_efficiency must be in (0, 1]"),
    ("--compute-efficiency 1.5", "compute_efficiency must be in (0, 1]"),
    ("--compute-efficiency nan", "compute_efficiency (--compute-efficiency) must be a finite"),
    ("--compute-efficiency inf", "must be a finite number, got inf"),
    ("--bandwidth-efficiency nan", "bandwidth_efficiency (--bandwidth-efficiency) must be"),
    ("--bandwidth-efficiency=-inf", "must be a finite number, got -inf"),
    ("--bandwidth-efficiency 0", "bandwidth_efficiency must be in (0, 1]"),
    ("--routing-imbalance inf", "routing_imbalance (--routing-imbalance) must be a finite"),
    ("--routing-imbalance nan", "must be a finite number, got nan"),
    ("--routing-imbalance 0.5", "routing_imbalance is the busiest rank's"),
    ("--routing bogus", "routing is balanced, expected, or a histogram"),
    ("--routing=-1,2", "needs non-negative finite shares"),
    ("--routing 0,0", "needs non-negative finite shares"),
    ("--launch-overhead-us nan", "launch_overhead_s (--launch-overhead-us) must be a finite"),
    ("--launch-overhead-us inf", "must be a finite number, got inf"),
    ("--launch-overhead-us -1", "launch_overhead_s must be >= 0"),
    ("--on-chip-budget-bytes 0", "on_chip_budget_bytes must be a positive integer"),
    ("--on-chip-budget-bytes 1e9", "--on-chip-budget-bytes: invalid int value"),
    ("--hardware bogus", "unknown hardware 'bogus'"),
    ("--hardware {root}/missing.toml", "does not exist"),
    ("--depth 0", "--depth: must be a positive integer"),
    ("--kernels x", "--kernels: invalid int value"),
    ("--bogus-flag", "unrecognized arguments: --bogus-flag"),
    # output paths
    ("--json /nonexistent/dir/x.json", "no folder /nonexistent/dir"),
    ("--json {root}", "it is a folder"),
    ("--json {root}/a.json --csv {root}/a.json", "two outputs to one path"),
    ("--html {root}/a.html --timeline {root}/a.html", "two outputs to one path"),
    ("--save-trace {root}/a.json --json {root}/./a.json", "two outputs to one path"),
    ("--plot-roofline {root}/a.jpg", "plots are written as .pdf, .png or .svg"),
    ("--plot-layers {root}/a.txt", "plots are written as"),
    # models
    ("no-such-model", "unknown model 'no-such-model'"),
    ("lama-3-8b", "did you mean llama-3-8b"),
]


@pytest.mark.parametrize(("flags", "needle"), KNOBS, ids=[k for k, _ in KNOBS])
def test_a_bad_knob_is_refused_before_tracing(capsys, files, flags, needle):
    argv = ["estimate", *flags.format(root=files["root"]).split()]
    _refused(capsys, argv, needle.format(root=files["root"]))


# --from-trace fixes the workload: a MODEL argument or a workload flag is refused, not ignored
FROM_TRACE_FLAGS = [
    "--batch 4",
    "--regime decode",
    "--quant fp8",
    "--tp 8",
    "--seq 64",
    "--dtype fp32",
    "--kv-dtype fp8",
    "gpt2",
]


@pytest.mark.parametrize("flags", FROM_TRACE_FLAGS)
def test_from_trace_refuses_what_it_would_ignore(capsys, files, flags):
    argv = ["estimate", *flags.split(), "--from-trace", files["trace"]]
    word = "the model 'gpt2'" if flags == "gpt2" else flags.split()[0]
    _refused(capsys, argv, "a trace's workload is fixed", word)


COMPARE = [
    ("--vary batch=1,2 --vary batch=4", "--vary batch is given twice"),
    ("--vary batch", "--vary takes KEY=V1,V2"),
    ("--vary =1,2", "unknown key ''"),
    ("--vary batch=0,1", "batch must be a positive integer"),
    ("--vary bogus=1,2", "bogus"),
]


@pytest.mark.parametrize(("flags", "needle"), COMPARE, ids=[c for c, _ in COMPARE])
def test_compare_refuses_a_bad_vary(capsys, files, flags, needle):
    _refused(capsys, ["compare", str(files["config"]), *flags.split()], needle)


def test_sweep_refuses_an_unknown_axis(capsys):
    _refused(capsys, ["sweep", "--over", "bogus"], "--over: invalid choice")


# -- config.json: every field checked before transformers builds anything -----------------
CONFIGS: list[tuple[str, Any, str]] = [
    ("vocab_size", 0, "vocab_size=0"),
    ("vocab_size", -1, "vocab_size=-1"),
    ("vocab_size", "big", "vocab_size='big' is not an integer"),
    ("hidden_size", 0, "hidden_size=0"),
    ("hidden_size", 128.5, "hidden_size=128.5 is not an integer"),
    ("hidden_size", 250, "hidden_size=250 is not a multiple of num_attention_heads=4"),
    ("intermediate_size", 0, "intermediate_size=0"),
    ("num_attention_heads", 0, "num_attention_heads=0"),
    ("num_attention_heads", 3, "is not a multiple of num_attention_heads=3"),
    ("num_key_value_heads", 0, "num_key_value_heads=0"),
    ("num_key_value_heads", 3, "num_key_value_heads=3 does not divide"),
    ("num_key_value_heads", 8, "num_key_value_heads=8 does not divide"),
    ("head_dim", 0, "head_dim=0"),
    ("head_dim", 7, "head_dim"),
    ("num_hidden_layers", 0, "num_hidden_layers=0"),
    ("num_hidden_layers", -2, "num_hidden_layers=-2"),
    ("num_hidden_layers", 1_000_000, "above the layer budget of 1,024"),
    ("num_hidden_layers", True, "num_hidden_layers=True is not an integer"),
]


@pytest.mark.parametrize(
    ("field", "value", "needle"), CONFIGS, ids=[f"{f}={v}" for f, v, _ in CONFIGS]
)
def test_a_bad_config_field_is_refused_before_building(capsys, tmp_path, field, value, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, field: value}))
    _refused(capsys, ["estimate", path], needle, str(path))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (json.dumps([TINY]), "a JSON list, not an object"),
        (json.dumps("llama"), "a JSON str, not an object"),
        (json.dumps({k: v for k, v in TINY.items() if k != "model_type"}), 'no "model_type"'),
        ("{not json", "invalid model config"),
        (json.dumps({**TINY, "model_type": "not-a-model"}), "not-a-model"),
    ],
    ids=["list", "string", "no-model-type", "not-json", "unknown-model-type"],
)
def test_a_config_file_that_is_not_a_config(capsys, tmp_path, text, needle):
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(text)
    _refused(capsys, ["estimate", path.parent], needle)


def test_a_model_directory_without_config_json(capsys, tmp_path):
    _refused(capsys, ["estimate", tmp_path], "no config.json")


def test_a_config_field_varied_past_its_range_is_refused_by_compare(capsys, files):
    _refused(
        capsys,
        ["compare", files["config"], "--vary", "num_key_value_heads=3"],
        "num_key_value_heads=3",
    )


# -- a model directory's code is never run --------------------------------------------------
def _remote_code_dir(root: Path, model_type: str = "evilnet") -> tuple[Path, Path]:
    """A model directory whose config names its own Python file (auto_map), which would
    write a marker file if it ever ran."""
    folder = root / "remote"
    folder.mkdir()
    marker = root / "MARKER"
    (folder / "config.json").write_text(
        json.dumps(
            {
                **TINY,
                "model_type": model_type,
                "auto_map": {
                    "AutoConfig": "evil.EvilConfig",
                    "AutoModelForCausalLM": "evil.EvilModel",
                },
            }
        )
    )
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evilnet'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return folder, marker


def test_remote_code_is_refused_never_prompted_nor_run(tmp_path):
    folder, marker = _remote_code_dir(tmp_path)
    # a real process whose stdin answers "y" to any prompt: none comes, nothing runs
    result = subprocess.run(
        [sys.executable, "-m", "torchroof", "estimate", str(folder)],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr
    assert not marker.exists()
    assert "Traceback" not in result.stderr and "[y/N]" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "torchroof: error:" in line]
    assert len(errors) == 1 and "never runs" in errors[0] and "evilnet" in errors[0]


def test_remote_code_beside_a_known_model_type_is_not_run_either(capsys, tmp_path):
    folder, marker = _remote_code_dir(tmp_path, model_type="llama")
    config = load_config(folder)  # transformers' own LlamaConfig, not the file's
    assert type(config).__name__ == "LlamaConfig"
    code, _, err = _cli(capsys, ["estimate", folder, "--seq", "16", "--kernels", "0"])
    assert code == 0, err
    assert not marker.exists()


# -- saved traces: structure, each op against its rule, facts against ops ------------------
def _first(data: dict, name: str) -> dict:
    return next(op for op in data["ops"] if op["op"] == name)


def _mm(data: dict) -> dict:
    return _first(data, "aten.mm.default")


def _flash(data: dict) -> dict:
    return _first(data, "aten._scaled_dot_product_flash_attention.default")


def _mm_one_input(data: dict) -> None:
    op = _mm(data)
    op["in"] = op["in"][:1]
    del op["args"]["mat2"]


def _mm_rank(rank: int) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        tensor = _mm(data)["in"][0]
        tensor[0] = [4] * rank
        tensor[1] = [4 ** (rank - 1 - n) for n in range(rank)]

    return edit


def _mm_inner(data: dict) -> None:
    tensor = _mm(data)["in"][0]
    tensor[0] = [tensor[0][0], tensor[0][1] + 1]


def _flash_2d(data: dict) -> None:
    for tensor in _flash(data)["in"][:3]:
        tensor[0], tensor[1] = [16, 32], [32, 1]


def _args_emptied(data: dict) -> None:
    for op in data["ops"]:
        op["args"] = {}


def _renamed_to_mm(data: dict) -> None:
    _first(data, "aten.add.Tensor")["op"] = "aten.mm.default"


def _renamed_to_bmm(data: dict) -> None:
    _mm(data)["op"] = "aten.bmm.default"


def _renamed_to_addmm(data: dict) -> None:
    _mm(data)["op"] = "aten.addmm.default"


def _huge_rows(data: dict) -> None:
    _mm(data)["in"][0][0][0] = 10**400


def _huge_stride(data: dict) -> None:
    _mm(data)["in"][0][1][0] = 10**400


def _ops_deleted_and_count_edited(data: dict) -> None:
    del data["ops"][5:9]
    data["op_count"] = len(data["ops"])


def _workload(**fields: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["metadata"]["workload"].update(fields)

    return edit


def _metadata(**fields: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["metadata"].update(fields)

    return edit


def _tokens_times(factor: int) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["metadata"]["tokens"] *= factor

    return edit


def _role_bytes(role: str, value: int) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["role_bytes"][role] = value

    return edit


TRACES: list[tuple[str, Callable[[dict], None], str]] = [
    ("mm-one-input", _mm_one_input, "argument 'mat2' (a 2-d tensor its rule reads) is missing"),
    ("mm-0d", _mm_rank(0), "argument 'self' has shape []: 0-d, its rule needs 2-d"),
    ("mm-1d", _mm_rank(1), "1-d, its rule needs 2-d"),
    ("mm-3d", _mm_rank(3), "3-d, its rule needs 2-d"),
    ("mm-inner", _mm_inner, "inner dimensions differ"),
    ("flash-2d", _flash_2d, "argument 'query' has shape [16,32]: 2-d, its rule needs at least 3-d"),
    ("args-emptied", _args_emptied, "input 0 is referenced by no argument"),
    ("add-renamed-mm", _renamed_to_mm, "aten.mm.default"),
    ("mm-renamed-bmm", _renamed_to_bmm, "its rule needs 3-d"),
    ("mm-renamed-addmm", _renamed_to_addmm, "argument 'mat1'"),
    ("rows-10^400", _huge_rows, "no device holds such a tensor"),
    ("stride-10^400", _huge_stride, "is beyond any tensor's"),
    ("ops-deleted-count-edited", _ops_deleted_and_count_edited, "ops 5-8 are missing"),
    ("batch-many", _workload(batch="many"), '"batch" is "many", not a positive integer'),
    ("batch-0", _workload(batch=0), '"batch" is 0'),
    ("seq-float", _workload(seq=16.5), '"seq" is 16.5'),
    ("tp-0", _workload(tp=0), '"tp" is 0'),
    ("regime-bogus", _workload(regime="bogus"), '"regime" is "bogus"'),
    ("regime-decode", _workload(regime="decode"), "a decode step of the workload"),
    ("seq-edited", _workload(seq=4096), "processes 4,096"),
    ("batch-edited", _workload(batch=64), "processes 1,024"),
    ("tokens-x10^4", _tokens_times(10**4), '"tokens" is 160,000'),
    ("tokens-negative", _metadata(tokens=-16), '"tokens" is -16'),
    ("tp-8", _workload(tp=8), '"tp" is 8, but the ops hold no collective'),
    ("ep-4", _workload(ep=4), '"ep" is 4, but the ops hold no collective'),
    ("cp-2", _workload(cp=2), '"cp" is 2'),
    ("weights-10^15", _role_bytes("weights", 10**15), '"role_bytes"."weights" is'),
    ("kv-10^15", _role_bytes("kv_cache", 10**15), '"role_bytes"."kv_cache" is'),
    ("tokens-string", _metadata(tokens="16"), '"tokens" is "16", not int'),
    ("workload-list", _metadata(workload=[1]), '"workload" is [1], not dict'),
]


@pytest.mark.parametrize(("edit", "needle"), [t[1:] for t in TRACES], ids=[t[0] for t in TRACES])
def test_an_edited_trace_is_refused_naming_file_op_and_field(capsys, files, tmp_path, edit, needle):
    data = json.loads(files["trace"].read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    _refused(capsys, ["estimate", "--from-trace", path, "--kernels", "0"], needle, str(path))
    with pytest.raises(TraceFileError):
        torchroof.Trace.load(path)  # the API refuses it the same way


def test_the_saved_trace_itself_loads_and_prices_as_traced(capsys, files):
    code, out, err = _cli(capsys, ["estimate", "--from-trace", files["trace"], "--kernels", "0"])
    assert code == 0, err
    fresh = torchroof.estimate_trace(Trace.load(files["trace"]), "h100-sxm")
    saved = Estimate.from_json(files["estimate"])
    assert fresh.time_s == pytest.approx(saved.time_s, rel=1e-12)
    assert fresh.flops == saved.flops


def test_an_op_its_rule_cannot_read_is_named_when_built_in_memory():
    """A trace built by hand (not read from a file) that breaks a rule: pricing names the op
    rather than raising from inside the counter."""
    bad = TensorMeta((2, 3, 4), (12, 4, 1), "float32", 1, 0)
    other = TensorMeta((4, 5), (5, 1), "float32", 2, 0)
    out = TensorMeta((2, 5), (5, 1), "float32", 3, 0)
    from torchroof.records.tensors import TensorRef

    op = OpRecord(
        0,
        "aten.mm.default",
        (bad, other),
        (out,),
        {"self": TensorRef(0), "mat2": TensorRef(1)},
        "",
        "forward",
    )
    trace = Trace(ops=[op])
    found = unpriceable_op(trace)
    assert found is not None and "ops[0] (aten.mm.default)" in str(found)
    with pytest.raises(TraceFileError, match=r"ops\[0\] \(aten\.mm\.default\): its cost rule"):
        torchroof.estimate_trace(trace, "h100-sxm")


def test_a_bad_trace_exits_2_without_a_traceback_in_a_real_process(files, tmp_path):
    data = json.loads(files["trace"].read_text())
    _args_emptied(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    result = subprocess.run(
        [sys.executable, "-m", "torchroof", "estimate", "--from-trace", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "referenced by no argument" in result.stderr


# -- saved estimates: fields and totals against kernels -----------------------------------
def _drop(key: str) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        del data[key]

    return edit


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data[key] = value

    return edit


def _kernel(field: str, value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        if value is KeyError:
            del data["kernels"][0][field]
        else:
            data["kernels"][0][field] = value

    return edit


def _total(field: str, factor: float) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["totals"][field] *= factor

    return edit


def _memory_field(data: dict) -> None:
    data["memory"]["bogus_bytes"] = 1


ESTIMATES: list[tuple[str, Callable[[dict], None], str]] = [
    ("no-kernels", _drop("kernels"), 'missing "kernels"'),
    ("kernels-object", _set("kernels", {"0": {}}), '"kernels" is dict, not a list'),
    ("kernels-string", _set("kernels", "many"), '"kernels" is str, not a list'),
    ("memory-unknown-field", _memory_field, "\"memory\" has an unknown field 'bogus_bytes'"),
    ("memory-list", _set("memory", [1]), '"memory" is list, not an object'),
    ("step-time-edited", _set("step_time_s", 1.0), '"step_time_s" is 1.0, but its kernels end'),
    ("total-time-edited", _total("time_s", 2.0), '"totals"."time_s" is'),
    ("total-flops-edited", _total("flops", 3), '"totals"."flops" is'),
    ("kernel-time-nan", _kernel("time_s", math.nan), "kernels[0].time_s is nan"),
    ("kernel-time-inf", _kernel("time_s", math.inf), "kernels[0].time_s is inf, not finite"),
    ("kernel-time-negative", _kernel("time_s", -1.0), "kernels[0].time_s is -1.0"),
    ("kernel-flops-string", _kernel("flops", "many"), "kernels[0].flops is 'many', not a number"),
    ("kernel-flops-float", _kernel("flops", 1.5), "kernels[0].flops is 1.5, not a number"),
    ("kernel-no-time", _kernel("time_s", KeyError), "kernels[0] is missing 'time_s'"),
    ("kernel-unknown-field", _kernel("speed", 1), "kernels[0] has an unknown field 'speed'"),
    ("kernel-list", _set("kernels", [[1, 2]]), "kernels[0] is list, not an object"),
    ("no-hardware", _drop("hardware"), "missing 'hardware'"),
    ("version-99", _set("version", 99), "version 99 is not supported"),
    ("no-format", _drop("format"), "not a torchroof estimate"),
]


@pytest.mark.parametrize(
    ("edit", "needle"), [e[1:] for e in ESTIMATES], ids=[e[0] for e in ESTIMATES]
)
def test_an_edited_estimate_is_refused_naming_the_field(files, tmp_path, edit, needle):
    data = json.loads(files["estimate"].read_text())
    edit(data)
    path = tmp_path / "estimate.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as caught:
        Estimate.from_json(path)
    _one_line(caught.value, needle, str(path))


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[1, 2]", "not a JSON object"), ("{not json", "not valid JSON"), ("", "not valid JSON")],
    ids=["list", "not-json", "empty"],
)
def test_an_estimate_file_that_is_not_one(tmp_path, text, needle):
    path = tmp_path / "estimate.json"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        Estimate.from_json(path)
    _one_line(caught.value, needle, str(path))


def test_a_missing_estimate_file(tmp_path):
    with pytest.raises(ValueError) as caught:
        Estimate.from_json(tmp_path / "none.json")
    _one_line(caught.value, "cannot read it")


def test_the_saved_estimate_round_trips(files):
    est = Estimate.from_json(files["estimate"])
    assert est.time_s == pytest.approx(sum(k.time_s for k in est.kernels))


# -- hardware TOML: unusable figures refused, implausible ones warned ---------------------
H100 = (ROOT / "hardware" / "h100-sxm.toml").read_text()


def _hardware_file(tmp_path: Path, key: str, value: str) -> Path:
    """h100-sxm.toml renamed, with ``key``'s value replaced (the first line that sets it)."""
    lines = []
    done = False
    for line in H100.splitlines():
        if line.startswith("name = "):
            line = 'name = "edited"'
        elif line.startswith("aliases = "):
            continue
        elif not done and line.startswith(f"{key} = {{ value = "):
            head, _, rest = line.partition("value = ")
            line = head + "value = " + value + "," + rest.partition(",")[2]
            done = True
        lines.append(line)
    assert done, key
    path = tmp_path / "edited.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


HARDWARE_ERRORS = [
    ("hbm_bytes_per_s", "3.35", "it looks typed in TB/s"),
    ("hbm_bytes_per_s", "1e-300", "hbm_bytes_per_s.value: 1e-300 B/s is outside"),
    ("hbm_bytes_per_s", "nan", "expected a finite number"),
    ("hbm_bytes_per_s", "inf", "expected a finite number"),
    ("hbm_bytes_per_s", "0", "must be positive"),
    ("hbm_bytes_per_s", '"fast"', "expected a number"),
    ("hbm_capacity_bytes", "80", "it looks typed in GiB"),
    ("bf16", "989.4", "it looks typed in TFLOP/s"),
    ("fp32", "66.9", "it looks typed in TFLOP/s"),
    ("memory_latency_s", "600", "it looks typed in ns"),
    ("compute_units", "0", "must be positive"),
]


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    HARDWARE_ERRORS,
    ids=[f"{k}={v}" for k, v, _ in HARDWARE_ERRORS],
)
def test_an_unusable_hardware_figure_is_an_error(capsys, tmp_path, key, value, needle):
    path = _hardware_file(tmp_path, key, value)
    _refused(capsys, ["hardware", path], needle, key)
    _refused(capsys, ["estimate", "--hardware", path], needle)  # before any tracing


HARDWARE_WARNINGS = [
    ("hbm_bytes_per_s", "3.35e6", "it looks typed in MB/s"),
    ("launch_overhead_s", "2", "it looks typed in us"),
    ("compute_units", "1000000", "compute_units.value: 1e+06"),
    ("shared_memory_bytes_per_sm", "228", "it looks typed in KiB"),
    ("l2_bytes_per_s", "9000", "it looks typed in GB/s"),
    ("l2_bytes", "50", "it looks typed in MiB"),
    # far too large only makes the resource free (a what-if): a warning, not an error
    ("sfu_flops_per_s", "1e30", "sfu_flops_per_s.value: 1e+30 FLOP/s is outside"),
]


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    HARDWARE_WARNINGS,
    ids=[f"{k}={v}" for k, v, _ in HARDWARE_WARNINGS],
)
def test_an_implausible_hardware_figure_is_warned(tmp_path, key, value, needle):
    path = _hardware_file(tmp_path, key, value)
    with pytest.warns(HardwareFigureWarning, match=key) as caught:
        get(path)
    assert needle in str(caught[0].message)


def test_an_eager_launch_typed_in_microseconds_is_warned(tmp_path):
    """eager_launch_s = 4.5 (microseconds typed as seconds) is outside 10 ns-1 ms."""
    text = H100.replace('name = "h100-sxm"', 'name = "edited"')
    text = "\n".join(line for line in text.splitlines() if not line.startswith("aliases = "))
    path = tmp_path / "edited.toml"
    path.write_text(f'eager_launch_s = {{ value = 4.5, source = "typed" }}\n{text}\n')
    with pytest.warns(HardwareFigureWarning, match="eager_launch_s") as caught:
        get(path)
    assert "it looks typed in us" in str(caught[0].message)


def test_shipped_hardware_and_clusters_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", HardwareFigureWarning)
        for spec in available():
            get(spec.path)
        for cluster in available_clusters():
            load_cluster_file(cluster.path)


def test_shared_memory_below_any_real_part_is_warned(tmp_path):
    # 2 KiB per SM is below the plausible 4 KiB-8 MiB: named, with the unit it looks typed in
    path = _hardware_file(tmp_path, "shared_memory_bytes_per_sm", "2048")
    with pytest.warns(HardwareFigureWarning, match="shared_memory_bytes_per_sm"):
        get(path)


def test_an_fp32_gemm_on_a_100_kib_part_prices_on_the_smallest_tile():
    # fp32 operands: the smallest tile's 4 stages of (64 + 64) x 64 x 4 B = 131,072 B exceed
    # the L4's 102,400 B per SM; real kernels run it with fewer stages (same traffic), so it
    # is priced, not refused: 2 x 512^3 = 268,435,456 FLOPs
    with torchroof.trace() as t:
        torch.ones(512, 512, device="meta") @ torch.ones(512, 512, device="meta")
    est = t.estimate("l4", mode="realistic")
    (kernel,) = [k for k in est.kernels if k.flops]
    assert kernel.flops == 2 * 512**3
    assert math.isfinite(kernel.time_s) and kernel.time_s > 0


def test_a_gemm_tile_that_cannot_fit_is_refused(files):
    trace = Trace.load(files["trace"])
    with pytest.raises(OptionError, match=r"gemm_tile=1024x1024: its operand stages need"):
        torchroof.estimate_trace(trace, "h100-sxm", mode="realistic", gemm_tile="1024x1024")


def test_a_gemm_tile_that_fits_prices(files):
    trace = Trace.load(files["trace"])
    est = torchroof.estimate_trace(trace, "h100-sxm", mode="realistic", gemm_tile="64x64")
    assert est.time_s > 0 and math.isfinite(est.time_s)


# -- cluster TOML: figures checked, and a step larger than the cluster refused -------------
DGX = (ROOT / "hardware" / "clusters" / "dgx-h100.toml").read_text()


def _cluster_file(tmp_path: Path, edit: Callable[[str], str]) -> Path:
    text = "\n".join(
        'name = "edited"' if line.startswith("name = ") else line
        for line in DGX.splitlines()
        if not line.startswith("aliases = ")
    )
    path = tmp_path / "cluster.toml"
    path.write_text(edit(text) + "\n")
    return path


def _value(key: str, value: str, table: str = "") -> Callable[[str], str]:
    def edit(text: str) -> str:
        out, current, done = [], "", False
        for line in text.splitlines():
            if line.startswith("["):
                current = line.strip("[] ")
            if not done and current == table and line.startswith(f"{key} = {{ value = "):
                head, _, rest = line.partition("value = ")
                line = head + "value = " + value + "," + rest.partition(",")[2]
                done = True
            out.append(line)
        assert done, (key, table)
        return "\n".join(out)

    return edit


def _one_node_at_most(text: str) -> str:
    return "\n".join(
        line
        + ('\nmax_nodes = { value = 1, source = "edited" }' if line.startswith("gpus_per") else "")
        for line in text.splitlines()
    )


def _without_network(text: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skipping = line.strip() == "[network]"
        if not skipping:
            out.append(line)
    return "\n".join(out)


CLUSTER_ERRORS = [
    ("line-rate-GB/s", _value("line_bytes_per_s", "50", "network"), "it looks typed in GB/s"),
    # a per-message latency of a day prices every collective absurdly; 1e-300 s would only
    # make the latency free (warned, below)
    ("latency-1e5", _value("latency_s", "1e5", "network"), "latency_s.value: 100000 s is outside"),
    ("gpus-0", _value("gpus_per_node", "0"), "must be positive"),
]


@pytest.mark.parametrize(
    ("edit", "needle"), [c[1:] for c in CLUSTER_ERRORS], ids=[c[0] for c in CLUSTER_ERRORS]
)
def test_an_unusable_cluster_figure_is_an_error(capsys, tmp_path, edit, needle):
    _refused(capsys, ["hardware", _cluster_file(tmp_path, edit)], needle)


def test_an_implausible_cluster_figure_is_warned(tmp_path):
    path = _cluster_file(tmp_path, _value("latency_s", "25.6", "network"))
    with pytest.warns(HardwareFigureWarning, match=r"network\.latency_s.*typed in us"):
        load_cluster_file(path)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_one_node_at_most, "has at most 1 nodes of 8 GPUs"),
        (_without_network, "has no [network]: it is one node of 8 GPUs"),
    ],
    ids=["max-nodes-1", "no-network"],
)
def test_a_step_larger_than_the_cluster_is_refused(capsys, files, tmp_path, edit, needle):
    path = _cluster_file(tmp_path, edit)
    argv = ["estimate", "--from-trace", files["wide"], "--hardware", path]
    _refused(capsys, argv, "the step spans 16 GPUs", needle)


def test_the_same_step_on_a_cluster_that_holds_it_prices(capsys, files):
    code, out, err = _cli(
        capsys, ["estimate", "--from-trace", files["wide"], "--hardware", "dgx-h100"]
    )
    assert code == 0, err
    assert "over the 16 GPUs" in out


# -- traced code: budgets bound every loop -------------------------------------------------
class _Step(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


class _LoopCallingASubmodule(torch.nn.Module):
    """``while x.abs().max() > tol: x = self.step(x)``: on meta the test is always True, and
    each iteration enters and leaves ``step`` (which reset the per-call answer count)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = _Step()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while x.abs().max() > 1e-6:
            x = self.step(x)
        return x


def test_a_loop_that_calls_a_submodule_is_bounded_per_trace():
    with pytest.raises(OpBudgetExceeded) as caught:
        with torchroof.trace(max_item_answers=50):
            _LoopCallingASubmodule()(torch.ones(4, 4, device="meta"))
    first = str(caught.value).splitlines()[0]
    assert "100 Tensor.item() answers in this trace" in first  # 2 x 50
    assert caught.value.ops < 2_000


def test_a_fused_adamw_on_meta_is_one_clear_error():
    model = torch.nn.Linear(4, 4, device="meta")
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(WorkloadError) as caught:
        with torchroof.trace():
            model(torch.ones(2, 4, device="meta")).sum().backward()
            optimizer.step()
    _one_line(caught.value, "AdamW(fused=True)", "fused=False")


def test_rank_zero_trace_does_not_grow_with_the_world(files, monkeypatch):
    """tp=2 x dp=4096 traces the same ops as tp=2 x dp=1, and the mesh creates only rank 0's
    groups (one per dimension, 5), not the 4,096 + 2 x 2 + ... torch would."""
    import torch.distributed.device_mesh as device_mesh

    made: list[list[int]] = []
    real = device_mesh.new_group

    def counted(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        made.append(list(ranks or []))
        return real(ranks, *args, **kwargs)

    monkeypatch.setattr(device_mesh, "new_group", counted)
    small = torchroof.trace_model(str(files["config"]), "prefill", seq=16, tp=2)
    groups_small = len(made)
    made.clear()
    large = torchroof.trace_model(str(files["config"]), "prefill", seq=16, tp=2, dp=4096)
    assert len(large.ops) == len(small.ops)
    assert len(made) <= groups_small + 5 and all(0 in ranks for ranks in made)


def test_a_decode_within_the_positions_prices(capsys, files):
    code, out, err = _cli(
        capsys, ["estimate", files["config"], "--regime", "decode", "--context", "255"]
    )
    assert code == 0, err
    assert "Traceback" not in err


# -- the Python API answers the same way -----------------------------------------------------
API: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("layers-10^6", {"num_hidden_layers": 10**6}, ValueError, "above the layer budget"),
    ("kv-heads-3", {"num_key_value_heads": 3}, ValueError, "num_key_value_heads=3 does not"),
    ("vocab-0", {"vocab_size": 0}, ValueError, "vocab_size=0"),
]


@pytest.mark.parametrize(
    ("fields", "kind", "needle"), [a[1:] for a in API], ids=[a[0] for a in API]
)
def test_a_config_object_is_checked_before_building(fields, kind, needle):
    from transformers import LlamaConfig

    config = LlamaConfig(**{**{k: v for k, v in TINY.items() if k != "model_type"}})
    for name, value in fields.items():
        setattr(config, name, value)  # set after construction: transformers checks nothing
    with pytest.raises(kind) as caught:
        torchroof.estimate(config, "train", seq=16)
    _one_line(caught.value, needle)


@pytest.mark.parametrize(
    ("knobs", "needle"),
    [
        ({"routing_imbalance": math.inf}, "routing_imbalance (--routing-imbalance) must be a"),
        ({"launch_overhead_s": math.nan}, "launch_overhead_s (--launch-overhead-us) must be a"),
        ({"compute_efficiency": math.nan}, "compute_efficiency (--compute-efficiency) must be"),
        ({"batch": math.nan}, "batch must be a positive integer, got nan"),
        ({"seq": 16.0}, "seq must be a positive integer, got 16.0"),
        ({"tp": 8, "dp": 10**6}, "world-size budget"),
    ],
    ids=["imbalance-inf", "launch-nan", "efficiency-nan", "batch-nan", "seq-float", "world"],
)
def test_api_knobs_are_refused_before_tracing(files, knobs, needle):
    with pytest.raises(OptionError) as caught:
        torchroof.estimate(str(files["config"]), "prefill", **{"seq": 16, **knobs})
    _one_line(caught.value, needle)


def test_compare_refuses_a_layer_count_past_the_budget(capsys, files):
    _refused(
        capsys,
        ["compare", files["config"], "--vary", "num_hidden_layers=1000000"],
        "above the layer budget of 1,024",
    )

"""Defaults and names a user expects: ``seq`` follows the
model's maximum positions, training defaults to mixed precision, the Python API mirrors the
CLI (``torchroof.compare`` / ``torchroof.sweep``, ``estimate``'s keywords listed), a plain
``nn.Module`` traces on the inputs given, and compare / sweep refuse a bad variant before
anything is traced."""

from __future__ import annotations

import importlib
import inspect
import time
from dataclasses import fields

import pytest
import torch
from conftest import SMALL

import torchroof
from torchroof.cli.main import _parser, main
from torchroof.config import DEFAULT_SEQ, PricingOptions, Workload
from torchroof.config.errors import WorkloadError
from torchroof.models.sources import PositionLimitError, load_config
from torchroof.render import text

TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512)


def _gpt2(**overrides):
    from transformers import GPT2Config

    return GPT2Config(**{**TINY_GPT2, "bos_token_id": 0, "eos_token_id": 0, **overrides})


def _help(command: str, dest: str) -> str:
    subparsers = next(a for a in _parser()._actions if a.dest == "command")
    return next(a.help for a in subparsers.choices[command]._actions if a.dest == dest)


# -- seq follows the model ------------------------------------------------------------------


def test_gpt2_default_seq_is_its_1024_positions():
    # the shipped GPT-2 (n_positions = 1024), one layer to keep the trace small: the default
    # 4096 is longer, so the step is batch x 1024 tokens and the summary says why
    config = load_config("gpt2")
    config.n_layer = 1
    est = torchroof.estimate(config, "prefill", batch=2)
    assert est.workload.seq == 1024 and est.workload.context == 1024
    assert est.facts.tokens == 2 * 1024
    line = "seq: 1024, the model's maximum positions (n_positions=1024; the default 4096 is longer)"
    assert line in text.summary(est).splitlines()


def test_a_model_with_more_positions_keeps_4096_and_says_nothing():
    est = torchroof.estimate(_gpt2(n_positions=8192), "prefill")
    assert est.workload.seq == DEFAULT_SEQ == 4096 and est.facts.tokens == 4096
    assert not est.facts.defaults and "default 4096" not in text.summary(est)


def test_train_and_decode_follow_the_maximum_too():
    train = torchroof.estimate(_gpt2(), "train", batch=3)
    assert train.workload.seq == 512 and train.facts.tokens == 3 * 512
    decode = torchroof.estimate(_gpt2(), "decode", batch=2)
    # decode's context (left out, it follows seq) is 512 - 1: the step's new token takes
    # index 511, the last of the model's 512 positions; the static cache holds 511 + 1 = 512
    assert decode.workload.context == 511 and decode.facts.tokens == 2
    assert decode.facts.kv_cache_tokens == 512
    assert (
        "context: 511, the model's maximum positions (n_positions=512, less 1 for the step's "
        "new token;" in text.summary(decode)
    )
    assert not any(a.startswith("positions:") for a in decode.assumptions)  # within it


def test_a_pipelined_step_records_the_resolved_seq():
    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL, max_position_embeddings=1024)
    trace = torchroof.trace_model(config, "train", pp=2, microbatches=2)
    assert trace.facts.workload.seq == 1024  # each stage traced at the model's 1024
    assert trace.facts.tokens == 2 * 1024  # batch 1 x 1024 x 2 micro-batches
    est = trace.estimate("dgx-h100")
    assert "seq: 1024, the model's maximum positions (max_position_embeddings=1024;" in (
        text.summary(est)
    )


def test_an_explicit_longer_seq_is_still_refused():
    with pytest.raises(PositionLimitError, match="2,048 positions is longer"):
        torchroof.estimate(_gpt2(), "prefill", seq=2048)
    with pytest.raises(PositionLimitError):
        torchroof.estimate(_gpt2(), "decode", context=600)


def test_the_cli_shows_the_default_and_labels_the_resolved_seq(tmp_path, capsys):
    assert "4096, or the model's maximum positions if shorter" in _help("estimate", "seq")
    assert Workload().seq is None  # "not given" until the model is known
    path = tmp_path / "tiny-gpt2.json"
    path.write_text(_gpt2().to_json_string())
    assert main(["estimate", str(path), "--kernels", "0"]) == 0
    out = capsys.readouterr().out
    assert "prefill, batch 1 x 512 tokens" in out.splitlines()[0]
    assert "seq: 512, the model's maximum positions" in out


# -- training defaults to mixed precision ---------------------------------------------------


def test_training_defaults_to_mixed_precision():
    assert Workload().precision == "mixed"
    assert "(default mixed)" in _help("estimate", "precision")
    est = torchroof.estimate(_gpt2(), "train", seq=32)
    assert est.facts.precision == "mixed"
    line = "precision: mixed (bf16 compute, fp32 master weights, gradients and optimizer state)"
    assert line in text.summary(est).splitlines()
    # mixed AdamW per parameter: bf16 weights 2 B, fp32 gradients 4 B, fp32 master + two
    # fp32 moments 12 B (mixed-precision AdamW's 30 B/param with the bf16 gradient read and
    # rewrite)
    n, memory = est.facts.parameters, est.memory
    assert (memory.weights_bytes, memory.gradients_bytes) == (2 * n, 4 * n)
    assert memory.optimizer_state_bytes == 12 * n
    bf16 = torchroof.estimate(_gpt2(), "train", seq=32, precision="bf16")
    assert "precision: bf16 throughout" in text.summary(bf16)
    assert bf16.memory.optimizer_state_bytes == 4 * n  # two bf16 moments


# -- the Python API mirrors the CLI ---------------------------------------------------------

# estimate's keywords that are not knobs: where the step runs, the objects, a plain
# module's inputs and loss, the progress report
NOT_KNOBS = {"model", "hardware", "workload", "pricing", "inputs", "loss_fn", "progress"}


def test_estimate_lists_every_knob_by_name():
    params = inspect.signature(torchroof.estimate).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    knobs = {f.name for cls in (Workload, PricingOptions) for f in fields(cls)}
    assert named - NOT_KNOBS == knobs  # regime is the second positional argument
    for cls in (Workload, PricingOptions):
        for f in fields(cls):
            if f.name == "regime":
                continue
            wanted = f.type.split("|")[0].strip()
            assert params[f.name].default is None, f.name
            assert params[f.name].annotation == f"{wanted} | None", f.name


def test_compare_and_sweep_are_top_level_with_the_cli_names():
    module = importlib.import_module("torchroof.studies")
    assert torchroof.compare is module.compare and torchroof.sweep is module.sweep
    compare_names = list(inspect.signature(torchroof.compare).parameters)
    assert compare_names[:3] == ["model", "vary", "hardware"]
    sweep_names = list(inspect.signature(torchroof.sweep).parameters)
    assert sweep_names[:4] == ["model", "over", "values", "hardware"]
    curve = torchroof.sweep(_gpt2(), over="batch", values=[1, 2], regime="decode", context=16)
    assert [p.value for p in curve.points] == [1, 2]
    assert [p.estimate.facts.tokens for p in curve.points] == [1, 2]
    result = torchroof.compare(_gpt2(), vary={"batch": [1, 2]}, regime="prefill", seq=16)
    assert [v.estimate.facts.tokens for v in result.variants] == [16, 32]


# -- a plain nn.Module ----------------------------------------------------------------------


def test_a_plain_module_runs_its_forward_on_the_inputs_given():
    module = torch.nn.Linear(256, 512, bias=False)
    x = torch.randn(64, 256)  # a real tensor: only a meta copy runs
    est = torchroof.estimate(module, "prefill", inputs=(x,))
    assert est.flops == 2 * 64 * 256 * 512  # one mm: 2 M N K
    assert module.weight.device.type == "cpu"  # the module is left alone
    assert any("plain nn.Module" in a for a in est.assumptions)


def test_a_plain_module_trains_forward_loss_backward_and_the_optimizer_step():
    module = torch.nn.Linear(256, 512, bias=False)
    x = torch.randn(64, 256)
    est = torchroof.estimate(module, "train", inputs=(x,), precision="mixed")
    P = 256 * 512
    by_phase = {p: sum(k.flops for k in est.kernels if k.phase == p) for p in ("forward",)}
    # forward: the mm (2·64·256·512) and the .sum() loss over 64·512 outputs
    assert by_phase["forward"] == 2 * 64 * 256 * 512 + 64 * 512
    optimizer = [k for k in est.kernels if k.phase == "optimizer"]
    assert sum(k.flops for k in optimizer) == 12 * P  # the fused AdamW step, 12 FLOP each
    memory = est.memory  # cast to bf16 (precision given): masters, grads and state fp32
    assert (memory.weights_bytes, memory.gradients_bytes) == (2 * P, 4 * P)
    assert memory.optimizer_state_bytes == 12 * P
    # a loss_fn replaces the sum; the default precision (mixed) trains the fp32 module in
    # bf16 too, with the same bytes per parameter
    mean = torchroof.estimate(module, "train", inputs=(x,), loss_fn=lambda y: (y * y).mean())
    assert mean.facts.precision == "mixed"
    assert mean.memory.weights_bytes == 2 * P and mean.memory.optimizer_state_bytes == 12 * P


def test_a_plain_module_refuses_decode_and_names_the_inputs_way():
    module = torch.nn.Linear(8, 8)
    with pytest.raises(WorkloadError, match="decode needs a model with a KV cache"):
        torchroof.estimate(module, "decode", inputs=(torch.randn(2, 8),))
    with pytest.raises(WorkloadError, match=r"inputs=\(x,\)"):
        torchroof.estimate(module)


# -- compare / sweep variants are checked before any tracing --------------------------------


@pytest.fixture
def no_tracing(monkeypatch):
    module = importlib.import_module("torchroof.studies")

    def traced(*_, **__):
        raise AssertionError("traced before every variant was checked")

    monkeypatch.setattr(module, "_trace", traced)
    monkeypatch.setattr(module, "estimate", traced)
    load_config("llama-3-70b")  # transformers imported: the timing is the check's own


@pytest.mark.parametrize(
    ("vary", "error", "message"),
    [
        ({"num_key_value_heads": [8, 128]}, ValueError, "variant num_key_value_heads=128: "),
        ({"batch": [1, 0]}, WorkloadError, "variant batch=0: batch must be a positive integer"),
        ({"n_experts_wrong": [2]}, ValueError, "variant n_experts_wrong=2: unknown key"),
        ({"seq": [4096, 16384]}, PositionLimitError, "variant seq=16384: llama-3-70b: a seq"),
        ({"tp": [2, 3]}, WorkloadError, "variant tp=3: llama-3-70b cannot run with tp=3"),
    ],
)
def test_a_bad_variant_is_refused_named_within_a_second(no_tracing, vary, error, message):
    start = time.perf_counter()
    with pytest.raises(error) as raised:
        torchroof.compare("llama-3-70b", vary, regime="decode")
    assert time.perf_counter() - start < 5  # under a second unloaded
    assert str(raised.value).startswith(message)


def test_kv_heads_that_do_not_divide_a_32_head_model():
    with pytest.raises(ValueError, match="variant num_key_value_heads=64: num_key_value_heads=64"):
        torchroof.compare("llama-3-8b", {"num_key_value_heads": [8, 64]})


def test_a_bad_sweep_point_is_refused_before_any_tracing(no_tracing):
    start = time.perf_counter()
    with pytest.raises(WorkloadError, match="variant batch=0: "):
        torchroof.sweep("llama-3-70b", "batch", [1, 64, 0], regime="decode")
    assert time.perf_counter() - start < 5


def test_the_cli_refuses_a_bad_variant_in_one_line(no_tracing, capsys):
    code = main(["compare", "llama-3-70b", "--vary", "num_key_value_heads=8,128"])
    err = capsys.readouterr().err
    assert code == 2 and "variant num_key_value_heads=128: " in err
    assert "Traceback" not in err

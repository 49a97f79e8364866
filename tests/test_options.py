"""One place for every knob (torchroof/config/workload.py, pricing.py): the API, the CLI and
compare read the same two dataclasses, so a knob cannot drift between them."""

import json
from dataclasses import fields

import pytest

import torchroof
from torchroof.cli.main import _parser, main
from torchroof.config import OptionError, PricingOptions, Workload
from torchroof.studies import compare

TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(**TINY_GPT2)


def _dests(command: str) -> set[str]:
    subparsers = next(a for a in _parser()._actions if a.dest == "command")
    return {a.dest for a in subparsers.choices[command]._actions}


@pytest.mark.parametrize("command", ["estimate", "compare", "sweep"])
def test_every_knob_is_a_flag_of_every_command(command):
    knobs = {f.name for cls in (Workload, PricingOptions) for f in fields(cls)}
    assert knobs <= _dests(command)


def test_flag_units_and_booleans_follow_the_fields():
    args = _parser().parse_args(
        ["estimate", "--launch-overhead-us", "4", "--no-overlap", "--tf32", "--checkpointing"]
    )
    assert args.launch_overhead_s == 4  # in the flag's microseconds until converted
    from torchroof.config import from_flags

    pricing = PricingOptions(**from_flags(args, PricingOptions))
    assert pricing.launch_overhead_s == pytest.approx(4e-6)
    assert pricing.overlap is False and pricing.allow_tf32 is True
    assert Workload(**from_flags(args, Workload)).checkpointing is True


def test_the_api_and_the_cli_give_the_same_number(tmp_path):
    # the same request both ways: a shipped config, decode at batch 2 against 64 tokens
    out = tmp_path / "gpt2.json"
    code = main(
        [
            "estimate",
            "gpt2",
            "--regime",
            "decode",
            "--batch",
            "2",
            "--context",
            "64",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    api = torchroof.estimate("gpt2", "decode", batch=2, context=64)
    cli = json.loads(out.read_text())
    assert cli["totals"]["time_s"] == api.time_s
    assert len(cli["kernels"]) == len(api.kernels)


def test_decode_context_defaults_to_seq():
    # the API's decode once rejected its own default context=0; now context = seq, as the CLI
    est = torchroof.estimate(_gpt2(), "decode", seq=64)
    assert est.metadata["workload"]["context"] == 64


@pytest.mark.parametrize(
    ("key", "values"),
    [("overlap", [True, False]), ("checkpointing", [False, True]), ("epilogue", [False, True])],
)
def test_compare_varies_every_knob_by_its_name(key, values):
    result = compare(_gpt2(), {key: values}, regime="train", seq=32)
    first, second = (v.estimate for v in result.variants)
    assert first.time_s != second.time_s  # each knob changes the step it names
    assert [v.label for v in result.variants] == [f"{key}={v}" for v in values]


def test_unknown_option_names_every_knob():
    with pytest.raises(OptionError) as error:
        torchroof.estimate(_gpt2(), "prefill", seq=32, fusoin="eager")
    message = str(error.value)
    assert message.startswith("unknown option fusoin; options are ")
    listed = message.split("options are ")[1].split(", ")
    assert listed == [f.name for cls in (Workload, PricingOptions) for f in fields(cls)]


def test_a_pricing_knob_is_not_a_tracing_knob():
    from torchroof.api import trace_model

    with pytest.raises(OptionError, match="choose how a trace is priced"):
        trace_model(_gpt2(), "prefill", seq=32, fusion="eager")

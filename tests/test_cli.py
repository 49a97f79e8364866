"""The ``torchroof`` command as a user runs it."""

import json

import pytest

from torchroof.cli.main import console, main


def test_estimate_prints_budget_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gpt2.json"
    trace = tmp_path / "trace.json"
    code = main(
        [
            "estimate",
            "gpt2",
            "--seq",
            "128",
            "--hardware",
            "a100",
            "--json",
            str(out),
            "--save-trace",
            str(trace),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "transformer.h.0-10 (x11)" in printed  # h.11 shares a kernel with ln_f
    assert "A100" in printed and "coverage" in printed
    data = json.loads(out.read_text())
    assert data["hardware"] == "a100-sxm" and data["uncounted"] == {}
    # the saved trace re-estimates on other hardware without the model
    assert main(["estimate", "--from-trace", str(trace), "--hardware", "h100"]) == 0
    assert "H100" in capsys.readouterr().out


def test_hardware_listing_shows_ridges(capsys):
    assert main(["hardware"]) == 0
    printed = capsys.readouterr().out
    # columns: name, HBM TB/s, GiB, bf16 / fp8 / fp32 TF/s, then the ridges I* bf16 / fp8 / fp32
    h100 = next(line for line in printed.splitlines() if line.startswith("h100-sxm")).split()
    # I* = pi / beta: 989.4e12 / 3.35e12 = 295.3 (bf16), 1978.9e12 / 3.35e12 = 590.7 (fp8)
    assert (h100[0], h100[6], h100[7]) == ("h100-sxm", "295", "591")
    assert main(["hardware", "l40s"]) == 0
    assert "source" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "llama-3-8", "--seq", "8"], "did you mean"),
        (["estimate", "gpt2", "--hardware", "h1000"], "unknown hardware"),
        (["estimate", "gpt2", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
        (["estimate", "gpt2", "--bacth", "2"], "unrecognized arguments: --bacth 2"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_negative_batch_is_rejected(capsys):
    assert main(["estimate", "gpt2", "--batch", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "torchroof: error: batch must be a positive integer, got -1\n"


def test_decode_and_train_from_the_command_line(capsys):
    assert (
        main(
            [
                "estimate",
                "gpt2",
                "--regime",
                "decode",
                "--batch",
                "8",
                "--context",
                "512",
                "--kernels",
                "0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "decode, batch 8, context 512, static cache" in printed
    assert "tokens/s" in printed and "KV reads overtake weight reads" in printed
    assert "largest decode batch that fits at context 512" in printed
    assert (
        main(
            [
                "estimate",
                "gpt2",
                "--regime",
                "train",
                "--seq",
                "128",
                "--precision",
                "mixed",
                "--kernels",
                "0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "optimizer ms" in printed and "opt state MB" in printed
    assert "optimizer state" in printed and "fits" in printed


def test_decode_context_zero_is_rejected(capsys):
    assert main(["estimate", "gpt2", "--regime", "decode", "--context", "0"]) == 2
    assert capsys.readouterr().err == (
        "torchroof: error: context must be a positive integer, got 0\n"
    )


def test_fusion_policies_side_by_side(capsys):
    assert (
        main(["estimate", "gpt2", "--seq", "256", "--fusion", "eager,fused", "--kernels", "0"]) == 0
    )
    printed = capsys.readouterr().out
    assert "h100-sxm eager ms" in printed and "h100-sxm fused ms" in printed
    total = next(line for line in printed.splitlines() if line.startswith("total"))
    assert total.split()[3].endswith("x")  # the speed-up column
    assert main(["estimate", "gpt2", "--fusion", "inductor", "--seq", "8"]) == 2
    assert "unknown fusion policy" in capsys.readouterr().err


def test_limitations_are_one_line_not_a_stack_trace(tmp_path, capsys):
    # an encoder has no decode step: named in one line
    config = tmp_path / "distilbert.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "distilbert",
                "dim": 64,
                "hidden_dim": 128,
                "n_layers": 2,
                "n_heads": 4,
                "vocab_size": 512,
            }
        )
    )
    # --quiet: no progress lines (a finished stage's line would precede the error)
    assert main(["estimate", str(config), "--regime", "decode", "--context", "8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "does not generate" in err and "Traceback" not in err and err.count("\n") == 1
    # a config with no heads: refused before transformers divides by it, one line naming
    # the file and the field
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 0}))
    assert main(["estimate", str(broken), "--seq", "8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "invalid model config" in err and "num_attention_heads=0" in err
    assert err.count("\n") == 1


def test_a_model_that_fails_on_meta_is_one_named_error():
    from conftest import meta_causal_lm

    import torchroof

    model = meta_causal_lm("llama")

    def broken_forward(*args, **kwargs):
        raise RuntimeError("data-dependent op on meta\nsecond line of detail")

    model.model.layers[1].mlp.forward = broken_forward
    with pytest.raises(torchroof.ModelTraceError) as info:
        torchroof.estimate(model, "prefill", seq=8)
    message = str(info.value)
    assert message.startswith("LlamaForCausalLM could not be traced for prefill: RuntimeError")
    assert "second line" not in message and "Architectures that do not trace" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_bad_output_path_fails_before_any_work(tmp_path, capsys):
    missing = tmp_path / "no-such-folder" / "out.json"
    assert main(["estimate", "gpt2", "--seq", "8", "--json", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing traced, nothing printed
    assert captured.err == (
        f"torchroof: error: cannot write {missing}: no folder {missing.parent}\n"
    )


def test_every_file_written_is_named(tmp_path, capsys):
    out, csv, trace = tmp_path / "e.json", tmp_path / "k.csv", tmp_path / "t.json"
    timeline = tmp_path / "timeline.json"  # a plain .json: the flag, not the suffix, decides
    argv = ["estimate", "gpt2", "--seq", "8", "--kernels", "0", "--quiet"]  # no progress
    argv += ["--json", str(out), "--csv", str(csv), "--save-trace", str(trace)]
    argv += ["--timeline", str(timeline)]
    assert main(argv) == 0
    said = capsys.readouterr().err.splitlines()
    assert said == [
        f"torchroof: wrote the trace to {trace}",
        f"torchroof: wrote the estimate (JSON) to {out}",
        f"torchroof: wrote one row per kernel (CSV) to {csv}",
        f"torchroof: wrote the Chrome / Perfetto timeline to {timeline}",
    ]
    assert out.stat().st_size and csv.stat().st_size and trace.stat().st_size
    kernels = len(json.loads(out.read_text())["kernels"])
    events = json.loads(timeline.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == kernels
    assert len(csv.read_text().splitlines()) == 1 + kernels  # a header, a row per kernel


def test_a_plot_named_in_no_image_format_fails_before_any_work(tmp_path, capsys):
    plot = tmp_path / "roofline.jpg"
    assert main(["estimate", "gpt2", "--seq", "8", "--plot-roofline", str(plot)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing traced, nothing printed
    assert captured.err == (
        "torchroof: error: plots are written as .pdf, .png or .svg, got 'roofline.jpg'\n"
    )
    assert not plot.exists()


def test_the_command_sets_its_objects_aside_from_the_last_collection(monkeypatch, capsys):
    """The installed ``torchroof`` command runs main(), then freezes what it made, so
    Python's last garbage collection at exit passes over none of it; main(), which the
    tests call, freezes nothing. Its exit code is main's: 0 for the help, 2 for a model
    that does not exist."""
    import gc

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr("sys.argv", ["torchroof"])
    assert console() == 0 and frozen == [True]
    assert main(["estimate", "no-such-model"]) == 2 and frozen == [True]
    monkeypatch.setattr("sys.argv", ["torchroof", "estimate", "no-such-model"])
    assert console() == 2 and frozen == [True, True]
    assert "unknown model 'no-such-model'" in capsys.readouterr().err

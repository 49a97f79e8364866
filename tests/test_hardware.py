"""Hardware specs: ridge points (Williams et al. 2009), lookup, user files, dtype errors."""

import pickle
import re
from pathlib import Path

import pytest
from torchroof.hardware import (
    HardwareSpecError,
    UnknownHardwareError,
    UnsupportedDtypeError,
    available,
    get,
)
from torchroof.hardware.spec import SCHEMA_KEYS


@pytest.mark.parametrize(
    ("name", "beta", "peaks", "seed"),
    [
        # the hardware files' figures (B/s; bf16, fp8, fp32 FLOP/s) and the ridge points
        # I* = pi / beta for bf16, fp8, fp32 worked by hand, rounded as printed
        ("a100-sxm", 2.039e12, (312e12, None, 19.5e12), (153, None, 9.6)),
        ("h100-sxm", 3.35e12, (989.4e12, 1978.9e12, 66.9e12), (295, 591, 20)),
        ("h200-sxm", 4.8e12, (989.4e12, 1978.9e12, 66.9e12), (206, 412, 14)),
        ("b200", 8e12, (2250e12, 4500e12, 80e12), (281, 563, 10)),
        ("mi300x", 5.3e12, (1307.4e12, 2614.9e12, 163.4e12), (247, 493, 31)),
        ("l40s", 0.864e12, (362.05e12, 733e12, 91.6e12), (419, 848, 106)),
        ("rtx-4090", 1.008e12, (165.2e12, 330.3e12, 82.6e12), (164, 328, 82)),
    ],
)
def test_table1_ridge_points(name, beta, peaks, seed):
    spec = get(name)
    assert spec.hbm_bytes_per_s.value == beta
    for dtype, peak, printed in zip(("bf16", "fp8", "fp32"), peaks, seed, strict=True):
        if peak is None:
            with pytest.raises(UnsupportedDtypeError, match="no fp8 tensor cores"):
                spec.ridge(dtype)
            continue
        ridge = spec.ridge(dtype)
        assert ridge == peak / beta, dtype
        # each I* above is rounded to its last digit (9.6: tenths): within half of it
        # (B200 fp8: 4500 / 8 = 562.5, printed 563)
        half_unit = 0.05 if isinstance(printed, float) else 0.5
        assert abs(ridge - printed) <= half_unit, (dtype, ridge, printed)


def test_h100_worked_numbers():
    h100 = get("h100")
    # 989.4 TF/s / 3.35 TB/s = 295.3
    assert h100.ridge("bfloat16") == 989.4e12 / 3.35e12
    # the tensor-core / fp32 vector cliff, 989.4 / 66.9 = 14.79 ("14.8x")
    assert h100.tensor_peak("bfloat16") / h100.vector_peak("fp32") == 989.4e12 / 66.9e12


def test_every_shipped_figure_has_a_source_and_the_required_parts_exist():
    names = {spec.name for spec in available()}
    assert {
        "a100-sxm",
        "h100-sxm",
        "h200-sxm",
        "b200",
        "mi300x",
        "l40s",
        "rtx-4090",
        "h100-pcie",
        "l4",
        "a10g",
    } <= names
    for spec in available():
        for key, figure in spec.figures().items():
            assert figure.value > 0, (spec.name, key)
            assert len(figure.source) > 10, (spec.name, key)
        assert {"bf16", "fp16"} <= set(spec.tensor_flops_per_s)
        assert "fp32" in spec.vector_flops_per_s
    # derived figures are flagged
    assert get("h100").sfu_flops_per_s.approximate
    assert not get("h100").hbm_bytes_per_s.approximate


@pytest.mark.parametrize("alias", ["h100", "H100", "h100_sxm5", "h100-sxm"])
def test_aliases_resolve(alias):
    assert get(alias).name == "h100-sxm"


def test_unknown_name_lists_the_closest():
    with pytest.raises(UnknownHardwareError) as info:
        get("h1000")
    message = str(info.value)
    assert "h1000" in message and "did you mean" in message and "h100" in message


def test_user_toml_path(tmp_path):
    text = (
        Path(get("h100").path)
        .read_text()
        .replace('name = "h100-sxm"', 'name = "my-gpu"')
        .replace("value = 3.35e+12", "value = 1e+12")
    )
    path = tmp_path / "my-gpu.toml"
    path.write_text(text)
    spec = get(str(path))
    assert spec.name == "my-gpu"
    assert spec.ridge("bf16") == pytest.approx(989.4)  # 989.4 TF/s over 1 TB/s


def test_bad_user_toml_names_the_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\nhbm_bytes_per_s = { value = 1e12 }\n')
    with pytest.raises(ValueError, match="hbm_bytes_per_s"):
        get(str(path))


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(UnsupportedDtypeError, match="complex32|no hardware ceiling"):
        get("h100").tensor_peak("complex32")


# --- the file format: validated as a whole --------------------------------------------------

# the guide page on accelerators, hardware files and their format
HARDWARE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "hardware.md"
H100_TEXT = Path(get("h100").path).read_text()
HBM_LINE = next(line for line in H100_TEXT.splitlines() if line.startswith("hbm_bytes_per_s"))


def _accelerators_section() -> str:
    text = HARDWARE_PAGE.read_text()
    start = text.index("\n## Accelerators\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _write(tmp_path, text, name="bad.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _h100_with(*replacements):
    text = H100_TEXT
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _refusal(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(HardwareSpecError) as info:
        get(str(path))
    return info.value, str(path)


def test_true_is_not_a_bandwidth(tmp_path):
    # before whole-file validation: float(True) == 1.0 and the H100 was read as 1 B/s
    error, path = _refusal(tmp_path, _h100_with(("value = 3.35e+12", "value = true")))
    assert error.problems == (
        "hbm_bytes_per_s.value: expected a number of B/s, got true (a boolean)",
    )
    assert str(error).startswith(f"{path}: 1 problem: hbm_bytes_per_s.value")


@pytest.mark.parametrize(
    ("key", "old"),
    [
        ("hbm_capacity_bytes", "value = 85899345920"),
        ("l2_bytes", "value = 52428800"),
        ("shared_memory_bytes_per_sm", "value = 233472"),
        ("compute_units", "value = 132"),
    ],
)
def test_capacities_and_counts_are_whole_numbers(tmp_path, key, old):
    error, _ = _refusal(tmp_path, _h100_with((old, "value = 1.5")))
    assert len(error.problems) == 1
    assert error.problems[0].startswith(f"{key}.value: ")
    assert "must be a whole number, got 1.5" in error.problems[0]
    # a whole number written as a float is still whole
    path = _write(tmp_path, _h100_with((old, "value = 2.0e3")), "whole.toml")
    assert get(str(path)).figures()[key].value == 2000


BAD_THREE = _h100_with(
    ("value = 3.35e+12", "value = true"),
    ("value = 85899345920", "value = 1.5"),
    ("compute_units = {", "compute_unit = {"),
)


def test_three_problems_come_in_one_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, BAD_THREE)
    with pytest.raises(HardwareSpecError) as info:
        get("bad.toml")
    error = info.value
    assert error.path == "bad.toml"
    assert error.problems == (
        "hbm_bytes_per_s.value: expected a number of B/s, got true (a boolean)",
        "hbm_capacity_bytes.value: bytes must be a whole number, got 1.5",
        "compute_unit: unknown key; did you mean compute_units?",
    )
    message = str(error)
    assert message == "bad.toml: 3 problems: " + "; ".join(error.problems)
    assert "\n" not in message
    # the hardware guide shows this very message
    assert f"torchroof: error: {message}\n" in _accelerators_section()
    assert isinstance(error, ValueError)
    assert pickle.loads(pickle.dumps(error)).problems == error.problems


def test_an_attention_share_names_a_known_kernel_and_stays_a_fraction(tmp_path):
    shipped = (Path(get("h100-sxm").path)).read_text()
    bad = shipped.replace("fa3_forward = { value = 0.608", "fa3_forward = { value = 1.2")
    bad = bad.replace("cudnn_backward =", "cudnn_backwards =")
    path = tmp_path / "h100-edit.toml"
    path.write_text(bad)
    with pytest.raises(HardwareSpecError) as info:
        get(str(path))
    assert info.value.problems == (
        "attention_tensor_fraction.fa3_forward.value: a fraction of peak is at most 1, got 1.2",
        "attention_tensor_fraction.cudnn_backwards: unknown name (known: fa2_forward, "
        "fa2_backward, fa3_forward, fa3_backward, flashinfer_forward, flashinfer_backward, "
        "cudnn_forward, cudnn_backward, trtllm_forward, trtllm_backward, sdpa_forward, "
        "sdpa_backward)",
    )


def test_a_toml_syntax_error_names_the_file_and_the_line(tmp_path):
    path = _write(tmp_path, 'name = "x"\nhbm_bytes_per_s = { value = \n')
    with pytest.raises(HardwareSpecError) as info:
        get(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: 1 problem: not valid TOML: ")
    assert "line 2" in message


def test_a_file_that_is_not_text_names_the_file(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b'name = "\xff"\n')
    with pytest.raises(HardwareSpecError, match=r"binary\.toml: 1 problem: not UTF-8"):
        get(str(path))


@pytest.mark.parametrize(
    ("replacements", "problem"),
    [
        # a number where a figure (table) is expected
        (
            [(HBM_LINE, "hbm_bytes_per_s = 3.35e+12")],
            "hbm_bytes_per_s: expected a figure",
        ),
        ([("[tensor_flops_per_s]", "tensor_flops_per_s = 5\n[t]")], "tensor_flops_per_s: expected"),
        ([("value = 3.35e+12", "value = 0")], "hbm_bytes_per_s.value: must be positive, got 0"),
        ([("value = 3.35e+12", "value = -3")], "hbm_bytes_per_s.value: must be positive, got -3"),
        ([("value = 3.35e+12", "value = nan")], "hbm_bytes_per_s.value: expected a finite number"),
        ([("value = 3.35e+12", "value = inf")], "hbm_bytes_per_s.value: expected a finite number"),
        ([("value = 3.35e+12", 'value = "3.35e12"')], "hbm_bytes_per_s.value: expected a number"),
        ([("value = 132, source", "source")], "compute_units.value: missing"),
        (
            [
                (
                    'value = 132, source = "NVIDIA H100 whitepaper: 132 SMs on H100 SXM5"',
                    "value = 132",
                )
            ],
            "compute_units.source: missing",
        ),
        (
            [('source = "NVIDIA H100 whitepaper: 132 SMs on H100 SXM5"', "source = 132")],
            "compute_units.source: expected a string, got 132 (a number)",
        ),
        (
            [('source = "NVIDIA H100 whitepaper: 132 SMs on H100 SXM5"', 'source = " "')],
            "compute_units.source: must not be empty",
        ),
        (
            [("value = 132,", 'value = 132, approximate = "yes",')],
            "compute_units.approximate: expected true or false, got 'yes' (a string)",
        ),
        (
            [("value = 132,", "value = 132, aproximate = true,")],
            "compute_units.aproximate: unknown field",
        ),
        ([('name = "h100-sxm"', "name = 7")], "name: expected a string, got 7 (a number)"),
        ([('name = "h100-sxm"', 'name = ""')], "name: must not be empty"),
        (
            [('display_name = "NVIDIA H100 SXM5 80GB"', "display_name = []")],
            "display_name: expected a string, got an array of 0 items",
        ),
        ([('aliases = ["h100"', 'aliases = [1, "h100"')], "aliases: expected an array of strings"),
        ([('name = "h100-sxm"', 'source = 1\nname = "h100-sxm"')], "source: expected a string"),
        (
            [("sfu_flops_per_s = {", "sfu_flop_per_s = {")],
            "sfu_flop_per_s: unknown key; did you mean sfu_flops_per_s?",
        ),
        (
            [("sfu_flops_per_s = {", "sfu_flop_per_s = {")],
            "sfu_flops_per_s: required key is missing",
        ),
        ([("\nbf16 = {", "\nbfloat16 = {")], "tensor_flops_per_s.bfloat16: unknown datatype"),
        ([("\nfp32 = {", "\nfp16 = {")], "vector_flops_per_s.fp16: unknown datatype"),
        ([("\nfp32 = {", "\nfp16 = {")], "vector_flops_per_s.fp32: required figure is missing"),
        (
            [("\nfp8 = {", "\nfp8 = { value = 1, source = 'x' }\nfp8_ = {")],
            "tensor_flops_per_s.fp8_: unknown datatype",
        ),
        (
            [
                (
                    "[interconnect_bytes_per_s]",
                    "[interconnect_bytes_per_s]\nl2_bytes = { value = 1, source = 'x' }",
                )
            ],
            "interconnect_bytes_per_s.l2_bytes: l2_bytes is a top-level key, but written below",
        ),
        (
            [
                (
                    "[interconnect_bytes_per_s]",
                    "[measured]\nlaunch_overhead_s = -1\n[interconnect_bytes_per_s]",
                )
            ],
            "measured.launch_overhead_s: expected a number of seconds >= 0, got -1 (a number)",
        ),
    ],
)
def test_each_kind_of_bad_value_is_refused_naming_its_key(tmp_path, replacements, problem):
    error, path = _refusal(tmp_path, _h100_with(*replacements))
    assert any(p.startswith(problem) for p in error.problems), error.problems
    assert str(error).startswith(f"{path}: ")


def test_a_file_missing_everything_lists_every_required_key(tmp_path):
    error, _ = _refusal(tmp_path, 'display_name = "empty"\n')
    assert error.problems == tuple(
        f"{key}: required key is missing"
        for key in (
            "name",
            "hbm_bytes_per_s",
            "hbm_capacity_bytes",
            "sfu_flops_per_s",
            "tensor_flops_per_s",
            "vector_flops_per_s",
        )
    )


def test_informational_and_optional_keys_may_be_left_out(tmp_path):
    text = "\n".join(
        line
        for line in H100_TEXT.splitlines()
        if not line.startswith(("l2_bytes", "compute_units", "shared_memory_bytes_per_sm"))
    ).split("[interconnect_bytes_per_s]")[0]
    text = 'source = "measured"\n' + text + "[measured]\nlaunch_overhead_s = 5e-06\nx = 'y'\n"
    spec = get(str(_write(tmp_path, text, "lean.toml")))
    assert spec.l2_bytes is None and spec.compute_units is None
    assert spec.shared_memory_bytes_per_sm is None and spec.interconnect_bytes_per_s == {}
    assert {"l2_bytes", "compute_units", "shared_memory_bytes_per_sm"}.isdisjoint(spec.figures())
    assert spec.ridge("bf16") == pytest.approx(989.4e12 / 3.35e12)  # nothing else changed
    with pytest.raises(ValueError, match="lists no shared_memory_bytes_per_sm"):
        spec.shared_memory_per_sm()


def test_every_shipped_spec_has_the_informational_figures_and_its_shared_memory():
    kib = {spec.name: spec.shared_memory_per_sm() / 1024 for spec in available()}
    # vendor tuning guides: Hopper / Blackwell 228 KB, A100 164 KB, GA102 / Ada 100 KB; CDNA 3
    # LDS 64 KB
    assert kib == {
        "a100-sxm": 164,
        "a10g": 100,
        "b200": 228,
        "h100-pcie": 228,
        "h100-sxm": 228,
        "h100-sxm-96gb-500w": 228,
        "h200-sxm": 228,
        "l4": 100,
        "l40s": 100,
        "mi300x": 64,
        "rtx-4090": 100,
    }
    for spec in available():
        for key in ("shared_memory_bytes_per_sm", "l2_bytes", "compute_units"):
            assert len(spec.figures()[key].source) > 10, (spec.name, key)
    assert get("a10g").shared_memory_bytes_per_sm.approximate  # GA102 figure stands in
    names = [n for spec in available() for n in (spec.name, *spec.aliases)]
    assert len(names) == len(set(names))  # no alias shadows another part


def test_the_hardware_guide_documents_every_key_and_its_example_loads(tmp_path):
    section = _accelerators_section()
    documented = set(re.findall(r"^\| `\[?([a-z0-9_]+)\]?` \|", section, flags=re.M))
    assert documented == set(SCHEMA_KEYS)
    example = section.split("```toml\n")[1].split("```")[0]
    spec = get(str(_write(tmp_path, example, "example.toml")))
    assert spec.ridge("bf16") == pytest.approx(989.4e12 / 3.35e12)
    assert spec.shared_memory_per_sm() == 228 * 1024


def test_the_hardware_listing_is_the_guide_table(capsys):
    from torchroof.cli.main import main

    assert main(["hardware"]) == 0
    printed = capsys.readouterr().out.split("\n\n")[0]  # the runtimes follow
    table = _accelerators_section().split("```\n")[1]
    rows = [line.rstrip() for line in printed.splitlines() if set(line) != {"-", " "}]
    assert rows == table.rstrip("\n").splitlines()  # the page leaves out the rule line


@pytest.mark.parametrize("command", [["estimate", "gpt2"], ["gemm", "64", "64", "64"]])
def test_cli_answers_a_bad_hardware_file_in_one_line(tmp_path, capsys, command):
    from torchroof.cli.main import main

    path = _write(tmp_path, BAD_THREE)
    assert main([*command, "--hardware", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"torchroof: error: {path}: 3 problems: ")
    for key in ("hbm_bytes_per_s.value", "hbm_capacity_bytes.value", "compute_unit: unknown"):
        assert key in captured.err


def test_gemm_tile_fit_uses_the_hardwares_shared_memory(tmp_path, capsys):
    from torchroof.cli.main import main
    from torchroof.labs.gemm_workbench import gemm_workbench

    # two bf16 128 x 128 input tiles, 2 x 128 * 128 * 2 B = 64 KiB, plus a 128 x 128 fp32
    # accumulator, 128 * 128 * 4 B = 64 KiB: 128 KiB
    def spec(kib):
        return _write(
            tmp_path,
            _h100_with(("value = 233472", f"value = {kib * 1024}")),
            f"smem-{kib}.toml",
        )

    h100 = gemm_workbench(4096, 4096, 4096, tile=128, hardware="h100")
    assert h100.tile_bytes == 128 * 1024 and h100.local_budget_bytes == 228 * 1024
    assert h100.tile_fits
    small = gemm_workbench(4096, 4096, 4096, tile=128, hardware=str(spec(100)))
    assert small.local_budget_bytes == 100 * 1024 and not small.tile_fits
    exact = gemm_workbench(4096, 4096, 4096, tile=128, hardware=str(spec(128)))
    assert exact.tile_fits  # 128 KiB fits 128 KiB
    assert not gemm_workbench(4096, 4096, 4096, hardware="rtx-4090").tile_fits  # Ada: 100 KB
    assert gemm_workbench(4096, 4096, 4096, tile=64, hardware="mi300x").tile_fits  # 32 KiB
    # an explicit budget still wins
    assert gemm_workbench(4096, 4096, 4096, hardware=str(spec(100)), local_budget_bytes=2**20)

    def tile_fit(*extra):
        argv = ["gemm", "4096", "4096", "4096", "--tile", "128", "--hardware", *extra]
        assert main(argv) == 0
        line = capsys.readouterr().out
        found = re.search(
            r"^tile fit: .* = (\d+) KiB against (\d+) KiB: (fits|does NOT fit)", line, re.M
        )
        assert found, line
        return int(found[1]), int(found[2]), found[3]

    assert tile_fit(str(spec(100))) == (128, 100, "does NOT fit")
    assert tile_fit("h100") == (128, 228, "fits")
    assert tile_fit(str(spec(100)), "--local-budget-kib", "256") == (128, 256, "fits")


def test_gemm_on_a_spec_without_shared_memory_says_what_to_add(tmp_path, capsys):
    from torchroof.cli.main import main

    text = "\n".join(
        line for line in H100_TEXT.splitlines() if not line.startswith("shared_memory")
    )
    path = _write(tmp_path, text, "no-smem.toml")
    assert main(["gemm", "64", "64", "64", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "lists no shared_memory_bytes_per_sm" in err and "--local-budget-kib" in err
    assert (
        main(["gemm", "64", "64", "64", "--hardware", str(path), "--local-budget-kib", "64"]) == 0
    )

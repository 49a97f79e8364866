"""Hardware specs: seed 000 Table 1 ridge points, lookup, user files, dtype errors."""

from pathlib import Path

import pytest
from torchroof.hardware import (
    UnknownHardwareError,
    UnsupportedDtypeError,
    available,
    get,
)


@pytest.mark.parametrize(
    ("name", "bf16", "fp8", "fp32"),
    [
        # seed 000 Table 1: I* = pi / beta at the HBM boundary
        ("a100-sxm", 153, None, 9.6),
        ("h100-sxm", 295, 591, 20),
        ("h200-sxm", 206, 412, 14),
        ("b200", 281, 563, 10),
        ("mi300x", 247, 493, 31),
        ("l40s", 419, 848, 106),
        ("rtx-4090", 164, 328, 82),
    ],
)
def test_table1_ridge_points(name, bf16, fp8, fp32):
    spec = get(name)
    assert spec.ridge("bf16") == pytest.approx(bf16, abs=1)
    assert spec.ridge("fp32") == pytest.approx(fp32, abs=0.5)
    if fp8 is None:
        with pytest.raises(UnsupportedDtypeError, match="no fp8 tensor cores"):
            spec.ridge("fp8")
    else:
        assert spec.ridge("fp8") == pytest.approx(fp8, abs=1.5)


def test_h100_worked_numbers():
    h100 = get("h100")
    # 989.4 TF/s / 3.35 TB/s = 295.3
    assert h100.ridge("bfloat16") == pytest.approx(989.4e12 / 3.35e12)
    assert h100.tensor_peak("bfloat16") / h100.vector_peak("fp32") == pytest.approx(14.8, abs=0.05)


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

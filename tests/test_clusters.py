"""Cluster specs: network link ridges, lookup, user files, whole-file errors."""

import math
from pathlib import Path

import pytest
from torchroof.hardware import (
    ClusterSpecError,
    UnknownClusterError,
    available,
    available_clusters,
    get_cluster,
    is_cluster,
)

# One cluster file with eight problems, each of a different kind.
BAD_EIGHT = """\
name = "bad-cluster"
accelerator = "h1000"
gpus_per_node = { value = 8.5, source = "typo" }

[intra_node]
kind = "nvlink"
name = "NVLink"
line_rate = { value = 4.5e11, source = "misspelt key" }
achieved_fraction = { value = 1.2, source = "above the line rate" }
latency_s = { value = 2e-5 }
max_nodes = { value = 4, source = "written below the [intra_node] header" }

[network]
name = "NIC"
line_bytes_per_s = { value = 5e10, source = "400 Gb/s" }
achieved_fraction = { value = 0.94, source = "nccl-tests" }
"""

# A cluster of user accelerators: the accelerator is a TOML next to the cluster file.
USER_ACCELERATOR = """\
name = "my-gpu"
hbm_bytes_per_s = { value = 1e12, source = "mine" }
hbm_capacity_bytes = { value = 1073741824, source = "mine" }
sfu_flops_per_s = { value = 1e12, source = "mine" }
[tensor_flops_per_s]
bf16 = { value = 1e15, source = "mine" }
[vector_flops_per_s]
fp32 = { value = 1e14, source = "mine" }
"""
USER_CLUSTER = """\
name = "my-box"
accelerator = "my-gpu.toml"
gpus_per_node = { value = 4, source = "mine" }

[intra_node]
kind = "pcie"
name = "PCIe Gen4 through a switch"
line_bytes_per_s = { value = 2.5e10, source = "mine" }
achieved_fraction = { value = 0.8, source = "mine", approximate = true }
latency_s = { value = 1e-5, source = "mine" }
"""


def _write(folder: Path, text: str, name: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def test_seed_link_ridges_on_an_h100():
    """The network ridge: I* = pi / beta_link at the H100's 989.4 TFLOP/s dense bf16."""
    ridges = get_cluster("dgx-h100").link_ridges("bf16")
    # NVLink 4: 989.4e12 / 450e9 = 2,198.67 (truncated to 2,198)
    assert ridges["nvlink"] == pytest.approx(989.4e12 / 450e9)
    assert math.floor(ridges["nvlink"]) == 2198
    # PCIe Gen5 x16: 989.4e12 / 64e9 = 15,459.375
    assert ridges["pcie"] == pytest.approx(989.4e12 / 64e9)
    assert math.floor(ridges["pcie"]) == 15459
    # 400 Gb/s per GPU = 50 GB/s: 989.4e12 / 50e9 = 19,788 exactly
    assert ridges["network"] == pytest.approx(19788)


def test_ridges_follow_the_dtype_and_the_accelerator():
    # fp8 doubles pi: 1,978.9e12 / 50e9 = 39,578
    assert get_cluster("dgx-h100").link_ridges("fp8")["network"] == pytest.approx(39578)
    # DGX A100: 312e12 / 300e9 = 1,040 on NVLink 3; 312e12 / 25e9 = 12,480 on 200 Gb/s
    a100 = get_cluster("dgx-a100").link_ridges("bf16")
    assert a100["nvlink"] == pytest.approx(1040) and a100["network"] == pytest.approx(12480)
    # an AMD node names its link xgmi: 1,307.4e12 / 448e9 = 2,918.3
    assert get_cluster("nd-mi300x-v5").link_ridges("bf16")["xgmi"] == pytest.approx(2918.3, 1e-4)


def test_the_shipped_clusters():
    names = {cluster.name for cluster in available_clusters()}
    wanted = {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72", "aws-p5"}
    assert wanted <= names
    assert any(c.accelerator.name == "mi300x" for c in available_clusters())
    for cluster in available_clusters():
        assert cluster.network is not None and cluster.intra_node.achieved_fraction is not None
        # achieved below line, and a NIC far below the scale-up link
        assert cluster.intra_node.achieved_bytes_per_s <= cluster.intra_node.line_bytes_per_s.value
        assert cluster.network.achieved_bytes_per_s < cluster.intra_node.achieved_bytes_per_s
        fractions = [f for k, f in cluster.figures().items() if k.endswith("achieved_fraction")]
        assert all(f.approximate for f in fractions)  # every achieved rate is a derived figure


def test_dgx_h100_carries_the_measured_nccl_rates():
    h100 = get_cluster("dgx-h100")
    # nccl-tests: ~370 GB/s ring bus bandwidth against a 450 GB/s line; ~480 with NVLS
    assert h100.intra_node.achieved_bytes_per_s == pytest.approx(370e9, rel=1e-3)
    assert h100.intra_node.nvls_all_reduce_bus_bytes_per_s.value == 480e9
    # a 400 Gb/s NIC reaches 46-48 GB/s
    assert 46e9 <= h100.network.achieved_bytes_per_s <= 48e9
    assert h100.gpus_per_node == 8 and h100.node_of(7) == 0 and h100.node_of(8) == 1


def test_cluster_names_do_not_shadow_accelerators():
    accelerator_names = {s.name for s in available()} | {a for s in available() for a in s.aliases}
    for cluster in available_clusters():
        assert not ({cluster.name, *cluster.aliases} & accelerator_names)


def test_lookup_by_alias_path_and_case(tmp_path):
    assert get_cluster("HGX_H100").name == "dgx-h100"
    assert get_cluster("p5.48xlarge").name == "aws-p5"
    shipped = Path(get_cluster("dgx-b200").path)
    assert get_cluster(str(shipped)).name == "dgx-b200"
    assert is_cluster("dgx-h100") and not is_cluster("h100")


def test_unknown_cluster_names_the_known_ones():
    with pytest.raises(UnknownClusterError) as error:
        get_cluster("dgx-h1000")
    message = str(error.value)
    assert "did you mean dgx-h100" in message
    assert all(cluster.name in message for cluster in available_clusters())
    with pytest.raises(UnknownClusterError, match="does not exist"):
        get_cluster("no-such-cluster.toml")


def test_a_bad_cluster_file_lists_every_problem_at_once(tmp_path):
    path = _write(tmp_path, BAD_EIGHT, "bad.toml")
    with pytest.raises(ClusterSpecError) as error:
        get_cluster(str(path))
    problems = error.value.problems
    assert str(error.value).startswith(f"{path}: 8 problems: ")
    expected = [
        "accelerator: unknown hardware 'h1000'",
        "gpus_per_node.value: GPUs must be a whole number, got 8.5",
        "intra_node.line_rate: unknown key",
        "intra_node.achieved_fraction.value: a fraction of the line rate is <= 1, got 1.2",
        "intra_node.latency_s.source: missing",
        "intra_node.max_nodes: max_nodes is a top-level key",
        "intra_node.line_bytes_per_s: required key is missing",
        "network.latency_s: required key is missing",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in problems), start


def test_an_unknown_accelerator_is_one_problem_of_the_file(tmp_path):
    text = USER_CLUSTER.replace('"my-gpu.toml"', '"h1000"')
    path = _write(tmp_path, text, "cluster.toml")
    with pytest.raises(ClusterSpecError) as error:
        get_cluster(str(path))
    assert str(error.value).startswith(f"{path}: 1 problem: accelerator: unknown hardware")
    assert "did you mean" in str(error.value)


def test_types_are_checked(tmp_path):
    text = (
        'name = 3\naccelerator = "h100"\naliases = "one"\n'
        'gpus_per_node = { value = 8, source = "x" }\n'
        'intra_node = "nvlink"\npcie = { name = "PCIe", line_bytes_per_s = "64 GB/s" }\n'
    )
    path = _write(tmp_path, text, "types.toml")
    with pytest.raises(ClusterSpecError) as error:
        get_cluster(str(path))
    problems = error.value.problems
    assert problems[0] == "name: expected a non-empty string, got 3 (a number)"
    assert problems[1] == "aliases: expected an array of strings, got 'one' (a string)"
    assert problems[2].startswith("intra_node: expected a table")
    assert problems[3].startswith("pcie.line_bytes_per_s: expected a figure")
    assert len(problems) == 4


def test_not_toml_and_not_a_cluster(tmp_path):
    path = _write(tmp_path, "name = \n", "broken.toml")
    with pytest.raises(ClusterSpecError, match=f"^{path}: 1 problem: not valid TOML"):
        get_cluster(str(path))
    accelerator = _write(tmp_path, USER_ACCELERATOR, "my-gpu.toml")
    with pytest.raises(ClusterSpecError, match="this is an accelerator file"):
        get_cluster(str(accelerator))
    assert not is_cluster(str(accelerator))


def test_a_user_cluster_of_user_accelerators(tmp_path):
    _write(tmp_path, USER_ACCELERATOR, "my-gpu.toml")
    path = _write(tmp_path, USER_CLUSTER, "my-box.toml")
    assert is_cluster(str(path))
    box = get_cluster(str(path))
    assert box.accelerator.name == "my-gpu" and box.network is None and box.pcie is None
    # one link: 1e15 FLOP/s / 25e9 B/s = 40,000 FLOPs per byte
    assert box.link_ridges("bf16") == {"pcie": pytest.approx(40000)}
    # 25 GB/s x 0.8 = 20 GB/s
    assert box.intra_node.achieved_bytes_per_s == pytest.approx(20e9)


def test_cli_prints_a_cluster_and_its_ridges(capsys):
    from torchroof.cli.main import main

    assert main(["hardware", "dgx-h100"]) == 0
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line for line in printed.splitlines() if line.strip()}
    assert "2,198.7" in rows["nvlink"] and "370" in rows["nvlink"]
    assert "19,788.0" in rows["network"] and "15,459.4" in rows["pcie"]
    assert "480 GB/s" in printed and "intra_node.achieved_fraction" in printed
    # an accelerator still prints its own figures
    assert main(["hardware", "h100"]) == 0
    assert "hbm_bytes_per_s" in capsys.readouterr().out


def test_cli_unknown_name_is_one_line_naming_clusters(capsys):
    from torchroof.cli.main import main

    assert main(["hardware", "dgx-h1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean dgx-h100" in err and "gb200-nvl72" in err


def test_cli_reads_a_user_cluster_file(tmp_path, capsys):
    from torchroof.cli.main import main

    _write(tmp_path, USER_ACCELERATOR, "my-gpu.toml")
    path = _write(tmp_path, USER_CLUSTER, "my-box.toml")
    assert main(["hardware", str(path)]) == 0
    assert "40,000.0" in capsys.readouterr().out

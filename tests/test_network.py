"""Collective time model: nccl-tests bus factors, alpha + bytes / beta on the link a group spans."""

import pytest
from torchroof.counters.bus import COLLECTIVE_KINDS, bus_factor
from torchroof.hardware import get_cluster

from torchroof.timing.network import collective_time

GIB = 2**30
H100 = get_cluster("dgx-h100")
NVLINK_BETA = 450e9 * 0.8222  # 369.99 GB/s ring bus bandwidth
NVLINK_ALPHA = 25.6e-6
NIC_BETA = 50e9 * 0.94  # 47 GB/s per 400 Gb/s NIC
NIC_ALPHA = 47e-6


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("all_reduce", 2 * 7 / 8),  # 1.75
        ("all_gather", 7 / 8),
        ("reduce_scatter", 7 / 8),
        ("all_to_all", 7 / 8),
        ("broadcast", 1.0),
        ("send_recv", 1.0),
    ],
)
def test_bus_factor_on_eight_ranks(kind, expected):
    assert bus_factor(kind, 8) == pytest.approx(expected)
    assert bus_factor(kind, 1) == 0.0  # a group of one sends nothing


def test_bus_factor_refuses_bad_input():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*all_reduce"):
        bus_factor("allreduce", 8)
    for size in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="group_size"):
            bus_factor("all_reduce", size)


def test_ring_all_reduce_of_one_gib_on_a_dgx_h100():
    t = collective_time("all_reduce", GIB, range(8), H100, nvls=False)
    # 2 * 7/8 * 2^30 = 1,879,048,192 B at 369.99 GB/s = 5.0787 ms, + 25.6 us = 5.1043 ms
    assert t.time_s == pytest.approx(NVLINK_ALPHA + 2 * 7 / 8 * GIB / NVLINK_BETA)
    assert t.time_s == pytest.approx(5.1043e-3, rel=1e-4)
    assert (t.link, t.algorithm, t.nodes, t.ranks_per_node) == ("nvlink", "ring", 1, 8)
    assert t.wire_bytes_per_rank == 1_879_048_192 and t.network_bytes_per_rank == 0
    assert (t.alpha_s, t.beta_bytes_per_s) == (pytest.approx(NVLINK_ALPHA), NVLINK_BETA)


def test_all_reduce_takes_nvls_where_the_switch_reduces():
    t = collective_time("all_reduce", GIB, range(8), H100)
    # 1,879,048,192 B at 480 GB/s bus bandwidth = 3.9147 ms, + 25.6 us
    assert t.time_s == pytest.approx(NVLINK_ALPHA + 1_879_048_192 / 480e9)
    assert t.algorithm == "nvls"
    # no NVLS figure on a DGX A100: a ring at 300 GB/s x 0.772 = 231.6 GB/s
    a100 = collective_time("all_reduce", GIB, range(8), get_cluster("dgx-a100"))
    assert a100.algorithm == "ring"
    assert a100.time_s == pytest.approx(44.8e-6 + 1_879_048_192 / 231.6e9)


@pytest.mark.parametrize(
    ("kind", "factor"),
    [("all_gather", 7 / 8), ("reduce_scatter", 7 / 8), ("all_to_all", 7 / 8), ("broadcast", 1)],
)
def test_each_collective_in_one_node(kind, factor):
    t = collective_time(kind, GIB, [8, 9, 10, 11, 12, 13, 14, 15], H100)  # node 1, whole
    assert t.time_s == pytest.approx(NVLINK_ALPHA + factor * GIB / NVLINK_BETA)
    assert t.link == "nvlink"


def test_a_group_of_one_costs_nothing():
    t = collective_time("all_reduce", GIB, [5], H100)
    assert (t.time_s, t.wire_bytes_per_rank, t.link) == (0.0, 0.0, "none")


def test_send_recv_inside_and_across_nodes():
    inside = collective_time("send_recv", GIB, [0, 1], H100)
    assert inside.time_s == pytest.approx(NVLINK_ALPHA + GIB / NVLINK_BETA)
    across = collective_time("send_recv", GIB, [3, 11], H100)
    # 2^30 B over one 47 GB/s NIC = 22.85 ms, + 47 us
    assert across.time_s == pytest.approx(NIC_ALPHA + GIB / NIC_BETA)
    assert across.link == "network"


def test_one_rank_per_node_crosses_the_nic():
    t = collective_time("all_reduce", GIB, [0, 8, 16, 24], H100)
    # 2 * 3/4 * 2^30 = 1,610,612,736 B at 47 GB/s = 34.27 ms, + 47 us
    assert t.time_s == pytest.approx(NIC_ALPHA + 2 * 3 / 4 * GIB / NIC_BETA)
    assert (t.link, t.nodes, t.ranks_per_node) == ("network", 4, 1)
    assert t.intra_node_bytes_per_rank == 0


def test_hierarchical_all_reduce_over_two_nodes_of_eight():
    """Reduce-scatter inside each node, all-reduce across nodes on 1/8, all-gather inside."""
    t = collective_time("all_reduce", GIB, range(16), H100)
    # inside: (7/8 + 7/8) * 2^30 = 1.75 GiB at 369.99 GB/s = 5.0787 ms
    # across: 2 * 1/2 * 2^30 / 8 = 128 MiB at 47 GB/s = 2.8557 ms; pipelined: the slower wins
    assert t.intra_node_bytes_per_rank == 1.75 * GIB
    assert t.network_bytes_per_rank == GIB / 8
    assert t.time_s == pytest.approx(NIC_ALPHA + 1.75 * GIB / NVLINK_BETA)
    assert (t.link, t.bound_link, t.nodes, t.ranks_per_node) == ("hierarchical", "nvlink", 2, 8)
    assert t.beta_bytes_per_s == NVLINK_BETA


def test_hierarchical_all_gather_over_four_nodes():
    t = collective_time("all_gather", GIB, range(32), H100)
    # across: 3/4 * 2^30 / 8 = 96 MiB; inside: 7/8 * 2^30 = 896 MiB
    assert t.network_bytes_per_rank == 96 * 2**20
    assert t.intra_node_bytes_per_rank == 896 * 2**20
    # 896 MiB / 369.99 GB/s = 2.539 ms > 96 MiB / 47 GB/s = 2.142 ms
    assert t.time_s == pytest.approx(NIC_ALPHA + 896 * 2**20 / NVLINK_BETA)


def test_hierarchical_all_to_all_is_network_bound():
    t = collective_time("all_to_all", GIB, range(16), H100)
    # each rank keeps 1/16, sends 7/16 to node peers and 8/16 over its NIC
    assert t.intra_node_bytes_per_rank == 7 / 16 * GIB
    assert t.network_bytes_per_rank == GIB / 2
    # 512 MiB / 47 GB/s = 11.42 ms > 448 MiB / 369.99 GB/s = 1.27 ms
    assert t.time_s == pytest.approx(NIC_ALPHA + GIB / 2 / NIC_BETA)
    assert t.bound_link == "network" and t.beta_bytes_per_s == NIC_BETA


def test_an_uneven_group_is_priced_by_its_busiest_node():
    t = collective_time("all_reduce", GIB, [0, 1, 2, 8], H100)
    # k = 3 on node 0, m = 2: inside 2 * 2/3 * S, across 2 * 1/2 * S / 3
    assert (t.nodes, t.ranks_per_node) == (2, 3)
    assert t.intra_node_bytes_per_rank == pytest.approx(4 / 3 * GIB)
    assert t.network_bytes_per_rank == pytest.approx(GIB / 3)


def test_many_nodes_approach_the_rail_bandwidth():
    """DGX A100, 16 nodes of 8: the network bounds, and the bus bandwidth nears 8 NICs x 24 GB/s
    (NVIDIA/nccl#812 measures 192 GB/s), where one NIC per ring would allow 24."""
    a100 = get_cluster("dgx-a100")
    size = 8 * GIB
    t = collective_time("all_reduce", size, range(128), a100)
    assert t.bound_link == "network"
    bus_bandwidth = bus_factor("all_reduce", 128) * size / (t.time_s - t.alpha_s)
    # (2 * 127/128) / (2 * 15/16 / 8) * 24 GB/s = 203.2 GB/s
    assert bus_bandwidth == pytest.approx(203.2e9, rel=1e-3)


def test_a_full_mesh_group_uses_only_its_own_links():
    mi300x = get_cluster("nd-mi300x-v5")
    t = collective_time("all_gather", GIB, range(4), mi300x)
    # 4 of 8 GPUs use 3 of 7 links: 448 GB/s x 0.75 x 3/7 = 144 GB/s
    assert t.beta_bytes_per_s == pytest.approx(144e9)
    assert t.time_s == pytest.approx(25.6e-6 + 3 / 4 * GIB / 144e9)
    assert t.link == "xgmi"
    whole = collective_time("all_gather", GIB, range(8), mi300x)
    assert whole.beta_bytes_per_s == pytest.approx(336e9)  # all 7 links


def test_the_achieved_nvlink_rate_is_pytorchs_hopper_figure():
    """The rate PyTorch's comm_analysis carries for Hopper NVLink (from NCCL's topo.h) is the
    one this model reuses for the DGX H100 (370 GB/s)."""
    comm = pytest.importorskip("torch._inductor.comm_analysis")
    table = getattr(comm, "_GPU_NVLINK_BW", None)
    if table is None:
        pytest.skip("torch moved _GPU_NVLINK_BW")
    hopper = table[comm.NVIDIA_GPU_TYPE.HOPPER] * 1e9
    assert H100.intra_node.achieved_bytes_per_s == pytest.approx(hopper, rel=1e-3)


@pytest.mark.parametrize(
    ("kind", "size", "ranks", "message"),
    [
        ("all_reduce", GIB, [], "empty"),
        ("all_reduce", GIB, [0, 1, 1], "repeats ranks \\[1\\]"),
        ("all_reduce", GIB, [0, -1], "integers >= 0"),
        ("send_recv", GIB, [0, 1, 2], "two ranks of the pair"),
        ("all_reduce", -1, [0, 1], "message_bytes"),
        ("all_reduce", float("nan"), [0, 1], "message_bytes"),
        ("gather", GIB, [0, 1], "unknown collective 'gather'"),
    ],
)
def test_bad_input_is_refused(kind, size, ranks, message):
    with pytest.raises(ValueError, match=message):
        collective_time(kind, size, ranks, H100)


def test_ranks_beyond_the_cluster_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at most 2500 nodes"):
        collective_time("all_reduce", GIB, [0, 20_000], get_cluster("aws-p5"))
    text = (
        'name = "box"\naccelerator = "l40s"\ngpus_per_node = { value = 4, source = "x" }\n'
        '[intra_node]\nkind = "pcie"\nname = "PCIe"\n'
        'line_bytes_per_s = { value = 3.2e10, source = "x" }\n'
        'achieved_fraction = { value = 0.7, source = "x" }\n'
        'latency_s = { value = 1e-5, source = "x" }\n'
    )
    path = tmp_path / "box.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="has no \\[network\\]: it is one node of 4 GPUs"):
        collective_time("all_reduce", GIB, [0, 4], get_cluster(str(path)))


def test_every_kind_is_priced():
    for kind in COLLECTIVE_KINDS:
        ranks = [0, 9] if kind == "send_recv" else range(16)
        assert collective_time(kind, GIB, ranks, H100).time_s > NIC_ALPHA

"""Roofline timing (Williams, Waterman & Patterson 2009; the overlap assumption:
docs/concepts/roofline.md)."""

import pytest
from torchroof.counters import Cost
from torchroof.hardware import get

from torchroof.config import PricingOptions
from torchroof.timing.roofline import time_kernel

H100 = get("h100")


def test_seed_004_worked_example():
    # 120 GFLOP and 12 GB on a 20 TFLOP/s, 100 GB/s machine: max(0.006, 0.12) = 0.12 s.
    # Scale both ceilings by the efficiency options to build that machine from an H100.
    options = PricingOptions(
        compute_efficiency=20e12 / 989.4e12, bandwidth_efficiency=100e9 / 3.35e12
    )
    t = time_kernel(Cost(120e9, 12e9, 0, "tensor", "bfloat16"), H100, options)
    assert t.compute_s == pytest.approx(0.006)
    assert t.memory_s == pytest.approx(0.12)
    assert t.time_s == pytest.approx(0.12) and t.bound == "memory"


def test_max_versus_no_overlap_is_exactly_two_at_the_ridge():
    # 989.4 GFLOP at 989.4 TFLOP/s and 3.35 GB at 3.35 TB/s: 1 ms each, so the kernel sits
    # at the ridge, I = 989.4e9 / 3.35e9 = 295.3 FLOP/B (the H100 SXM datasheet's figures)
    cost = Cost(989_400_000_000, 3_350_000_000, 0, "tensor", "bfloat16")
    assert cost.intensity == pytest.approx(295.34, abs=0.005)
    overlap = time_kernel(cost, H100, PricingOptions())
    serial = time_kernel(cost, H100, PricingOptions(overlap=False))
    assert overlap.compute_s == pytest.approx(1e-3) and overlap.memory_s == pytest.approx(1e-3)
    # max(1 ms, 1 ms) = 1 ms overlapped; 1 ms + 1 ms = 2 ms serial
    assert overlap.time_s == pytest.approx(1e-3)
    assert serial.time_s == pytest.approx(2e-3)


def test_units_choose_their_ceiling():
    flops = 1e12
    tensor = time_kernel(Cost(flops, 0, 0, "tensor", "bfloat16"), H100, PricingOptions())
    vector = time_kernel(Cost(flops, 0, 0, "vector", "bfloat16"), H100, PricingOptions())
    sfu = time_kernel(Cost(flops, 0, 0, "sfu", "float32"), H100, PricingOptions())
    assert tensor.compute_s == pytest.approx(flops / 989.4e12)
    assert vector.compute_s == pytest.approx(flops / 66.9e12)
    assert sfu.compute_s == pytest.approx(flops / (66.9e12 / 4))


def test_pure_data_movement_is_memory_time_only():
    t = time_kernel(Cost(0, 2e9, 1.35e9, "none"), H100, PricingOptions())
    assert t.time_s == pytest.approx(1.0e-3)  # 3.35 GB at 3.35 TB/s
    assert t.bound == "memory"


def test_launch_overhead_and_efficiency():
    cost = Cost(0, 3.35e6, 0, "none")  # 1 us of HBM time
    t = time_kernel(cost, H100, PricingOptions(bandwidth_efficiency=0.5, launch_overhead_s=4e-6))
    assert t.time_s == pytest.approx(2e-6 + 4e-6)


def test_fp8_on_a100_is_an_error_not_a_fallback():
    from torchroof.hardware import UnsupportedDtypeError

    with pytest.raises(UnsupportedDtypeError, match="A100"):
        time_kernel(Cost(1e9, 1e6, 0, "tensor", "float8_e4m3fn"), get("a100"), PricingOptions())


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_options_reject_impossible_efficiencies(bad):
    with pytest.raises(ValueError, match="efficiency"):
        PricingOptions(compute_efficiency=bad)

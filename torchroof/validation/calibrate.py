"""Measure the local device's real ceilings and write them as a hardware TOML.

Measure the ceilings before trusting them (STREAM: McCalpin 1995): published peaks are burst
figures; a roofline built from measured bandwidth (STREAM copy and triad, sized well past
the last-level cache) and measured matmul throughput per dtype is worth more than a precise
model on vendor maxima. Also measured: elementwise throughput on cache-resident data and
the per-op launch overhead (a kernel of a few microseconds partly measures its own launch).
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

_SPEC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Calibration:
    """What was measured, in SI units."""

    device: str
    device_name: str
    torch_version: str
    date: str
    copy_bytes_per_s: float
    triad_bytes_per_s: float
    matmul_flops_per_s: dict[str, float]  # spec dtype key -> FLOP/s (tf32 where enabled)
    vector_flops_per_s: float
    launch_overhead_s: float
    capacity_bytes: int
    cache_bytes: int
    compute_units: int
    notes: list[str] = field(default_factory=list)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The roofline's beta: the better of copy and triad."""
        return max(self.copy_bytes_per_s, self.triad_bytes_per_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_toml(self, name: str) -> str:
        """A hardware file every torchroof command accepts (``--hardware file.toml``)."""
        src = (
            f"measured by torchroof calibrate on {self.device_name}, {self.date}, "
            f"torch {self.torch_version}"
        )

        def fig(value: float, what: str, approximate: bool = False) -> str:
            text = str(int(value)) if float(value).is_integer() else f"{value:.6g}"
            tail = ", approximate = true" if approximate else ""
            return f'{{ value = {text}, source = "{src}: {what}"{tail} }}'

        lines = [
            f"# {self.device_name}, measured {self.date}",
            'source = "measured"',
            f'name = "{name}"',
            f'display_name = "{self.device_name} (measured)"',
            "aliases = []",
            "",
            "hbm_bytes_per_s = " + fig(self.bandwidth_bytes_per_s, "best of STREAM copy and triad"),
            "hbm_capacity_bytes = "
            + fig(self.capacity_bytes, "device memory reported by the system"),
            "l2_bytes = "
            + fig(max(self.cache_bytes, 1), "last-level cache reported by the system"),
            "compute_units = " + fig(max(self.compute_units, 1), "cores / multiprocessors"),
            "sfu_flops_per_s = "
            + fig(self.vector_flops_per_s / 4, "1/4 of measured elementwise (assumed)", True),
        ]
        if self.launch_overhead_s > 0:  # realistic mode charges it to every kernel
            launch = "one 1-element add, call to completion, median"
            lines.append("launch_overhead_s = " + fig(self.launch_overhead_s, launch))
        lines += [
            "",
            "[tensor_flops_per_s]",
        ]
        for key, value in sorted(self.matmul_flops_per_s.items()):
            lines.append(f"{key} = " + fig(value, f"best {key} matmul"))
        lines += [
            "",
            "[vector_flops_per_s]",
            "fp32 = " + fig(self.vector_flops_per_s, "cache-resident fp32 elementwise (addcmul)"),
            "",
            "[measured]",
            f"copy_bytes_per_s = {self.copy_bytes_per_s:.6g}",
            f"triad_bytes_per_s = {self.triad_bytes_per_s:.6g}",
            f'device = "{self.device}"',
            f'date = "{self.date}"',
            f'torch_version = "{self.torch_version}"',
        ]
        return "\n".join(lines) + "\n"

    def lines(self) -> list[str]:
        out = [
            f"{self.device_name} ({self.device}), torch {self.torch_version}, {self.date}",
            f"copy {self.copy_bytes_per_s / 1e9:.1f} GB/s, "
            f"triad {self.triad_bytes_per_s / 1e9:.1f} GB/s",
        ]
        out += [
            f"matmul {k}: {v / 1e12:.3f} TFLOP/s"
            for k, v in sorted(self.matmul_flops_per_s.items())
        ]
        out += [
            f"elementwise (cache-resident): {self.vector_flops_per_s / 1e9:.1f} GFLOP/s",
            f"launch overhead: {self.launch_overhead_s * 1e6:.2f} us per op",
        ]
        return out + [f"note: {n}" for n in self.notes]


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def time_op(fn: Callable[[], Any], device: str, repeats: int = 5, inner: int = 1) -> float:
    """Median seconds per call of ``fn`` after one warm-up call."""
    sync = _sync(device)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _cache_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024**2}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KM")) * scale)
    return best or 32 * 1024**2


def _device_facts(device: str) -> tuple[str, int, int]:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return props.name, int(props.total_memory), int(props.multi_processor_count)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = platform.processor() or platform.machine()
    return f"CPU {name} x{torch.get_num_threads()} threads", int(memory), os.cpu_count() or 1


def _stream(device: str, n: int) -> tuple[float, float]:
    """STREAM copy (2 arrays moved) and triad (3 arrays) bandwidth on n fp32 elements."""
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.ones(n, dtype=torch.float32, device=device)
    c = torch.ones(n, dtype=torch.float32, device=device)
    copy_s = time_op(lambda: a.copy_(b), device)
    triad_s = time_op(lambda: torch.add(b, c, alpha=3.0, out=a), device)
    return 2 * 4 * n / copy_s, 3 * 4 * n / triad_s


def calibrate(
    device: str = "cpu",
    progress: Callable[[str], None] = lambda message: None,
    stream_bytes: int | None = None,
    matmul_sizes: tuple[int, ...] | None = None,
    elementwise_bytes: int | None = None,
) -> Calibration:
    """Measure bandwidth, matmul throughput per dtype, elementwise throughput and launch
    overhead on ``device`` (``cpu`` or ``cuda``). Takes well under a minute; the sizes
    (bytes per STREAM array, matmul sizes, bytes of the elementwise operand) make it
    shorter, as ``torchroof validate`` does before each repeat of its step."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device is available here; use --device cpu")
    cache = _cache_bytes(device)
    name, capacity, units = _device_facts(device)
    notes: list[str] = []
    # STREAM: arrays well past the last-level cache (4x, at least 256 MiB each)
    size = stream_bytes or max(4 * cache, 256 * 1024**2)
    n = size // 4
    progress(f"bandwidth: STREAM copy and triad on {3 * size / 2**20:.0f} MiB")
    copy_bw, triad_bw = _stream(device, n)

    sizes = matmul_sizes or ((4096, 8192) if device.startswith("cuda") else (1024, 2048))
    dtypes = ["fp32", "bf16", "fp16"] if device.startswith("cuda") else ["fp32", "bf16"]
    matmul: dict[str, float] = {}
    for key in dtypes:
        best = 0.0
        for m in sizes:
            progress(f"matmul {key} {m}^3")
            x = torch.randn(m, m, device=device).to(_SPEC_DTYPES[key])
            y = torch.randn(m, m, device=device).to(_SPEC_DTYPES[key])
            seconds = time_op(functools.partial(torch.mm, x, y), device, repeats=3)
            best = max(best, 2 * m**3 / seconds)
        matmul[key] = best
    if device.startswith("cuda"):
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        m = sizes[-1]
        x, y = torch.randn(m, m, device=device), torch.randn(m, m, device=device)
        matmul["tf32"] = 2 * m**3 / time_op(lambda: torch.mm(x, y), device, repeats=3)
        torch.backends.cuda.matmul.allow_tf32 = previous
    else:
        notes.append("fp32 matmuls on this device use the measured fp32 matmul rate")

    progress("elementwise throughput (cache-resident)")
    small = (elementwise_bytes or max(cache // 16, 64 * 1024)) // 4
    x = torch.ones(small, device=device)
    out = torch.empty_like(x)
    inner = 50
    vector = 2 * small / time_op(lambda: torch.addcmul(x, x, x, out=out), device, inner=inner)

    progress("launch overhead")
    one = torch.ones(1, device=device)
    out1 = torch.empty_like(one)
    overhead = time_op(lambda: torch.add(one, one, out=out1), device, repeats=7, inner=200)
    return Calibration(
        device=device,
        device_name=name,
        torch_version=torch.__version__,
        date=datetime.date.today().isoformat(),
        copy_bytes_per_s=copy_bw,
        triad_bytes_per_s=triad_bw,
        matmul_flops_per_s=matmul,
        vector_flops_per_s=vector,
        launch_overhead_s=overhead,
        capacity_bytes=capacity,
        cache_bytes=cache,
        compute_units=units,
        notes=notes,
    )

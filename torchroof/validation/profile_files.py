"""Reading a profile of a real step: a PyTorch profiler trace exported as Chrome JSON
(``prof.export_chrome_trace(path)``; torch.profiler docs, "Examining stack traces" and
"Using tracing functionality") or a CSV of per-op timings (a ``name`` column with the aten
op, and ``time_s``, ``time_ms`` or ``time_us``), as the ops torchroof prices, each with its
time; and, on a GPU trace, how long the GPU sat idle between its kernels.

On a GPU trace an op's time is the device time of the kernels it launched (linked by the
profiler's ``External id``); on a CPU trace, the op's own time.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchroof.validation.profiling import normalise


class ProfileError(ValueError):
    """A profile that cannot be read or matched; the message says why."""


@dataclass(frozen=True)
class _Op:
    name: str
    pid: Any
    tid: Any
    start: float
    end: float
    external: Any


def _is_aten_op(event: dict[str, Any]) -> bool:
    name = str(event.get("name", ""))
    return event.get("ph") == "X" and event.get("cat") == "cpu_op" and name.startswith("aten::")


def _ops(events: list[dict[str, Any]]) -> list[_Op]:
    out = []
    for e in filter(_is_aten_op, events):
        start = float(e["ts"])
        external = (e.get("args") or {}).get("External id")
        out.append(
            _Op(e["name"], e.get("pid"), e.get("tid"), start, start + float(e["dur"]), external)
        )
    return out


def _events(path: str | Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ProfileError(f"{path}: not a readable Chrome trace JSON: {error}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError(f"{path}: no traceEvents list (export with prof.export_chrome_trace)")
    return events


def _device_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in device]


@dataclass(frozen=True)
class DeviceIdle:
    """A GPU trace's time from its first kernel's start to its last kernel's end, and the
    part of it no kernel ran (seconds): the GPU waiting on the host."""

    span_s: float
    idle_s: float

    def line(self) -> str:
        share = self.idle_s / self.span_s if self.span_s else 0.0
        return (
            f"GPU idle between kernels: {self.idle_s * 1e3:.3f} ms of the "
            f"{self.span_s * 1e3:.3f} ms from the trace's first kernel to its last "
            f"({share:.0%}): time the GPU waited on the host, which the fitted per-kernel "
            "figures do not hold (a runtime profile's host_overhead_s, per step, is where it "
            "goes: divide by the steps profiled)"
        )


def _idle(spans: list[tuple[float, float]]) -> DeviceIdle:
    """The span of ``spans`` (start, end in microseconds, sorted) and the part of it no
    interval covers."""
    busy, (start, end) = 0.0, spans[0]
    last = max(stop for _, stop in spans)
    for begin, stop in spans[1:]:
        if begin > end:  # a gap: the merged run so far is done
            busy += end - start
            start, end = begin, stop
        else:
            end = max(end, stop)
    busy += end - start
    span = last - spans[0][0]
    return DeviceIdle(span * 1e-6, (span - busy) * 1e-6)


def device_idle(path: str | Path) -> DeviceIdle | None:
    """How long a GPU trace's device sat idle between its first and last kernel or copy
    (the union of their intervals over every stream taken from the span), over the whole
    trace; where the trace holds several devices, the busiest one's. None for a CPU trace
    or a CSV."""
    return None if str(path).endswith(".csv") else _device_idle(_events(path))


def _device_idle(events: list[dict[str, Any]]) -> DeviceIdle | None:
    by_device: defaultdict[Any, list[tuple[float, float]]] = defaultdict(list)
    for e in _device_events(events):
        by_device[e.get("pid")].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    if not by_device:
        return None
    busiest = max(by_device.values(), key=len)
    return _idle(sorted(busiest))


def chrome_trace_ops(path: str | Path, names: set[str]) -> list[tuple[str, float]]:
    """The top-most profiled ops whose op torchroof prices as a kernel (``names``,
    normalised), in start order, each with its time in seconds: its kernels' device time on
    a GPU trace, its own time on a CPU one."""
    return _chrome_ops(_events(path), names)


def _chrome_ops(events: list[dict[str, Any]], names: set[str]) -> list[tuple[str, float]]:
    ops = sorted(_ops(events), key=lambda o: (o.start, -o.end))
    chosen: list[_Op] = []
    owner: dict[Any, int] = {}  # External id -> index in chosen
    open_by_thread: dict[tuple[Any, Any], list[tuple[_Op, int | None]]] = {}
    for op in ops:
        stack = open_by_thread.setdefault((op.pid, op.tid), [])
        while stack and stack[-1][0].end <= op.start:
            stack.pop()
        top = next((i for _, i in reversed(stack) if i is not None), None)
        if top is None and normalise(op.name) in names:
            top = len(chosen)
            chosen.append(op)
        if op.external is not None and top is not None:
            owner[op.external] = top
        stack.append((op, top))
    kernels = _device_events(events)
    if not kernels:
        return [(normalise(o.name), (o.end - o.start) * 1e-6) for o in chosen]
    device = [0.0] * len(chosen)
    for k in kernels:
        index = owner.get((k.get("args") or {}).get("External id"))
        if index is not None:
            device[index] += float(k["dur"]) * 1e-6
    return [(normalise(o.name), t) for o, t in zip(chosen, device, strict=True) if t > 0]


UNITS = {"time_s": 1.0, "time_ms": 1e-3, "time_us": 1e-6}


def csv_ops(path: str | Path) -> list[tuple[str, float]]:
    """Per-op timings from a CSV: a ``name`` column and one time column (:data:`UNITS`)."""
    try:
        with Path(path).open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as error:
        raise ProfileError(f"{path}: cannot read it: {error.strerror or error}") from None
    columns = set(rows[0]) if rows else set()
    unit = next((c for c in UNITS if c in columns), None)
    if "name" not in columns or unit is None:
        raise ProfileError(f"{path}: needs a 'name' column and one of {', '.join(UNITS)}")
    out = []
    for n, row in enumerate(rows, start=2):
        try:
            out.append((normalise(row["name"]), float(row[unit]) * UNITS[unit]))
        except ValueError:
            raise ProfileError(f"{path}:{n}: {row[unit]!r} is not a time") from None
    return out


def profiled_ops(path: str | Path, names: set[str]) -> list[tuple[str, float]]:
    """The profile's ops, from a Chrome trace or (by its suffix) a CSV."""
    return read_profile(path, names)[0]


def read_profile(
    path: str | Path, names: set[str]
) -> tuple[list[tuple[str, float]], DeviceIdle | None]:
    """The profile's ops (:func:`profiled_ops`) and its GPU's idle time
    (:func:`device_idle`), the file read once."""
    if str(path).endswith(".csv"):
        return [op for op in csv_ops(path) if op[0] in names], None
    events = _events(path)
    return _chrome_ops(events, names), _device_idle(events)

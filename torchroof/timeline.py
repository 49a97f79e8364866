"""The predicted kernel sequence as a Chrome / Perfetto trace (``chrome://tracing``,
https://ui.perfetto.dev), to open beside a real profile in the viewers people already use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.records import TOP_LEVEL

if TYPE_CHECKING:
    from torchroof.report import Estimate

_THREADS = {"forward": 1, "backward": 2, "recompute": 3, "optimizer": 4}
_COMMUNICATION_THREAD = 5  # collectives and the copies feeding them, on their own stream


def chrome_trace(est: Estimate) -> dict[str, Any]:
    """Kernels on a timeline, one track per phase, times in microseconds: back to back (the
    roofline sum) for a step on one GPU; at their places on the two-stream schedule
    (torchroof.schedule) when the step communicates, with the collectives on a
    ``communication`` track beside the compute."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"torchroof {est.label}"}}
    ]
    tracks = dict(_THREADS)
    scheduled = any(k.start_s is not None for k in est.kernels)
    if scheduled:
        tracks["communication"] = _COMMUNICATION_THREAD
    for phase, tid in tracks.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": phase}}
        )
    start_us = 0.0
    for k in est.kernels:
        duration_us = k.time_s * 1e6
        if scheduled and k.start_s is not None:
            start_us = k.start_s * 1e6
        tid = _THREADS.get(k.phase, 1)
        if scheduled and k.communication:
            tid = _COMMUNICATION_THREAD
        events.append(
            {
                "name": k.name.removeprefix("aten."),
                "cat": k.bound,
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": start_us,
                "dur": duration_us,
                "args": {
                    "module": k.module or TOP_LEVEL,
                    "ops": list(k.ops),
                    "flops": k.flops,
                    "bytes": k.bytes,
                    "intensity": k.intensity if k.bytes else None,
                    "bound": k.bound,
                    "compute_us": k.compute_s * 1e6,
                    "memory_us": k.memory_s * 1e6,
                    **({"link": k.link, "exposed_us": k.exposed_s * 1e6} if k.link else {}),
                },
            }
        )
        start_us += duration_us
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(est: Estimate, path: str | Path) -> Path:
    """The trace as JSON at ``path`` (any name; ``torchroof.render_files.write`` picks this
    format for a ``.trace.json`` suffix)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(est)))
    return path

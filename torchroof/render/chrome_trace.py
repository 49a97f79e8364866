"""The predicted kernel sequence as a Chrome / Perfetto trace (``chrome://tracing``,
https://ui.perfetto.dev), to open beside a real profile in the viewers people already use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchroof.records.ops import TOP_LEVEL
from torchroof.render.text import estimate_label
from torchroof.timing.streams import NETWORK

if TYPE_CHECKING:
    from torchroof.report.estimate import Estimate

_THREADS = {"forward": 1, "backward": 2, "recompute": 3, "optimizer": 4}
_COMMUNICATION_THREAD = 5  # collectives and the copies feeding them, on their own stream
_NETWORK_THREAD = 6  # those crossing the network, on theirs (torchroof.timing.streams.lane_of)


def chrome_trace(est: Estimate) -> dict[str, Any]:
    """Kernels on a timeline, one track per phase, times in microseconds: back to back (the
    roofline sum) for a step on one GPU; at their places on the schedule
    (torchroof.timing.streams) when the step communicates, with the collectives on a
    ``communication`` track beside the compute (and those crossing the network on a
    ``communication (network)`` track of their own: the two run at once)."""
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": 1,
            "args": {"name": f"torchroof {estimate_label(est)}"},
        }
    ]
    tracks = dict(_THREADS)
    scheduled = any(k.start_s is not None for k in est.kernels)
    if scheduled:
        tracks["communication"] = _COMMUNICATION_THREAD
        if any(k.lane == NETWORK for k in est.kernels):
            tracks["communication (network)"] = _NETWORK_THREAD
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
            tid = _NETWORK_THREAD if k.lane == NETWORK else _COMMUNICATION_THREAD
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
    if est.pipeline is not None:
        events += pipeline_events(est)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


_PIPELINE_PID = 100  # rank r of a pipeline is process 100 + r, after the kernels' process
_PIPELINE_TRACKS = {"compute": 1, "send": 2, "after": 3}
_ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}


def pipeline_events(est: Estimate) -> list[dict[str, Any]]:
    """A pipelined step's per-rank timeline: one process per rank, its actions
    (stage, micro-batch) on a ``compute`` track, the activations and gradients it sends on
    a ``send`` track, its gradient sync and optimizer step on an ``after`` track. The
    kernels process above is the slowest rank's, one micro-batch."""
    step = est.pipeline
    assert step is not None
    events: list[dict[str, Any]] = []
    for row in step.ranks:
        pid = _PIPELINE_PID + row.rank
        stages = ", ".join(str(s) for s in row.stages)
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "args": {"name": f"rank {row.rank} (stage {stages})"},
            }
        )
        for track, tid in _PIPELINE_TRACKS.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
            )
    args: dict[str, Any]
    for span in step.timeline:
        if span.what in _ACTION_NAMES:
            name, tid = f"{span.what}{span.microbatch} s{span.stage}", _PIPELINE_TRACKS["compute"]
            args = {"stage": span.stage, "microbatch": span.microbatch}
            args["action"] = _ACTION_NAMES[span.what]
        elif span.what == "send":
            name, tid = f"send {span.microbatch} s{span.stage}", _PIPELINE_TRACKS["send"]
            args = {"stage": span.stage, "microbatch": span.microbatch}
        else:
            name, tid = "gradient sync + optimizer", _PIPELINE_TRACKS["after"]
            args = {}
        events.append(
            {
                "name": name,
                "cat": span.what,
                "ph": "X",
                "pid": _PIPELINE_PID + span.rank,
                "tid": tid,
                "ts": span.start_s * 1e6,
                "dur": (span.end_s - span.start_s) * 1e6,
                "args": args,
            }
        )
    return events


def write_chrome_trace(est: Estimate, path: str | Path) -> Path:
    """The trace as JSON at ``path`` (any name; ``torchroof.render.files.write`` picks this
    format for a ``.trace.json`` suffix)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(est)))
    return path

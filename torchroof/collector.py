"""The cyclic garbage collector paused while a step is traced or priced."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: tracing and pricing allocate many small objects
    (op records, tensor layouts, meta tensors) and little cyclic garbage, and each full
    collection rescans the whole model and trace (about a second of a 70B training step's
    three, for no memory back: ``examples/benchmark_trace_speed.py`` shows the peak RSS).
    Reference counting still frees everything not in a cycle; the collector is enabled
    again when the block ends (if it was before)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

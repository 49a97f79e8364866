"""Other libraries' warnings and log lines that torchroof's own calls provoke but that say
nothing to the person running torchroof, silenced narrowly around those calls.

Each line is named by its message and by the logger or module it comes from; a user's own
warnings and log records, and every other line of those libraries, pass as before. Nothing
here changes a global filter for longer than the call it wraps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence

# (message regex, category, module regex) of warnings raised while a workload is traced.
TRACE_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # FSDP2 warns about every module whose output is a view (an embedding, a norm): on meta
    # nothing runs in place on those views, and the warning names internals, once per run.
    (r"FSDP2-wrapped module .* returned a view tensor", UserWarning, r"torch\.distributed"),
)

# logger name -> message regexes of the records dropped from it (and from its children).
TRACE_LOG_LINES: dict[str, tuple[str, ...]] = {
    "transformers": (
        # a training step with activation checkpointing: caching is off either way
        r"`use_cache=True` is incompatible with gradient checkpointing",
        r"[Cc]aching is incompatible with gradient checkpointing",
        # shipped configs leave loss_type unset; the default causal-LM loss is the one priced
        r"`loss_type=.*` was set in the config but it is unrecognized",
        # a model whose fast kernels live in packages not installed: a trace on meta prices
        # the kernel a GPU runtime launches, not the reference implementation's speed
        r"is falling back to its reference PyTorch implementation",
    ),
}

# log lines of a step traced with its sizes as symbols that cannot run on them: torchroof
# traces it at each size instead and says so in a line of its own
SYMBOLIC_LOG_LINES: dict[str, tuple[str, ...]] = {
    "torch._subclasses.fake_tensor": (r"failed while attempting to run meta for",),
}

# log lines printed while torchao is imported on a machine without its CUDA extensions
IMPORT_LOG_LINES: dict[str, tuple[str, ...]] = {
    "torchao": (
        r"Failed to load .*_C",
        r"Skipping import of cpp extensions",
        r"Detected no triton",  # its Triton kernels are not what a trace on meta runs
    ),
    "torch.utils._pytree": (r"is an Enum subclass and is now natively supported",),
}
IMPORT_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r".*", DeprecationWarning, r"torchao"),
    (r".*", FutureWarning, r"torchao"),
)

# what torch's profiler (kineto) prints to the process's stderr at each start and stop
PROFILER_LINES = (r"^USDT:.*\] profiler_(start|stop)\s*$",)


class _DropRecords(logging.Filter):
    """Drops the records of ``loggers`` (or their children) whose message matches."""

    def __init__(self, lines: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.patterns = {name: [re.compile(p) for p in ps] for name, ps in lines.items()}

    def filter(self, record: logging.LogRecord) -> bool:
        for name, patterns in self.patterns.items():
            if record.name == name or record.name.startswith(name + "."):
                try:
                    message = record.getMessage()
                except Exception:  # noqa: BLE001 - a broken record is not ours to judge
                    return True
                return not any(p.search(message) for p in patterns)
        return True


def _handlers_reached(logger: logging.Logger) -> list[logging.Handler]:
    """Every handler a record of ``logger`` (or of a child that propagates) reaches."""
    found: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        found += [h for h in current.handlers if h not in found]
        if not current.propagate:
            break
        current = current.parent
    if not found and logging.lastResort is not None:
        found.append(logging.lastResort)
    return found


@contextlib.contextmanager
def drop_log_lines(lines: dict[str, tuple[str, ...]]) -> Iterator[None]:
    """For the block, drop the records of the named loggers whose message matches: the
    filter sits on each logger (records logged there) and on the handlers its records
    reach (records of its children, e.g. ``transformers.models.llama.modeling_llama``)."""
    drop = _DropRecords(lines)
    attached: list[logging.Filterer] = []
    for name in lines:
        logger = logging.getLogger(name)
        for target in [logger, *_handlers_reached(logger)]:
            if target not in attached:
                target.addFilter(drop)
                attached.append(target)
    try:
        yield
    finally:
        for target in attached:
            target.removeFilter(drop)


@contextlib.contextmanager
def drop_warnings(filters: Sequence[tuple[str, type[Warning], str]]) -> Iterator[None]:
    """For the block, ignore the warnings matching (message, category, module); every other
    warning is shown as the filters outside the block say."""
    with warnings.catch_warnings():
        for message, category, module in filters:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        yield


@contextlib.contextmanager
def quiet_trace() -> Iterator[None]:
    """Around building and tracing a workload: FSDP2's view warnings and transformers'
    notes on caching, checkpointing and the loss type."""
    with drop_warnings(TRACE_WARNINGS), drop_log_lines(TRACE_LOG_LINES):
        yield


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Around importing torchao (directly or through transformers): the CUDA extensions a
    CPU build cannot load and the enums torch no longer needs registered."""
    with drop_warnings(IMPORT_WARNINGS), drop_log_lines(IMPORT_LOG_LINES):
        yield


@contextlib.contextmanager
def drop_native_lines(patterns: Sequence[str] = PROFILER_LINES) -> Iterator[None]:
    """For the block, catch what is written to the process's stderr (file descriptor 2,
    where C++ libraries print) and write back every line that matches none of
    ``patterns`` once the block ends. Python's own ``sys.stderr`` output in the block is
    written back too, in order."""
    compiled = [re.compile(p) for p in patterns]
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 here: nothing to catch
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line
                for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                if not any(p.search(line.rstrip("\n")) for p in compiled)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()

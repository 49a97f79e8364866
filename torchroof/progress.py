"""What long work is doing, while it does it: building the model, tracing the forward and
backward passes and the optimizer step, pricing the ops, fusing them into kernels,
scheduling, and which point of a comparison or sweep is running.

The stages report to the reporter of the current context (:func:`current`), which is
silent unless a caller turned progress on with :func:`reporting` (the CLI does, unless
``--quiet``; the Python API when given ``progress=True``). On a terminal a live reporter
draws a progress bar (tqdm) and leaves one line per finished stage; otherwise it writes
plain lines to stderr::

    torchroof: building the model ... 0.4 s
    torchroof: tracing the forward pass (12,345 ops) ... 3.2 s

A stage ends when the next one begins, when :meth:`Reporter.end` is called, or when the
``with reporter.stage(...)`` block it opened is left.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

PREFIX = "torchroof: "
_REFRESH_EVERY = 64  # counted items at most between two updates of the bar (tqdm throttles)


class Reporter:
    """The silent reporter: every method does nothing. :class:`LiveReporter` writes."""

    live = False

    def begin(self, what: str, total: int | None = None, unit: str = "") -> None:
        """End the open stage, if any, and start ``what`` (``total`` items of ``unit``
        when the count is known in advance)."""

    def advance(self, count: int = 1) -> None:
        """``count`` more items of the open stage done."""

    def end(self, failed: bool = False) -> None:
        """End the open stage, if any (``failed``: it stopped on an error, which says so)."""

    def point(self, index: int, count: int, label: str = "", noun: str = "point") -> None:
        """Point ``index`` (from 1) of ``count`` of a comparison or sweep begins (``noun``:
        what is counted, e.g. ``architecture``)."""

    def close(self, failed: bool = False) -> None:
        """End everything still open."""

    @contextlib.contextmanager
    def stage(self, what: str, total: int | None = None, unit: str = "") -> Iterator[None]:
        """Report the block as one stage; a stage begun inside it ends with it."""
        self.begin(what, total, unit)
        with self.ending():
            yield

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """End whichever stage is open when the block is left (as failed on an error):
        around work whose stages begin one another."""
        try:
            yield
        except BaseException:
            self.end(failed=True)
            raise
        self.end()

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """The items, each counted as done for the open stage."""
        return iter(items)


SILENT = Reporter()
_CURRENT: ContextVar[Reporter] = ContextVar("torchroof_progress", default=SILENT)


def current() -> Reporter:
    """The reporter stages report to here (:data:`SILENT` unless progress is on)."""
    return _CURRENT.get()


@contextlib.contextmanager
def reporting(on: bool = True, stream: TextIO | None = None) -> Iterator[Reporter]:
    """Turn progress on for the block (``on`` False: leave it as it is, so a call made
    inside a command that shows progress keeps showing it). ``stream`` defaults to
    stderr: a bar on a terminal, plain lines otherwise."""
    outer = _CURRENT.get()
    if not on or outer.live:
        yield outer
        return
    reporter = LiveReporter(stream)
    token = _CURRENT.set(reporter)
    try:
        yield reporter
    except BaseException:
        reporter.close(failed=True)
        raise
    else:
        reporter.close()
    finally:
        _CURRENT.reset(token)


def reporter(on: bool = True, stream: TextIO | None = None) -> Reporter:
    """A reporter of one's own, not made current: a script's stages show (``on``) while
    the torchroof calls it makes stay silent."""
    return LiveReporter(stream) if on else SILENT


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """No progress from the block: work inside a stage that reports it as a whole."""
    token = _CURRENT.set(SILENT)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _tqdm() -> Any:
    """tqdm's bar class, imported when a terminal first needs one: a subclass of our own
    without tqdm's monitor thread (it only tunes how often a stalled bar redraws), so a
    pipeline's stages may still be traced in forked processes
    (:mod:`torchroof.parallel.pipeline.workers`); other bars in the process keep theirs."""
    global _BAR
    if _BAR is None:
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

        _BAR = type("TorchroofBar", (tqdm,), {"monitor_interval": 0})
    return _BAR


_BAR: Any = None


def _seconds(elapsed: float) -> str:
    if elapsed < 60:
        return f"{elapsed:.1f} s"
    minutes, seconds = divmod(round(elapsed), 60)
    return f"{minutes} min {seconds:02d} s"


class LiveReporter(Reporter):
    """Writes each finished stage as a line on ``stream`` (stderr when None, looked up at
    each write); on a terminal, also a tqdm bar for the stage under way."""

    live = True

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        target = self.stream
        self.terminal = bool(getattr(target, "isatty", lambda: False)())
        self._what = ""
        self._unit = ""
        self._total: int | None = None
        self._start = 0.0
        self._done = 0
        self._pending = 0
        self._every = _REFRESH_EVERY
        self._bar: Any = None
        self._points: Any = None
        self._indent = ""  # stages inside a point of a comparison or sweep are indented

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    # -- writing ------------------------------------------------------------------------
    def _line(self, text: str) -> None:
        if self.terminal:
            _tqdm().write(PREFIX + text, file=self.stream)
        else:
            print(PREFIX + text, file=self.stream, flush=True)

    def _bar_for(self, what: str, total: int | None, unit: str) -> Any:
        counted = "{desc}: {n_fmt} " + (unit or "items") + " [{elapsed}]"
        bar_format = (
            "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"
            if total
            else (counted if unit else "{desc} [{elapsed}]")
        )
        return _tqdm()(
            total=total,
            desc=PREFIX + what,
            file=self.stream,
            leave=False,
            dynamic_ncols=True,
            bar_format=bar_format,
            mininterval=0.25,
        )

    # -- stages -------------------------------------------------------------------------
    def begin(self, what: str, total: int | None = None, unit: str = "") -> None:
        self.end()
        self._what, self._total, self._unit = what, total, unit
        self._start = time.perf_counter()
        self._done = self._pending = 0
        self._every = min(_REFRESH_EVERY, max(1, (total or 0) // 100)) if total else _REFRESH_EVERY
        if self.terminal:
            self._bar = self._bar_for(what, total, unit)

    def advance(self, count: int = 1) -> None:
        if not self._what:
            return
        self._done += count
        if self._bar is not None:
            self._pending += count
            if self._pending >= self._every:
                self._bar.update(self._pending)
                self._pending = 0

    def end(self, failed: bool = False) -> None:
        if not self._what:
            return
        elapsed = time.perf_counter() - self._start
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        what = self._what
        if self._unit and self._total is None and self._done:
            unit = self._unit.removesuffix("s") if self._done == 1 else self._unit
            what += f" ({self._done:,} {unit})"
        self._what = ""
        if not failed:  # a stage that failed leaves the error to say what happened
            self._line(f"{self._indent}{what} ... {_seconds(elapsed)}")

    def point(self, index: int, count: int, label: str = "", noun: str = "point") -> None:
        self.end()
        text = f"{noun} {index} of {count}" + (f": {label}" if label else "")
        if self.terminal:
            if self._points is None:
                self._points = _tqdm()(
                    total=count,
                    file=self.stream,
                    leave=False,
                    dynamic_ncols=True,
                    bar_format="{desc} |{bar}| [{elapsed}]",
                )
            self._points.n = index - 1
            self._points.set_description_str(PREFIX + text)
        self._line(text)
        self._indent = "  "

    def close(self, failed: bool = False) -> None:
        self.end(failed)
        if self._points is not None:
            self._points.close()
            self._points = None

    def track(self, items: Iterable[T]) -> Iterator[T]:
        return self._counted(items)

    def _counted(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            yield item
            self.advance()

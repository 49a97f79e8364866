"""The streams of a planned step with collectives: its kernels laid out once, timed at each
point.

A step with collectives is timed by laying its kernels on the compute and communication
streams (:mod:`torchroof.timing.streams`), not by adding their times. What the schedule
reads of a kernel besides its time (its stream, the storages it reads and writes, what it
waits for, the link a collective crosses) is the same at every point of a planned step: its
kernels' ops and storages are those of the plan, and each timed kernel's link is its
class's. So the tasks and what each waits for are made once per link layout, and a point
lays the same tasks with its own durations: the schedule, step time and exposed
communication :func:`torchroof.pricing.price.price_trace` gives that point's trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torchroof.kernels.fusion import Kernel
from torchroof.report.estimate import KernelEstimate
from torchroof.timing.streams import COMMUNICATION, Task, schedule, tasks_of, waits


class PlannedStreams:
    """The schedule's view of a planned step's kernels (every one, in launch order),
    with ``order[i]`` the timed kernel the ``i``-th is (its class)."""

    def __init__(self, kernels: Sequence[Kernel], order: Sequence[int]) -> None:
        self._kernels = list(kernels)
        self._order = tuple(order)
        self._laid: dict[tuple[str, ...], tuple[list[Task], list[tuple[int, ...]]]] = {}

    def _tasks(self, timed: Sequence[KernelEstimate]) -> tuple[list[Task], list[tuple[int, ...]]]:
        """The tasks (durations unset) and what each waits for, under the links of the
        timed kernels (made once per layout of links)."""
        links = tuple(timed[place].link for place in self._order)
        laid = self._laid.get(links)
        if laid is None:
            tasks = tasks_of(self._kernels, [0.0] * len(self._kernels), links=list(links))
            laid = self._laid[links] = (tasks, waits(tasks))
        return laid

    def lay(
        self, timed: Sequence[KernelEstimate], overlap: bool
    ) -> tuple[float, list[KernelEstimate], tuple[float, ...]]:
        """(the step time, the timed kernels with each communication kernel's exposed
        time: the mean of its copies', and each launch's own exposed time, in launch
        order: what a fresh estimate adds up) at a point whose distinct kernels are
        ``timed``."""
        tasks, before = self._tasks(timed)
        durations = [timed[place].time_s for place in self._order]
        laid = schedule(tasks, overlap=overlap, before=before, durations=durations)
        exposed = [0.0] * len(timed)
        copies = [0] * len(timed)
        for place, task, charged in zip(self._order, tasks, laid.exposed_s, strict=True):
            if task.stream == COMMUNICATION:
                exposed[place] += charged
                copies[place] += 1
        out = [
            replace(k, stream=COMMUNICATION, exposed_s=exposed[n] / copies[n]) if copies[n] else k
            for n, k in enumerate(timed)
        ]
        each = tuple(
            charged if task.stream == COMMUNICATION else 0.0
            for task, charged in zip(tasks, laid.exposed_s, strict=True)
        )
        return laid.step_time_s, out, each

"""The one-dimensional search the calibration fits use: a coarse grid, then golden-section
search between the grid's best point's neighbours (J. Kiefer, "Sequential minimax search for
a maximum", Proc. AMS 4, 1953)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def minimum(
    f: Callable[[float], float], low: float, high: float, grid: int = 16, steps: int = 36
) -> float:
    """Where ``f`` is least on [low, high]: the best of ``grid`` evenly spaced points, then
    ``steps`` golden-section steps between its neighbours (each shrinks the bracket to 0.618
    of itself: 36 steps to 3e-8; each evaluates ``f`` once, the other point kept from the
    step before)."""
    points = np.linspace(low, high, grid)
    best = int(np.argmin([f(x) for x in points]))
    a, b = float(points[max(best - 1, 0)]), float(points[min(best + 1, grid - 1)])
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:  # the least is in [a, d]: the old c is the new d
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:  # in [c, b]: the old d is the new c
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2

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
    of itself: 36 steps to 3e-8)."""
    points = np.linspace(low, high, grid)
    best = int(np.argmin([f(x) for x in points]))
    a, b = points[max(best - 1, 0)], points[min(best + 1, grid - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(steps):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        a, b = (a, d) if f(c) < f(d) else (c, b)
    return float((a + b) / 2)

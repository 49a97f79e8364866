"""How the text tables write figures: milliseconds, FLOP per byte, ratios and counted nouns
(figures stay in SI units until here)."""

from __future__ import annotations


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def flop_per_byte(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.2f}"


def ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after else "-"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")

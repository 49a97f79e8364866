"""One-line error reports: what the CLI prints and the zoo records for a failure."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` for one-line error reports."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]

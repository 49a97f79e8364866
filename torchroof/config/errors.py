"""One-line error reports: what the CLI prints and the zoo records for a failure."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` for one-line error reports."""
    text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    head = text[0] if text else ""
    if head.endswith(":") and len(text) > 1:  # "... for validator 'x':" then the reason
        head = f"{head} {text[1]}"
    return f"{type(error).__name__}: {head}"[:300]


class OptionError(ValueError):
    """A knob with a value it does not take, or a name no dataclass defines."""


class WorkloadError(OptionError):
    """A workload that cannot be built from the arguments or the model given."""

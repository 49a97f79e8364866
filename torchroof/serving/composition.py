"""What one engine step processes: per sequence, its new tokens and its cached context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchroof.config.errors import OptionError


@dataclass(frozen=True)
class SequenceWork:
    """One sequence's share of an engine step.

    ``new_tokens`` are processed this step (1 for a decode, a chunk or a whole prompt for a
    prefill, k + 1 for a target model verifying k drafted tokens) against ``context``
    tokens already in its KV cache; ``samples`` says whether the step samples a token for
    it (a decode and a prompt's last chunk do, an earlier chunk does not), which decides
    the rows the output projection computes (vLLM computes logits only where it samples);
    ``verifies`` marks a target model checking ``new_tokens - 1`` drafted tokens, whose
    logits it computes at every new token.
    """

    new_tokens: int
    context: int = 0
    samples: bool = True
    verifies: bool = False

    def __post_init__(self) -> None:
        if (
            type(self.new_tokens) is int
            and type(self.context) is int
            and self.new_tokens >= 1
            and self.context >= 0
            and (self.samples or not self.verifies)
        ):
            return  # the engine's own steps: checked at the cost of one line
        for name in ("new_tokens", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionError(f"{name} must be a whole number of tokens, got {value!r}")
        if self.new_tokens < 1:
            raise OptionError(
                f"new_tokens must be at least 1 (a decode processes 1), got {self.new_tokens}"
            )
        if self.context < 0:
            raise OptionError(f"context must be 0 or more cached tokens, got {self.context}")
        if self.verifies and not self.samples:
            raise OptionError("a speculative verification samples: verifies needs samples=True")

    @property
    def logit_rows(self) -> int:
        """Rows of logits the step computes for this sequence."""
        if self.verifies:
            return self.new_tokens
        return 1 if self.samples else 0

    @property
    def length(self) -> int:
        """Tokens in the sequence's cache once the step has written its new tokens."""
        return self.context + self.new_tokens


def decodes(batch: int, context: int) -> tuple[SequenceWork, ...]:
    """``batch`` sequences each decoding one token against ``context`` cached tokens."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise OptionError(f"batch must be a whole number of sequences >= 1, got {batch!r}")
    return (SequenceWork(1, context),) * batch


def prompt(tokens: int, context: int = 0, *, last: bool = True) -> SequenceWork:
    """A prompt's chunk of ``tokens`` on top of ``context`` already prefilled; ``last``:
    the prompt's final chunk, which samples the first output token."""
    return SequenceWork(tokens, context, samples=last)


def check_step(step: Sequence[SequenceWork]) -> None:
    """Refuse an empty step and a member that is not a :class:`SequenceWork`."""
    if not step:
        raise OptionError("an engine step needs at least one sequence")
    for i, work in enumerate(step):
        if not isinstance(work, SequenceWork):
            raise OptionError(
                f"sequence {i} of the step is a {type(work).__name__}, not a SequenceWork"
            )

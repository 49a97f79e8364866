"""Speculative decoding in the engine: a draft model proposes up to k tokens for each
decoding request, and the target model checks them in its next step.

Each step (vLLM's V1 engine, docs.vllm.ai "Speculative Decoding"; Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"):

1. The target model processes, for a decoding request with d drafted tokens, its last
   token and the d drafts (d + 1 new tokens, logits at each: a verification), alongside
   the other requests' prompt chunks and decodes. Of the drafts, the first a are accepted
   and the target samples one more token: a + 1 tokens are produced, and the cache keeps
   the K/V of the last token and the a accepted drafts.
2. The draft model then proposes the next step's drafts for every request that sampled
   and still needs 2 or more tokens: its first pass processes each prompt chunk of the
   step (the draft keeps its own cache of the prompt) with, on a prompt's last chunk, the
   target's first token, and for a decoding request the token the target just sampled
   (and, where every draft was accepted, the last draft, which the draft model never
   processed); each further pass processes the draft it just proposed, one token per
   request, for as many passes as the most drafts any request needs.

Acceptance: a rate alpha (each draft accepted with probability alpha when the ones before
it were), so that position i is accepted with probability alpha^i and a verification of k
drafts yields E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) tokens
(Leviathan et al., eq. 1); or per-position rates as vLLM's metrics report them (the share
of drafts whose position i was accepted: p_1 >= p_2 >= ... >= p_k), E = 1 + sum p_i.
The number accepted in each verification is drawn from these rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from torchroof.config.errors import OptionError
from torchroof.serving.composition import SequenceWork

if TYPE_CHECKING:
    from torchroof.serving.step_time import StepTimer


@dataclass(frozen=True)
class Acceptance:
    """The probability that each drafted position is accepted: ``rates[i]`` is position
    i + 1's (every position before it accepted too), so they never rise."""

    rates: tuple[float, ...]

    @classmethod
    def of(cls, acceptance: float | str | Sequence[float], tokens: int) -> Acceptance:
        """From a rate alpha (position i accepted with probability alpha^i), per-position
        rates (``0.8,0.6,0.4`` or a sequence, one per drafted token), for ``tokens``
        drafts per step."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise OptionError(f"speculative tokens must be a whole number >= 1, got {tokens!r}")
        values = _numbers(acceptance)
        if len(values) == 1:
            rates = tuple(round(values[0] ** (i + 1), 12) for i in range(tokens))
        elif len(values) == tokens:
            rates = tuple(values)
        else:
            raise OptionError(
                f"{len(values)} acceptance rates for {tokens} speculative tokens: give one "
                "rate, or one per drafted position"
            )
        for i, rate in enumerate(rates):
            if not 0 <= rate <= 1:
                raise OptionError(f"acceptance rates are in [0, 1], got {rate} at position {i + 1}")
            if i and rate > rates[i - 1]:
                raise OptionError(
                    f"position {i + 1}'s acceptance {rate} is above position {i}'s "
                    f"{rates[i - 1]}: a position is accepted only when every one before it "
                    "was, so the rates cannot rise"
                )
        return cls(rates)

    @property
    def tokens(self) -> int:
        """k: drafts proposed per step."""
        return len(self.rates)

    def expected_tokens(self, drafts: int | None = None) -> float:
        """Tokens one verification of ``drafts`` (k) drafts yields on average:
        1 + p_1 + ... + p_drafts."""
        return 1 + sum(self.rates[: self.tokens if drafts is None else drafts])

    def draw(self, rng: np.random.Generator, drafts: int) -> int:
        """How many of ``drafts`` drafts one verification accepts: position i is accepted,
        given position i - 1 was, with probability p_i / p_(i-1)."""
        accepted = 0
        before = 1.0
        for rate in self.rates[:drafts]:
            if before <= 0 or rng.random() >= rate / before:
                break
            accepted += 1
            before = rate
        return accepted


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _numbers(acceptance: float | str | Sequence[float]) -> list[float]:
    if isinstance(acceptance, str):
        try:
            return [float(part) for part in acceptance.split(",")]
        except ValueError:
            raise OptionError(
                f"acceptance must be a rate or rates separated by commas, got {acceptance!r}"
            ) from None
    given = list(acceptance) if isinstance(acceptance, (Sequence, np.ndarray)) else [acceptance]
    if not given or not all(_is_number(v) for v in given):
        raise OptionError(f"acceptance must be a rate or a list of rates, got {acceptance!r}")
    values = [float(v) for v in given]  # type: ignore[arg-type]  # numbers, checked
    if not all(math.isfinite(v) for v in values):
        raise OptionError(f"acceptance rates must be numbers in [0, 1], got {acceptance!r}")
    return values


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding as a deployment asks for it: the ``draft`` model (a shipped
    name, a config file or folder, a config or module, as :func:`torchroof.prepare`
    takes; or ``"eagle"`` or ``"mtp"``, a one-layer head on the served model:
    :mod:`torchroof.serving.draft_heads`), the ``acceptance`` of its drafts (a rate, or
    one per position: what the deployment's own metrics report), ``tokens`` (k) proposed
    per step (vLLM's ``num_speculative_tokens``), and the draft's tensor-parallel size
    (the target's when None, as vLLM's ``draft_tensor_parallel_size`` defaults)."""

    draft: Any
    acceptance: float | str | Sequence[float]
    tokens: int = 3
    tp: int | None = None

    def rates(self) -> Acceptance:
        """The acceptance rates per position (a bad rate refused in a line)."""
        if self.tp is not None and (
            isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1
        ):
            raise OptionError(f"the draft's tp must be a whole number >= 1, got {self.tp!r}")
        return Acceptance.of(self.acceptance, self.tokens)


@dataclass(frozen=True)
class Drafter:
    """The draft model's step timer and the acceptance of its drafts."""

    timer: StepTimer
    acceptance: Acceptance
    label: str = ""  # what the draft is called, where not its model's name (a head)
    shared_weights_bytes: int = 0  # per GPU, the head's weights that are the served model's

    @property
    def head(self) -> bool:
        """Whether the draft is a head on the served model (named by its label)."""
        return bool(self.label)

    @property
    def tokens(self) -> int:
        return self.acceptance.tokens

    def time_s(self, passes: Sequence[Sequence[SequenceWork]]) -> float:
        """The draft model's passes of one engine step."""
        return sum(self.timer.time(one).time_s for one in passes)

    def describe(self) -> dict[str, Any]:
        """What a result records of the speculation."""
        draft = self.timer.describe()
        return {
            "draft_model": self.label or draft["model"],
            "draft_tp": draft["tp"],
            "draft_ep": draft["ep"],
            "speculative_tokens": self.tokens,
            "acceptance_per_position": list(self.acceptance.rates),
            "expected_tokens_per_verification": self.acceptance.expected_tokens(),
        }


@dataclass(frozen=True)
class Proposal:
    """One sequence of a target step as the draft model continues it: the tokens its first
    pass processes over ``context``, whether it samples there, and the drafts proposed."""

    new_tokens: int
    context: int
    drafts: int


def draft_passes(proposals: Sequence[Proposal]) -> tuple[tuple[SequenceWork, ...], ...]:
    """The draft model's passes for one engine step: the first processes every proposal's
    new tokens (sampling where it drafts), each further pass one token for each proposal
    with drafts left."""
    if not proposals:
        return ()
    first = tuple(SequenceWork(p.new_tokens, p.context, samples=p.drafts > 0) for p in proposals)
    passes = [first]
    for j in range(2, max(p.drafts for p in proposals) + 1):
        passes.append(
            tuple(
                SequenceWork(1, p.context + p.new_tokens + j - 2)
                for p in proposals
                if p.drafts >= j
            )
        )
    return tuple(passes)


def check_draft(target: StepTimer, draft: StepTimer) -> None:
    """Refuse a draft model whose vocabulary is not the target's (its tokens are the
    target's tokens: vLLM refuses likewise)."""
    ours, theirs = _vocabulary(target), _vocabulary(draft)
    if ours is not None and theirs is not None and ours != theirs:
        raise OptionError(
            f"the draft model's vocabulary has {theirs:,} tokens, the target's {ours:,}: a "
            "draft proposes the target's tokens, so the two must share one vocabulary"
        )


def _vocabulary(timer: StepTimer) -> int | None:
    config = timer.config
    size = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", None)
    return size if isinstance(size, int) else None

"""What one engine step processes: per sequence, its new tokens and its cached context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from torchroof.config.errors import OptionError
from torchroof.counters.attention import causal_fraction


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


Item = tuple[int, int, bool, bool]
"""One sequence's share of a step as the scheduler writes it: (new tokens, context,
samples, verifies), the fields of :class:`SequenceWork` in their order."""


SHORT_QUERY = 16
"""The most new tokens a sequence of a step may have for a latent-attention (MLA) layer to
run it in its absorbed decode kernel, a modelling choice: vLLM's MLA backends send short
queries there (``split_decodes_and_prefills`` up to their ``reorder_batch_threshold``,
1 + k under speculative decoding with k drafts), so verifications and draft passes of up
to 15 drafts run as decodes; prompt chunks longer than 16 tokens take the expanded prefill
path. A short prompt tail beside decodes runs as a decode here (FlashMLA's builder sends
it to the prefill path unless every leading query is as long), and a verification of
more than 15 drafts in the expanded form."""


@dataclass(frozen=True)
class StepMix:
    """What pricing a step reads of its sequences, summed once: the token and logit-row
    counts, its decodes' count and keys, its multi-token chunks' count, rows, keys and
    causal pairs, and what says whether it replays a CUDA graph
    (:meth:`launched_eagerly`). :meth:`of` sums it from a step's sequences; the scheduler
    sums it as it schedules them."""

    sequences: int
    tokens: int  # N: new tokens
    rows: int  # L: logit rows
    longest: int  # the longest sequence's cache once the step has written it
    width: int  # every sequence's new tokens where they are all equal, else 0
    plain_chunks: bool  # a prompt chunk of more than one token (not a verification)
    decodes: int  # sequences of one new token
    decode_keys: int  # their cached and new keys
    chunks: int  # sequences of more than one new token (prompt chunks, verifications)
    chunk_rows: int
    chunk_keys: int
    chunk_pairs: int  # (query, key) pairs their causal kernels keep
    verifications: int
    drafted: int  # drafts the verifications check
    # of the chunks, those of at most SHORT_QUERY new tokens (verifications, a draft head's
    # passes, a prompt's last few tokens): a latent-attention layer decodes them
    shorts: int = 0
    short_rows: int = 0
    short_keys: int = 0
    short_pairs: int = 0

    @classmethod
    def of(cls, items: Sequence[Item]) -> StepMix:
        """The mix of a step's sequences, each an :data:`Item`."""
        tokens = rows = longest = decodes = decode_keys = 0
        chunks = chunk_rows = chunk_keys = chunk_pairs = verifications = drafted = 0
        shorts = short_rows = short_keys = short_pairs = 0
        width = items[0][0] if items else 0
        plain = False
        for new, context, samples, verifies in items:
            length = context + new
            tokens += new
            if length > longest:
                longest = length
            if new != width:
                width = 0
            if verifies:
                verifications += 1
                drafted += new - 1
                rows += new
            else:
                rows += samples
            if new == 1:
                decodes += 1
                decode_keys += length
                continue
            pairs = causal_pairs(new, length)
            chunks += 1
            chunk_rows += new
            chunk_keys += length
            chunk_pairs += pairs
            plain = plain or not verifies
            if new <= SHORT_QUERY:
                shorts += 1
                short_rows += new
                short_keys += length
                short_pairs += pairs
        return cls(
            len(items),
            tokens,
            rows,
            longest,
            width,
            plain,
            decodes,
            decode_keys,
            chunks,
            chunk_rows,
            chunk_keys,
            chunk_pairs,
            verifications,
            drafted,
            shorts,
            short_rows,
            short_keys,
            short_pairs,
        )

    @classmethod
    def decoding(cls, count: int, keys: int, longest: int) -> StepMix:
        """The mix of ``count`` decodes of one new token each, each sampling it: ``keys``
        cached and new keys in all, the longest sequence ``longest`` (a scheduler sums
        these as it schedules them)."""
        return cls(
            sequences=count,
            tokens=count,
            rows=count,
            longest=longest,
            width=1 if count else 0,
            plain_chunks=False,
            decodes=count,
            decode_keys=keys,
            chunks=0,
            chunk_rows=0,
            chunk_keys=0,
            chunk_pairs=0,
            verifications=0,
            drafted=0,
        )

    def __add__(self, other: StepMix) -> StepMix:
        """The mix of both steps' sequences together (as :meth:`of` sums them)."""
        if not other.sequences:
            return self
        if not self.sequences:
            return other
        summed = {name: getattr(self, name) + getattr(other, name) for name in _SUMMED}
        return StepMix(
            **summed,
            longest=max(self.longest, other.longest),
            width=self.width if self.width == other.width else 0,
            plain_chunks=self.plain_chunks or other.plain_chunks,
        )

    def launched_eagerly(self, graphed: int | None = None) -> bool:
        """Whether the step runs without a CUDA graph: one with a prompt chunk, or with
        requests of different numbers of new tokens, or, where ``graphed`` is given, of
        another number than it. vLLM's V1 engine replays a full graph only for a uniform
        decode batch: every request 1 token, or 1 + k with k speculative tokens
        (docs.vllm.ai, "CUDA Graphs")."""
        first = self.width if graphed is None else graphed
        return self.plain_chunks or not self.width or first != self.width


_SUMMED = tuple(
    f.name for f in fields(StepMix) if f.name not in ("longest", "width", "plain_chunks")
)


def items_of(step: Sequence[SequenceWork]) -> list[Item]:
    """``step``'s sequences as :data:`Item` tuples."""
    return [(w.new_tokens, w.context, w.samples, w.verifies) for w in step]


def causal_pairs(new: int, keys: int) -> int:
    """(query, key) pairs a causal kernel computes for a sequence of ``new`` tokens over
    ``keys`` keys (its cached ones and the new): each new token attends to every cached key
    and the new ones up to itself."""
    return round(causal_fraction(new, keys, aligned_to_end=True) * new * keys)

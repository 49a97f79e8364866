"""A vLLM-style continuous-batching scheduler over paged KV blocks, stepped by the caller.

Each step (Kwon et al. 2023, PagedAttention; vLLM's V1 scheduler, docs.vllm.ai "Engine
Arguments" for the knobs and their defaults):

1. The running requests first, oldest first: each gets the tokens it still has to compute
   (1 for a decode; the rest of its prompt, up to the step's remaining token budget, with
   chunked prefill). The KV blocks those tokens need are allocated; when none are free, the
   newest running request is preempted, its blocks freed and its cache dropped, and it goes
   back to the front of the queue to compute its prompt and the tokens it generated again
   (vLLM's recompute preemption).
2. Then waiting requests, first come first served, while the token budget, ``max_num_seqs``
   and the free blocks allow (none are admitted in a step that preempted).

Without chunked prefill (vLLM's earlier scheduler) a step is either whole prompts only, as
many as the budget, the blocks and ``max_num_seqs`` admit, or, when none can start, one
decode for every running request; every prompt must then fit the budget.

A request samples a token when a step computes the last of its pending tokens: the end of
its prompt (its first token), then one per decode, until it has ``output_len`` tokens.

With speculative decoding (:mod:`torchroof.serving.speculative`) a decoding request's step
also verifies the drafts proposed for it in the step before (they count against the token
budget and take KV slots, as vLLM's V1 scheduler counts them), and produces the accepted
drafts and one token more.

With swap preemption (vLLM's earlier engine, ``preemption_mode="swap"``) a preempted
request's KV blocks are copied to host memory instead (while ``swap_space`` holds them;
else it is recomputed) and copied back before it runs again: swapped requests resume
before any waiting request is admitted, and the copies cost their bytes over the GPU's
host link in the step that makes them.

With prefix caching (on by default, as in vLLM's V1 engine) a request admitted from the
queue starts with the blocks of its group's prefix that are cached
(:mod:`torchroof.serving.prefix_cache`) and computes the rest of its prompt.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import TYPE_CHECKING

from torchroof.config.errors import OptionError
from torchroof.serving.composition import Item, SequenceWork, StepMix
from torchroof.serving.prefix_cache import BlockKey, PrefixCache
from torchroof.serving.requests import Request
from torchroof.serving.speculative import Acceptance, Proposal, draft_passes

if TYPE_CHECKING:
    import numpy as np


PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class EngineConfig:
    """The scheduler's knobs, with vLLM's defaults (docs.vllm.ai, "Engine Arguments")."""

    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 8192  # new tokens per step
    chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9  # the share of HBM the engine takes
    num_gpu_blocks_override: int | None = None  # KV blocks, whatever memory is left
    prefix_caching: bool = True  # cached prompt prefixes found again (vLLM V1's default)
    preemption: str = "recompute"  # or "swap" (vLLM's earlier preemption_mode)
    swap_space_gib: float = 4.0  # host memory per GPU for swapped KV (vLLM's swap_space)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(f"{name} must be a whole number >= 1, got {value!r}")
        blocks = self.num_gpu_blocks_override
        if blocks is not None and (
            isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1
        ):
            raise OptionError(
                f"num_gpu_blocks_override must be a whole number >= 1, got {blocks!r}"
            )
        if self.preemption not in PREEMPTION_MODES:
            raise OptionError(
                f"unknown preemption mode {self.preemption!r} (known: "
                f"{', '.join(PREEMPTION_MODES)})"
            )
        if not (self.swap_space_gib >= 0 and math.isfinite(self.swap_space_gib)):
            raise OptionError(f"swap_space_gib must be 0 or more GiB, got {self.swap_space_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise OptionError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(eq=False, slots=True)
class Running:
    """A request's state in the engine: tokens cached, tokens sampled, blocks held, and
    the times it arrived, produced its tokens and was preempted."""

    request: Request
    arrival_s: float
    computed: int = 0  # tokens whose K and V are cached
    generated: int = 0  # output tokens sampled
    blocks: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    admitted_s: float | None = None  # first scheduled
    preemptions: int = 0
    drafts: int = 0  # tokens the draft model proposed for its next step
    shared: list[BlockKey] = field(default_factory=list)  # cached prefix blocks it uses
    prefix_blocks: int = 0  # blocks of its prefix it has found or filled
    swapped_blocks: int = 0  # its KV blocks in host memory while swapped out
    cached_tokens: int = 0  # prompt tokens found cached when first admitted
    gaps: list[float] = field(default_factory=list)  # between successive tokens

    @property
    def pending(self) -> int:
        """Tokens to compute before its next sample: its prompt and every token it
        generated but the last, less what is cached."""
        return self.request.input_len + self.generated - self.computed

    @property
    def done(self) -> bool:
        return self.generated >= self.request.output_len

    @property
    def held(self) -> int:
        """KV blocks it holds: its own and the cached prefix blocks it shares."""
        return self.blocks + len(self.shared)

    @property
    def decoding(self) -> bool:
        """Whether its next step is a decode: a token sampled, and nothing else pending."""
        return self.generated > 0 and self.pending == 1


@dataclass(frozen=True)
class ScheduledStep:
    """What one step computes: per request, its new tokens (``items`` in the same order,
    summed in ``mix``), and with speculative decoding the drafts each verification
    accepts, the drafts proposed for the next step and the draft model's passes."""

    requests: tuple[Running, ...]
    items: tuple[Item, ...]
    mix: StepMix
    prefill_tokens: int  # new tokens of prompts (first computed, or again after a preemption)
    preempted: int  # requests preempted to make room for this step
    blocks_used: int  # after the step's allocation
    queried_tokens: int = 0  # prompt tokens of the requests admitted, looked up in the cache
    cached_tokens: int = 0  # of which found cached
    swapped_out: int = 0  # requests whose KV went to host memory to make room for it
    swapped_in: int = 0  # requests whose KV came back from host memory for it
    swap_blocks: int = 0  # KV blocks those copies move, either way
    accepted: tuple[int, ...] = ()  # per request: drafts accepted (0 without a verification)
    expected_accepted: float = 0.0  # the mean of the drafts accepted, from the rates
    proposed: tuple[int, ...] = ()  # per request: drafts proposed for its next step
    draft: tuple[tuple[SequenceWork, ...], ...] = ()  # the draft model's passes

    @functools.cached_property
    def work(self) -> tuple[SequenceWork, ...]:
        """Each request's share of the step, in ``requests``' order."""
        return tuple(SequenceWork(*item) for item in self.items)


class Scheduler:
    """The waiting queue, the running requests and ``kv_blocks`` KV blocks of one engine."""

    def __init__(
        self,
        config: EngineConfig,
        kv_blocks: int,
        acceptance: Acceptance | None = None,
        rng: np.random.Generator | None = None,
        host_blocks: int = 0,
        head: bool = False,
    ) -> None:
        if acceptance is not None and rng is None:
            raise OptionError("speculative decoding draws its acceptances: give an rng")
        self.config = config
        self.acceptance = acceptance
        # a draft head's first pass runs over every token the request verified (vLLM's
        # padded drafter batch), a draft model's over the tokens it has not seen
        self.head = head
        self.rng = rng
        # slots a running request keeps for the drafts the draft model writes (vLLM's
        # num_lookahead_tokens: k with a draft model)
        self.lookahead = acceptance.tokens if acceptance is not None else 0
        self.kv_blocks = kv_blocks
        self.free_blocks = kv_blocks
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.preemptions = 0
        self.cache = PrefixCache(kv_blocks) if config.prefix_caching else None
        self._queried = self._found = 0  # this step's lookups
        self.swapped: deque[Running] = deque()
        self.host_free = host_blocks  # host memory for swapped KV, in blocks
        self._swaps = [0, 0, 0]  # this step's swapped out, swapped in, blocks copied

    def submit(self, state: Running) -> None:
        self.waiting.append(state)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, now: float) -> ScheduledStep:
        """The next step's requests and tokens (their blocks allocated)."""
        budget = self.config.max_num_batched_tokens
        preempted_before = self.preemptions
        self._queried = self._found = 0
        self._swaps = [0, 0, 0]
        if not self.config.chunked_prefill and not self.swapped:
            prompts = self._admit(budget, now, whole=True)
            if prompts:
                return self._step([], [], StepMix.of([]), 0, prompts, preempted_before)
        states, items, mix, prefill, left = self._running(budget)
        chosen = []
        if self.preemptions == preempted_before:  # swapped requests first, then new ones
            chosen = self._swap_in(left)
            left -= sum(n for _, n in chosen)
        if self.config.chunked_prefill and self.preemptions == preempted_before:
            chosen += self._admit(left, now, whole=False) if not self.swapped else []
        return self._step(states, items, mix, prefill, chosen, preempted_before)

    def complete(self, step: ScheduledStep, now: float) -> list[Running]:
        """Advance ``step``'s requests by the tokens it computed at time ``now``; the
        requests it finished, their blocks freed."""
        finished = []
        count = len(step.items)
        accepted = step.accepted or repeat(0, count)
        proposed = step.proposed or repeat(0, count)
        prefixes = self.cache is not None
        for state, (new, _, samples, verifies), kept, drafts in zip(
            step.requests, step.items, accepted, proposed, strict=True
        ):
            state.computed += kept + 1 if verifies else new
            state.drafts = drafts
            if prefixes and state.request.prefix_group is not None:
                self._cache_prefix(state)
            if not samples:
                continue
            state.generated += kept + 1
            if state.first_token_s is None:
                state.first_token_s = now
            else:
                state.gaps.append(now - (state.last_token_s or now))
            state.last_token_s = now
            if state.generated >= state.request.output_len:  # done
                state.finish_s = now
                self.running.remove(state)
                self._free(state)
                finished.append(state)
        return finished

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _running(self, budget: int) -> tuple[list[Running], list[Item], StepMix, int, int]:
        """The running requests scheduled, oldest first, with each one's :data:`Item`
        (its tokens first), their :class:`StepMix`, the prompt tokens among them and the
        budget they leave."""
        chosen: list[Running] = []
        items: list[Item] = []
        others: list[Item] = []  # every item but the one-token decodes' (summed here)
        prefill = decodes = keys = longest = 0
        size, lookahead = self.config.block_size, self.lookahead
        choose, itemise = chosen.append, items.append
        # a preemption removes requests after this one (the newest first), or this one and
        # ends the loop: the iteration never skips one
        for state in self.running:
            if budget <= 0:
                break
            computed, generated = state.computed, state.generated
            pending = state.request.input_len + generated - computed
            decoding = generated > 0 and pending == 1
            if decoding:  # with the drafts proposed for it
                pending += state.drafts
            tokens = pending if pending < budget else budget
            need = -(-(computed + tokens + lookahead) // size) - state.blocks - len(state.shared)
            if need > 0:
                while need > self.free_blocks and self.running[-1] is not state:
                    self._preempt(self.running[-1])
                if need > self.free_blocks:  # the request itself is the newest: it waits
                    self._preempt(state)
                    break
                self._allocate(state, need)
            choose(state)
            item = _item(tokens, computed, pending, decoding)
            itemise(item)
            if decoding and tokens == 1:
                decodes += 1
                keys += computed + 1
                if computed >= longest:
                    longest = computed + 1
            else:
                others.append(item)
                if not decoding:
                    prefill += tokens
            budget -= tokens
        mix = StepMix.decoding(decodes, keys, longest) + StepMix.of(others)
        return chosen, items, mix, prefill, budget

    def _admit(self, budget: int, now: float, whole: bool) -> list[tuple[Running, int]]:
        chosen: list[tuple[Running, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            state = self.waiting[0]
            found = self._lookup(state)
            cached = len(found) * self.config.block_size
            pending = state.pending - cached
            tokens = pending if whole else min(pending, budget)
            if tokens > budget:
                break
            # the k draft slots too once anything is computed (a prefix-cache hit, or a
            # request back from preemption that decodes at once), as a running request holds
            # them; a wider rule than vLLM v1's, which gives num_lookahead_tokens to a
            # waiting request only where num_computed_tokens > 0 before its cache hit
            ahead = self.lookahead if state.computed + cached > 0 else 0
            need = self.blocks_for(state.computed + cached + tokens + ahead)
            need -= state.held + len(found)
            reclaimed = self.cache.reclaimed(found) if self.cache is not None else 0
            if need + reclaimed > self.free_blocks:
                break
            self.waiting.popleft()
            self.running.append(state)
            if state.admitted_s is None:
                state.admitted_s = now
            if not state.preemptions:  # as vLLM counts queries: new requests' prompts
                state.cached_tokens = cached
                self._queried += state.request.input_len
                self._found += cached
            if found:
                assert self.cache is not None
                self.cache.use(found)
                self.free_blocks -= reclaimed
                state.shared, state.computed = found, state.computed + cached
                state.prefix_blocks = len(found)
            self._allocate(state, need)
            chosen.append((state, tokens))
            budget -= tokens
        return chosen

    def _allocate(self, state: Running, blocks: int) -> None:
        """Give ``state`` ``blocks`` new blocks, from the free queue's head."""
        if self.cache is not None:
            self.cache.take(blocks)
        self.free_blocks -= blocks
        state.blocks += blocks

    def _free(self, state: Running) -> None:
        """Free ``state``'s own blocks, then end its use of cached prefix blocks."""
        self.free_blocks += state.blocks
        if self.cache is not None:
            self.cache.free_own(state.blocks)
        if state.shared:
            assert self.cache is not None
            self.free_blocks += self.cache.release(state.shared)
        state.blocks, state.shared = 0, []

    def _lookup(self, state: Running) -> list[BlockKey]:
        """The cached blocks of a queued request's prefix it can start from: whole blocks,
        and never its whole prompt (its last token is computed for its logits)."""
        request = state.request
        if self.cache is None or request.prefix_group is None or state.computed:
            return []
        size = self.config.block_size
        blocks = min(request.prefix_len // size, (state.pending - 1) // size)
        return self.cache.found(request.prefix_group, blocks)

    def _cache_prefix(self, state: Running) -> None:
        """Cache the prefix blocks ``state`` has filled: each becomes shared unless another
        request's copy is cached already."""
        request = state.request
        if self.cache is None or request.prefix_group is None:
            return
        full = min(state.computed, request.prefix_len) // self.config.block_size
        for i in range(state.prefix_blocks, full):
            if self.cache.add((request.prefix_group, i)):
                state.shared.append((request.prefix_group, i))
                state.blocks -= 1
        state.prefix_blocks = max(state.prefix_blocks, full)

    def _preempt(self, state: Running) -> None:
        self.running.remove(state)
        state.preemptions += 1
        self.preemptions += 1
        held = state.held
        if self.config.preemption == "swap" and state.computed and held <= self.host_free:
            self._free(state)  # its blocks, copied to host memory
            self.host_free -= held
            state.swapped_blocks = held
            self._swaps[0] += 1
            self._swaps[2] += held
            self.swapped.append(state)
            return
        self._free(state)
        state.computed = state.drafts = state.prefix_blocks = 0
        self.queue_after_holders(state)

    def queue_after_holders(self, state: Running) -> None:
        """``state`` first in the queue, after any request that holds its blocks already
        (one whose prompt a disaggregated prefill instance sent): those need none to
        start."""
        at = next((i for i, s in enumerate(self.waiting) if not s.held), len(self.waiting))
        self.waiting.insert(at, state)

    def _swap_in(self, budget: int) -> list[tuple[Running, int]]:
        """Swapped requests back, oldest swapped first, while the budget, ``max_num_seqs``
        and the free blocks allow: their blocks copied back and their next tokens."""
        chosen: list[tuple[Running, int]] = []
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            state = self.swapped[0]
            tokens = min(state.pending + (state.drafts if state.decoding else 0), budget)
            need = self.blocks_for(state.computed + tokens + self.lookahead)
            if need > self.free_blocks:
                break
            self.swapped.popleft()
            self.running.append(state)
            self.host_free += state.swapped_blocks
            self._swaps[1] += 1
            self._swaps[2] += state.swapped_blocks
            state.swapped_blocks = 0
            self._allocate(state, need)
            chosen.append((state, tokens))
            budget -= tokens
        return chosen

    def _step(
        self,
        states: list[Running],
        items: list[Item],
        mix: StepMix,
        prefill: int,
        chosen: list[tuple[Running, int]],
        preempted_before: int,
    ) -> ScheduledStep:
        """The step of the running requests ``states``, their ``items``, ``mix`` and
        ``prefill`` tokens worked out as they were scheduled (:meth:`_running`), and of
        the requests ``chosen`` with their tokens after them (swapped in, admitted), theirs
        here."""
        running = len(items)
        append = items.append
        for state, tokens in chosen:
            computed, generated = state.computed, state.generated
            pending = state.request.input_len + generated - computed
            decoding = generated > 0 and pending == 1
            append(_item(tokens, computed, pending, decoding))
            if not decoding:
                prefill += tokens
        step = ScheduledStep(
            (*states, *[state for state, _ in chosen]),
            tuple(items),
            mix + StepMix.of(items[running:]),
            prefill,
            self.preemptions - preempted_before,
            self.kv_blocks - self.free_blocks,
            queried_tokens=self._queried,
            cached_tokens=self._found,
            swapped_out=self._swaps[0],
            swapped_in=self._swaps[1],
            swap_blocks=self._swaps[2],
        )
        return self._speculate(step) if self.acceptance is not None else step

    def _speculate(self, step: ScheduledStep) -> ScheduledStep:
        """``step`` with its verifications' acceptances drawn, and the draft model's
        proposals for the next step (:mod:`torchroof.serving.speculative`)."""
        assert self.acceptance is not None and self.rng is not None
        accepted, proposals, expected = [], [], 0.0
        for state, (new, context, samples, verifies) in zip(step.requests, step.items, strict=True):
            kept = self.acceptance.draw(self.rng, new - 1) if verifies else 0
            if verifies:
                expected += self.acceptance.expected_tokens(new - 1) - 1
            accepted.append(kept)
            produced = kept + 1 if samples else 0
            left = state.request.output_len - state.generated - produced
            drafts = min(self.acceptance.tokens, left - 1) if samples else 0
            drafts = max(0, drafts)
            if not state.decoding:  # a prompt chunk, and the first token where it samples
                proposals.append(Proposal(new + int(drafts > 0), context, drafts))
            elif drafts and self.head:  # the verified tokens, on the served model's states
                proposals.append(Proposal(new, context, drafts))
            elif drafts:  # the token sampled, and the last draft where all were accepted
                cached = state.computed + (kept + 1 if verifies else 1)
                unseen = 2 if verifies and kept == state.drafts else 1
                proposals.append(Proposal(unseen, cached - (unseen - 1), drafts))
            else:
                proposals.append(Proposal(0, 0, 0))
        return replace(
            step,
            accepted=tuple(accepted),
            expected_accepted=expected,
            proposed=tuple(p.drafts for p in proposals),
            draft=draft_passes([p for p in proposals if p.new_tokens]),
        )


def _item(tokens: int, computed: int, pending: int, decoding: bool) -> Item:
    """A scheduled request's :data:`Item`: a decode's new tokens are checked drafts past the
    first, if any; a prompt's chunk samples where it reaches the ``pending`` tokens."""
    if decoding:
        return (tokens, computed, True, tokens > 1)
    return (tokens, computed, tokens >= pending, False)

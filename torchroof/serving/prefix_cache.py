"""Prefix caching: KV blocks of prompt prefixes that requests share, kept after their
requests end until the space is needed.

vLLM's automatic prefix caching (docs.vllm.ai, "Automatic Prefix Caching"):

- a full block of a prompt is known by its tokens and every token before it (a chain of
  hashes), so a later prompt that starts with the same tokens finds the same blocks, from
  its first block on, up to the first block not cached;
- a request found in the cache starts with those tokens computed, but always computes at
  least its last token (its logits are needed), so at most ``(prompt - 1) // block``
  blocks are found;
- a cached block in use by running requests is shared, not copied; when the last of them
  ends it stays cached but free;
- free blocks wait in one queue: those never used first, then every block freed, in the
  order freed, cached or not (a request's blocks are freed last block first, so its own
  blocks go before its prefix's, and a prefix's tail before its head); a request that
  needs a block takes the queue's first, evicting it from the cache if it was cached.

Requests here share prefixes by group (:class:`~torchroof.serving.requests.Request`'s
``prefix_group`` and ``prefix_len``): the first ``prefix_len`` tokens of every prompt of a
group are the same tokens, so block i of a group's prefix is one block whichever request
computed it. Blocks of a prompt past its group's prefix are its own and are never found
again: freed, they wait in the queue under a number of their own.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

BlockKey = tuple[int, int]  # (prefix group, block index within the prefix)


class PrefixCache:
    """An engine's cached prefix blocks, those in use with their number of users, and its
    free blocks as one queue: ``never_used`` of them first, then ``queue``, oldest freed
    first. A cached block is queued as its :data:`BlockKey`; a request's own blocks, freed
    together, as one entry (a number of its own) holding how many they are: they are never
    found again, so only their count and their place in the queue matter."""

    def __init__(self, blocks: int) -> None:
        self.users: dict[BlockKey, int] = {}
        self.never_used = blocks
        # each entry -> the free blocks it holds (1 for a cached block)
        self.queue: OrderedDict[BlockKey | int, int] = OrderedDict()
        self._own = itertools.count()

    @property
    def evictable(self) -> list[BlockKey]:
        """The cached blocks free, oldest freed first."""
        return [key for key in self.queue if isinstance(key, tuple)]

    def found(self, group: int, blocks: int) -> list[BlockKey]:
        """The group's cached prefix blocks from the first on, at most ``blocks``."""
        keys = []
        for i in range(blocks):
            if (group, i) not in self.users:
                break
            keys.append((group, i))
        return keys

    def reclaimed(self, keys: list[BlockKey]) -> int:
        """How many of ``keys`` are free (cached, unused): using them takes free blocks."""
        return sum(1 for key in keys if self.users[key] == 0)

    def use(self, keys: list[BlockKey]) -> None:
        """A request starts using cached ``keys``."""
        for key in keys:
            if self.users[key] == 0:
                del self.queue[key]
            self.users[key] += 1

    def release(self, keys: list[BlockKey]) -> int:
        """A request ends or is preempted: its use of ``keys`` ends, last block first; the
        number that became free."""
        freed = 0
        for key in reversed(keys):
            self.users[key] -= 1
            if self.users[key] == 0:
                self.queue[key] = 1
                freed += 1
        return freed

    def free_own(self, blocks: int) -> None:
        """A request's own ``blocks`` (none of them a cached prefix's) join the queue."""
        if blocks > 0:
            self.queue[next(self._own)] = blocks

    def add(self, key: BlockKey) -> bool:
        """A request filled ``key`` with its prompt: cached (in use by it) unless another
        request's copy is; whether it was added."""
        if key in self.users:
            return False
        self.users[key] = 1
        return True

    def take(self, count: int) -> None:
        """``count`` free blocks for a request: never used ones first, then the queue's
        first, a cached one evicted from the cache."""
        fresh = min(count, self.never_used)
        self.never_used -= fresh
        left = count - fresh
        while left > 0:
            key = next(iter(self.queue))  # the scheduler takes no more than are free
            held = self.queue[key]
            if held > left:  # part of a request's own blocks: the rest stay in place
                self.queue[key] = held - left
                return
            del self.queue[key]
            left -= held
            if isinstance(key, tuple):
                del self.users[key]

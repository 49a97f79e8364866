"""Prefix caching: KV blocks of prompt prefixes that requests share, kept after their
requests end until the space is needed.

vLLM's automatic prefix caching (docs.vllm.ai, design "Automatic Prefix Caching"):

- a full block of a prompt is known by its tokens and every token before it (a chain of
  hashes), so a later prompt that starts with the same tokens finds the same blocks, from
  its first block on, up to the first block not cached;
- a request found in the cache starts with those tokens computed, but always computes at
  least its last token (its logits are needed), so at most ``(prompt - 1) // block``
  blocks are found;
- a cached block in use by running requests is shared, not copied; when the last of them
  ends it stays cached but free: a request that needs a new block takes an empty one, and
  when none is left evicts the cached block freed longest ago (its requests' blocks are
  freed last block first, so a prefix's tail goes before its head).

Requests here share prefixes by group (:class:`~torchroof.serving.requests.Request`'s
``prefix_group`` and ``prefix_len``): the first ``prefix_len`` tokens of every prompt of a
group are the same tokens, so block i of a group's prefix is one block whichever request
computed it. Blocks of a prompt past its group's prefix are its own and are never found
again (freed blocks that held them are the empty ones here).
"""

from __future__ import annotations

from collections import OrderedDict

BlockKey = tuple[int, int]  # (prefix group, block index within the prefix)


class PrefixCache:
    """An engine's cached prefix blocks: those in use (with their number of users) and
    those free but cached, oldest freed first."""

    def __init__(self) -> None:
        self.users: dict[BlockKey, int] = {}
        self.evictable: OrderedDict[BlockKey, None] = OrderedDict()

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
                del self.evictable[key]
            self.users[key] += 1

    def release(self, keys: list[BlockKey]) -> int:
        """A request ends or is preempted: its use of ``keys`` ends, last block first; the
        number that became free."""
        freed = 0
        for key in reversed(keys):
            self.users[key] -= 1
            if self.users[key] == 0:
                self.evictable[key] = None
                freed += 1
        return freed

    def add(self, key: BlockKey) -> bool:
        """A request filled ``key`` with its prompt: cached (in use by it) unless another
        request's copy is; whether it was added."""
        if key in self.users:
            return False
        self.users[key] = 1
        return True

    def evict(self, count: int) -> None:
        """Drop the ``count`` cached free blocks freed longest ago."""
        for _ in range(count):
            key, _ = self.evictable.popitem(last=False)
            del self.users[key]

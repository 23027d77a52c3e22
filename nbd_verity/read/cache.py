"""Verified hash blocks, kept in memory so they are never re-read or re-checked.

Policy (after dm-bufio's hash_verified flag and nbdkit's cache filter): only a block whose
digest matched its slot in an already verified parent (or the root) is ever stored.
Every cached block of every level counts against one byte budget (`cache-size`), so memory
is bounded whatever the device size. Upper levels are preferred: each level has its own
LRU, and when the budget is full the least recently used block of the lowest level that
holds any is evicted first (level 0 before level 1, and so on). Upper levels are small and
every read needs them (a 1 TiB device with 4 KiB blocks and SHA-256 has 64 MiB of level 1
and 256 KiB above), so keeping them keeps the cost of a level-0 miss at one hash read. On
a device whose upper levels alone exceed the budget (a 64 TiB one has 4 GiB of level 1),
level 0 is not cached at all and level 1 churns: slower, never larger.

The budget counts the hash bytes; each entry also costs about 100 bytes of Python objects
(a bytes header and a dictionary slot), 2.5% of a 4 KiB block (docs/server.md, "Limits").

The lock serialises the writers (put, which inserts and evicts); it is held only for
dictionary operations, never during I/O or hashing. A look-up takes no lock: each
dictionary operation is atomic under the GIL, and a block evicted between the look-up
and its move to the LRU's end was verified all the same (the move is then skipped).
Hits and misses are counted per thread (tally.py), without a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .tally import Tally

DEFAULT_CACHE_SIZE = 64 << 20  # bytes of hash blocks, all levels (8 GiB of data at 4K/SHA-256)


class HashBlockCache:
    """Verified hash blocks by absolute block number, all levels in one byte budget."""

    def __init__(self, hash_block_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.block_size = hash_block_size
        self.capacity = max(1, cache_size // hash_block_size)  # blocks kept, all levels
        self._levels: list[OrderedDict[int, bytes]] = []  # index = tree level
        self._level_of: dict[int, int] = {}  # block -> its level
        self._lock = threading.Lock()
        self.evictions = 0  # under the lock
        self._tally = Tally(2)  # hits, misses

    def get(self, block: int) -> bytes | None:
        """A verified block, or None; counts a hit or a miss (no lock, see above)."""
        level = self._level_of.get(block)
        data = None if level is None else self._levels[level].get(block)
        if data is not None:
            try:  # noqa: SIM105 - contextlib.suppress costs a context manager per look-up
                self._levels[level].move_to_end(block)
            except KeyError:  # evicted meanwhile by another thread's put
                pass
        self._tally.row()[data is None] += 1
        return data

    def level(self, level: int) -> OrderedDict[int, bytes]:
        """The LRU of one level, blocks by absolute number (made if absent, never
        replaced): serve/fastpath.py looks leaves up in it directly, as get() does."""
        with self._lock:
            while len(self._levels) <= level:
                self._levels.append(OrderedDict())
            return self._levels[level]

    def row(self) -> list[int]:
        """This thread's counters: hits at 0, misses at 1 (serve/fastpath.py)."""
        return self._tally.row()

    @property
    def hits(self) -> int:
        return self._tally.totals()[0]

    @property
    def misses(self) -> int:
        return self._tally.totals()[1]

    def contains(self, block: int) -> bool:
        """Whether a block is cached, without touching the LRU order or the counters."""
        return block in self._level_of

    def peek(self, block: int) -> bytes | None:
        """A verified block without touching the LRU order or the counters; None if absent."""
        level = self._level_of.get(block)
        return None if level is None else self._levels[level].get(block)

    def put(self, block: int, level: int, data: bytes) -> None:
        """Store a block that has just been verified, evicting lower levels first."""
        with self._lock:
            while len(self._levels) <= level:
                self._levels.append(OrderedDict())
            if block not in self._level_of:
                self._level_of[block] = level
            self._levels[level][block] = data
            self._levels[level].move_to_end(block)
            while len(self._level_of) > self.capacity:
                self._evict_one()

    def resize(self, cache_size: int) -> None:
        """A new budget (a many-export server shares one among its exports): evict down
        to it now, lowest levels first, as put() would."""
        with self._lock:
            self.capacity = max(1, cache_size // self.block_size)
            while len(self._level_of) > self.capacity:
                self._evict_one()

    def _evict_one(self) -> None:
        """Drop the least recently used block of the lowest level holding any (locked)."""
        for blocks in self._levels:
            if blocks:
                victim, _ = blocks.popitem(last=False)
                del self._level_of[victim]
                self.evictions += 1
                return

    def reset_counters(self) -> None:
        with self._lock:
            self.evictions = 0
        self._tally.reset()

    def __len__(self) -> int:
        return len(self._level_of)

"""Verified hash blocks, kept in memory so they are never re-read or re-checked.

Policy (after dm-bufio's hash_verified flag and nbdkit's cache filter): only a block whose
digest matched its slot in an already verified parent (or the root) is ever stored.
Levels above 0 are small (a 1 TiB device with 4 KiB blocks and SHA-256 has 64 MiB of
level 1) and are kept for the life of the server. Level 0 holds over 99% of the tree and
lives in an LRU bounded by a byte budget, so memory does not grow with the device.

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

DEFAULT_CACHE_SIZE = 64 << 20  # bytes of level-0 blocks (covers 8 GiB of data at 4K/SHA-256)


class HashBlockCache:
    """Verified hash blocks by absolute block number; level 0 in a bounded LRU."""

    def __init__(self, hash_block_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.capacity = max(1, cache_size // hash_block_size)  # level-0 blocks kept
        self._upper: dict[int, bytes] = {}
        self._leaves: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._tally = Tally(2)  # hits, misses

    def get(self, block: int) -> bytes | None:
        """A verified block, or None; counts a hit or a miss."""
        data = self._leaves.get(block)  # level 0 first: nearly every look-up is a leaf
        if data is not None:
            try:  # noqa: SIM105 - contextlib.suppress costs a context manager per look-up
                self._leaves.move_to_end(block)
            except KeyError:  # evicted meanwhile by another thread's put
                pass
        else:
            data = self._upper.get(block)
        self._tally.row()[data is None] += 1
        return data

    @property
    def hits(self) -> int:
        return self._tally.totals()[0]

    @property
    def misses(self) -> int:
        return self._tally.totals()[1]

    def contains(self, block: int) -> bool:
        """Whether a block is cached, without touching the LRU order or the counters."""
        return block in self._upper or block in self._leaves

    def put(self, block: int, level: int, data: bytes) -> None:
        """Store a block that has just been verified."""
        with self._lock:
            if level > 0:
                self._upper[block] = data
                return
            self._leaves[block] = data
            self._leaves.move_to_end(block)
            while len(self._leaves) > self.capacity:
                self._leaves.popitem(last=False)

    def reset_counters(self) -> None:
        self._tally.reset()

    def __len__(self) -> int:
        return len(self._upper) + len(self._leaves)

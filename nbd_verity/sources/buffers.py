"""Read buffers kept for reuse, per length, for the reads that land in a buffer of their
own before their bytes are copied to the request (sources/ahead.py's staged reads,
sources/pipe.py's reads on a shared connection). A new bytearray of 128 KiB or more is
fresh pages from the kernel (glibc maps it), zeroed and faulted in at the first write:
for a 128 KiB read from an NBD upstream that cost more than the read itself.
Locking: one lock, held only to take or give back a buffer.
"""

from __future__ import annotations

import threading

KEEP = 16  # buffers kept per length


class Buffers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}

    def take(self, length: int) -> bytearray:
        """A buffer given back earlier, or a new one (its bytes are whatever they were)."""
        with self._lock:
            free = self._free.get(length)
            if free:
                return free.pop()
        return bytearray(length)

    def give_back(self, data: bytearray) -> None:
        """Only a buffer nothing writes into any more (its read answered)."""
        with self._lock:
            free = self._free.setdefault(len(data), [])
            if len(free) < KEEP:
                free.append(data)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

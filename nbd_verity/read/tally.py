"""Counters that many threads add to without a lock per update: each thread has its own row.

Only the thread that owns a row writes it, so `row[i] += n` cannot lose an update (a
shared `self.count += n` can, between its read and its write, and a lock around it costs
more than the rest of a small request's bookkeeping). A reader sums the rows. Rows are
found by thread ident, not threading.local: nbdkit's threads are not Python's, and its
plugin makes a new Python thread state for every callback unless serve/threadstate.py
keeps it (not where its extension is missing or NBD_VERITY_KEEP_THREAD_STATE=0), so a
threading.local could start empty on every request. Rows of threads that ended stay,
since their counts are part of the totals, and a new thread that gets the same ident
takes its row over (idents are unique among live threads). Reset never writes the rows
(a writer would undo it): it takes the current sums as the new zero.
The lock guards the row table and the zero: taken when a thread first counts, on a read
and on a reset, never on an update.
"""

from __future__ import annotations

import threading
from threading import get_ident


class Tally:
    """A fixed set of integer counters, summed over per-thread rows."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows: dict[int, list[int]] = {}
        self._zero = [0] * size
        self._lock = threading.Lock()

    def row(self) -> list[int]:
        """This thread's row: add to it in place (`tally.row()[i] += n`)."""
        row = self._rows.get(get_ident())
        if row is None:
            with self._lock:
                row = self._rows.setdefault(get_ident(), [0] * self.size)
        return row

    def _sums(self) -> list[int]:
        rows = list(self._rows.values())  # under the lock: no row is added meanwhile
        return [sum(column) for column in zip(*rows, strict=True)] if rows else [0] * self.size

    def totals(self) -> list[int]:
        """Every counter since the last reset."""
        with self._lock:
            return [s - z for s, z in zip(self._sums(), self._zero, strict=True)]

    def reset(self) -> None:
        with self._lock:
            self._zero = self._sums()

"""The class gate: a request waits, before it does any work, while a better class is busy.

One server is one process: its connections share the GIL, the page cache's copies and the
pool, so a worse class's bulk load takes them from a better class's small reads unless
whole requests are ranked, as the block layer's schedulers do: idle is served only when
nobody else wants the disk, rt before be. The gate is the server's one ranking of classes
(per-class nice values and a class-ordered pool queue met no QoS bar it did not meet
alone: docs/decisions/priority.md).
- RANK (ioclass.py): rt 0, be and none 1, idle 2.
- A request waits at its start, with the GIL released (a condition variable), while a
  connection of a better rank has a request in flight or finished one less than QUIET_S
  (8 ms, as BFQ's slice_idle) ago. Requests in flight are never stopped.
- The bound: no request waits here longer than WAIT_S (1 s); after that it runs. Nothing
  waits when no better class is connected: an idle load alone runs as a be load does.
- When it has nothing to rank (the open connections all of one rank) `ranked` is False
  and the plugin does not call it at all; NBD_VERITY_CLASS_PRIORITY=0 turns it off.
Locking: counts of open connections per rank change under the lock; the per-request path
reads them without it (a stale count costs one request one needless look or one missed
wait). A waiter looks again by itself (a better request's end wakes nobody): at the end
of the quiet time, or, while better requests are in flight, after 8, 16, 32 then every
64 ms. A closed better connection wakes the waiters at once.
Why, with the figures (a be reader's p99 16x alone beside an idle load without it):
docs/decisions/gate.md.
"""

from __future__ import annotations

import threading
import time

from ..ioclass import RANK
from ..limits import switched_off

RANKS = 3
QUIET_S = 0.008  # a better rank stays busy this long after its last request ended
WAIT_S = 1.0  # the most any request waits here (the bound docs/control.md states)
POLL_MAX_S = 0.064  # a waiter behind requests in flight looks again at most this late


class ClassGate:
    """One per server process: every export's connections are ranked together, as they
    share its CPU, its GIL and its pool."""

    def __init__(self, quiet_s: float = QUIET_S, wait_s: float = WAIT_S,
                 enabled: bool = True) -> None:
        self.enabled = enabled  # off: connections are not counted, so nothing waits
        self.quiet_s = quiet_s
        self.wait_s = wait_s
        self._cond = threading.Condition(threading.Lock())
        self._open = [0] * RANKS  # connections open, per rank
        self.ranked = False  # connections of two ranks or more are open: enter() matters
        self._active = [0] * RANKS  # requests in flight, per rank (counted only when a
        self._ended = [0.0] * RANKS  # worse rank is open); the last one's end, monotonic
        self.waits = [0] * RANKS  # requests that waited, per rank (ctl stats)
        self.aged = [0] * RANKS  # of which ran because they had waited wait_s
        self.waited_s = [0.0] * RANKS  # time spent waiting, per rank

    # -- connections --------------------------------------------------------------------

    def opened(self, io_class: int) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._open[RANK[io_class]] += 1
            self._ranks_changed()

    def closed(self, io_class: int) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._open[RANK[io_class]] -= 1
            self._ranks_changed()
            self._cond.notify_all()  # a better rank gone: its waiters look again

    def _ranks_changed(self) -> None:
        """Under the lock. enter() waits only behind a better rank and counts only for a
        worse one, so with one rank open (or none) it would do nothing: `ranked` says
        whether it may do something. A request that reads it stale is one that raced a
        connection's open or close, as one reading the counts stale is."""
        self.ranked = sum(1 for count in self._open if count) > 1

    # -- requests -----------------------------------------------------------------------

    def enter(self, io_class: int) -> bool:
        """Wait while a better rank is busy (at most wait_s); True when this request must
        call leave(): a worse rank is open and watches this one. Called only while
        `ranked` (plugin.pread); anything else returns False at once, as it would then."""
        rank = RANK[io_class]
        opened = self._open
        if rank and (opened[0] or (rank == 2 and opened[1])):
            self._wait(rank)
        if rank == 2 or not (opened[2] or (rank == 0 and opened[1])):
            return False
        with self._cond:
            self._active[rank] += 1
        return True

    def leave(self, io_class: int) -> None:
        """The end of a request enter() said to count. It wakes nobody: the waiters must
        wait quiet_s after it anyway, and look again by themselves (_wait); waking them at
        every request of a busy reader would cost that reader their GIL hand-offs."""
        rank = RANK[io_class]
        with self._cond:
            self._active[rank] -= 1
            self._ended[rank] = time.monotonic()

    def _busy_until(self, rank: int) -> float | None:
        """Until when a better rank than rank counts as busy (None: it is in flight);
        a time in the past when none is."""
        until = 0.0
        for better in range(rank):
            if self._active[better]:
                return None
            until = max(until, self._ended[better] + self.quiet_s)
        return until

    def _wait(self, rank: int) -> None:
        with self._cond:
            now = time.monotonic()
            until = self._busy_until(rank)
            if until is not None and until <= now:
                return
            started = now
            deadline = now + self.wait_s
            step = self.quiet_s
            while True:  # look again at the end of the quiet, or after step
                if until is None:  # in flight: look again later and later
                    wake, step = now + step, min(POLL_MAX_S, 2 * step)
                else:
                    wake = until
                self._cond.wait(min(deadline, wake) - now)
                now = time.monotonic()
                until = self._busy_until(rank)
                if until is not None and until <= now:
                    break
                if now >= deadline:
                    self.aged[rank] += 1
                    break
            self.waits[rank] += 1
            self.waited_s[rank] += now - started

    def snapshot(self) -> dict:
        """Per rank: connections open, requests that waited, of which aged, seconds."""
        with self._cond:
            names = ("rt", "be", "idle")
            return {names[r]: {"connections": self._open[r], "waited": self.waits[r],
                               "aged": self.aged[r],
                               "waited_s": round(self.waited_s[r], 3)}
                    for r in range(RANKS)}


GATE_ENV = "NBD_VERITY_CLASS_PRIORITY"  # 0: the gate off (nothing counted, nobody waits)
gate = ClassGate(enabled=not switched_off(GATE_ENV))
# the server's (serve/callbacks.py); tests make their own

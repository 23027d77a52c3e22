"""How long a source's reads take lately, and whether that is slow: what decides that a
request's hash blocks are fetched beside its data (read/beside.py) and that a stream's
data is read ahead (sources/ahead.py). An exponential average of each read's time, the
first taken whole (the start-up check of the root reads one hash block).
Locking: none; the average is one float, replaced whole (a lost update costs one sample).
"""

from __future__ import annotations

SLOW_S = 250e-6  # a source slower than this per read is read beside and ahead
WEIGHT = 0.125  # each read's share of the average


class Latency:
    """One source's time per read, lately (0.0: none measured yet)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        """One read's time."""
        last = self.seconds
        self.seconds = seconds if not last else last + WEIGHT * (seconds - last)

    def slow(self) -> bool:
        return self.seconds >= SLOW_S

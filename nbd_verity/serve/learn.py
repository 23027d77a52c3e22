"""The inline-or-pool choice learned from live requests, per class and size.

The start-up calibration (calibrate.py) times one request at a time on an idle server,
and a start on a busy machine, or one core's neighbour at work, keeps what it measured
then (measured: three starts on the same quiet machine chose 4 MiB, 4 MiB and all
inline, minutes after one chose 256 KiB, while fio's 2 MiB reads from one client ran
1009 MB/s on the pool and 760 inline). So for a class nobody pinned, a request of at
least LEARN_MIN bytes takes the path that served its size best lately:

- Requests are grouped by class and size bucket (powers of two: 64 KiB up to 128 KiB,
  ... up to 32 MiB). Each bucket keeps, per path, the seconds per byte of its last
  WINDOW requests, timed around the whole request as the client sees it, under whatever
  load there is; a path's cost is their median (the lower one of an even count): one
  disturbed request (the pool's first, which starts its threads; a preempted one) does
  not move it.
- A bucket starts with a run of RUN requests on the table's path, then one on the other;
  after that the cheaper path, except that every EXPLORE-th request starts a run on the
  other one, so that a change of load (more clients, another process on the cores) moves
  the choice within a few hundred requests. When the other path costs over 1.5 times as
  much, a run starts only every EXPLORE_FAR-th request.
- A run's first SKIP requests are not counted: a path taken after others costs more at
  first (measured on this 2-core VM: 2 MiB requests on the pool took 1.1-1.2 ms each in
  a stream of pool requests, 1.4-2.2 ms when one in sixteen took it; likely because its
  workers' CPUs had gone idle, not measured apart), and counting them biased the choice
  against the path not taken (runs of 4 with one not counted still kept one client's 2
  MiB reads inline).
- The load rule of dispatch.py still applies on top: a request that should take the pool
  is verified inline when no worker is free (`busy_inline`).

What was learned is in `ctl stats` and `ctl thresholds` (`learned`: per class the
buckets with their microseconds per MiB on each path and the choice, and the smallest
size the pool is chosen for). Explicit thresholds pin their class: the table alone
decides, exactly. Updates take no lock: a lost update under a race costs one sample.
"""

from __future__ import annotations

from collections import deque

from ..control.table import CLASSES, INLINE, POOL

LEARN_MIN = 64 << 10  # smaller requests follow the table (inline, where it was measured)
BUCKETS = 10  # 64 KiB, 128 KiB, ... 32 MiB (MAX_REQUEST_SIZE)
WINDOW = 8  # samples kept per path: its cost is their median
RUN = 16  # requests of a run on the path not chosen
SKIP = 4  # of which the first are not counted
EXPLORE = 256  # every this-many-th request of a bucket starts a run on the other path
EXPLORE_FAR = 1024  # ... or this many, when that path costs over FAR times as much
FAR = 1.5


def bucket(length: int) -> int:
    """0 for LEARN_MIN..2*LEARN_MIN-1 bytes, 1 for the next power of two, ..."""
    return min(BUCKETS - 1, length.bit_length() - LEARN_MIN.bit_length())


class Learner:
    """Per (class, bucket): [inline cost, pool cost, requests, inline samples, pool
    samples, the run's path, its requests left, requests of it not to count], costs in
    seconds per byte (None before a first sample)."""

    def __init__(self) -> None:
        self._rows = [[self._row() for _ in range(BUCKETS)] for _ in CLASSES]

    @staticmethod
    def _row() -> list:
        return [None, None, 0, deque(maxlen=WINDOW), deque(maxlen=WINDOW), None, 0, 0]

    def choose(self, io_class: int, length: int, table_path: str) -> str:
        row = self._rows[io_class][bucket(length)]
        inline, pool, count = row[0], row[1], row[2]
        row[2] = count + 1
        if row[6] > 0:  # a run goes on
            row[6] -= 1
            return row[5]
        if inline is None and pool is None:  # the first: a run of the table's path
            row[5], row[6], row[7] = table_path, RUN - 1, SKIP
            return table_path
        if inline is None or pool is None:
            other = INLINE if inline is None else POOL
        else:
            best, other = (INLINE, POOL) if inline <= pool else (POOL, INLINE)
            ratio = max(inline, pool) / max(min(inline, pool), 1e-12)
            every = EXPLORE_FAR if ratio > FAR else EXPLORE
            if count % every != every - 1:
                return best
        row[5], row[6], row[7] = other, RUN - 1, SKIP  # a run of the other path
        return other

    def record(self, io_class: int, length: int, path: str, seconds: float) -> None:
        row = self._rows[io_class][bucket(length)]
        if row[7] and path == row[5]:  # a run's first requests: not counted
            row[7] -= 1
            return
        index = 0 if path == INLINE else 1
        samples = row[3 + index]
        samples.append(seconds / length)
        ordered = sorted(samples)
        row[index] = ordered[(len(ordered) - 1) // 2]

    def reset(self) -> None:
        for rows in self._rows:
            for i in range(len(rows)):
                rows[i] = self._row()

    def snapshot(self) -> dict:
        """Per class with requests: its buckets (bytes from) with µs per MiB on each path
        and the choice, and the smallest bucket the pool is chosen for (None: none)."""
        out: dict = {}
        for c, rows in enumerate(self._rows):
            buckets = {}
            pool_from = None
            for b, (inline, pool, count, *_) in enumerate(rows):
                if not count:
                    continue
                size = LEARN_MIN << b
                choice = (None if inline is None or pool is None else
                          INLINE if inline <= pool else POOL)
                if choice == POOL and pool_from is None:
                    pool_from = size
                buckets[str(size)] = {
                    "requests": count, "choice": choice,
                    "inline_us_per_mib": _per_mib(inline), "pool_us_per_mib": _per_mib(pool)}
            if buckets:
                out[CLASSES[c]] = {"pool_from": pool_from, "buckets": buckets}
        return out


def _per_mib(seconds_per_byte: float | None) -> float | None:
    return None if seconds_per_byte is None else round(seconds_per_byte * (1 << 20) * 1e6, 1)

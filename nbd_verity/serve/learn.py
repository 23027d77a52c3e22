"""The inline-or-pool choice learned from live requests, per class and size.

The start-up calibration (calibrate.py) times one request at a time on an idle server,
and a start on a busy machine, or one core's neighbour at work, keeps what it measured
then (measured: the same quiet machine gave 256 KiB, 4 MiB and all inline in three
starts, while fio's 2 MiB reads from one client ran 1009 MB/s on the pool and 760
inline). So for a class nobody pinned, a request of at least LEARN_MIN bytes takes the
path that served its size best lately:

- Requests are grouped by class and size bucket (powers of two: 64 KiB up to 128 KiB,
  ... up to 32 MiB). Each bucket keeps, per path, a moving average (weight ALPHA) of
  the seconds per byte its requests took, measured around the whole request as the
  client sees it, under whatever load there is.
- A bucket's first request takes the table's path, its second the other one; after that
  the cheaper path, except that every EXPLORE-th request takes the other one, so that a
  change of load (more clients, another process on the cores) moves the choice within
  a few dozen requests. When the other path costs over 1.5 times as much, it is tried
  only every EXPLORE_FAR-th request.
- The load rule of dispatch.py still applies on top: a request that should take the pool
  is verified inline when no worker is free (`busy_inline`).

What was learned is in `ctl stats` and `ctl thresholds` (`learned`: per class the
buckets with their microseconds per MiB on each path and the choice, and the smallest
size the pool is chosen for). Explicit thresholds pin their class: the table alone
decides, exactly. Updates take no lock: a lost update under a race costs one sample.
"""

from __future__ import annotations

from ..control.table import CLASSES, INLINE, POOL

LEARN_MIN = 64 << 10  # smaller requests follow the table (inline, where it was measured)
BUCKETS = 10  # 64 KiB, 128 KiB, ... 32 MiB (MAX_REQUEST_SIZE)
ALPHA = 0.125  # weight of a new sample in a path's moving average
EXPLORE = 16  # every this-many-th request of a bucket takes the path it did not choose
EXPLORE_FAR = 64  # ... or this many, when that path costs over FAR times as much
FAR = 1.5


def bucket(length: int) -> int:
    """0 for LEARN_MIN..2*LEARN_MIN-1 bytes, 1 for the next power of two, ..."""
    return min(BUCKETS - 1, length.bit_length() - LEARN_MIN.bit_length())


class Learner:
    """Moving averages per (class, bucket): [inline s/byte, pool s/byte, requests]."""

    def __init__(self) -> None:
        self._rows = [[[None, None, 0] for _ in range(BUCKETS)] for _ in CLASSES]

    def choose(self, io_class: int, length: int, table_path: str) -> str:
        row = self._rows[io_class][bucket(length)]
        inline, pool, count = row
        row[2] = count + 1
        if inline is None or pool is None:  # the table's path, then the other one
            if inline is None and pool is None:
                return table_path
            return INLINE if inline is None else POOL
        best, other = (INLINE, POOL) if inline <= pool else (POOL, INLINE)
        ratio = max(inline, pool) / max(min(inline, pool), 1e-12)
        every = EXPLORE_FAR if ratio > FAR else EXPLORE
        return other if count % every == every - 1 else best

    def record(self, io_class: int, length: int, path: str, seconds: float) -> None:
        row = self._rows[io_class][bucket(length)]
        index = 0 if path == INLINE else 1
        sample = seconds / length
        old = row[index]
        row[index] = sample if old is None else old + ALPHA * (sample - old)

    def reset(self) -> None:
        for rows in self._rows:
            for row in rows:
                row[:] = [None, None, 0]

    def snapshot(self) -> dict:
        """Per class with requests: its buckets (bytes from) with µs per MiB on each path
        and the choice, and the smallest bucket the pool is chosen for (None: none)."""
        out: dict = {}
        for c, rows in enumerate(self._rows):
            buckets = {}
            pool_from = None
            for b, (inline, pool, count) in enumerate(rows):
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

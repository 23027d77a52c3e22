"""The scheduling layer over the verifier's read: inline or pool (dm-verity's use_bh_bytes).

Dispatcher.read has the verifier's read interface (buf, offset) plus the request's class.
A request up to its class's threshold is verified inline, on the nbdkit thread that
received it; a larger one is split on chunk boundaries (POOL_CHUNK_SIZE) and verified
across the pool (pool.py; the native engine hashes with the GIL released), and completes
when every chunk has. For a class nobody pinned, a request of SHARED_MIN bytes or more
goes to the pool only when the pool takes it (pool.take: the clients that sent such
requests lately, the load, are at most half the workers, and a worker is free); else it
is verified inline, in its own thread, instead of queueing behind other clients' chunks
(`busy_inline`). A threshold set with --threshold or `ctl thresholds` pins its class:
the table alone decides, exactly.
Invariants: the table is a tuple replaced whole (control/table.py has the presets and
checks); a request reads it once, and a change applies from the next request on. Every
chunk of a request has ended before the request returns, and its error is the first
failing chunk's in offset order, as inline would have raised it.
Locking: none per request. PathStats counts in per-thread rows (read/tally.py) and
appends latencies to deques (atomic); take() is the pool's (lock-free).
Why: docs/decisions/dispatch.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from ..control.table import INLINE, POOL
from ..errors import ImageIOError
from ..ioclass import CLASSES
from ..log import log
from ..read.tally import Tally
from .pool import ClassPool

POOL_CHUNK_SIZE = 256 << 10  # bytes per pool task: measured best of 64K..256K (docs/control.md)
SHARED_MIN = 2 * POOL_CHUNK_SIZE  # an unpinned class's request the pool must take: two
                                  # chunks (a smaller one gets nothing but its hand-off)
LATENCY_SAMPLES = 4096  # recent latencies kept per class and path, for percentiles


class Client:
    """The scheduling layer's view of one connection (serve/device.Connection is one):
    its I/O class and its Merkle readahead window (read/readahead.py; None: off)."""

    def __init__(self, io_class: int, readahead=None) -> None:
        self.io_class, self.readahead = io_class, readahead


def decide(table: tuple[int, ...], io_class: int, length: int) -> str:
    """The pure decision: inline when the request fits its class's threshold."""
    return INLINE if length <= table[io_class] else POOL


class PathStats:
    """Requests, bytes and recent latencies for each (class, path), recorded without a lock:
    counts per thread (tally.py), latencies appended to a deque (an atomic append; a
    snapshot copies it in one C call, which no append can interleave)."""

    def __init__(self) -> None:
        self._keys = [(c, p) for c in range(len(CLASSES)) for p in (INLINE, POOL)]
        self._slot = {key: 2 * i for i, key in enumerate(self._keys)}  # requests; bytes next
        self._tally = Tally(2 * len(self._keys))
        self._latency = {key: deque(maxlen=LATENCY_SAMPLES) for key in self._keys}

    def reset(self) -> None:
        self._tally.reset()
        for samples in self._latency.values():  # in place: the fast path holds them
            samples.clear()

    def slot(self, io_class: int, path: str) -> int:
        """Where (class, path) counts in a row: requests there, bytes just after."""
        return self._slot[(io_class, path)]

    def latency(self, io_class: int, path: str) -> deque:
        """The recent latencies of (class, path), in seconds; append to record one."""
        return self._latency[(io_class, path)]

    def row(self) -> list[int]:
        """This thread's row of request and byte counts (serve/fastpath.py)."""
        return self._tally.row()

    def record(self, io_class: int, path: str, length: int, seconds: float) -> None:
        key = (io_class, path)
        slot = self._slot[key]
        row = self._tally.row()
        row[slot] += 1
        row[slot + 1] += length
        self._latency[key].append(seconds)

    def snapshot(self) -> dict:
        """Per class and path: requests, bytes, p50 and p99 latency in microseconds."""
        totals = self._tally.totals()
        latency = self._latency
        out: dict = {}
        for (c, p), slot in self._slot.items():
            samples = sorted(latency[(c, p)])
            out.setdefault(CLASSES[c], {})[p] = {
                "requests": totals[slot], "bytes": totals[slot + 1],
                "p50_us": _percentile(samples, 0.50), "p99_us": _percentile(samples, 0.99),
            }
        return out


def _percentile(sorted_samples: list[float], q: float) -> float | None:
    if not sorted_samples:
        return None
    index = min(len(sorted_samples) - 1, int(q * len(sorted_samples)))
    return round(sorted_samples[index] * 1e6, 1)


class Dispatcher:
    """Runs each read inline or across the pool, as the current table says."""

    def __init__(self, read_fn, block_size: int, table: tuple[int, ...],
                 workers: int = 0, shared_pool=None, pinned: frozenset = frozenset(),
                 counters=None) -> None:
        self._read = read_fn  # read_fn(buf, offset) verifies in place
        self._counters = counters  # the verifier's (read/counters.py): io_errors, per request
        self.block_size = block_size
        self.table = table  # replaced whole, never mutated
        self.pinned = frozenset(pinned)  # classes whose threshold alone decides (explicit)
        self.workers = workers or os.cpu_count() or 1
        self.chunk_size = max(block_size, POOL_CHUNK_SIZE - POOL_CHUNK_SIZE % block_size)
        self.stats = PathStats()
        self._busy_inline = Tally(len(CLASSES))  # pool-sized, verified inline: pool busy
        self._pool: ClassPool | None = None
        self._shared_pool = shared_pool  # a many-export server's: () -> its one pool
        self._start_lock = threading.Lock()

    def start(self) -> ClassPool:
        """Create the pool (after nbdkit forked: threads do not survive a fork), or take
        the server's shared one."""
        with self._start_lock:
            if self._pool is None:
                self._pool = (self._shared_pool() if self._shared_pool is not None else
                              ClassPool(self.workers))
            return self._pool

    def pool(self) -> ClassPool:
        """The pool (started, or the server's shared one)."""
        return self._pool or self.start()

    def busy_inline(self) -> dict[str, int]:
        """Per class: pool-sized requests verified inline because no worker was free."""
        return dict(zip(CLASSES, self._busy_inline.totals(), strict=True))

    def stop(self) -> None:
        if self._pool is not None and self._shared_pool is None:  # a shared one stays
            self._pool.shutdown(wait=True)
        self._pool = None

    def set_table(self, table: tuple[int, ...], pinned: frozenset | None = None) -> None:
        self.table = table  # one reference assignment: atomic for readers
        if pinned is not None:
            self.pinned = frozenset(pinned)

    def read(self, buf: memoryview, offset: int, client: Client) -> None:
        """Verify len(buf) bytes at offset into buf for client (a Client: its class, its
        readahead window), inline or across the pool. A request of a class nobody pinned
        that its threshold sends to the pool and that spans two chunks (SHARED_MIN) goes
        there only when the pool takes it (pool.take); else it is verified here."""
        length = len(buf)
        if not length:
            return
        if client.readahead is not None:
            client.readahead.before_read(offset, length)
        io_class = client.io_class
        path = decide(self.table, io_class, length)
        if (path == POOL and length >= SHARED_MIN and io_class not in self.pinned
                and not self.pool().take(id(client), time.perf_counter())):
            self._busy_inline.row()[io_class] += 1  # the cores are taken: verified here
            path = INLINE
        try:
            started = time.perf_counter()
            try:
                if path == INLINE:
                    self._read(buf, offset)
                else:
                    self._read_in_pool(buf, offset)
            finally:  # failed requests count too, and their latency
                self.stats.record(io_class, path, length, time.perf_counter() - started)
        except ImageIOError as e:
            self.failed(e)
            raise

    def failed(self, error: ImageIOError) -> None:
        """A request failed to read: its one count and line (nbdkit logs EIO too); the
        fast path's remote reads (serve/fastpath.py) count theirs here too."""
        if self._counters is not None:
            self._counters.add(io_errors=1)
        log(str(error))

    def busy(self, io_class: int) -> None:
        """Count a pool-sized request verified inline because the pool did not take it
        (the fast path's: serve/fastpath.py)."""
        self._busy_inline.row()[io_class] += 1

    def _read_in_pool(self, buf: memoryview, offset: int) -> None:
        """Split on block boundaries into chunks, verify them in parallel, wait for all.
        The first failing chunk's error (in offset order) is the request's error, as the
        inline path would have raised it first."""
        pool = self._pool or self.start()
        futures = []
        pos, end = offset, offset + len(buf)
        try:
            while pos < end:
                boundary = (pos // self.chunk_size + 1) * self.chunk_size
                stop = min(end, boundary)
                futures.append(pool.submit(self._read, buf[pos - offset:stop - offset],
                                           pos))
                pos = stop
        finally:  # every chunk queued has ended before the buffer goes back
            error = None
            for future in futures:
                try:
                    future.result()
                except Exception as e:
                    error = error or e
        if error is not None:
            raise error

"""The scheduling layer over the verifier's read: inline or pool (dm-verity's use_bh_bytes).

Dispatcher.read has the verifier's read interface (buf, offset) plus the request's class.
A request up to its class's threshold is verified inline, on the nbdkit thread that
received it; a larger one is split on chunk boundaries (POOL_CHUNK_SIZE) and verified
across the pool (pool.py; the native engine hashes with the GIL released), and completes
when every chunk has. For a class nobody pinned, a request of LEARN_MIN bytes or more
takes the learner's path (learn.py); one that should take the pool goes there only while
such requests are at most half the workers and a worker is free (pool.claim), else it is
verified inline (`busy_inline`). A threshold set with --threshold or `ctl thresholds`
pins its class: the table alone decides, exactly.
Invariants: the table is a tuple replaced whole (control/table.py has the presets and
checks); a request reads it once, and a change applies from the next request on. Every
chunk of a request has ended before the request returns, and its error is the first
failing chunk's in offset order, as inline would have raised it.
Locking: none per request. PathStats counts in per-thread rows (read/tally.py) and
appends latencies to deques (atomic); a connection's Cycle is written only by the
thread serving that connection's request.
Why: docs/decisions/dispatch.md and docs/decisions/learner.md.
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
from .learn import LEARN_MIN, Learner
from .pool import ClassPool

CYCLE_GAP_S = 0.05  # a client quiet longer than this: the request alone is the sample

POOL_CHUNK_SIZE = 256 << 10  # bytes per pool task: measured best of 64K..256K (docs/control.md)
LATENCY_SAMPLES = 4096  # recent latencies kept per class and path, for percentiles


class Cycle:
    """A connection's last learned request, whose cost (learn.py: its cycle as its client
    sees it) is recorded when the connection's next request comes; started 0.0: none."""

    __slots__ = ("ended", "io_class", "length", "load", "path", "started")

    def __init__(self) -> None:
        self.started = 0.0

    def hold(self, started: float, ended: float, length: int, path: str, load: int,
             io_class: int) -> None:
        self.ended, self.length, self.path, self.load = ended, length, path, load
        self.io_class = io_class
        self.started = started  # last: a reader that sees it sees the rest


class Client:
    """The scheduling layer's view of one connection (serve/device.Connection is one):
    its I/O class, its last learned request (a Cycle; None: each request alone) and its
    Merkle readahead window (read/readahead.py; None: off)."""

    def __init__(self, io_class: int, cycle: Cycle | None = None, readahead=None) -> None:
        self.io_class, self.cycle, self.readahead = io_class, cycle, readahead


class Choice:
    """The learner's choice for one request, made by the fast path (serve/fastpath.py),
    which hands the request to read() with it, so that it is not chosen twice."""

    __slots__ = ("came", "load", "path")

    def __init__(self, path: str, load: int, came: float) -> None:
        self.path, self.load, self.came = path, load, came


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
        # the unpinned classes' choice at LEARN_MIN bytes and more; the rule's workers are
        # those that can run at once (no more than the CPUs this process may use)
        cores = min(self.workers, len(os.sched_getaffinity(0)))
        self.learner = Learner(cores=cores, spread=2 * self.chunk_size)
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

    def read(self, buf: memoryview, offset: int, client: Client,
             chosen: Choice | None = None) -> None:
        """Verify len(buf) bytes at offset into buf for client (a Client: its class, its
        last learned request, its readahead window), inline or across the pool; chosen:
        the fast path's choice for this request (None: choose here). A learned request's
        cost is its whole cycle as its client sees it (see learned); with no Cycle, the
        request alone.

        Every microsecond of Python here is one the client waits for (decisions/learner.md),
        so a request records its connection's last learned sample once its own path is
        chosen, and one sent to the pool does it while the workers verify its chunks."""
        length = len(buf)
        if not length:
            return
        if client.readahead is not None:
            client.readahead.before_read(offset, length)
        io_class, clock = client.io_class, client.cycle
        sample = None  # a learned request's (path chosen, load): its cost is a sample
        if chosen is not None:  # chosen by the fast path: not chosen twice
            path, now = chosen.path, chosen.came
            sample = (path, chosen.load)
        else:
            now = time.perf_counter()
            path = decide(self.table, io_class, length)
            if io_class not in self.pinned and length >= LEARN_MIN:
                load = self.learner.load(id(clock), now)
                path = self.learner.choose(io_class, length, path, load)
                sample = (path, load)
        cycle = now if clock is not None and clock.started else None  # ends the last one's
        pool = claimed = None
        if sample is not None and path == POOL:
            pool = self._pool or self.start()
            claimed = id(buf)  # no other request being served has this buffer
            if not pool.claim(claimed):  # the cores are taken: verified here, no queueing
                self._busy_inline.row()[io_class] += 1
                path = INLINE  # the sample stays the pool's: what choosing it gets the client
        try:
            if cycle is not None and path == INLINE:
                self.learned(clock, cycle)
            started = time.perf_counter()
            try:
                if path == INLINE:
                    self._read(buf, offset)
                else:
                    self._read_in_pool(buf, offset, clock, cycle)
            finally:  # failed requests count too, and their latency
                ended = time.perf_counter()
                self.stats.record(io_class, path, length, ended - started)
                if sample is not None and clock is not None:  # taken at the next request
                    clock.hold(started, ended, length, sample[0], sample[1], io_class)
                elif sample is not None:
                    self.learner.record(io_class, length, sample[0], ended - started,
                                        started, sample[1])
        except ImageIOError as e:  # the request's one count and line (nbdkit logs EIO too)
            if self._counters is not None:
                self._counters.add(io_errors=1)
            log(str(e))
            raise
        finally:
            if claimed is not None:
                pool.release(claimed)

    def learned(self, clock: Cycle, now: float) -> None:
        """The connection's previous learned request, now that its next one has come: its
        cost is the time from its start to this one's (what its client waited for: the
        verification, the reply's copies out of nbdkit and into the client, and the next
        request's way in, which are not the same for both paths: on this 2-core VM one
        client's 2 MiB reads were 8% faster on the pool as the client saw them, and 20%
        slower on it timed inside the server). When the client was quiet for over
        CYCLE_GAP_S in between, or sent this one before the last had ended, the request
        alone is the sample. Requests the fast path answered in between (fastpath.py, which
        does not come here) count into the cycle."""
        started = clock.started
        if not started:  # another request of the connection's took it (racy: rare)
            return
        clock.started = 0.0
        ended = clock.ended
        gap = now - ended
        seconds = now - started if 0 <= gap <= CYCLE_GAP_S else ended - started
        self.learner.record(clock.io_class, clock.length, clock.path, seconds, started,
                            clock.load)

    def _read_in_pool(self, buf: memoryview, offset: int, clock: Cycle | None = None,
                      cycle: float | None = None) -> None:
        """Split on block boundaries into chunks, verify them in parallel, wait for all.
        The first failing chunk's error (in offset order) is the request's error, as the
        inline path would have raised it first. clock and cycle: the connection's last
        sample, recorded once the chunks are queued (read; cycle None: none)."""
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
            if cycle is not None:
                self.learned(clock, cycle)
        finally:  # every chunk queued has ended before the buffer goes back
            error = None
            for future in futures:
                try:
                    future.result()
                except Exception as e:
                    error = error or e
        if error is not None:
            raise error

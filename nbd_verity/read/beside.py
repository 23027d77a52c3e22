"""A cold request's hash blocks fetched beside its data (dm-verity's verity_submit_prefetch).

When a request's level-0 hash blocks are not all cached, the kernel submits their reads
at map time, together with the data I/O, so that one wait covers both. Here, when the
hash source is slow (sources/latency.py: over 250 µs per read lately), Verifier.read
starts a Fetch before it reads the data: each level's missing blocks, from the request's
leaves up to the first cached ancestor, are read in one read per level, every level at
once. An NBD source's reads are sent by the request's own thread (NbdSource.submit, each
on a connection of its own: no hand-off to another thread, which cost 4 KiB requests on
a cold cache at 1 ms 80-120 us of CPU each); another source's run on the I/O threads.
The request's own thread reads the data meanwhile, then finishes the fetch: it
verifies the fetched blocks top down, each against its verified parent (or the root),
and caches those that match.
A block that does not match, or a read that failed, is left out: the request's
verification then reads it again and reports it as it always does (or FEC repairs it),
so a fetch changes when bytes arrive, never what is trusted or which error a request
gets. No data byte is used before its digest matched.
Invariants: nothing unverified enters the cache; a Fetch is finished by the thread that
started it, after its data read, always (a submitted read holds a connection until it is
waited for); the I/O threads only read.
Locking: none of its own. The cache is HashBlockCache's (its own lock); the latency is
Latency's (one float).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ImageIOError
from ..sources.latency import Latency
from .counters import PREFETCH_CLUSTER

WAIT_SLICE_S = 0.25  # a fetch is waited for in slices, after each of which stopping() is asked
IO_THREADS = 32  # reads in flight at once: 16 requests of a connection, two levels each


def cluster_blocks(cluster_bytes: int, data_block_size: int) -> int:
    """Level-0 blocks per prefetch cluster, as dm-verity computes them (verity_prefetch_io):
    the bytes over the DATA block size (the kernel's quirk: they are hash blocks), rounded
    down to a power of two; 0 or 1: no widening."""
    cluster = cluster_bytes // data_block_size
    return 1 << (cluster.bit_length() - 1) if cluster > 1 else cluster


class Beside:
    """Decides whether a request's hash blocks are fetched beside its data, and starts
    their reads (one verifier's)."""

    def __init__(self, verifier, cluster_bytes: int = PREFETCH_CLUSTER) -> None:
        self.verifier = verifier
        self.latency = Latency()  # of the hash source: the verifier's reads and the fetches'
        self._io: ThreadPoolExecutor | None = None  # started at the first fetch (after fork)
        self.cluster = cluster_blocks(cluster_bytes, verifier.geo.data_block_size)

    def start(self, first: int, count: int) -> Fetch | None:
        """A Fetch of data blocks first..first+count-1's missing hash blocks, started; None
        when they are cached or the hash source answers fast (then the request's own
        reads are cheaper than a hand-off)."""
        verifier = self.verifier
        geo = verifier.geo
        if not self.latency.slow() or geo.levels == 0:
            return None
        lo, hi = geo.parent_slot(first)[0], geo.parent_slot(first + count - 1)[0]
        if verifier.uncached(0, lo, hi)[0] > hi:
            return None  # the request's own leaves are cached
        lo, hi = self.widen(lo, hi)
        runs = []  # (level, lo, hi): each level's missing blocks, from level 0 up
        for level in range(geo.levels):
            lo, hi = verifier.uncached(level, lo, hi)
            if lo > hi:
                break
            runs.append((level, lo, hi))
            lo, hi = geo.parent_slot(lo)[0], geo.parent_slot(hi)[0]
        if not runs:
            return None
        submit = getattr(verifier.hashes, "submit", None)
        if submit is not None:
            hbs, starts = geo.hash_block_size, geo.level_start
            sent, reads = time.perf_counter(), []
            for level, lo, hi in runs:  # level 0 first: the one surely needed
                # never a wait for a connection while holding one: requests in flight
                # would hold them all, each waiting for another. A run without one is
                # left to the request's own verification, after its data read.
                pending = submit((hi - lo + 1) * hbs, (starts[level] + lo) * hbs)
                if pending is None:
                    break
                reads.append(((level, lo, hi), _Sent(pending, sent, self.latency)))
            return Fetch(self, reads) if reads else None
        if self._io is None:
            self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="hash-fetch")
        # Each run's buffer is made here, on the request's thread, and read into on an I/O
        # thread: no copy, and no allocation there (its malloc arena would keep it).
        hbs = geo.hash_block_size
        return Fetch(self, [(run, self._io.submit(self._read, *run,
                                                  bytearray((run[2] - run[1] + 1) * hbs)))
                            for run in runs])

    def widen(self, lo: int, hi: int) -> tuple[int, int]:
        """Level-0 blocks lo..hi widened to dm-verity's prefetch cluster, aligned both
        ways, while the cache has room for it; as they were otherwise. A full cache would
        evict a cluster's worth of blocks, each as likely to be wanted again, for every
        block a random reader needs (a 64 GiB image read at random through a 16 MiB
        cache read 11 times the hash blocks with it)."""
        cluster, verifier = self.cluster, self.verifier
        if cluster > 1 and len(verifier.cache) + cluster <= verifier.cache.capacity:
            return lo & -cluster, min(hi | (cluster - 1), verifier.geo.level_blocks[0] - 1)
        return lo, hi

    def _read(self, level: int, lo: int, hi: int, buf: bytearray) -> bytearray:
        geo, hbs = self.verifier.geo, self.verifier.geo.hash_block_size
        started = time.perf_counter()
        self.verifier.hashes.read_into(memoryview(buf), (geo.level_start[level] + lo) * hbs)
        self.latency.add(time.perf_counter() - started)
        return buf

    def stop(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None


class _Sent:
    """A read sent by the request's thread (NbdSource.submit), as a Future's result():
    its bytes, or its ImageIOError. Its time (sent to answered, as the request sees it:
    it is waited for after the data read) is the source's latency sample."""

    __slots__ = ("latency", "pending", "sent")

    def __init__(self, pending, sent: float, latency: Latency) -> None:
        self.pending, self.sent, self.latency = pending, sent, latency

    def result(self, timeout: float | None = None) -> bytearray:
        data = self.pending.result()  # its waits end when the server stops (NbdSource)
        self.latency.add(time.perf_counter() - self.sent)
        return data


class Fetch:
    """One request's hash reads in flight: finish() verifies and caches what came."""

    def __init__(self, beside: Beside, reads: list[tuple[tuple[int, int, int], Future]]):
        self.beside, self.reads = beside, reads

    def finish(self) -> None:
        """Wait for every read, then verify the fetched blocks top down and cache those
        that match; anything else is left to the request's own verification."""
        verifier = self.beside.verifier
        geo, hbs, d = verifier.geo, verifier.geo.hash_block_size, verifier.digester
        cache, top = verifier.cache, verifier.geo.levels - 1
        stopping = getattr(verifier.hashes, "stopping", None)  # an NBD source's
        fetched = []
        for run, future in self.reads:
            while True:
                try:
                    fetched.append((run, future.result(WAIT_SLICE_S)))
                except TimeoutError:
                    if stopping is not None and stopping():
                        return  # the request's own reads say so, promptly
                    continue
                except ImageIOError:
                    pass  # the request's own read reports it (or FEC rebuilds it)
                break
        blocks = reads = 0
        for (level, lo, hi), run in reversed(fetched):  # the top first: parents before
            data = memoryview(run)  # each block cached is one copy of its bytes
            reads += 1
            blocks += hi - lo + 1
            start = geo.level_start[level]
            slots = d.slots_of(data, hbs)  # the whole run in one call, as prefetch_leaves
            for index in range(lo, hi + 1):
                if cache.contains(start + index):
                    continue
                if level == top:
                    want = verifier.root
                else:  # only against a verified parent: one not cached is left alone
                    parent_index, slot = geo.parent_slot(index)
                    parent = cache.peek(geo.level_start[level + 1] + parent_index)
                    if parent is None:
                        continue
                    want = d.stored(parent, slot)
                if d.stored(slots, (index - lo) * d.slot_size) == want:
                    cache.put(start + index, level,
                              bytes(data[(index - lo) * hbs:(index - lo + 1) * hbs]))
        if reads:
            verifier.counters.add(hash_reads=reads, hash_blocks_read=blocks)

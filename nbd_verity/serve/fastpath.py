"""The fast path: the common read answered in one frame around one read and its check.

A mode of the one read path, as the kernel's verity_verify_io runs in softirq context
first: the common request is aligned, lies under one level-0 hash block whose verified
copy is cached, is verified inline (within its class's threshold, or an unpinned class's
request the pool does not take: dispatch.py), and no option that changes the success
path is in play (FEC, ignore-zero-blocks, check-at-most-once, Merkle readahead, a data
image that is not a local file, the pure-Python engine). For it bind()'s function fast()
reads and verifies straight into nbdkit's buffer with one read_verify call and counts
what the general path would count. bind() hands the connection the same steps in one
native frame (format/_native.c, FastRead.read: no bytecode of its own holds the GIL the
other requests wait for), which leaves what is over the class's threshold to fast().
Anything else, and any failure here (a mismatch, a short read), goes to the general path
from the start (Dispatcher.read), which stays the reference: the request's bytes, error
and counters are its own there. An image read over NBD has its own (bind_remote): the
same request, if it also reads nothing ahead, read on an idle connection of the source
and verified with one native call; a read the upstream fails is the request's failure
there too (Dispatcher.failed counts it).
Invariants: what it counts (ctl stats) equals the general path's for the same request
(tests/server/serve/test_fastpath.py compares every answer and counter, native and
Python); one request in SAMPLE_EVERY per thread has its latency timed (every one the
pool did not take).
Locking: none. It writes only this thread's rows of the general path's own Tallies
(read/tally.py: each row has one writer, its thread) and the cache's LRU order, as
HashBlockCache.get does.
Why a separate frame: 4 KiB random reads from eight clients ran 181 MB/s with it, 171
without (bench/threads.py, docs/benchmarks.md "The three ratios"); why a native one:
docs/decisions/fastpath.md, "One native frame for a local file".
NBD_VERITY_FAST_PATH=0 turns it off, for tests that run every suite on both paths;
NBD_VERITY_FAST_NATIVE=0 keeps a local file's in Python (fast(), the native frame's
reference), for the tests that compare the two and for measuring.
"""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from time import perf_counter

from ..control.table import INLINE
from ..errors import ImageIOError
from ..format.digest import _native
from ..limits import MAX_REQUEST_SIZE, switched_off
from ..schedule.dispatch import SHARED_MIN
from ..sources.remote import UNCHECKED

FAST_PATH_ENV = "NBD_VERITY_FAST_PATH"  # 0: every request takes the general path
FAST_NATIVE_ENV = "NBD_VERITY_FAST_NATIVE"  # 0: a local file's fast path in Python, not C
SAMPLE_EVERY = 64  # one request in this many (per thread and class) has its latency timed


def enabled(device) -> bool:
    """Whether the requests of a device (a device.Device) may take the fast path at all:
    its options and sources allow it, and the environment does not turn it off."""
    verifier = device.verifier
    return (not switched_off(FAST_PATH_ENV) and device.fec is None
            and (verifier.fast_path_ready or verifier.fast_reads is not None))


def never(buf, offset: int) -> None:
    """The fast path of a connection that may not take it."""
    return None


def _bound(connection) -> tuple:
    """What both fast paths bind when a connection opens: its device's verifier and
    dispatcher, the geometry as masks and shifts, the level-0 LRU itself (never
    replaced), the connection's class and its inline slot (requests; bytes at slot + 1)
    and latency samples, and each thread's counting rows (rows_of by thread ident;
    rows() makes the calling thread's: data_blocks_verified, cache hits, path stats)."""
    device = connection.device
    verifier, dispatcher = device.verifier, device.dispatcher
    geo = verifier.geo
    dbs = geo.data_block_size
    io_class = connection.io_class
    counters, cache, stats = verifier.counters, device.cache, dispatcher.stats
    rows_of: dict[int, tuple[list[int], list[int], list[int]]] = {}

    def rows() -> tuple[list[int], list[int], list[int]]:
        mine = rows_of[get_ident()] = (counters.row(), cache.row(), stats.row())
        return mine
    return (verifier, dispatcher, dbs, dbs - 1, dbs.bit_length() - 1, geo.hpb_bits,
            (1 << geo.hpb_bits) - 1, geo.slot_size, geo.level_start[0], cache.level(0),
            io_class, stats.slot(io_class, INLINE), stats.latency(io_class, INLINE),
            rows_of, rows)


def bind(connection) -> Callable[[object, int], object]:
    """The fast path of one connection (a device.Connection, which calls this: not
    imported here, so that the import runs one way): fast(buf, offset) -> True when it
    answered the request (buf filled and verified); else None, for the general path
    (Dispatcher.read). For a local file that is FastRead.read, the same steps natively,
    unless NBD_VERITY_FAST_NATIVE=0 or the module has none."""
    device = connection.device
    if not device.fast_path:
        return never
    if not device.verifier.fast_path_ready:
        return bind_remote(connection)
    if connection.readahead is not None:
        return never
    (verifier, dispatcher, dbs, mask, shift, hpb_bits, hpb_mask, slot_size, leaf_start,
     leaves, io_class, slot, latency, rows_of, rows) = _bound(connection)
    read_verify = verifier.digester.native.read_verify
    fd = device.data.fd
    client = id(connection)  # as Dispatcher.read names the connection to the pool
    sample_mask = SAMPLE_EVERY - 1

    def fast(buf, offset: int):
        size = len(buf)
        if offset & mask or size & mask or not size:
            return None
        if size > dispatcher.table[io_class]:  # thresholds <= MAX_REQUEST_SIZE
            if (size < SHARED_MIN or io_class in dispatcher.pinned
                    or size > MAX_REQUEST_SIZE):
                return None  # the pool's by the table
            shared = True  # the pool's if it takes it, if the rest is the common request
        else:
            shared = False
        first = offset >> shift
        blocks = size >> shift
        index = first & hpb_mask
        if index + blocks > hpb_mask + 1:  # the run spans two leaves
            return None
        block = leaf_start + (first >> hpb_bits)
        leaf = leaves.get(block)
        if leaf is None:
            return None
        verified, hits, path = rows_of.get(get_ident()) or rows()
        if shared:
            if not shared_read(buf, offset, size, leaf, index):
                return None
        elif path[slot] & sample_mask:
            if read_verify(fd, buf, offset, dbs, leaf, index * slot_size) != -1:
                return None
        else:
            started = perf_counter()
            if read_verify(fd, buf, offset, dbs, leaf, index * slot_size) != -1:
                return None
            latency.append(perf_counter() - started)
        try:  # noqa: SIM105 - as HashBlockCache.get: LRU order, evicted meanwhile
            leaves.move_to_end(block)
        except KeyError:
            pass
        verified[0] += blocks
        hits[0] += 1
        path[slot] += 1
        path[slot + 1] += size
        return True

    def shared_read(buf, offset: int, size: int, leaf, index: int) -> bool:
        """A request of an unpinned class that its threshold sends to the pool: when the
        pool does not take it (Dispatcher.read's rule), it is verified here, timed, and
        counted as busy inline (True); the pool's, and a read that failed here, go to the
        general path (False), which asks the pool afresh."""
        started = perf_counter()
        if dispatcher.pool().take(client, started):
            return False
        if read_verify(fd, buf, offset, dbs, leaf, index * slot_size) != -1:
            return False
        latency.append(perf_counter() - started)
        dispatcher.busy(io_class)
        return True

    native = getattr(_native, "FastRead", None)
    if native is None or switched_off(FAST_NATIVE_ENV):
        return fast
    # the same steps in one native frame; fast() answers what is over the threshold
    return native(verifier.digester.native, fd, dbs, hpb_bits, slot_size, leaf_start,
                  leaves, dispatcher, io_class, slot, latency, rows_of, rows, SAMPLE_EVERY,
                  fast).read


def bind_remote(connection) -> Callable[[object, int], object]:
    """The fast path of one connection to an image read over NBD (the verifier's
    fast_reads: an NBD source's read_idle): an aligned request under one leaf within its
    class's threshold, which reads nothing ahead (Readahead.random). Under a cached leaf
    it is read on a connection idle now and verified in the same native call
    (read_verify_idle: the GIL held only for the bookkeeping; else read_idle, then the
    general path's native verify); under a leaf not cached, the leaf's read is sent beside the
    data read (cold(): the general path's steps without its frames). A read the source
    fails is the general path's failure (Dispatcher.failed: counted, logged, raised);
    anything else it declines (no idle connection, reads sent ahead staged, a digest
    that differs) goes to the general path, which reads again."""
    (verifier, dispatcher, dbs, mask, shift, hpb_bits, hpb_mask, slot_size, leaf_start,
     leaves, io_class, slot, latency, rows_of, rows) = _bound(connection)
    hasher = verifier.digester.native
    verify = hasher.verify
    read_idle = verifier.fast_reads
    checked = verifier.fast_checked_reads  # read and verified in one native call, or None
    read_into, verify_blocks = verifier.data.read_into, verifier.verify_blocks
    beside_start = verifier.beside.start
    readahead = connection.readahead
    # a stream's requests in flight together read in shared chunks (sources/ahead.py)
    from_chunk = getattr(verifier.data, "from_chunk", None) if readahead is not None else None
    stats = dispatcher.stats
    sample_mask = SAMPLE_EVERY - 1

    def fast(buf, offset: int):
        size = len(buf)
        if offset & mask or size & mask or not size or size > dispatcher.table[io_class]:
            return None
        first = offset >> shift
        blocks = size >> shift
        index = first & hpb_mask
        if index + blocks > hpb_mask + 1:
            return None
        chunked = False
        if readahead is not None:
            if readahead.deep():  # requests of the connection in flight together
                chunked = from_chunk is not None
            elif not readahead.random(offset, size):
                return None  # a stream read ahead of (Readahead.before_read): the general path's
        block = leaf_start + (first >> hpb_bits)
        leaf = leaves.get(block)
        if leaf is None:
            return cold(buf, offset, first, blocks, chunked)
        started = perf_counter()
        at = index * slot_size
        try:
            if chunked and from_chunk(buf, offset):
                verdict = UNCHECKED
            elif checked is not None:
                verdict = checked(buf, offset, hasher, dbs, leaf, at)
                if verdict is None:
                    return None
            elif not read_idle(buf, offset):
                return None
            else:
                verdict = UNCHECKED
        except ImageIOError as error:  # the request's failure, as the general path's
            dispatcher.failed(error)
            stats.record(io_class, INLINE, size, perf_counter() - started)
            raise
        if verdict == UNCHECKED:
            verdict = verify(buf, dbs, leaf[at:at + blocks * slot_size])
        if verdict != -1:
            return None  # the general path reads it again, and reports it
        verified, hits, path = rows_of.get(get_ident()) or rows()
        if not path[slot] & sample_mask:
            latency.append(perf_counter() - started)
        try:  # noqa: SIM105 - as HashBlockCache.get: LRU order, evicted meanwhile
            leaves.move_to_end(block)
        except KeyError:
            pass
        verified[0] += blocks
        hits[0] += 1
        path[slot] += 1
        path[slot + 1] += size
        return True

    def cold(buf, offset: int, first: int, blocks: int, chunked: bool):
        """The leaf is not cached: its read (and any missing parent's) sent beside the
        data read (Beside.start: None when the hash source answers fast or has no free
        connection, and the general path decides), then the general path's own steps,
        without its frames: the fetch finished after the data, the run verified, counted
        and timed as Dispatcher.read counts and times it."""
        fetch = beside_start(first, blocks)
        if fetch is None:
            return None
        started = perf_counter()
        try:
            try:
                if not (chunked and from_chunk(buf, offset)) and not read_idle(buf, offset):
                    read_into(memoryview(buf), offset)
            finally:
                fetch.finish()  # also after a failed data read: it holds connections
            verify_blocks(memoryview(buf), first, blocks)
        except ImageIOError as error:
            dispatcher.failed(error)
            raise
        finally:
            stats.record(io_class, INLINE, len(buf), perf_counter() - started)
        return True

    return fast

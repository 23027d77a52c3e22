"""The fast path: the common read answered in one Python frame around one native call.

The common request is aligned, lies under one level-0 hash block whose verified copy is
cached, is verified inline (it fits its class's threshold, or it is a request of an
unpinned class that the learner, learn.py, sends inline), and no option that changes
the success path is in play (FEC, ignore-zero-blocks, check-at-most-once, Merkle
readahead, a data image that is not a local file, the pure-Python engine, a tree
without levels). For it the plugin's pread calls the function bind() made when the
connection opened; that function reads and verifies straight into nbdkit's buffer with
one read_verify call, passing the leaf whole with the slot's offset (no slice), and
counts what the general path would have counted.

Anything else returns False having counted nothing (but a learned request's choice,
below), and the request takes the general path (device.Connection.read), which stays
the reference: a request that fails here (a mismatch, a short read) is done again there
from the start, so its bytes, its error and its counters are the general path's own.
What the fast path counts (ctl stats) equals the general path's for the same request:
one cache hit, the blocks verified, one inline request of its class and its bytes.
Latency is sampled: one request in SAMPLE_EVERY per thread is timed (the first one
included), where the general path times every request.
A request over its class's threshold (an unpinned class's, LEARN_MIN or more) is chosen
here as Dispatcher.read would choose it, and counted once:
inline is served and timed here (its cost is the learner's sample, so every one is
timed), and the pool's (or an inline read that failed here) goes to the general path
with its choice handed on (Dispatcher.hand_on), so that it is not chosen twice.
Measured: eight clients' 512 KiB reads over a calibrated 256 KiB ran 0.88-0.91 of the
same server pinned all inline while the fast path took only requests within the
threshold, 0.94 once it took learned ones (docs/benchmarks.md, run O). One within its
threshold is answered inline without asking the learner, as before, where the general
path would ask it (a calibrated threshold of 512 KiB or more: the rule's pool for one
client's 512 KiB reads within one leaf is not taken; not changed, not measured).

Counts go into the per-thread rows of the same Tallies the general path uses (tally.py),
fetched once per thread and kept by thread ident, so a request does one dict look-up and
four in-place additions. The slot arithmetic is geometry's parent_slot inlined as shifts
(tests/server/test_fastpath.py compares every answer and counter with the general
path's, which uses parent_slot). NBD_VERITY_FAST_PATH=0
turns the fast path off, for the tests that run every suite on both paths and for
measuring it; it is not a setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from threading import get_ident
from time import perf_counter

from ..control.table import INLINE, POOL
from ..limits import MAX_REQUEST_SIZE
from ..schedule.learn import LEARN_MIN

FAST_PATH_ENV = "NBD_VERITY_FAST_PATH"  # 0: every request takes the general path
SAMPLE_EVERY = 64  # one request in this many (per thread and class) has its latency timed


def enabled(device) -> bool:
    """Whether the requests of a device (a device.Device) may take the fast path at all:
    its options and sources allow it, and the environment does not turn it off."""
    verifier = device.verifier
    return (os.environ.get(FAST_PATH_ENV, "") not in ("0", "false", "no", "off")
            and verifier.fast_path_ready and device.fec is None)  # ready: a local file


def never(buf, offset: int) -> bool:
    """The fast path of a connection that may not take it."""
    return False


def bind(connection) -> Callable[[object, int], bool]:
    """The fast path of one connection (a device.Connection, which calls this: not
    imported here, so that the import runs one way): fast(buf, offset) -> True when it
    answered the request (buf filled and verified), False when the general path must."""
    device = connection.device
    if connection.readahead is not None or not device.fast_path:
        return never
    verifier, dispatcher = device.verifier, device.dispatcher
    geo = verifier.geo
    dbs = geo.data_block_size
    mask, shift = dbs - 1, dbs.bit_length() - 1
    hpb_bits, slot_size = geo.hpb_bits, geo.slot_size
    hpb_mask = (1 << hpb_bits) - 1
    leaf_start = geo.level_start[0]
    leaves = device.cache.level(0)  # the level-0 LRU itself, never replaced
    read_verify = verifier.digester.native.read_verify
    fd = device.data.fd
    io_class = connection.io_class
    slot = dispatcher.stats.slot(io_class, INLINE)  # requests; bytes at slot + 1
    latency = dispatcher.stats.latency(io_class, INLINE)
    counters, cache, stats = verifier.counters, device.cache, dispatcher.stats
    learner, clock = dispatcher.learner, connection.clock
    connection_key = id(clock)  # as Dispatcher.read names the connection to the learner
    rows_of: dict[int, tuple[list[int], list[int], list[int]]] = {}
    sample_mask = SAMPLE_EVERY - 1

    def rows() -> tuple[list[int], list[int], list[int]]:
        """This thread's rows: data_blocks_verified at 0, cache hits at 0, path stats."""
        mine = rows_of[get_ident()] = (counters.row(), cache.row(), stats.row())
        return mine

    def fast(buf, offset: int) -> bool:
        size = len(buf)
        if offset & mask or size & mask or not size:
            return False
        if size > dispatcher.table[io_class]:  # thresholds <= MAX_REQUEST_SIZE
            if (size < LEARN_MIN or io_class in dispatcher.pinned
                    or size > MAX_REQUEST_SIZE):
                return False  # the pool's by the table
            learned = True  # the learner's (learn.py), if the rest is the common request
        else:
            learned = False
        first = offset >> shift
        blocks = size >> shift
        index = first & hpb_mask
        if index + blocks > hpb_mask + 1:  # the run spans two leaves
            return False
        block = leaf_start + (first >> hpb_bits)
        leaf = leaves.get(block)
        if leaf is None:
            return False
        verified, hits, path = rows_of.get(get_ident()) or rows()
        if learned:
            if not learned_read(buf, offset, size, leaf, index):
                return False
        elif path[slot] & sample_mask:
            if read_verify(fd, buf, offset, dbs, leaf, index * slot_size) != -1:
                return False
        else:
            started = perf_counter()
            if read_verify(fd, buf, offset, dbs, leaf, index * slot_size) != -1:
                return False
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

    def learned_read(buf, offset: int, size: int, leaf, index: int) -> bool:
        """A request of an unpinned class over its threshold: the learner chooses its path
        as Dispatcher.read would; inline is served here, timed as the general path times
        it (every request: its cost is a sample), and the pool's is handed on to the
        general path with the choice made, as is an inline read that failed here."""
        came = perf_counter()
        load = learner.load(connection_key, came)
        if learner.choose(io_class, size, POOL, load) != INLINE:
            dispatcher.hand_on(offset, size, POOL, load, came)
            return False
        if clock[0]:  # the connection's last learned request's cycle ends here
            dispatcher.learned(clock, came)
        started = perf_counter()
        if read_verify(fd, buf, offset, dbs, leaf, index * slot_size) != -1:
            dispatcher.hand_on(offset, size, INLINE, load, came)
            return False
        ended = perf_counter()
        latency.append(ended - started)
        clock[:] = [started, ended, size, (INLINE, load), io_class]
        return True

    return fast

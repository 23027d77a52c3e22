"""Data reads started ahead of a sequential stream on a source with latency (the page
cache's readahead, for an image read over a network).

A connection whose requests nbdkit serves one at a time (serialize-requests, the safe
model on nbdkit 1.32) still has its client's next requests queued behind the one being
served; on a source where each read waits, the stream would pay one wait per request.
AheadSource wraps such a source: the connection's readahead (read/readahead.py) asks it
to start the reads of the stream's next requests (ahead()), and the read that asks for
exactly one of them takes its bytes (read_into). An NBD source's reads are sent by the
asking thread and received by the taking one (NbdSource.submit: a connection of the
pool each, only if one is free now; no hand-off to another thread, which cost 75-110 us
of CPU per 128 KiB read over the read itself); another source's run on I/O threads.
Those bytes are untrusted like any other: the verifier hashes them in the request's
buffer before a byte is served, as it does what read_into returns. A read started ahead
that failed is read again by the request itself (its own error, or its own success).
Only when the source is slow (sources/latency.py): a fast one starts nothing.
Invariants: at most MAX_STAGED reads and MAX_STAGED_BYTES staged; one taken is gone; the
oldest not taken is dropped first (a sent one abandoned: its connection closed unread);
a taken read's buffer is reused (sources/buffers.py), a dropped one's is not (its read
may still be writing into it). The latency is sampled by the reads not staged (a staged
read's time is its stream's, not its source's).
Locking: one lock guards the staged reads (never held during I/O); the latency is
Latency's (one float).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ImageIOError
from .buffers import Buffers
from .latency import Latency

MAX_STAGED = 64  # reads started ahead and not yet taken, all streams together
MAX_STAGED_BYTES = 64 << 20  # ... and their bytes
IO_THREADS = 16
WAIT_SLICE_S = 0.25  # a staged read is waited for in slices, after each stopping() is asked


class _Stopping(Exception):
    """The server stops: the request fails now, without reading again."""


class AheadSource:
    """A source (NbdSource's interface) whose reads a stream may start ahead."""

    def __init__(self, source) -> None:
        self.source = source
        self.latency = Latency()
        self._staged: OrderedDict = OrderedDict()  # (offset, length) -> (read, sent at)
        self._bytes = 0  # staged
        self._lock = threading.Lock()
        self._io: ThreadPoolExecutor | None = None  # made at the first read ahead (after fork)
        self._buffers = Buffers()  # staging buffers, reused
        self._submit = getattr(source, "submit", None)  # an NBD source's: sent from here
        self._read_idle = getattr(source, "read_idle", None)  # an NBD source's: read_idle
        self._read_verify_idle = getattr(source, "read_verify_idle", None)  # ... and this
        self._closed = False
        if self._submit is not None:  # a request that finds no connection free takes one
            source.lender = self  # of ours; one staged for IDLE_S is let go (reclaim)

    def __getattr__(self, name):  # path, role, size, counters, stopping, ...
        return getattr(self.source, name)

    def waits(self) -> bool:
        return self.latency.slow()

    def ahead(self, offset: int, length: int) -> None:
        """Start reading length bytes at offset, unless that read is staged already."""
        key = (offset, length)
        with self._lock:
            if self._closed or key in self._staged or length > MAX_STAGED_BYTES:
                return
            if self._submit is None and self._io is None:
                self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="read-ahead")
            io = self._io
        if self._submit is None:
            read = io.submit(self._timed_read, length, offset)
        else:
            data = self._buffers.take(length)
            read = self._submit(length, offset, into=data)
            if read is None:  # no connection free now: the request reads it itself
                self._buffers.give_back(data)
                return
        dropped = []
        with self._lock:
            if self._closed or key in self._staged:  # closed, or staged by another meanwhile
                dropped.append(read)
            else:
                while self._staged and (len(self._staged) >= MAX_STAGED or
                                        self._bytes + length > MAX_STAGED_BYTES):
                    (_, size), (old, _) = self._staged.popitem(last=False)  # a stream gone
                    self._bytes -= size
                    dropped.append(old)
                self._staged[key] = (read, time.monotonic())
                self._bytes += length
        for old in dropped:
            _let_go(old)

    def _timed_read(self, length: int, offset: int) -> bytearray:
        data = self._buffers.take(length)
        started = time.perf_counter()
        self.source.read_into(memoryview(data), offset)
        self.latency.add(time.perf_counter() - started)
        return data

    def read_into(self, buf: memoryview, offset: int) -> None:
        with self._lock:
            staged = self._staged.pop((offset, len(buf)), None)
            if staged is not None:
                self._bytes -= len(buf)
                staged = staged[0]
        if staged is not None:
            try:
                data = self._result(staged)
                buf[:] = data
                self._buffers.give_back(data)
                return
            except _Stopping as e:
                raise ImageIOError(str(e)) from None
            except ImageIOError:
                stopping = getattr(self.source, "stopping", None)
                if stopping is not None and stopping():
                    raise  # the server stops: no read again
                # else read again: the request's own error, or its own success
        started = time.perf_counter()
        self.source.read_into(buf, offset)
        self.latency.add(time.perf_counter() - started)

    def read_idle(self, buf, offset: int) -> bool:
        """read_into on a connection idle now (NbdSource.read_idle), timed as read_into
        times its reads: False, having done nothing, while reads sent ahead are staged
        (read_into takes them) or when the source has no read_idle or no idle
        connection; else True, or read_into's ImageIOError."""
        read_idle = self._read_idle
        if self._staged or read_idle is None:
            return False
        started = time.perf_counter()
        if not read_idle(buf, offset):
            return False
        self.latency.add(time.perf_counter() - started)
        return True

    def read_verify_idle(self, buf, offset: int, hasher, block_size: int, slots,
                         at: int) -> int | None:
        """NbdSource.read_verify_idle, timed as read_idle: None, having done nothing,
        while reads sent ahead are staged or when the source has none (or no idle
        connection); else its verdict, or its ImageIOError."""
        read = self._read_verify_idle
        if self._staged or read is None:
            return None
        started = time.perf_counter()
        verdict = read(buf, offset, hasher, block_size, slots, at)
        if verdict is not None:
            self.latency.add(time.perf_counter() - started)
        return verdict

    def _result(self, staged):
        """A staged read's bytes, waited for in slices: a server stopping ends the wait
        (a sent read's wait is NbdSource's, which ends so too)."""
        if not isinstance(staged, Future):
            return staged.result()
        stopping = getattr(self.source, "stopping", None)
        while True:
            try:
                return staged.result(WAIT_SLICE_S)
            except TimeoutError:
                if stopping is not None and stopping():
                    raise _Stopping(f"{self.source.role}: read ahead abandoned, the "
                                    f"server is stopping") from None

    def reclaim(self, before: float | None) -> bool:
        """Free connections that reads sent ahead hold (NbdSource asks); whether any was.
        None: a request needs one now: the oldest sent read is received (its reply has
        been on its way longest) and stays staged, done. A time: the reads sent before
        it and never taken are let go (a stream that stopped)."""
        with self._lock:
            sent = [(key, since) for key, (read, since) in self._staged.items()
                    if _holds(read)]
            if before is None:
                sent = sent[:1]
            else:
                sent = [(key, since) for key, since in sent if since <= before]
            gone = [(key, since, self._staged.pop(key)[0]) for key, since in sent]
            self._bytes -= sum(key[1] for key, _, _ in gone)
        for key, since, read in gone:
            if before is not None:
                _let_go(read)
                continue
            try:
                data = read.result()
            except ImageIOError:
                continue  # the request that wants it reads it itself
            with self._lock:
                if not self._closed and key not in self._staged:
                    self._staged[key] = (_Done(data), since)
                    self._staged.move_to_end(key, last=False)  # still the oldest
                    self._bytes += key[1]
        return bool(gone)

    def read(self, size: int, offset: int) -> bytearray:
        buf = bytearray(size)
        self.read_into(memoryview(buf), offset)
        return buf

    def close(self) -> None:
        """The source first: its reads in flight end (NbdSource.close), then the threads."""
        with self._lock:
            self._closed = True
            io, self._io = self._io, None
            staged = [read for read, _ in self._staged.values()]
            self._staged.clear()
            self._buffers.clear()
            self._bytes = 0
        for read in staged:  # a sent read holds a connection the source no longer knows
            _let_go(read)
        self.source.close()
        if io is not None:
            io.shutdown(wait=True)


class _Done:
    """A sent read received before it was taken (reclaim), as a Future's result()."""

    __slots__ = ("data",)

    def __init__(self, data: bytearray) -> None:
        self.data = data

    def result(self, timeout: float | None = None) -> bytearray:
        return self.data


def _holds(read) -> bool:
    """Whether a staged read holds a connection of its source (a sent one, unreceived)."""
    return not isinstance(read, (Future, _Done))


def _let_go(read) -> None:
    """A staged read nobody will take: a sent one is abandoned (its connection closed
    unread); one on the I/O threads ends by itself."""
    if _holds(read):
        read.abandon()

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
A stream with requests in flight together (the parallel model) reads nothing ahead of
them that way (read/readahead.py, Readahead.deep), but its requests share reads: the fast
path's read of such a request (serve/fastpath.py) near the last one it read (within
CHUNK_REQUESTS requests of it, as that one was of its own: STREAK) takes its bytes from
its chunk (from_chunk): one read of CHUNK_REQUESTS requests' bytes aligned on their size
(at most MAX_CHUNK_BYTES), sent with the next chunk's read. The first request that needs
a chunk receives its read, the others wait for it; each copies its own bytes out,
verified by the fast path as any read. The storage sees a few large reads instead of
many small ones, as the kernel's block layer merges a stream's requests; the NBD
upstream's CPU per request was the difference (docs/decisions/fastpath.md). A chunk
whose read failed or could not be sent fails nobody: its requests read their bytes
themselves.
Invariants: at most MAX_STAGED reads and MAX_STAGED_BYTES staged, and MAX_CHUNKS chunks
(each read received by one thread, or let go: its connection closed unread); one taken is
gone; the oldest not taken is dropped first (a sent one abandoned: its connection closed
unread); a taken read's buffer (and a chunk's all requests took) is reused
(sources/buffers.py), a dropped one's is not (its read may still be writing into it).
The latency is sampled by the reads not staged (a staged read's time is its stream's,
not its source's) and by the chunks' reads.
Locking: one lock guards the staged reads, another the chunks (each chunk's condition is
on it); neither is held during I/O; the latency is Latency's (one float); where the last
fast-path read ended and the streak are not locked (a race costs a chunk not read, or
one read for a request that reads its own bytes after all).
"""

from __future__ import annotations

import os
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
CHUNK_REQUESTS = 8  # a stream's requests whose bytes one chunk read brings (a client's QD8)
MAX_CHUNK_BYTES = 1 << 20  # ... at most this many (fewer requests per chunk if larger)
MAX_CHUNKS = 8  # chunks kept, all streams together (the oldest let go first)
# reads in a row each near the one before that make a stream: one near by chance (4 KiB
# or 64 KiB random reads, one in 200 within 8 requests of the last) read a chunk, 7% more
# bytes from the upstream at 64 KiB QD4; two in a row by chance are one in 40000
STREAK = 2
CHUNKS_ENV = "NBD_VERITY_STREAM_CHUNKS"  # 0: every request reads its own bytes (measuring)


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
        self._seen_end = -1  # where the last fast-path read ended (a stream's next one near)
        self._streak = 0  # fast-path reads in a row near the one before
        # chunks of streams with requests in flight: start -> _Chunk, the oldest first
        self._chunks: OrderedDict = OrderedDict()
        self._chunk_lock = threading.Lock()
        # a stream's requests in flight together read in chunks (from_chunk), or None
        self.from_chunk = (self._from_chunk if self._submit is not None
                           and os.environ.get(CHUNKS_ENV, "1") != "0" else None)
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

    def _from_chunk(self, buf, offset: int) -> bool:
        """buf's bytes from its chunk, if it continues a stream on a slow source (within
        CHUNK_REQUESTS requests of the last fast-path read, which was so too: STREAK; the
        chunk not past MAX_CHUNK_BYTES, buf inside one chunk): True once buf holds them
        (unverified); False, having done nothing, if it is none of those, or its chunk's
        read failed (the request then reads them itself). The next chunk's read is sent
        too."""
        length = len(buf)
        seen, self._seen_end = self._seen_end, offset + length
        near = seen >= 0 and abs(offset - seen) <= CHUNK_REQUESTS * length
        self._streak = streak = self._streak + 1 if near else 0
        if streak < STREAK or not self.latency.slow():
            return False
        size = min(CHUNK_REQUESTS, MAX_CHUNK_BYTES // length) * length
        start = offset - offset % size if size >= 2 * length else -1
        if start < 0 or offset + length > start + size:
            return False
        total = self.source.size()
        lock = self._chunk_lock
        with lock:
            if self._closed:
                return False
            chunk = self._chunks.get(start)
            if chunk is None:
                chunk = self._chunks[start] = _Chunk(start, min(size, total - start), lock)
            chunk.readers += 1
            later = None
            if start + size < total and start + size not in self._chunks:
                later = self._chunks[start + size] = _Chunk(
                    start + size, min(size, total - start - size), lock)
            gone = [self._chunks.popitem(last=False)[1]
                    for _ in range(len(self._chunks) - MAX_CHUNKS)]
        for old in gone:
            old.let_go()
        try:
            self._send(chunk)
            if later is not None:
                self._send(later)
            self._receive(chunk)
            if chunk.ok:
                at = offset - start
                buf[:] = memoryview(chunk.data)[at:at + length]
            return chunk.ok
        finally:
            with lock:
                chunk.readers -= 1
                chunk.used += length
                if chunk.used >= chunk.length or not chunk.ok:  # every request had its bytes
                    if self._chunks.get(start) is chunk:
                        del self._chunks[start]
                    if chunk.ok and not chunk.readers:
                        self._buffers.give_back(chunk.data)

    def _send(self, chunk) -> None:
        """Send a chunk's read, once (one that cannot be sent is done, and not ok)."""
        with chunk.cond:
            if chunk.sent:
                return
            chunk.sent = True
        data = self._buffers.take(chunk.length)
        pending = self._submit(chunk.length, chunk.start, into=data)
        with chunk.cond:
            chunk.data, chunk.pending = data, pending
            chunk.sent_at = time.monotonic()
            gone = chunk.done  # let go meanwhile
            if pending is None and not gone:
                chunk.finish(False)
            chunk.cond.notify_all()
        if gone and pending is not None:
            pending.abandon()

    def _receive(self, chunk) -> None:
        """Wait until the chunk's read is done: received here by the first that needs it
        (timed as the source's other reads), waited for by the others."""
        with chunk.cond:
            while not chunk.done and chunk.pending is None:  # being sent by another
                chunk.cond.wait()
            receive = not (chunk.done or chunk.receiving)
            chunk.receiving = True
        if not receive:  # a latch, not the condition: no lock to take again once woken
            chunk.ready.acquire()
            chunk.ready.release()
            return
        ok = False
        started = time.perf_counter()
        try:
            chunk.pending.result()
            ok = True
            self.latency.add(time.perf_counter() - started)
        except ImageIOError:
            pass  # its requests read their bytes themselves
        finally:
            with chunk.cond:
                chunk.finish(ok)

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
        None: a request needs one now: the oldest chunk's read nobody waits for is let
        go, else the oldest sent read is received (its reply has been on its way
        longest) and stays staged, done. A time: the chunks' reads and the reads sent
        before it and never taken are let go (a stream that stopped)."""
        chunks = self._let_go_chunks(before)  # chunks' reads nobody waits for first
        if chunks and before is None:
            return True
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
        return bool(gone) or chunks

    def _let_go_chunks(self, before: float | None) -> bool:
        """Let go of chunk reads sent and not received (their connections closed unread):
        those sent before `before` (a stream that stopped), or with None the oldest one
        nobody waits for yet (a request needs a connection now); whether any was."""
        with self._chunk_lock:
            idle = [c for c in self._chunks.values() if c.pending is not None
                    and not c.receiving and not c.done and not c.readers]
            idle = idle[:1] if before is None else [c for c in idle if c.sent_at <= before]
            for c in idle:
                del self._chunks[c.start]
        for c in idle:
            c.let_go()
        return bool(idle)

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
        with self._chunk_lock:
            chunks = list(self._chunks.values())
            self._chunks.clear()
        for chunk in chunks:
            chunk.let_go()
        with self._lock:
            self._buffers.clear()
            self._bytes = 0
        for read in staged:  # a sent read holds a connection the source no longer knows
            _let_go(read)
        self.source.close()
        if io is not None:
            io.shutdown(wait=True)


class _Chunk:
    """One read of a stream's next requests' bytes, shared by them (_from_chunk)."""

    __slots__ = ("cond", "data", "done", "length", "ok", "pending", "readers", "ready",
                 "receiving", "sent", "sent_at", "start", "used")

    def __init__(self, start: int, length: int, lock: threading.Lock) -> None:
        self.start, self.length = start, length
        self.cond = threading.Condition(lock)  # the chunks' lock: its read sent
        self.ready = threading.Lock()  # held until done: its read's requests wait on it
        self.ready.acquire()
        self.data = self.pending = None
        self.sent = self.receiving = self.done = self.ok = False
        self.sent_at = 0.0
        self.readers = self.used = 0  # requests taking bytes now; bytes taken

    def let_go(self) -> None:
        """Nobody will receive it: its read abandoned (the connection closed unread, its
        buffer never reused), any request waiting for it reads its bytes itself."""
        with self.cond:
            if self.done or self.receiving:
                return
            pending, self.pending = self.pending, None
            self.finish(False)
        if pending is not None:
            pending.abandon()

    def finish(self, ok: bool) -> None:
        """Done (once, with cond held): its requests take their bytes, or read them."""
        self.ok, self.done = ok, True
        self.cond.notify_all()
        self.ready.release()


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

"""One NBD connection that carries many reads at once, for an upstream that does not
advertise multi-conn (NbdSource opens one connection to it, and the NBD protocol lets a
client have many requests in flight on it, as the kernel's nbd driver and qemu do).

Each reading thread sends its own request (libnbd's aio_pread into a buffer of the
read's own, copied into the caller's once answered) and waits for its reply; one thread
per process (started at the first read, so that none is lost in a fork) drives the
connection: it waits in select() on the socket
and on a wake-up pipe, and lets libnbd read the replies (aio_notify_read/write). libnbd
holds a handle's lock for the whole of its own poll, which would block every other
request for that long: here no libnbd call waits. The failure model is NbdSource's:
- a reply with an error fails that read; ESHUTDOWN (the server stops) drops the
  connection and raises _Shutdown, which NbdSource tries once more on a new one;
- a dropped connection fails every read in flight on it; the next read reconnects
  (`reconnects`);
- a read unanswered after timeout_s drops the connection (as a timed-out read does in the
  pool): its reads in flight fail. A waiter that finds the server stopping (or its own
  client gone) fails its request at once and leaves the read in flight: the reply lands
  in the read's own buffer, so the other clients' reads on the connection go on;
- idle for IDLE_S, the connection is closed (an upstream stopped with SIGTERM can exit).
Locking: one lock guards the handle, the reads in flight and the counters, and is held
for every libnbd call on the handle (none of them waits: the waiting is select()'s, which
runs without it). A read's buffer is its own until answered: no reply is written into
memory whose reader has gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import threading
import time

from ..errors import ImageIOError
from . import handles
from .buffers import Buffers

SLICE_S = 0.25  # select() and every waiter wake at least this often (deadlines, stopping)


class _Read:
    __slots__ = ("cookie", "data", "deadline", "done", "error")

    def __init__(self, data: bytearray, deadline: float) -> None:
        self.cookie = 0
        self.data = data  # libnbd writes here, never into the caller's buffer
        self.deadline = deadline
        self.done = threading.Event()
        self.error: ImageIOError | None = None


class Pipe:
    """Reads of one NbdSource on its one connection, many in flight at once."""

    def __init__(self, source, first, idle_s: float) -> None:
        self.source = source
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._connecting = threading.Lock()  # one handshake at a time
        self._h = first
        self._idle_since = time.monotonic()
        self._reads: dict[int, _Read] = {}  # cookie -> read in flight on self._h
        self._buffers = Buffers()  # read buffers, reused once answered
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._driver_pid = 0  # the process whose driver thread runs
        self._dropped = False  # a connection was lost since the last one was opened
        self._closed = False

    # -- readers ------------------------------------------------------------------------

    def read_into(self, piece: memoryview, offset: int, where) -> None:
        """One NBD read into piece; raises ImageIOError (or _Shutdown). where(): what its
        error message begins with (built only then)."""
        self.receive(self.send(len(piece), offset, where), piece, where)

    def send(self, length: int, offset: int, where) -> _Read:
        """Send one read of length bytes at offset; receive() waits for its bytes. Raises
        ImageIOError when it cannot be sent."""
        import nbd
        h = self._handle()
        read = _Read(self._buffers.take(length), time.monotonic() + self.source.timeout_s)
        with self._lock:
            if self._h is not h:
                raise ImageIOError(f"{where()}: connection lost")
            try:
                read.cookie = h.aio_pread(nbd.Buffer.from_buffer(read.data), offset)
            except nbd.Error as e:
                raise ImageIOError(f"{where()}: {e.string}") from None
            self._reads[read.cookie] = read
            start = self._driver_pid != os.getpid()
            if start:
                self._driver_pid = os.getpid()
            self._wake()  # the request may wait to be written: the driver's select says when
        if start:
            threading.Thread(target=self._drive, name="nbd-source-pipe", daemon=True).start()
        return read

    def receive(self, read: _Read, piece: memoryview, where) -> None:
        """Wait for a sent read's reply and copy its bytes into piece; raises ImageIOError
        (or _Shutdown)."""
        from .remote import _Shutdown
        while not read.done.wait(SLICE_S):
            if self.source.stopping():  # this request ends; its read, in flight, stays
                raise ImageIOError(f"{where()}: abandoned, the server is stopping")
        if read.error is not None:
            error = read.error
            if isinstance(error, _Shutdown):
                raise _Shutdown(f"{where()}: {error}")
            raise ImageIOError(f"{where()}: {error}")
        piece[:] = read.data
        self._buffers.give_back(read.data)

    def _handle(self):
        """The connection, opened (or reopened after a drop) by the first reader to need it."""
        with self._connecting:
            with self._lock:
                if self._closed:
                    raise ImageIOError(f"{self.source.role}: source closed")
                if self._h is not None:
                    return self._h
            h = self.source._connect()
            with self._lock:
                self._h = h
                self._idle_since = time.monotonic()
                replacing, self._dropped = self._dropped, False
            if replacing:
                self.source.count_reconnect()
            return h

    def _wake(self) -> None:
        """Wake the driver (under the lock: the pipe is closed under it, once)."""
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
                os.write(self._wake_w, b"x")

    def _close_pipe(self) -> None:
        """Under the lock: the wake-up pipe is closed, by the driver as it ends (or by
        close() where none runs)."""
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the driver ---------------------------------------------------------------------

    def _drive(self) -> None:
        import nbd
        while True:
            idle = None
            with self._lock:
                if self._closed:
                    self._close_pipe()
                    return
                h = self._h
                if h is not None and not self._reads and \
                        time.monotonic() - self._idle_since > self.idle_s:
                    self._h, idle, h = None, h, None  # an upstream that stops may exit
                if h is not None:
                    fd, direction = h.aio_get_fd(), h.aio_get_direction()
                wake = self._wake_r
            if idle is not None:  # closed outside the lock: a goodbye may wait
                handles.close(idle)
            rd, wr = [wake], []
            if h is not None:
                if direction & nbd.AIO_DIRECTION_READ:
                    rd.append(fd)
                if direction & nbd.AIO_DIRECTION_WRITE:
                    wr.append(fd)
            readable, writable, _ = select.select(rd, wr, [], SLICE_S)
            if wake in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake, 4096)
            if h is not None:
                self._advance(h, fd in readable, fd in writable)

    def _advance(self, h, readable: bool, writable: bool) -> None:
        """Let libnbd read and write what it can, then finish the answered reads."""
        import nbd

        from .remote import _is_dead, _Shutdown
        with self._lock:
            if self._h is not h:
                return
            try:
                if readable:
                    h.aio_notify_read()
                if writable:
                    h.aio_notify_write()
            except nbd.Error:
                pass  # the connection's state says the rest
            shutdown, answered = False, 0
            for cookie, read in list(self._reads.items()):
                try:
                    if not h.aio_command_completed(cookie):
                        continue
                except nbd.Error as e:
                    shutdown = shutdown or e.errnum == errno.ESHUTDOWN
                    read.error = (_Shutdown if e.errnum == errno.ESHUTDOWN
                                  else ImageIOError)(e.string)
                del self._reads[cookie]
                read.done.set()
                answered += 1
            if answered and not self._reads:
                self._idle_since = time.monotonic()
            now = time.monotonic()
            late = any(read.deadline < now for read in self._reads.values())
        if shutdown or late or _is_dead(h):
            self._drop(h, f"no reply in {self.source.timeout_s:g} s" if late
                       else "connection lost")

    def _drop(self, h, why: str) -> None:
        """Close h (if still the connection) and fail every read in flight on it."""
        with self._lock:
            if self._h is not h:
                return
            self._h = None
            self._dropped = True
            handles.close(h, disconnect=False)  # no reply lands in a buffer after this
            reads, self._reads = self._reads, {}
        for read in reads.values():
            if read.error is None:
                read.error = ImageIOError(why)
            read.done.set()

    def close(self) -> None:
        """Close the connection (reads in flight fail) and end the driver."""
        with self._lock:
            self._closed = True
            h, self._h = self._h, None
            reads, self._reads = self._reads, {}
            if h is not None and reads:  # no goodbye: no reply lands in their buffers
                handles.close(h, disconnect=False)
                h = None
            if self._driver_pid == os.getpid():
                self._wake()  # the driver ends, and closes the pipe
            elif self._wake_r >= 0:
                self._close_pipe()
        if h is not None:  # idle: a goodbye, outside the lock
            handles.close(h)
        for read in reads.values():
            read.error = ImageIOError("source closed")
            read.done.set()

"""Image bytes from an NBD server (nbd://, nbds://, nbd+unix://), and the one factory that
opens a data or hash source from its text (open_source): a URI, or a local path.

Everything read here is untrusted, like a local file: the verifier checks it before any byte is
served. What this module adds is the failure model of a network:
- a read goes straight into the caller's buffer (nbd.Buffer.from_buffer shares the memoryview:
  no copy) with libnbd's asynchronous pread, and the GIL is released while libnbd waits (its
  bindings release it in every call);
- a read that fails, times out or finds the connection dropped raises ImageIOError (the plugin's
  EIO for that request only); a dropped or timed-out connection is closed and the next read
  opens a new one (`reconnects`); both are counted for `ctl stats`;
- a connection whose server answers ESHUTDOWN (an nbdkit stopping on SIGTERM answers every
  request so, and cannot exit while we hold the connection) is dead too: it is closed, and the
  read is tried once more on a new connection, so a server restarted on the same socket serves
  the very next read;
- connecting has the same deadline as a read (a listener that accepts but never speaks fails
  that read with EIO), and every wait is cut into POLL_SLICE_MS slices after each of which
  `stopping()` is asked (the plugin passes one that asks nbdkit whether it is shutting down or
  the client has gone), so SIGTERM stops the server promptly whatever the upstream does;
- parallel requests use a pool of connections, each carrying one request at a time and opened
  only when requests overlap, up to DEFAULT_CONNECTIONS, but only if the upstream advertises
  multi-conn (NBD_FLAG_CAN_MULTI_CONN); otherwise one connection that carries every read in
  flight at once (pipe.py).
  The bound is nbdkit's default of 16 threads per client: a handle per busy thread, none for
  idle ones (docs/benchmarks.md, "Connections to an NBD source", has the measurements);
- a connection idle for IDLE_S is closed (by a thread of the pool's, started with the first read
  in the process that serves): an upstream stopped with SIGTERM while nobody read cannot exit
  while we hold its connection, and one that is not stopping costs a handshake at the next read.
The pool's lock guards the number of open connections, the waiters and the counters; it is
never held during I/O. The idle list is changed only by single list operations (append, pop,
remove), each atomic under the GIL, so that a request takes and gives back its connection
without the lock: with 16 requests in flight, the lock's bookkeeping (twice per request)
had the other threads wait for the GIL more (docs/benchmarks.md, "The pool's lock off the
request's way").
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import re
import threading
import time
import urllib.parse

from ..errors import ConfigError, ImageIOError, VerityError
from ..limits import MAX_REQUEST_SIZE
from . import handles
from .pipe import Pipe
from .source import ImageFile

URI_SCHEMES = ("nbd", "nbds", "nbd+unix", "nbds+unix")
REMOTE_SCHEMES = ("http", "https", "s3")  # read through a captive nbdkit (upstream.py)
DEFAULT_CONNECTIONS = 16  # pool bound with multi-conn: nbdkit's threads per client
READ_TIMEOUT_S = 60.0  # a read taking longer is an error and its connection is dropped
DRAIN_S = 5.0  # after an ESHUTDOWN, connections are not kept idle for this long
POLL_SLICE_MS = 250  # libnbd poll timeout per wait, so the deadline and stopping() are checked
IDLE_S = 5.0  # a connection idle this long is closed (one stopping upstream exits then)
UNCHECKED = -2  # read_verify_idle: buf holds the bytes, not verified (the caller checks)


def is_uri(text: str) -> bool:
    """Whether an image is named by an NBD URI (else it is a local path)."""
    return urllib.parse.urlsplit(text).scheme in URI_SCHEMES


def is_url(text: str) -> bool:
    """Whether an image is named by any URL we read (NBD, HTTP(S), S3): not a local path,
    so nothing about it (sidecars above all) is ever looked up in the file system."""
    return urllib.parse.urlsplit(text).scheme in URI_SCHEMES + REMOTE_SCHEMES


def redacted(uri: str) -> str:
    """A URI for messages, without the user part (NBD URIs may carry a TLS user name)."""
    parts = urllib.parse.urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def basic_auth(url: str) -> dict[str, str]:
    """The header curl sends for an http(s) URL's user:password@ (HTTP basic auth); {}
    without a user part."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    pair = (f"{urllib.parse.unquote(parts.username)}:"
            f"{urllib.parse.unquote(parts.password or '')}")
    return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode("ascii")}


HIDDEN = "***"  # what messages show for a user part or a query
# Any URL in a message: up to white space or a quote, and not the punctuation after it
# ("URL: reason", "[URL]").
URL_IN_TEXT = re.compile(r"\b(?:https?|s3|nbds?(?:\+unix)?)://[^\s'\"<>]*[^\s'\"<>:,;.)\]]")


def redact(url: str) -> str:
    """URL for messages: its user part and (but for an NBD URI's socket= and tls- keys,
    file names) its query shown as ***; a local path as it is."""
    parts = urllib.parse.urlsplit(url)
    if "://" not in url or not parts.scheme:
        return url
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{HIDDEN}@{host}" if "@" in parts.netloc else host
    query = parts.query if parts.scheme in URI_SCHEMES or not parts.query else HIDDEN
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def redact_text(text: str) -> str:
    """TEXT with every URL in it redacted (a message built from others' messages)."""
    return URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


@contextlib.contextmanager
def redacting():
    """Redact the URLs in the message of any VerityError raised inside: the CLI's last
    guard, for messages made below us (a sidecar's parser, boto3) from a URL."""
    try:
        yield
    except VerityError as e:
        e.args = tuple(redact_text(a) if isinstance(a, str) else a for a in e.args)
        raise


def open_source(text: str, role: str, stopping=None, timeout_s: float = READ_TIMEOUT_S):
    """The source of the data or hash image: NbdSource for a URI, else ImageFile.
    stopping() says whether a wait on an NBD server should give up (server shutdown);
    timeout_s bounds each connect and read there."""
    if is_uri(text):
        return NbdSource(text, role, timeout_s=timeout_s, stopping=stopping)
    return ImageFile(text, role)


def _never() -> bool:
    return False


_pid = [os.getpid()]  # this process's pid, without a system call per give-back


def forked() -> None:
    """After a fork: this process's pid anew (os.fork calls it; nbdkit's own fork, when
    it goes into the background, is not Python's: serve's after_fork calls it)."""
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=forked)


class _Shutdown(ImageIOError):
    """The server answered ESHUTDOWN: it is stopping, and this connection is dead."""


class NbdSource:
    """A read-only image on an NBD server, with ImageFile's interface."""

    def __init__(self, uri: str, role: str, connections: int = DEFAULT_CONNECTIONS,
                 timeout_s: float = READ_TIMEOUT_S, stopping=None) -> None:
        self.path = uri  # as ImageFile.path: what messages name
        self.role = role
        self.timeout_s = timeout_s
        self.stopping = stopping or _never
        self.source_errors = 0  # reads that failed (each one an EIO or a skipped readahead)
        self.reconnects = 0  # connections opened to replace a dropped one
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)
        # (handle, idle since, monotonic), the newest last; never replaced, changed only
        # by append, pop and remove (atomic under the GIL: taken and given back unlocked)
        self._idle: list = []
        self._waiting = 0  # threads in _take's wait (a give-back then notifies them)
        self._open = 0  # connections in existence (idle or in use)
        self._dropped = False  # a connection was lost since the last one was opened
        self._drain_until = 0.0  # after an ESHUTDOWN: keep no connection idle until then
        self._closed = threading.Event()  # close(): every wait ends, no read starts
        self._closing = False  # set just before _closed: read by every give-back
        first = self._connect()  # start-up: a refused connection is a clear error here
        self._size = first.get_size()
        self.multi_conn = bool(first.can_multi_conn())
        self.max_connections = max(1, connections) if self.multi_conn else 1
        self._max_read = _max_read_size(first)
        import nbd
        self._shared, self._nbd_error = nbd.Buffer.from_buffer, nbd.Error  # read_idle's
        self._open = 1
        # without multi-conn: the one connection carries every read in flight (pipe.py)
        self._pipe = None if self.multi_conn else Pipe(self, first, IDLE_S)
        if self.multi_conn:
            self._idle.append((first, time.monotonic()))
        self._reaper_pid = 0  # the process whose reaper thread runs (none survives a fork:
        # it is started anew by the first give-back after one, which forked() tells)
        # who holds connections with reads sent and not yet taken (sources/ahead.py):
        # lender.reclaim(before) lets go of those sent before `before` (None: receives
        # the oldest one), and says whether it freed any
        self.lender = None

    # -- connections ------------------------------------------------------------------

    def _connect(self):
        """A new connection, its handshake done within timeout_s (asynchronously: a
        server that accepts and never speaks cannot hold us), or ImageIOError."""
        import nbd  # Debian python3-libnbd; only servers with NBD sources need it
        h = nbd.NBD()
        h.set_pread_initialize(False)  # the bytes are verified or the request fails
        where = f"{self.role}: {redacted(self.path)}"
        try:
            h.aio_connect_uri(self.path)
            self._wait(h, lambda: not h.aio_is_connecting(), lambda: where, "no handshake")
            if not h.aio_is_ready():
                raise ImageIOError(f"{where}: {nbd.get_error() or 'connection failed'}")
        except nbd.Error as e:
            _close(h)
            raise ImageIOError(f"{where}: {e.string}") from None
        except ImageIOError:
            _close(h)
            raise
        return h

    def _wait(self, h, done, where, what: str) -> None:
        """Poll h until done(), within timeout_s; a wait past it, or while stopping(),
        abandons the handle (the caller closes it) and raises ImageIOError (its text
        begins with where(), built only then)."""
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                _abandon(h)
                raise ImageIOError(f"{where()}: {what} in {self.timeout_s:g} s")
            if h.poll(POLL_SLICE_MS) == 0 and (self.stopping() or self._closed.is_set()):
                _abandon(h)
                raise ImageIOError(f"{where()}: abandoned, the server is stopping")

    def _take(self, wait: bool = True):
        """An idle connection, a new one (up to the limit), or wait for one (wait False:
        None rather than wait)."""
        while True:
            with self._free:
                if self._closed.is_set():
                    raise self._stopping_error()
                try:  # unlocked takers pop too: an empty list raises, never a stale entry
                    return self._idle.pop()[0]
                except IndexError:
                    pass
                if self._open < self.max_connections:
                    self._open += 1
                    replacing = self._dropped
                    self._dropped = False
                    break
                if not wait:
                    return None
                self._wait_for_one()
        try:
            h = self._connect()
        except ImageIOError:
            with self._free:
                self._open -= 1
                self._dropped = self._dropped or replacing
                self.source_errors += 1
                self._free.notify()
            raise
        if replacing:
            with self._lock:
                self.reconnects += 1
        return h

    def _stopping_error(self) -> ImageIOError:
        """The error of a request abandoned because the server stops (counted)."""
        self.source_errors += 1
        return ImageIOError(f"{self.role}: {redacted(self.path)}: abandoned, "
                            f"the server is stopping")

    def _wait_for_one(self) -> None:
        """With the lock held, none idle and every connection open: let reads sent ahead
        give way (the lender), else wait one poll slice for a give-back; ImageIOError
        when the server is stopping. _waiting is counted before the idle list is looked at
        again, so that a connection given back unlocked after that look notifies."""
        if self.lender is not None:
            self._free.release()  # reads sent ahead give way to this one
            try:
                freed = self.lender.reclaim(None)
            finally:
                self._free.acquire()
            if freed:
                return
        self._waiting += 1
        try:
            if self._idle or self._closed.is_set():
                return
            # in slices, as _wait: a server stopping ends this wait too
            if not self._free.wait(POLL_SLICE_MS / 1000) and self.stopping():
                raise self._stopping_error()
        finally:
            self._waiting -= 1

    def _give_back(self, h, broken: bool) -> None:
        """Return a connection to the pool, or close it if it can no longer be trusted to
        answer (dropped, timed out with a request in flight). For DRAIN_S after a server
        said it is shutting down, every connection is closed after its request: one opened
        meanwhile may be to that same dying server, which cannot exit while we hold it.
        The common give-back takes no lock: one append, and the lock only to notify a
        waiter (_wait_for_one) or to start this process's reaper."""
        now = time.monotonic()
        if not broken and now >= self._drain_until and not self._closing:
            self._idle.append((h, now))
            if self._closing:  # closed meanwhile: close() may have missed it
                for stale in self._take_idle(float("inf")):
                    _close(stale)
            if self._waiting or self._reaper_pid != _pid[0]:
                self._notify_idle()
            return
        _close(h)
        with self._free:
            self._open -= 1
            self._dropped = True
        self._notify_idle()  # a waiter may open one in its place

    def _notify_idle(self) -> None:
        """A connection was given back (or closed): wake a waiter; the first give-back in
        this process starts its one reaper."""
        with self._free:
            self._free.notify()
            reaper = self._reaper_pid != _pid[0] and not self._closed.is_set()
            if reaper:
                self._reaper_pid = _pid[0]
        if reaper:
            threading.Thread(target=self._reap, name="nbd-source-idle", daemon=True).start()

    def _reap(self) -> None:
        """Close the connections idle for IDLE_S, until close()."""
        while not self._closed.wait(IDLE_S / 4):
            if self.lender is not None:  # reads sent ahead and never taken
                self.lender.reclaim(time.monotonic() - IDLE_S)
            stale = self._take_idle(time.monotonic() - IDLE_S)
            for h in stale:
                _close(h)

    def _take_idle(self, before: float) -> list:
        """Take the connections idle since before from the pool; the caller closes them."""
        with self._free:
            stale = []
            for entry in [e for e in self._idle if e[1] <= before]:
                try:  # a request may have taken it meanwhile, unlocked
                    self._idle.remove(entry)
                except ValueError:
                    continue
                stale.append(entry[0])
            if stale:
                self._open -= len(stale)
                self._free.notify(len(stale))  # a waiter may open one in their place
        return stale

    # -- ImageFile's interface --------------------------------------------------------

    def size(self) -> int:
        return self._size

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill buf with the bytes at offset, or raise ImageIOError (counted)."""
        total = len(buf)
        if offset + total > self._size:
            with self._lock:
                self.source_errors += 1
            raise ImageIOError(f"{self.role} image {redacted(self.path)} ends at byte "
                               f"{self._size}, {offset + total} needed")
        read = self._read_on_one if self._pipe is None else self._read_on_pipe
        try:
            read(buf, offset)
        except _Shutdown:  # that server is going: once more, on a new connection
            read(buf, offset)

    def read_idle(self, buf, offset: int) -> bool:
        """read_into on a connection idle now, in one frame (serve/fastpath.py's remote
        read): False, having done nothing, when none is idle, the read is longer than one
        request, or the connections are a pipe; else True once buf holds the bytes, or
        the ImageIOError read_into would raise (counted; one more try on a new connection
        after a server said it stops). Its wait is _finish's once a poll slice passed
        without a reply (deadline from then on)."""
        return self._on_idle(buf, offset, self._read_in_slices, ()) is not None

    def read_verify_idle(self, buf, offset: int, hasher, block_size: int, slots,
                         at: int) -> int | None:
        """read_idle and the check of its bytes against slots (from byte at on) in one
        native call, the GIL released once (Hasher.nbd_read_verify: libnbd's read, its
        wait for one poll slice and the hashing): None, having done nothing, where
        read_idle returns False; else the verdict (-1: every block matches; else the
        index of the first that differs), or UNCHECKED when buf holds the bytes
        unverified (no reply within the slice: read_idle's wait from then on; or read
        again after a server said it stops); or read_idle's ImageIOError."""
        h = self._pop_idle(buf, offset)
        if h is None:
            return None
        try:
            got = hasher.nbd_read_verify(h._o, buf, offset, block_size, slots, at,
                                         POLL_SLICE_MS)
        except BaseException:
            self._give_back(h, True)
            raise
        if got.__class__ is int:  # the common answer: no frame but the give-back's
            self._give_back(h, False)
            return got
        return self._on_taken(h, buf, offset, self._settle, (got,))

    def _on_idle(self, buf, offset: int, read, args: tuple):
        """read(h, buf, offset, *args) on a connection idle now: None, having done
        nothing, when there is none (or the read is longer than one request, or the
        connections are a pipe); else _on_taken's answer."""
        h = self._pop_idle(buf, offset)
        return None if h is None else self._on_taken(h, buf, offset, read, args)

    def _pop_idle(self, buf, offset: int):
        """A connection idle now, taken for buf's read at offset without the lock (one
        pop, atomic under the GIL); None when there is none, the read is longer than one
        request, or the connections are a pipe."""
        if self._pipe is not None or offset + len(buf) > self._size or \
                len(buf) > self._max_read:
            return None
        try:
            return self._idle.pop()[0]
        except IndexError:
            return None

    def _on_taken(self, h, buf, offset: int, read, args: tuple):
        """read(h, buf, offset, *args) on h, taken from the idle ones: what read returned,
        UNCHECKED after one more try on a new connection (a server said it stops), or the
        ImageIOError (counted; the connection closed if broken, else given back)."""
        broken = again = True
        try:
            got = read(h, buf, offset, *args)
            broken = again = False
        except _Shutdown as error:
            broken = self._failed(h, error)
        except ImageIOError as error:
            broken = self._failed(h, error)
            raise
        finally:
            self._give_back(h, broken)
        if again:  # that server is going: once more, on a new connection
            self._read_on_one(buf, offset)
            return UNCHECKED
        return got

    def _read_in_slices(self, h, buf, offset: int) -> int:
        """libnbd's read into buf on h, polled in slices; UNCHECKED, or ImageIOError."""
        try:
            cookie = h.aio_pread(self._shared(buf), offset)
            while not h.aio_command_completed(cookie):
                if not h.poll(POLL_SLICE_MS):  # a slice without a reply: the deadline
                    self._finish(h, cookie, offset)  # and stopping() from here on
                    break
        except self._nbd_error as e:
            raise _read_error(e.errnum, e.string, self._where(offset)) from None
        return UNCHECKED

    def _settle(self, h, buf, offset: int, got: tuple) -> int:
        """What nbd_read_verify answered other than a verdict: the read in flight after a
        slice without a reply (then waited for as _read_in_slices waits: UNCHECKED), or
        its failure (errno, message) as ImageIOError."""
        if len(got) == 1:  # in flight after a slice: the deadline and stopping()
            self._finish(h, got[0], offset)
            return UNCHECKED
        raise _read_error(got[0], got[1], self._where(offset))  # (errno, message)

    def _read_on_one(self, buf: memoryview, offset: int) -> None:
        """The read on one connection of the pool (given back, or closed if broken)."""
        h = self._take()

        def pieces() -> None:
            for start in range(0, len(buf), self._max_read):
                self._pread(h, buf[start:start + self._max_read], offset + start)
        self._using(h, pieces)

    def _using(self, h, work) -> None:
        """work() on h, a connection taken from the pool: given back after it, or closed
        if a failure (counted) left it broken."""
        broken = True
        try:
            work()
            broken = False
        except ImageIOError as error:
            broken = self._failed(h, error)
            raise
        finally:
            self._give_back(h, broken)

    def _failed(self, h, error: ImageIOError) -> bool:
        """Count a read on h that failed; whether h is broken (closed, not given back):
        dead, its server stopping (_Shutdown, after which the pool keeps no connection
        idle for DRAIN_S), or a read still in flight on it (the wait failed, not the
        read: its reply would land in a buffer that is no longer the reader's)."""
        with self._lock:
            self.source_errors += 1
            if isinstance(error, _Shutdown):
                self._drain_until = time.monotonic() + DRAIN_S
                return True
        return _is_dead(h) or _in_flight(h)

    def _read_on_pipe(self, buf: memoryview, offset: int) -> None:
        """The read on the one connection, beside the others in flight (pipe.py)."""
        try:
            for start in range(0, len(buf), self._max_read):
                at = offset + start
                self._pipe.read_into(buf[start:start + self._max_read], at,
                                     lambda at=at: self._where(at))
        except ImageIOError:
            with self._lock:
                self.source_errors += 1
            raise

    def count_reconnect(self) -> None:
        with self._lock:
            self.reconnects += 1

    def _where(self, offset: int) -> str:
        """What a failed read's message begins with (built only when one fails)."""
        return f"{self.role} image {redacted(self.path)}: read at byte {offset}"

    def _pread(self, h, piece: memoryview, offset: int) -> None:
        """One NBD read into piece (shared, not copied); raises ImageIOError. A timed-out
        read leaves its connection dead (closed by the caller)."""
        import nbd
        try:
            cookie = h.aio_pread(nbd.Buffer.from_buffer(piece), offset)
        except nbd.Error as e:
            raise _read_error(e.errnum, e.string, self._where(offset)) from None
        self._finish(h, cookie, offset)

    def _finish(self, h, cookie: int, offset: int) -> None:
        """Wait for the read cookie on h; raises ImageIOError (a timed-out read leaves h
        dead: closed by the caller)."""
        import nbd
        try:
            self._wait(h, lambda: h.aio_command_completed(cookie),
                       lambda: self._where(offset), "no reply")
        except nbd.Error as e:
            raise _read_error(e.errnum, e.string, self._where(offset)) from None

    def submit(self, length: int, offset: int, into: bytearray | None = None) -> Pending | None:
        """Start reading length bytes at offset (into `into`, else a new buffer) on a
        connection free now, and return at once; the Pending's result() waits for them on
        the caller's thread (no hand-off to another): read/beside.py's hash reads, in
        flight beside the request's data read, and sources/ahead.py's reads of a stream's
        next requests. None when no connection is free (a caller holding one never waits
        for another), the read is longer than one request, or it cannot be sent: the
        caller reads it itself then, with its own error. A Pending holds its connection
        until result() (any failure is its ImageIOError, counted) or abandon(): one of
        the two, always."""
        if offset + length > self._size or length > self._max_read:
            return None
        data = bytearray(length) if into is None else into
        if self._pipe is not None:
            return self._submit_on_pipe(data, offset)
        import nbd
        try:
            h = self._take(wait=False)
        except ImageIOError:  # closed, or no connection to be had (counted)
            return None
        if h is None:
            return None
        try:
            cookie = h.aio_pread(nbd.Buffer.from_buffer(data), offset)
        except nbd.Error:
            self._give_back(h, _is_dead(h))
            return None

        def result() -> bytearray:
            self._using(h, lambda: self._finish(h, cookie, offset))
            return data

        def abandon() -> None:  # its reply is not awaited: the connection goes with it
            handles.close(h, disconnect=False)  # no reply lands in data after this
            with self._free:
                self._open -= 1
                self._free.notify()
        return Pending(result, abandon)

    def _submit_on_pipe(self, data: bytearray, offset: int) -> Pending | None:
        """submit() on the one connection: sent now, received by result()."""
        try:
            read = self._pipe.send(len(data), offset, lambda: self._where(offset))
        except ImageIOError:
            return None

        def result() -> bytearray:
            try:
                self._pipe.receive(read, memoryview(data), lambda: self._where(offset))
            except ImageIOError:
                with self._lock:
                    self.source_errors += 1
                raise
            return data
        return Pending(result)

    def read(self, size: int, offset: int) -> bytearray:
        buf = bytearray(size)
        self.read_into(memoryview(buf), offset)
        return buf

    def counters(self) -> dict:
        with self._lock:
            return {"source_errors": self.source_errors, "reconnects": self.reconnects}

    def reset_counters(self) -> None:
        with self._lock:
            self.source_errors = self.reconnects = 0

    def close(self) -> None:
        self._closing = True
        self._closed.set()
        if self._pipe is not None:
            self._pipe.close()
        for h in self._take_idle(float("inf")):
            _close(h)


class Pending:
    """One read NbdSource.submit() started: result() (called once) waits for its bytes,
    or raises its ImageIOError; abandon(), instead, lets it go unread (its buffer may
    still be written: never reuse it)."""

    __slots__ = ("abandon", "result")

    def __init__(self, result, abandon=None) -> None:
        self.result = result
        self.abandon = abandon or _nothing


def _nothing() -> None:
    pass


def _read_error(errnum: int, text: str, where: str) -> ImageIOError:
    """libnbd's error of a read as ours: _Shutdown for ESHUTDOWN (the server stops)."""
    if errnum == errno.ESHUTDOWN:
        return _Shutdown(f"{where}: {text}")
    return ImageIOError(f"{where}: {text}")


def _max_read_size(h) -> int:
    """The largest read the server takes (its advertised maximum, else 32 MiB)."""
    import nbd
    try:
        advertised = h.get_block_size(nbd.SIZE_MAXIMUM)
    except nbd.Error:
        advertised = 0
    return min(advertised, MAX_REQUEST_SIZE) if advertised > 0 else MAX_REQUEST_SIZE


def _abandon(h) -> None:
    """Give up a handle's pending work and connection (it is closed by the caller)."""
    import nbd
    with contextlib.suppress(nbd.Error):  # not connected yet: closing is enough
        h.shutdown(nbd.SHUTDOWN_ABANDON_PENDING)


def _is_dead(h) -> bool:
    """Whether a handle lost its connection (a server-side error leaves it usable)."""
    try:
        return bool(h.aio_is_dead() or h.aio_is_closed())
    except Exception:  # a handle we cannot ask is not reused
        return True


def _in_flight(h) -> bool:
    """Whether a handle still has a command in flight (one that failed has retired)."""
    try:
        return h.aio_in_flight() > 0
    except Exception:  # a handle we cannot ask is not reused
        return True


def _close(h) -> None:
    """Disconnect and free a handle now, once, on every libnbd (sources/handles.py)."""
    handles.close(h)


def check_uri(key: str, text: str) -> str:
    """A URI as a plugin key's value: one of the NBD schemes, with a socket for +unix."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in URI_SCHEMES:
        raise ConfigError(f"{key}: {text!r} is not an NBD URI ({', '.join(URI_SCHEMES)})")
    if parts.scheme.endswith("+unix") and "socket=" not in parts.query:
        raise ConfigError(f"{key}: {text!r} names no socket (?socket=PATH)")
    return text

"""The control socket's server: a Unix socket that carries protocol.py's lines.

Only root and the server's own user may talk to it: the socket is created 0600 and each
peer's uid is checked with SO_PEERCRED. A stale socket file is replaced only after a
connect to it is refused. The listening socket is bound in get_ready (errors stop
start-up with one line); its thread starts in after_fork (threads die with a fork).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import selectors
import socket
import stat
import struct
import threading
import time
from concurrent.futures import Future

from ..errors import ConfigError
from ..log import log
from .protocol import MAX_REQUEST_LINE, Control

MAX_CLIENTS = 64  # connected at once; the longest idle one makes room for a new one
MAX_PENDING_REPLY = 1 << 20  # bytes of replies a client may leave unread
IDLE_TIMEOUT = 10.0  # seconds a client may stay silent before the server closes it
MAX_LINES_PER_TURN = 16  # lines of one client answered before the others get their turn
RATE_PER_S = 100  # requests a client may make per second, on average...
RATE_BURST = 100  # ...and at once; beyond that each request is refused with RATE_ERROR
ACCEPT_BACKOFF = 0.1  # seconds the listener rests when accept() fails and nothing can give
ACCEPT_LOG_INTERVAL = 60.0  # seconds between two log lines about a failing accept()
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
RATE_ERROR = f"rate: too many requests (at most {RATE_PER_S} per second per connection)"


class ControlServer:
    """A Unix socket serving Control to local peers of the right uid.

    One thread multiplexes every client (selectors): nothing is held per client but its
    socket and buffers, so there is no per-client thread to run out of. A client that
    sends nothing for IDLE_TIMEOUT seconds is closed, and when MAX_CLIENTS are connected
    the longest idle one is closed to make room: a new client is always served, however
    many idle ones sit on the socket. When accept() fails for want of file descriptors
    (EMFILE, ENFILE), the longest idle client is closed and accept() tried once more;
    with no client to close, or on any other error but "nothing to accept", the listener
    is left out of select for ACCEPT_BACKOFF seconds: it stays readable while the
    connection waits, and polling it again at once would spin. A line over
    MAX_REQUEST_LINE gets an error reply and the connection is closed; so is a client that
    leaves MAX_PENDING_REPLY bytes of replies unread. Requests are answered in order, each
    one completely before the next (a request whose reply is a Future, a reload, is
    answered when it is done, woken through the socket pair: meanwhile that client's
    later lines wait and every other client is served), MAX_LINES_PER_TURN of one client
    at a time (then the others have their turn), and a client's next chunk is read only
    once every line of the last one is answered. Beyond RATE_BURST requests at once and
    RATE_PER_S per second a request is refused with RATE_ERROR, which costs next to
    nothing: a write full of requests cannot hold the control thread, and the GIL, from
    the NBD threads."""

    def __init__(self, path: str, control: Control) -> None:
        self.path = path
        self.control = control
        self.sock = _bind_private(path)
        self.sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full pair already wakes the loop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._resume_accept = 0.0  # monotonic time; the listener rests until then
        self._logged_accept = -ACCEPT_LOG_INTERVAL  # when accept() trouble was last logged

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(2.0)
        try:
            self.sock.close()
        finally:
            self._wake_r.close()
            self._wake_w.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ, None)
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        clients: dict[socket.socket, _Client] = {}
        try:
            while not self._stopping:
                timeout = self._select_timeout(selector)
                queued = [c for c in clients.values() if c.ready()]  # their turn again
                served = set()
                for key, events in selector.select(timeout=0.0 if queued else timeout):
                    if key.fileobj is self.sock:
                        self._accept(selector, clients)
                    elif key.fileobj is self._wake_r:  # a reply done on another thread
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        client = clients.get(key.fileobj)
                        if client is not None:
                            self._service(client, events)
                            self._settle(selector, clients, client)
                            served.add(client)
                for client in queued:
                    if client not in served and client.conn in clients:
                        self._service(client, 0)
                        self._settle(selector, clients, client)
                now = time.monotonic()
                for client in [c for c in clients.values() if c.pending is None
                               and now - c.last_active > IDLE_TIMEOUT]:
                    self._drop(selector, clients, client)
        finally:
            for client in list(clients.values()):
                self._drop(selector, clients, client)
            selector.close()

    def _select_timeout(self, selector) -> float:
        """Put a resting listener back once its back-off is over; how long select may wait."""
        if self._resume_accept:
            rest = self._resume_accept - time.monotonic()
            if rest > 0:
                return min(rest, 1.0)
            self._resume_accept = 0.0
            selector.register(self.sock, selectors.EVENT_READ, None)
        return 1.0

    def _accept(self, selector, clients: dict) -> None:
        """Take one connection; out of descriptors, close the longest idle client first."""
        for attempt in (1, 2):
            try:
                conn, _ = self.sock.accept()
                break
            except (BlockingIOError, ConnectionAbortedError):
                return  # nothing to accept after all, or the peer gave up: not readable
            except OSError as e:
                if attempt == 1 and e.errno in _OUT_OF_FDS and clients and not self._stopping:
                    self._drop(selector, clients, _longest_idle(clients))
                    continue
                self._rest_listener(selector, e)
                return
        conn.setblocking(False)
        if len(clients) >= MAX_CLIENTS:  # make room: the longest idle client goes
            self._drop(selector, clients, _longest_idle(clients))
        client = _Client(conn)
        clients[conn] = client
        selector.register(conn, selectors.EVENT_READ, None)
        if not _peer_allowed(conn):
            client.reply({"ok": False, "error": "permission denied: uid not allowed"})
            client.closing = True
            client.flush()
        self._settle(selector, clients, client)

    def _rest_listener(self, selector, error: OSError) -> None:
        """Stop polling the listener for ACCEPT_BACKOFF seconds (it stays readable)."""
        self._resume_accept = time.monotonic() + ACCEPT_BACKOFF
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(self.sock)
        now = time.monotonic()
        if not self._stopping and now - self._logged_accept >= ACCEPT_LOG_INTERVAL:
            self._logged_accept = now
            log(f"control: accept: {error.strerror or error}; the listener rests "
                f"{ACCEPT_BACKOFF * 1000:.0f} ms at a time")

    def _service(self, client: _Client, events: int) -> None:
        """Read what the client sent, once its earlier lines are all answered; answer a
        turn's worth of lines; write pending replies."""
        if events & selectors.EVENT_READ and not (client.lines or client.pending
                                                  or client.closing or client.eof):
            try:
                data = client.conn.recv(65536)
            except BlockingIOError:
                data = None
            except OSError:
                client.broken = True
                return
            if data == b"":
                client.end_of_input()
            elif data:
                client.last_active = time.monotonic()
                client.feed(data)
        client.collect()
        if client.lines and client.pending is None:
            client.answer(self.control, self._wake)
        client.flush()

    def _wake(self, _future=None) -> None:
        """Wake the loop from another thread (a reply is done)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _settle(self, selector, clients: dict, client: _Client) -> None:
        """Close a client that is done; otherwise wait for what it needs next."""
        done = (client.closing or client.eof) and not (client.out or client.lines
                                                       or client.pending)
        if done or client.broken or len(client.out) > MAX_PENDING_REPLY:
            self._drop(selector, clients, client)
            return
        events = selectors.EVENT_WRITE if client.out else 0
        if not (client.lines or client.pending or client.closing or client.eof):
            # no reading ahead
            events |= selectors.EVENT_READ
        selector.modify(client.conn, events, None)

    @staticmethod
    def _drop(selector, clients: dict, client: _Client) -> None:
        clients.pop(client.conn, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(client.conn)
        client.conn.close()


class _Client:
    """One control connection: its lines not answered yet, the unfinished one, what we owe.

    Each chunk received is split once (the tail without a newline waits for the next);
    replies of a turn are joined once. Both were quadratic in the input before: the buffer
    split again per line, the replies grown by concatenation."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.partial = bytearray()  # the unfinished last line
        self.lines: collections.deque[bytes | None] = collections.deque()  # None: overlong
        self.out = bytearray()  # bytearray: dropping what was sent does not copy the rest
        self.pending: Future | None = None  # a reply done on another thread; lines wait
        self.eof = self.closing = self.broken = False
        self.last_active = self.refilled = time.monotonic()
        self.tokens = float(RATE_BURST)

    def feed(self, data: bytes) -> None:
        """Queue the complete lines in data (blank ones dropped); keep the unfinished tail."""
        cut = data.rfind(b"\n")
        if cut >= 0:
            head = bytes(self.partial) + data[:cut] if self.partial else data[:cut]
            self.partial = bytearray(data[cut + 1:])
            for line in head.split(b"\n"):
                if len(line) > MAX_REQUEST_LINE:
                    self._overlong()
                    return
                if line.strip():
                    self.lines.append(line)
        else:
            self.partial += data
        if len(self.partial) > MAX_REQUEST_LINE:
            self._overlong()

    def end_of_input(self) -> None:
        """The peer half-closed: an unterminated last line counts too."""
        self.eof = True
        if self.partial.strip():
            self.lines.append(bytes(self.partial))
        self.partial.clear()

    def _overlong(self) -> None:
        self.lines.append(None)  # answered in order, after the lines before it
        self.partial.clear()
        self.closing = True  # nothing more is read

    def ready(self) -> bool:
        """Whether the loop has something to do for this client without new input."""
        return (bool(self.lines) and self.pending is None) or (
            self.pending is not None and self.pending.done())

    def collect(self) -> None:
        """A reply done on another thread goes out, in its place among the others."""
        if self.pending is not None and self.pending.done():
            self.out += _encoded(self.pending.result())
            self.pending = None
            self.last_active = time.monotonic()

    def answer(self, control: Control, wake) -> None:
        """Answer up to MAX_LINES_PER_TURN queued lines, each within the rate or refused;
        a reply that is a Future stops the turn until it is done (wake is called then)."""
        replies = []
        for _ in range(min(len(self.lines), MAX_LINES_PER_TURN)):
            line = self.lines.popleft()
            if line is None:
                replies.append(_encoded({"ok": False, "error":
                                         f"line longer than {MAX_REQUEST_LINE} bytes"}))
                self.lines.clear()
                break
            reply = control.handle_line(line) if self._within_rate() else None
            if isinstance(reply, Future):
                self.pending = reply
                reply.add_done_callback(wake)
                break
            replies.append(_encoded(reply) if reply is not None else _RATE_REFUSAL)
        self.out += b"".join(replies)
        self.collect()  # done at once

    def _within_rate(self) -> bool:
        """A token bucket: RATE_BURST at once, refilled at RATE_PER_S."""
        now = time.monotonic()
        self.tokens = min(RATE_BURST, self.tokens + (now - self.refilled) * RATE_PER_S)
        self.refilled = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def reply(self, message: dict) -> None:
        self.out += _encoded(message)

    def flush(self) -> None:
        if not self.out:
            return
        try:
            sent = self.conn.send(self.out)
        except BlockingIOError:
            return
        except OSError:
            self.broken = True
            return
        del self.out[:sent]
        self.last_active = time.monotonic()


def _encoded(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


_RATE_REFUSAL = _encoded({"ok": False, "error": RATE_ERROR})


def _longest_idle(clients: dict) -> _Client:
    return min(clients.values(), key=lambda c: c.last_active)


def _peer_allowed(conn: socket.socket) -> bool:
    """SO_PEERCRED: root or the server's own uid."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid in (0, os.getuid())


def _bind_private(path: str) -> socket.socket:
    """Bind a 0600 Unix socket at path, replacing a stale one only if nobody answers."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"control: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # stale: nobody is listening
        except OSError as e:
            raise ConfigError(f"control: {path}: {e.strerror}") from None
        else:
            raise ConfigError(f"control: {path} is in use by a running server")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bind creates the file with mode 0777 & ~umask: 0600 from the start, so there is no
    # window where others could connect, and no chmod after it, which would follow a
    # symlink swapped in at path meanwhile. `serve` binds before it execs nbdkit, and
    # nbdkit calls get_ready before it serves: no other thread creates files meanwhile.
    old_mask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ConfigError(f"control: {path}: {e.strerror}") from None
    finally:
        os.umask(old_mask)
    sock.listen(128)
    return sock

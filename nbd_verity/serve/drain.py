"""A stop that costs a client nothing: answer what was received, then close.

Once nbdkit has SIGTERM it answers every new request with NBD_ESHUTDOWN, which the kernel
turns into EIO for the application; and a connection closed with a request unanswered
leaves that request to the kernel's timer. So the stop happens before SIGTERM, from the
control socket (`ctl stop`, the units' ExecStop):
1. new connections are refused in the handshake (a reconnecting client tries again);
2. each client connection's read side is shut (SHUT_RD) while one of its requests is
   inside the plugin: nbdkit writes that reply, answers whatever else is queued, then reads
   the end and closes, so the end reaches the client right behind its last reply, before
   it can send again. A connection with no request for IDLE_S is shut as it is. A request
   sent after the shut fails its send on a Unix socket (the kernel resends it on its next
   connection at once); over TCP it meets the close, and the kernel resends it at its
   timer. One request in flight at a time (a reader, a file system) loses nothing;
3. when no client connection is left (or after DRAIN_S: then they are shut whole) nbdkit
   is asked to shut down.
Client connections are the sockets in /proc/self/fd that were accepted on one of nbdkit's
listening sockets (their local address is the listener's), the control socket's aside; a
request finds its own by the peer nbdkit names (TCP) or the peer's pid (Unix). nbdkit
looks `pread` up on every call: the drain swaps in a wrapper that shuts its connection.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable

from ..log import log

DRAIN_S = 10.0  # the longest a stop waits for the clients' connections to end
IDLE_S = 0.2  # a connection with no request this long after the stop began is shut idle
REPLY_GRACE_S = 0.05  # the stop's reply goes out before nbdkit shuts down
POLL_S = 0.005  # how often it looks for connections still open (or newly accepted)


class Drain:
    """The server's stop; draining is read by open() (refuse new connections)."""

    def __init__(self, exclude_paths: tuple[str, ...] = (),
                 peer_pid: Callable[[], int] = lambda: -1) -> None:
        self.draining = False
        self._exclude = {p for p in exclude_paths if p}
        self._peer_pid = peer_pid
        self._lock = threading.Lock()  # guards _pending
        self._pending: dict[tuple, list[socket.socket]] = {}  # peer -> connections to shut
        self._done = threading.Event()

    def stop(self, shutdown) -> dict:
        """Drain every client connection, then call shutdown() (nbdkit.shutdown): what was
        done, for the control reply."""
        with self._lock:
            already = self.draining
            self.draining = True
        if already:
            self._done.wait(DRAIN_S + 5)
            return {"stopping": True, "already": True}
        began = time.monotonic()
        busy = self._shut_busy(began + IDLE_S)
        drained, forced = self._drain(began + DRAIN_S)
        drained += busy
        seconds = time.monotonic() - began
        log(f"stop: {drained} connection(s) drained ({busy} behind a reply), {forced} cut "
            f"after {DRAIN_S:g} s, in {seconds:.3f} s; shutting down")
        # after the reply to `ctl stop` has gone out: the control socket closes with nbdkit
        threading.Timer(REPLY_GRACE_S, shutdown).start()
        self._done.set()
        return {"stopping": True, "drained": drained, "behind_reply": busy, "cut": forced,
                "seconds": round(seconds, 3)}

    # -- shutting a connection from its own request ------------------------------------

    def _shut_busy(self, until: float) -> int:
        """Let requests shut their own connections until `until`: how many did."""
        pending: dict[tuple, list[socket.socket]] = {}
        for sock in client_sockets(self._exclude):
            pending.setdefault(_peer_of(sock), []).append(sock)
        total = sum(len(v) for v in pending.values())
        with self._lock:
            self._pending = pending
        self._wrap_requests()
        while time.monotonic() < until:
            with self._lock:
                if not self._pending:
                    break
            time.sleep(POLL_S)
        with self._lock:
            left, self._pending = self._pending, {}
        for socks in left.values():  # not shut by a request: _drain shuts them
            for sock in socks:
                sock.close()
        return total - sum(len(v) for v in left.values())

    def _wrap_requests(self) -> None:
        """Swap the request callbacks nbdkit looks up for ones that first shut their own
        connection's read side (once)."""
        module = sys.modules["__main__"]
        for name in ("pread", "cache"):
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, "_drains", False):
                setattr(module, name, self._wrapped(fn))

    def _wrapped(self, fn):
        def drains(*args):
            if self._pending:  # unlocked look: a stale answer costs one locked look
                self._shut_mine()
            return fn(*args)
        drains._drains = True
        return drains

    def _shut_mine(self) -> None:
        try:
            key = self._current_peer()
        except Exception:  # never let the stop fail a request
            return
        with self._lock:
            socks = self._pending.pop(key, ())
        for sock in socks:
            _shut(sock, socket.SHUT_RD)
            sock.close()

    def _current_peer(self) -> tuple:
        """The peer of the connection this request came on, as _peer_of names it."""
        buf = ctypes.create_string_buffer(128)
        size = ctypes.c_uint32(128)
        if ctypes.CDLL(None).nbdkit_peer_name(buf, ctypes.byref(size)) == 0:
            family = struct.unpack_from("=H", buf.raw)[0]
            if family == socket.AF_INET:
                return (family, socket.inet_ntop(family, buf.raw[4:8]),
                        struct.unpack_from(">H", buf.raw, 2)[0])
            if family == socket.AF_INET6:
                return (family, socket.inet_ntop(family, buf.raw[8:24]),
                        struct.unpack_from(">H", buf.raw, 2)[0])
        return (socket.AF_UNIX, self._peer_pid())

    # -- the rest ---------------------------------------------------------------------

    def _drain(self, deadline: float) -> tuple[int, int]:
        """Shut the read side of each client connection until none is left: (drained,
        cut) counts; at the deadline, what is left is shut whole."""
        shut: set[int] = set()  # inodes of the connections whose read side is shut
        forced = 0
        while True:
            conns = client_sockets(self._exclude)
            if not conns:
                return len(shut) - forced, forced
            late = time.monotonic() >= deadline
            for sock in conns:
                inode = _inode(sock)
                if late:
                    _shut(sock, socket.SHUT_RDWR)
                    forced += inode in shut
                    shut.add(inode)
                elif inode not in shut:
                    _shut(sock, socket.SHUT_RD)
                    shut.add(inode)
                sock.close()
            if late:
                return len(shut) - forced, forced
            time.sleep(POLL_S)


def _peer_of(sock: socket.socket) -> tuple:
    """(family, host, port) of a TCP peer; (AF_UNIX, pid) of a Unix one (SO_PEERCRED)."""
    if sock.family == socket.AF_UNIX:
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  12))[0]
        return (socket.AF_UNIX, pid)
    host, port = sock.getpeername()[:2]
    return (sock.family, host, port)


def _inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def _shut(sock: socket.socket, how: int) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)


def _address(sock: socket.socket):
    """What identifies the listener a socket belongs to: (family, path) or (family, port)."""
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return (sock.family, name if isinstance(name, str) else name.decode(errors="replace"))
    return (sock.family, name[1])


def client_sockets(exclude_paths: set[str]) -> list[socket.socket]:
    """Duplicates of the process's accepted NBD connections (the caller closes them)."""
    listening = set()
    accepted = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
                sock.close()
                continue
            where = _address(sock)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                listening.add(where)
                sock.close()
            else:
                accepted.append((where, sock))
        except OSError:
            sock.close()
    out = []
    for where, sock in accepted:
        if where in listening and where[1] not in exclude_paths and where[1] != "":
            out.append(sock)
        else:
            sock.close()
    return out

"""A stop that costs a client nothing: answer what was received, then close.

Once nbdkit has SIGTERM it answers every new request with NBD_ESHUTDOWN, which the kernel
turns into EIO for the application; and a connection closed with a request unanswered
leaves that request to the kernel's timer. So the stop happens before SIGTERM, from the
control socket (`ctl stop`, the units' ExecStop):
1. new connections are refused in the handshake (a reconnecting client tries again);
2. the read side of every client connection is shut (SHUT_RD). nbdkit still reads the
   requests already queued on it and writes every reply; then it reads the end and closes
   the connection, so the client sees its replies and then the end, with nothing in
   flight. A request the client sends after that moment fails its send at once on a Unix
   socket (the kernel then resends it on its next connection); over TCP it meets the
   close, and a kernel client resends it at its timer. A client that keeps one request in
   flight at a time (a reader, a file system's reads) loses nothing either way;
3. when no client connection is left (or after DRAIN_S: then they are shut whole) nbdkit
   is asked to shut down.
Client connections are the sockets in /proc/self/fd that were accepted on one of nbdkit's
listening sockets (their local address is the listener's), the control socket's aside.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time

from ..log import log

DRAIN_S = 10.0  # the longest a stop waits for the clients' connections to end
REPLY_GRACE_S = 0.05  # the stop's reply goes out before nbdkit shuts down
POLL_S = 0.005  # how often it looks for connections still open (or newly accepted)


class Drain:
    """The server's stop; draining is read by open() (refuse new connections)."""

    def __init__(self, exclude_paths: tuple[str, ...] = ()) -> None:
        self.draining = False
        self._exclude = {p for p in exclude_paths if p}
        self._lock = threading.Lock()
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
        drained, forced = self._drain(began + DRAIN_S)
        seconds = time.monotonic() - began
        log(f"stop: {drained} connection(s) drained, {forced} cut after {DRAIN_S:g} s, in "
            f"{seconds:.3f} s; shutting down")
        # after the reply to `ctl stop` has gone out: the control socket closes with nbdkit
        threading.Timer(REPLY_GRACE_S, shutdown).start()
        self._done.set()
        return {"stopping": True, "drained": drained, "cut": forced,
                "seconds": round(seconds, 3)}

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

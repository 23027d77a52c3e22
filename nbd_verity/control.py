"""The control socket: one JSON object per line in, one per line out.

Requests (`cmd` names the command; docs/control.md has examples):
  {"cmd": "thresholds"}                              -> current table
  {"cmd": "thresholds", "set": {"be": 65536}}        -> change some classes
  {"cmd": "thresholds", "preset": "kernel"}          -> load a preset
  {"cmd": "stats"} / {"cmd": "stats", "reset": true} -> counters (then zero them)
  {"cmd": "status"}                                  -> V/C, corruptions, uptime
Every reply has "ok"; failures are {"ok": false, "error": "..."} and change nothing.

The client half (`request`, `exchange`) is what `nbd-verity ctl`, tune, the launcher and
the tests use; it imports nothing of the server side.

Only root and the server's own user may talk to it: the socket is created 0600 and each
peer's uid is checked with SO_PEERCRED. A stale socket file is replaced only after a
connect to it is refused. The listening socket is bound in get_ready (errors stop
start-up with one line); its threads start in after_fork (threads die with a fork).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import threading

from .errors import ConfigError, VerityError

MAX_LINE = 64 << 10
MAX_CLIENTS = 8
CLIENT_TIMEOUT = 10.0  # seconds a client waits for the server's reply


# -- the client -----------------------------------------------------------------------


def exchange(path: str | os.PathLike, payload: bytes, timeout: float = CLIENT_TIMEOUT) -> bytes:
    """Send payload on a fresh connection, half-close, and return the reply line (raw).

    The server may stop reading early (an overlong line): a send error is ignored and the
    reply it wrote before closing is still read. OSError when the socket is unreachable."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(os.fspath(path))
        with contextlib.suppress(OSError):  # EPIPE, ECONNRESET: it stopped reading
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
    return reply


def request(path: str | os.PathLike, message: dict, timeout: float = CLIENT_TIMEOUT) -> dict:
    """One request, its decoded reply (ok or not); VerityError when there is none."""
    try:
        reply = exchange(path, json.dumps(message).encode() + b"\n", timeout)
    except OSError as e:
        raise VerityError(f"control: {os.fspath(path)}: {e.strerror or e}") from None
    try:
        answer = json.loads(reply)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise VerityError(f"control: {os.fspath(path)}: no valid reply")
    return answer


def checked_request(path: str | os.PathLike, message: dict,
                    timeout: float = CLIENT_TIMEOUT) -> dict:
    """A successful reply; the server's refusal as VerityError("server: ...")."""
    reply = request(path, message, timeout)
    if reply.get("ok") is not True:
        raise VerityError(f"server: {reply.get('error', 'unknown error')}")
    return reply


# -- the server -----------------------------------------------------------------------


_FIELDS = {  # the fields each command accepts
    "thresholds": {"cmd", "set", "preset"},
    "stats": {"cmd", "reset"},
    "status": {"cmd"},
}


class ProtocolError(VerityError):
    """A control request that is malformed or asks for something impossible."""


def _field(request: dict, name: str, kind, default=None):
    """A typed getter for one request field (absent → default)."""
    if name not in request:
        return default
    value = request[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ProtocolError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


class Control:
    """Answers control requests against one Device (no sockets here)."""

    def __init__(self, device) -> None:
        self.device = device
        self._lock = threading.Lock()

    def handle_line(self, line: bytes) -> dict:
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            return {"ok": False, "error": f"malformed JSON: {e}"}
        if not isinstance(request, dict):
            return {"ok": False, "error": "a request must be a JSON object"}
        try:
            return {"ok": True, **self.handle(request)}
        except VerityError as e:
            return {"ok": False, "error": str(e)}

    def handle(self, request: dict) -> dict:
        command = _field(request, "cmd", str)
        if command is None:
            raise ProtocolError("cmd: missing (thresholds, stats, status)")
        if command not in _FIELDS:
            raise ProtocolError(f"cmd: unknown command {command!r} (thresholds, stats, status)")
        unknown = set(request) - _FIELDS[command]
        if unknown:
            raise ProtocolError(f"unknown field(s): {', '.join(sorted(unknown))}")
        return getattr(self, f"_{command}")(request)

    def _thresholds(self, request: dict) -> dict:
        from .dispatch import preset, table_dict, updated_table  # server side only
        dispatcher = self.device.dispatcher
        changes = _field(request, "set", dict)
        name = _field(request, "preset", str)
        if changes is not None and name is not None:
            raise ProtocolError("give set or preset, not both")
        try:
            with self._lock:  # writers serialise, so two partial updates both land
                if name is not None:
                    dispatcher.set_table(preset(name))
                elif changes is not None:
                    dispatcher.set_table(updated_table(dispatcher.table, changes))
                table = dispatcher.table
        except ConfigError as e:
            raise ProtocolError(str(e)) from None
        return {"thresholds": table_dict(table)}

    def _stats(self, request: dict) -> dict:
        reply = {"stats": self.device.stats()}
        if _field(request, "reset", bool, False):
            self.device.reset_stats()
        return reply

    def _status(self, request: dict) -> dict:
        return {"status": self.device.status()}


class ControlServer:
    """A Unix socket serving Control to local peers of the right uid."""

    def __init__(self, path: str, control: Control) -> None:
        self.path = path
        self.control = control
        self.sock = _bind_private(path)
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed at cleanup
            if not self._slots.acquire(blocking=False):
                _send(conn, {"ok": False, "error": "too many control clients"})
                conn.close()
                continue
            threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()

    def _serve_client(self, conn: socket.socket) -> None:
        try:
            with conn:
                if not _peer_allowed(conn):
                    _send(conn, {"ok": False, "error": "permission denied: uid not allowed"})
                    return
                for line in _lines(conn):
                    if line is None:
                        _send(conn, {"ok": False, "error": f"line longer than {MAX_LINE} bytes"})
                        return
                    _send(conn, self.control.handle_line(line))
        except OSError:
            pass  # the client went away
        finally:
            self._slots.release()


def _lines(conn: socket.socket):
    """Yield request lines (without newline) until EOF; None for an overlong line."""
    pending = b""
    while True:
        data = conn.recv(65536)
        if not data:
            if pending.strip():
                yield pending
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if len(line) > MAX_LINE:
                yield None
                return
            if line.strip():
                yield line
        if len(pending) > MAX_LINE:
            yield None
            return


def _send(conn: socket.socket, reply: dict) -> None:
    conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")


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
    old_mask = os.umask(0o177)  # created 0600: no window where others could connect
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ConfigError(f"control: {path}: {e.strerror}") from None
    finally:
        os.umask(old_mask)
    os.chmod(path, 0o600)
    sock.listen(MAX_CLIENTS)
    return sock

"""The control socket: one JSON object per line in, one per line out.

Requests (`cmd` names the command; docs/control.md has examples):
  {"cmd": "thresholds"}                              -> current table
  {"cmd": "thresholds", "set": {"be": 65536}}        -> change some classes
  {"cmd": "thresholds", "preset": "kernel"}          -> load a preset
  {"cmd": "stats"} / {"cmd": "stats", "reset": true} -> counters (then zero them)
  {"cmd": "status"}                                  -> V/C, corruptions, uptime
  {"cmd": "stop"}                                    -> drain clients, then shut down
Every reply has "ok"; failures are {"ok": false, "error": "..."} and change nothing.

The client half (`request`, `exchange`) is what `nbd-verity ctl`, tune, the launcher and
the tests use; it imports nothing of the server side. `Control` answers one request line
against a Device; control/server.py owns the socket that carries the lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from concurrent.futures import Future

from ..errors import ConfigError, VerityError

MAX_REQUEST_LINE = 64 << 10  # bytes of one request line
MAX_DEPTH = 16  # JSON nesting of a request (requests need 2)
CLIENT_TIMEOUT = 10.0  # seconds a client waits for the server's reply


# -- the client -----------------------------------------------------------------------


def exchange(path: str | os.PathLike, payload: bytes, timeout: float = CLIENT_TIMEOUT) -> bytes:
    """Send payload on a fresh connection, half-close, and return the reply line (raw).

    The server may stop reading early (an overlong line): a send error is ignored and the
    reply it wrote before closing is still read. OSError when the socket is unreachable,
    TimeoutError when its backlog stays full or no reply comes for timeout seconds."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        _connect_waiting(sock, os.fspath(path), timeout)
        sock.settimeout(timeout)
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


def _connect_waiting(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect, waiting up to timeout seconds for room in a full listen backlog.

    On a Unix socket a full backlog is not EINPROGRESS but EAGAIN, at once for a
    non-blocking socket (which is what settimeout makes it). A blocking connect waits
    for room instead, for as long as SO_SNDTIMEO allows, and then fails with EAGAIN."""
    seconds, micros = divmod(max(round(timeout * 1e6), 1), 10**6)  # 0 would mean forever
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, micros))
    try:
        sock.connect(path)
    except BlockingIOError:
        raise TimeoutError(f"{path}: listen backlog still full after {timeout:g} s") from None


def request(path: str | os.PathLike, message: dict, timeout: float = CLIENT_TIMEOUT) -> dict:
    """One request, its decoded reply (ok or not); VerityError when there is none."""
    where = f"control: {os.fspath(path)}"
    try:
        reply = exchange(path, json.dumps(message).encode() + b"\n", timeout)
    except TimeoutError:
        raise VerityError(f"{where}: no reply within {timeout:g} s (server busy or "
                          f"stopped?)") from None
    except OSError as e:
        raise VerityError(f"{where}: {e.strerror or e}") from None
    if not reply:
        raise VerityError(f"{where}: the server closed the connection without a reply")
    try:
        answer = json.loads(reply)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise VerityError(f"{where}: no valid reply")
    return answer


def checked_request(path: str | os.PathLike, message: dict,
                    timeout: float = CLIENT_TIMEOUT) -> dict:
    """A successful reply; the server's refusal as VerityError("server: ...")."""
    reply = request(path, message, timeout)
    if reply.get("ok") is not True:
        raise VerityError(f"server: {reply.get('error', 'unknown error')}")
    return reply


# -- the requests ---------------------------------------------------------------------


_FIELDS = {  # the fields each command accepts
    "thresholds": {"cmd", "set", "preset"},
    "stats": {"cmd", "reset"},
    "status": {"cmd"},
    "stop": {"cmd"},
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


def nesting_depth(line: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in line, brackets inside strings
    not counted (a scan, so that no parser recursion is needed to refuse a deep one)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return 0  # cannot be deeper than that: the common case, no scan
    depth = deepest = 0
    in_string = escaped = False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def answered(work) -> dict | Future:
    """work()'s reply with "ok": true, a Future of it as it is (a reload: answered when
    done), or its failure as one error reply: never raises."""
    try:
        reply = work()
        return reply if isinstance(reply, Future) else {"ok": True, **reply}
    except VerityError as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # a bug: one reply and one log line, never a dead thread
        from ..log import log
        log(f"control: {type(e).__name__}: {e}")
        return {"ok": False, "error": f"internal error: {type(e).__name__}"}


def _stop_in_background(stop) -> Future:
    """A Future of stop()'s reply, done on a thread of its own."""
    future: Future = Future()
    threading.Thread(target=lambda: future.set_result(answered(stop)), name="control-stop",
                     daemon=True).start()
    return future


class Control:
    """Answers control requests against one Device (no sockets here)."""

    FIELDS = _FIELDS  # the commands and the fields each accepts (a subclass widens them)

    def __init__(self, device) -> None:
        self.device = device
        self._lock = threading.Lock()

    def handle_line(self, line: bytes) -> dict | Future:
        """The reply to one request line, or a Future of it for a request that takes a
        while (the server answers it when done): never raises, whatever the line holds."""
        if nesting_depth(line) > MAX_DEPTH:
            return {"ok": False, "error": f"nesting deeper than {MAX_DEPTH} levels"}
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            return {"ok": False, "error": f"malformed JSON: {e}"}
        except RecursionError:  # unreachable after nesting_depth; kept as the last guard
            return {"ok": False, "error": f"nesting deeper than {MAX_DEPTH} levels"}
        if not isinstance(request, dict):
            return {"ok": False, "error": "a request must be a JSON object"}
        return answered(lambda: self.handle(request))

    def handle(self, request: dict) -> dict:
        command = _field(request, "cmd", str)
        names = ", ".join(self.FIELDS)
        if command is None:
            raise ProtocolError(f"cmd: missing ({names})")
        if command not in self.FIELDS:
            raise ProtocolError(f"cmd: unknown command {command!r} ({names})")
        unknown = set(request) - self.FIELDS[command]
        if unknown:
            raise ProtocolError(f"unknown field(s): {', '.join(sorted(unknown))}")
        return getattr(self, f"_{command}")(request)

    def _thresholds(self, request: dict) -> dict:
        from ..ioclass import CLASSES, class_index
        from .table import ADAPTIVE, loaded, table_dict, updated_table
        dispatcher = self.device.dispatcher
        changes = _field(request, "set", dict)
        name = _field(request, "preset", str)
        if changes is not None and name is not None:
            raise ProtocolError("give set or preset, not both")
        try:
            with self._lock:  # writers serialise, so two partial updates both land
                if name is not None:  # a fixed preset as it is, pinning every class;
                    explicit = self.device.explicit if name == ADAPTIVE else {}  # `default`
                    dispatcher.set_table(*loaded(name, explicit))  # with --threshold over it
                elif changes is not None:  # what is set by hand, the table alone decides
                    table = updated_table(dispatcher.table, changes)
                    dispatcher.set_table(table, dispatcher.pinned | {
                        class_index(str(c), "threshold") for c in changes})
                table = dispatcher.table
        except ConfigError as e:
            raise ProtocolError(str(e)) from None
        return {"thresholds": table_dict(table),
                "pinned": [CLASSES[c] for c in sorted(dispatcher.pinned)]}

    def _stats(self, request: dict) -> dict:
        reply = {"stats": self.device.stats()}
        if _field(request, "reset", bool, False):
            self.device.reset_stats()
        return reply

    def _status(self, request: dict) -> dict:
        return {"status": self.device.status()}

    def _stop(self, request: dict) -> Future:
        """Drain every client connection, then shut the server down (serve/drain.py);
        answered once the connections are closed."""
        return _stop_in_background(self.device.hooks.stop)

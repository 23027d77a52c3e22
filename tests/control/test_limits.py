"""The control socket's limits: idle clients cannot lock it, deep or huge lines get an error
reply (never a traceback), and `ctl` names the real cause when a server does not answer."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from nbd_verity.control.server import IDLE_TIMEOUT, MAX_CLIENTS

from .harness import ctl, exchange, one_error_line


def idle_client(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


def test_a_new_client_is_answered_while_idle_ones_sit_on_the_socket(servers, image):
    server = servers.start(image)
    idle: list[socket.socket] = []
    with contextlib.ExitStack() as stack:
        for count in (32, MAX_CLIENTS + 40):
            while len(idle) < count:
                idle.append(stack.enter_context(idle_client(server.control)))
            assert server.ask({"cmd": "status"})["status"]["status"] == "V"
        result = ctl(server.control, "status")
        assert result.returncode == 0 and result.stdout.startswith("V"), result.stderr


def test_idle_clients_are_closed(servers, image):
    server = servers.start(image)
    with idle_client(server.control) as sock:
        sock.settimeout(IDLE_TIMEOUT + 10)
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed by the server, without a word
        assert IDLE_TIMEOUT - 1 <= time.monotonic() - started <= IDLE_TIMEOUT + 5


def test_deep_nesting_gets_an_error_reply(servers, image):
    server = servers.start(image)
    for line in (b"[" * 30000 + b"]" * 30000, b'{"cmd": ' + b"[" * 50000 + b"\n"):
        reply = json.loads(exchange(server.control, line + b"\n"))
        assert reply["ok"] is False and "nesting deeper" in reply["error"]
    reply = json.loads(exchange(server.control, b"[" * (70 << 10) + b"\n"))
    assert "longer than" in reply["error"]
    assert server.ask({"cmd": "status"})["ok"]
    assert "Traceback" not in server.log() and "RecursionError" not in server.log()


def fake_server(path, behaviour) -> threading.Thread:
    """A control socket that accepts one client and treats it as behaviour says."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve():
        with listener:
            conn, _ = listener.accept()
            with conn:
                behaviour(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_ctl_names_the_servers_refusal(tmp_path):
    path = tmp_path / "refuse.ctl"
    refusal = {"ok": False, "error": "permission denied: uid not allowed"}
    thread = fake_server(path, lambda c: c.sendall(json.dumps(refusal).encode() + b"\n"))
    line = one_error_line(ctl(path, "status"))
    thread.join(10)
    assert line == "nbd-verity: server: permission denied: uid not allowed"


def test_ctl_says_the_server_closed_without_a_reply(tmp_path):
    path = tmp_path / "close.ctl"
    thread = fake_server(path, lambda c: None)
    line = one_error_line(ctl(path, "status"))
    thread.join(10)
    assert "closed the connection without a reply" in line and "Broken pipe" not in line


def test_ctl_says_nothing_listens(tmp_path):
    path = tmp_path / "none.ctl"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(path))  # bound, never listening
        assert "Connection refused" in one_error_line(ctl(path, "status"))


def test_class_names_are_case_insensitive(servers, image):
    """Decided and documented (control.md): RT is rt everywhere; replies use lower case."""
    server = servers.start(image, "--threshold-preset", "seed", "--threshold", "IDLE=0",
                           "--default-class", "Rt")
    result = ctl(server.control, "thresholds", "BE=65536")
    assert result.returncode == 0, result.stderr
    assert server.thresholds() == {"none": 4096, "rt": 4096, "be": 65536, "idle": 0}
    with server.client("@IDLE") as h:
        assert h.pread(8192, 0) == image.expected(0, 8192)
    with server.client() as h:
        assert h.pread(8192, 0) == image.expected(0, 8192)
    counts = server.counts()
    assert counts[("idle", "pool")] == 1 and counts[("rt", "pool")] == 1

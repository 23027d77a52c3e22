"""An NBD upstream that stalls or stops: reads fail with EIO within the source timeout
or are served by the upstream that replaced it, and SIGTERM always stops the server.

The upstreams are real nbdkit `file` servers; the stalled one is a listener on the
upstream's socket that accepts connections and never says a word (the handshake never
starts), as a wedged or malicious server would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import nbd
import pytest

from nbd_verity.launch import NBDKIT
from nbd_verity.sources.remote import IDLE_S

from .serverlib import (
    MIB,
    PLUGIN,
    PROJECT,
    close_handle,
    control_request,
    error_number,
    expect_eio,
    make_image,
    random_bytes,
    server_env,
)
from .upstreams import NbdkitFile

CHUNK = 64 << 10
TIMEOUT_S = 3  # the servers' source-timeout here


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_image(tmp_path_factory.mktemp("upfail"), random_bytes(17, 2 * MIB))


@pytest.fixture(params=["multi-conn", "one-connection"])
def upstream(image, sockdir, request):
    """The upstream, advertising multi-conn (a pool of connections, one read each) or not
    (one connection carrying every read: sources/pipe.py)."""
    filters, keys = ((), ()) if request.param == "multi-conn" else \
        (("multi-conn",), ("multi-conn-mode=disable",))
    server = NbdkitFile(image.data, sockdir, "up", filters, keys).start()
    yield server
    server.stop()


class SilentListener:
    """Accepts every connection on a Unix socket and never answers (closed at the end)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self.accepted:
            conn.close()
        self._thread.join(10)


def totals(control: str) -> dict:
    return control_request(control, {"cmd": "stats"})["stats"]["totals"]


def start_verifier(servers, image, upstream, sockdir):
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.start(replace(image, data=upstream.uri), control=control,
                           source_timeout=TIMEOUT_S)
    return server, control


def test_a_stalled_upstream_fails_the_read_within_the_timeout(image, upstream, servers,
                                                              sockdir):
    server, _ = start_verifier(servers, image, upstream, sockdir)
    h = server.connect()
    assert h.pread(CHUNK, 0) == image.expected(0, CHUNK)
    upstream.proc.kill()  # by pid; its socket file stays: replace it with a silent one
    upstream.wait()
    os.unlink(upstream.sock)
    silent = SilentListener(upstream.sock)
    try:
        started = time.monotonic()
        expect_eio(h, CHUNK, CHUNK)  # the dropped connection
        expect_eio(h, CHUNK, 2 * CHUNK)  # the reconnect: accepted, never answered
        elapsed = time.monotonic() - started
        assert len(silent.accepted) >= 1
        assert elapsed < TIMEOUT_S * 2 + 10, elapsed
        assert "no handshake in 3 s" in server.log(), server.log()
    finally:
        silent.close()


@pytest.mark.parametrize("thread_model", ["serialize-requests", "parallel"])
def test_sigterm_stops_the_server_while_a_read_waits_on_a_stalled_upstream(
        image, upstream, servers, sockdir, thread_model):
    """With a source timeout of an hour, only SIGTERM can end the wait: it must. In the
    parallel model another worker of the connection waits for the client's next request
    in a read of the socket, which nbdkit cannot cut: there the read in flight fails, the
    connection is shut where nbdkit can (>= 1.40), and once the client hangs up (as a
    kernel client does on a shut socket) the server exits."""
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.start(replace(image, data=upstream.uri), control=control,
                           source_timeout=3600, thread_model=thread_model)
    h = server.connect()
    assert h.pread(CHUNK, 0) == image.expected(0, CHUNK)
    upstream.proc.kill()
    upstream.wait()
    os.unlink(upstream.sock)
    silent = SilentListener(upstream.sock)
    try:
        buf = nbd.Buffer(CHUNK)
        deadline = time.monotonic() + 30
        for _ in range(2):  # a read that finds the dropped connection fails: the next
            cookie = h.aio_pread(buf, CHUNK)  # reconnects, and stays in flight
            while not silent.accepted and h.aio_in_flight() and time.monotonic() < deadline:
                h.poll(100)
            if silent.accepted:
                break
            with pytest.raises(nbd.Error):
                h.aio_command_completed(cookie)
        assert silent.accepted, "the read never reached the stalled upstream"
        started = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        if thread_model == "parallel":
            while time.monotonic() - started < 10 and not _completed(h):
                h.poll(100)
            with pytest.raises(nbd.Error):
                h.aio_command_completed(cookie)  # failed: EIO, or the shut connection
            close_handle(h)
        server.proc.wait(timeout=20)
        assert time.monotonic() - started < 10
    finally:
        silent.close()


def _completed(h) -> bool:
    """Whether the one command in flight has its reply (asked without consuming it: an
    error reply raises in aio_command_completed); a dead connection ends every command."""
    return h.aio_is_dead() or h.aio_in_flight() == 0


def test_an_upstream_stopped_with_sigterm_while_nobody_reads_exits(image, upstream,
                                                                   servers, sockdir):
    """nbdkit cannot exit while a client holds its connection: ours, idle after a read,
    is closed after IDLE_S, so the stopping upstream exits without waiting for a next
    read; that read is then served by the upstream restarted on the same socket."""
    server, control = start_verifier(servers, image, upstream, sockdir)
    h = server.connect()
    assert h.pread(CHUNK, 0) == image.expected(0, CHUNK)
    old = upstream.proc
    old.send_signal(signal.SIGTERM)
    try:
        old.wait(IDLE_S * 2 + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the upstream held by an idle connection never exited: {server.log()}")
    upstream.start()
    assert h.pread(CHUNK, CHUNK) == image.expected(CHUNK, CHUNK)
    counts = totals(control)
    assert counts["source_errors"] == 0 and counts["corruptions"] == 0, counts


def test_a_server_gone_into_the_background_closes_idle_connections(image, sockdir,
                                                                    tmp_path):
    """nbdkit without -f forks after get_ready, where the hash upstream was already read
    (the superblock): that fork is not Python's, and the process that serves starts its
    own reaper all the same, so an upstream stopped while nobody reads exits."""
    hashes = NbdkitFile(image.hash, sockdir, "hup").start()
    data = NbdkitFile(image.data, sockdir, "dup").start()
    sock, pid_file = os.path.join(sockdir, "bg.sock"), os.path.join(sockdir, "bg.pid")
    pairs = replace(image, data=data.uri, hash=hashes.uri).pairs(source_timeout=TIMEOUT_S)
    log = tmp_path / "bg.log"
    with open(log, "wb") as log_f:
        subprocess.run([NBDKIT, "-r", "-U", sock, "-P", pid_file, "python", str(PLUGIN),
                        *[f"{k}={v}" for k, v in pairs]],
                       stdout=log_f, stderr=subprocess.STDOUT, timeout=60, check=True,
                       env={**server_env(), "PYTHONPATH": str(PROJECT)})
    pid = 0
    try:
        deadline = time.monotonic() + 30
        while not pid:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = int(Path(pid_file).read_text())
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        h = nbd.NBD()
        h.connect_unix(sock)
        try:
            assert h.pread(CHUNK, 0) == image.expected(0, CHUNK)
        finally:
            close_handle(h)
        for upstream in (hashes, data):
            upstream.proc.send_signal(signal.SIGTERM)
        for upstream in (hashes, data):
            try:
                upstream.proc.wait(IDLE_S * 2 + 10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{upstream.name}, held by an idle connection, never exited: "
                            f"{log.read_text()}")
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
        hashes.stop()
        data.stop()


def test_an_upstream_stopped_with_sigterm_is_replaced(image, upstream, servers, sockdir):
    """nbdkit answers ESHUTDOWN while it stops, and cannot exit while we hold its
    connection: the connection is dropped, the old upstream exits, and the very next
    read is served by the new one on the same socket."""
    server, control = start_verifier(servers, image, upstream, sockdir)
    h = server.connect()
    assert h.pread(CHUNK, 0) == image.expected(0, CHUNK)
    old = upstream.proc
    old.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while old.poll() is None:  # a client that goes on reading while the old one stops
        assert time.monotonic() < deadline, "the old upstream never exited"
        try:  # its answer (before it noticed), or ESHUTDOWN: the connection is dropped
            assert h.pread(CHUNK, CHUNK) == image.expected(CHUNK, CHUNK)
        except nbd.Error as e:  # EIO while none listens; never other bytes
            assert error_number(e) == errno.EIO, e
        time.sleep(0.05)
    upstream.start()
    for offset in range(0, image.size, CHUNK):  # every read, none failing
        assert h.pread(CHUNK, offset) == image.expected(offset, CHUNK)
    counts = totals(control)
    assert counts["reconnects"] >= 1 and counts["corruptions"] == 0

"""A lying HTTP server against the captive reader of a URL with a query (httpread.py).

The server here (Python's http.server on 127.0.0.1, in a thread) answers the captive's
size probe honestly, then answers every ranged GET of `liar.img` with 206 and a body far
longer (200 MiB, streamed) or shorter than the range asked; `honest.img` gets the right
bytes. The verifying server above must fail the lied-about read with EIO, and the
captive nbdkit must read no more than it asked for (+1 byte to see the lie): its peak
resident memory (VmHWM) stays far below the lie's size.
"""

from __future__ import annotations

import glob
import http.server
import os
import re
import threading
from pathlib import Path

import pytest

from .serverlib import MIB, expect_eio, make_image, random_bytes

LIE = 200 * MIB  # the length of the long lie's body
BOUND = 100 * MIB  # what the captive may grow by while it is lied to
PIECE = 1 * MIB  # the long lie is sent in pieces of this size (never held whole here)
TOKEN = "?token=t0k"  # a query: the captive is httpread.py, not nbdkit's curl


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_image(tmp_path_factory.mktemp("liar"), random_bytes(31, 1 * MIB))


class Handler(http.server.BaseHTTPRequestHandler):
    """GET /honest.img or /liar.img with a Range; the lie is the server's `lie` attribute:
    "long" (206, 200 MiB body) or "short" (206, half the range)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        """Quiet: the test reports what matters."""

    def do_GET(self) -> None:
        """A 206 for the range asked, honest or not."""
        data = self.server.data
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if match is None or self.path not in ("/honest.img" + TOKEN, "/liar.img" + TOKEN):
            self.send_error(404)
            return
        first, last = int(match[1]), min(int(match[2]), len(data) - 1)
        honest = self.path.startswith("/honest") or (first, last) == (0, 0)  # size probe
        if honest or self.server.lie == "short":
            body = data[first:last + 1] if honest else data[first:first + (last - first + 1) // 2]
            self._head(first, last, len(body))
            self.wfile.write(body)
            return
        self.server.lies += 1
        self._head(first, last, LIE)
        try:
            for _ in range(LIE // PIECE):
                self.wfile.write(bytes(PIECE))
        except OSError:  # the reader hung up once it had seen the lie
            self.close_connection = True

    def _head(self, first: int, last: int, length: int) -> None:
        """206 with a true Content-Range and the given Content-Length."""
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(self.server.data)}")
        self.send_header("Content-Length", str(length))
        self.end_headers()


@pytest.fixture
def liar(image):
    """The lying server on 127.0.0.1 (an ephemeral port), serving image.data."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.data = Path(image.data).read_bytes()
    server.lie, server.lies = "long", 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = lambda name: f"http://127.0.0.1:{server.server_port}/{name}{TOKEN}"
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def captive_pid(sockdir: str) -> int:
    """The pid of the one captive upstream nbdkit (its pid file in its private folder)."""
    (pid_file,) = glob.glob(f"{sockdir}/nbd-verity-up-*/*.pid")
    return int(Path(pid_file).read_text())


def status_kib(pid: int, field: str) -> int:
    """A kB field (VmHWM, VmRSS) of /proc/PID/status, in KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB$", text, re.M)[1])


def serve(servers, sockdir, liar, image, name: str, monkeypatch):
    """`serve URL HASH ROOT`: the data from the lying server, the hash tree local."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    return servers.serve_cli([liar.url(name), str(image.hash), image.root,
                              "--cache-size", "4K"])


def test_honest_answers_read_back(servers, sockdir, liar, image, monkeypatch):
    """The reader's bounded read takes a right answer whole."""
    h = serve(servers, sockdir, liar, image, "honest.img", monkeypatch).connect()
    assert h.pread(image.size, 0) == image.expected()


def test_long_lie_fails_the_read_within_bounded_memory(servers, sockdir, liar, image,
                                                       monkeypatch):
    """206 with 200 MiB for a 4 KiB range: EIO, and the captive never holds the lie."""
    h = serve(servers, sockdir, liar, image, "liar.img", monkeypatch).connect()
    pid = captive_pid(sockdir)
    start = status_kib(pid, "VmHWM")
    expect_eio(h, 4096, 8 * 4096)
    assert liar.lies >= 1, "the lying server was never asked for a range"
    grown = (status_kib(pid, "VmHWM") - start) * 1024
    assert grown < BOUND, f"the captive's peak memory grew by {grown >> 20} MiB"
    assert os.path.exists(f"/proc/{pid}"), "the captive died of the lie"


def test_short_answer_fails_the_read(servers, sockdir, liar, image, monkeypatch):
    """206 with half the range: EIO, and the log says how many bytes came, in one line."""
    liar.lie = "short"
    server = serve(servers, sockdir, liar, image, "liar.img", monkeypatch)
    expect_eio(server.connect(), 4096, 8 * 4096)
    log = Path(server.log_path).read_text()
    assert re.search(r"read at byte \d+: \d+ of \d+ bytes", log), log
    assert "Traceback" not in log

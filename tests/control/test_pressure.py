"""The control socket under pressure: a full listen backlog, no file descriptors left, a
flood of requests in one write. In each the server keeps answering and does not spin,
and NBD reads go on.

CPU time is the server's (utime + stime of its pid in /proc): the control thread is the
only one with work while these tests run, and bounds are far from what a spin costs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nbd_verity.control.protocol import request
from nbd_verity.control.server import RATE_BURST, RATE_ERROR, RATE_PER_S

from .harness import ctl, run

BACKLOG = 128  # the listen() backlog of the control socket (control/server.py)
FEW_FDS = ("bash", "-c", 'ulimit -n 48; exec "$@"', "bash")  # then exec nbd-verity serve
HELD = 60  # control connections held open: more than 48 descriptors allow
SPIN_WINDOW_S = 3.0
SPIN_BOUND_S = 0.5  # CPU seconds in that window; a spinning control thread takes ~3
FLOOD = b'{"cmd":"stats"}\n' * ((64 << 10) // 16)  # 4096 requests in one 64 KiB write
FLOOD_CPU_BOUND_S = 0.3  # answering every line in full took 0.7-2 s before the caps


def listen_queue(path) -> int:
    """Connections waiting in the backlog of the listening Unix socket at path (ss Recv-Q)."""
    fields = run(["ss", "-xlnH", "src", str(path)]).stdout.split()
    return int(fields[2]) if fields else 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_over(pid: int, seconds: float) -> float:
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return cpu_seconds(pid) - before


def connected(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll condition until it holds; fail after timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.01)


def test_a_full_backlog_makes_clients_wait_not_fail(servers, image):
    """150 simultaneous requests while the server is stopped (SIGSTOP, by pid): 129 fill the
    backlog and the others find it full. Each must wait for room, not fail with EAGAIN,
    and all are answered once the server runs again."""
    server = servers.start(image)
    clients = 150
    started = threading.Semaphore(0)

    def one_request() -> dict:
        started.release()
        return request(server.control, {"cmd": "stats"})

    os.kill(server.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(one_request) for _ in range(clients)]
            for _ in range(clients):
                assert started.acquire(timeout=30)
            until(lambda: listen_queue(server.control) > BACKLOG, what="a full backlog")
            time.sleep(0.5)  # for the last few to reach connect(); shorter only weakens it
            os.kill(server.pid, signal.SIGCONT)
            replies = [f.result(timeout=60) for f in futures]
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert all(reply.get("ok") is True for reply in replies)
    with server.client() as h:
        assert h.pread(4096, 0) == image.expected(0, 4096)


def test_out_of_descriptors_evicts_an_idle_client_and_never_spins(servers, image):
    """Under `ulimit -n 48`, 60 idle control connections: accept() fails with EMFILE
    once the descriptors are gone. The server closes the longest idle client to take the
    next one, so it uses little CPU, a new `ctl stats` is answered, and NBD reads go on."""
    server = servers.start(image, wrapper=FEW_FDS)
    with server.client() as h, contextlib.ExitStack() as stack:
        held = [stack.enter_context(connected(server.control)) for _ in range(HELD)]
        assert h.pread(4096, 0) == image.expected(0, 4096)
        cpu_s = cpu_over(server.pid, SPIN_WINDOW_S)
        assert cpu_s < SPIN_BOUND_S, f"{cpu_s:.2f} s of CPU in {SPIN_WINDOW_S:g} s"
        result = ctl(server.control, "stats", "--json")
        assert result.returncode == 0, result.stderr
        assert closed_by_server(held[0])  # the longest idle one made room
        assert h.pread(65536, 1 << 20) == image.expected(1 << 20, 65536)
    with server.client() as h:  # the held ones are gone: a new NBD connection gets in
        assert h.pread(4096, 8192) == image.expected(8192, 4096)


def test_out_of_descriptors_with_no_client_to_evict_the_listener_rests(servers, image):
    """NBD connections take every descriptor under `ulimit -n 48`, so there is no control
    client to close: the listener rests between tries instead of spinning, says so once in
    the log, and answers once NBD clients leave."""
    server = servers.start(image, wrapper=FEW_FDS)
    with contextlib.ExitStack() as stack:
        while len(os.listdir(f"/proc/{server.pid}/fd")) < 48:
            h = stack.enter_context(server.client())
            assert h.pread(4096, 0) == image.expected(0, 4096)
        waiting = [stack.enter_context(connected(server.control)) for _ in range(5)]
        cpu_s = cpu_over(server.pid, SPIN_WINDOW_S)
        assert cpu_s < SPIN_BOUND_S, f"{cpu_s:.2f} s of CPU in {SPIN_WINDOW_S:g} s"
        assert h.pread(65536, 1 << 20) == image.expected(1 << 20, 65536)
        for sock in waiting:
            sock.close()
    result = ctl(server.control, "stats", "--json")
    assert result.returncode == 0, result.stderr
    assert server.log().count("control: accept: Too many open files") == 1, server.log()


def test_a_flood_in_one_write_costs_little_and_follows_the_rate(servers, image):
    """4096 `stats` in one 64 KiB write: each line gets a reply, in order; the first
    RATE_BURST are answered, the others refused with RATE_ERROR but for the few the rate
    refills meanwhile. The server spends little CPU on it, and an NBD read issued meanwhile
    completes promptly."""
    server = servers.start(image)
    with server.client() as h, connected(server.control) as sock:
        assert h.pread(4096, 0) == image.expected(0, 4096)
        before = cpu_seconds(server.pid)
        started = time.monotonic()
        sock.sendall(FLOOD)
        sock.shutdown(socket.SHUT_WR)
        assert h.pread(4096, 1 << 20) == image.expected(1 << 20, 4096)
        read_s = time.monotonic() - started
        sock.settimeout(30)
        replies = sock.makefile("rb").read().splitlines()
        elapsed_s = time.monotonic() - started
        cpu_s = cpu_seconds(server.pid) - before
    assert cpu_s < FLOOD_CPU_BOUND_S, f"{cpu_s:.2f} s of CPU for one flood"
    assert read_s < 1.0, f"an NBD read took {read_s:.3f} s during the flood"
    answers = [json.loads(line) for line in replies]
    assert len(answers) == FLOOD.count(b"\n")
    assert all(a["ok"] and "stats" in a for a in answers[:RATE_BURST])
    refused = [a for a in answers if not a["ok"]]
    assert all(a == {"ok": False, "error": RATE_ERROR} for a in refused)
    answered = len(answers) - len(refused)
    assert RATE_BURST <= answered <= RATE_BURST + RATE_PER_S * elapsed_s + 1

"""The control socket under pressure: a full listen backlog, no file descriptors left, a
flood of requests in one write. In each the server keeps answering and does not spin,
and NBD reads go on.

CPU time is the server's (utime + stime of its pid in /proc): the control thread is the
only one with work while these tests run, and bounds are far from what a spin costs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from nbd_verity.control.protocol import request

from .harness import run

BACKLOG = 128  # the listen() backlog of the control socket (control/server.py)


def listen_queue(path) -> int:
    """Connections waiting in the backlog of the listening Unix socket at path (ss Recv-Q)."""
    fields = run(["ss", "-xlnH", "src", str(path)]).stdout.split()
    return int(fields[2]) if fields else 0


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

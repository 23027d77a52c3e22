"""Several clients at once, and clients that vanish mid-request, leave the server serving."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import threading

import nbd
import pytest

from nbd_verity.sources import handles

from .serverlib import close_handle, raw_connect, raw_read_reply, raw_read_request

FIO = shutil.which("fio") or "/usr/bin/fio"
NBDCOPY = shutil.which("nbdcopy") or "/usr/bin/nbdcopy"
FIO_SECONDS = 3


def fio_argv(uri: str) -> list[str]:
    """Four random 4 KiB readers and one sequential 1 MiB reader, one connection each."""
    common = ["--ioengine=nbd", f"--uri={uri}", "--time_based", f"--runtime={FIO_SECONDS}",
              "--output-format=json"]
    return [FIO, *common,
            "--name=rand", "--rw=randread", "--bs=4k", "--numjobs=4", "--iodepth=8",
            "--name=seq", "--rw=read", "--bs=1M", "--numjobs=1", "--iodepth=2"]


def checksum_over_nbd(uri: str) -> str:
    """sha256 of the whole export, read by nbdcopy (several connections of its own)."""
    proc = subprocess.Popen([NBDCOPY, "--connections=2", uri, "-"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    digest = hashlib.sha256()
    while chunk := proc.stdout.read(1 << 20):
        digest.update(chunk)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return digest.hexdigest()


def random_reader(server, expected: bytes, seed: int, reads: int, failures: list) -> None:
    """A libnbd client doing unaligned reads and comparing them; failures collected."""
    rng = random.Random(seed)
    h = server.connect()
    try:
        for _ in range(reads):
            offset = rng.randrange(len(expected) - 1)
            length = rng.randint(1, min(300_000, len(expected) - offset))
            if h.pread(length, offset) != expected[offset:offset + length]:
                failures.append((seed, offset, length))
    except nbd.Error as e:
        failures.append((seed, str(e)))


def test_concurrent_connections_fio_and_parallel_checksums(default_image, servers):
    server = servers.start(default_image)
    want = hashlib.sha256(default_image.expected()).hexdigest()
    expected = default_image.expected()
    fio = subprocess.Popen(fio_argv(server.uri), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        failures: list = []
        readers = [threading.Thread(target=random_reader,
                                    args=(server, expected, seed, 60, failures))
                   for seed in range(3)]
        for t in readers:
            t.start()
        sums = [checksum_over_nbd(server.uri) for _ in range(2)]  # while fio runs
        for t in readers:
            t.join()
        out, err = fio.communicate(timeout=FIO_SECONDS + 60)
    finally:
        if fio.poll() is None:
            os.kill(fio.pid, signal.SIGKILL)
            fio.communicate()
    assert fio.returncode == 0, err
    assert sums == [want, want]
    assert not failures, failures
    jobs = json.loads(out[out.index("{"):])["jobs"]
    assert len(jobs) == 5
    for job in jobs:
        assert job["error"] == 0, job
        assert job["read"]["io_bytes"] > 0, job
    assert server.alive()
    assert "corrupt" not in server.log() and "error" not in server.log(), server.log()


def drop_after_request(path: str, how: str, size: int) -> None:
    """Send a large read, then vanish: close at once, after part of the reply, or by RST."""
    sock, _ = raw_connect(path)
    try:
        raw_read_request(sock, 7, 0, size)
        if how == "partial":
            assert len(sock.recv(4096)) > 0
        if how == "reset":  # SO_LINGER 0: close() sends RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


@pytest.mark.parametrize("how", ["close", "partial", "reset"])
def test_client_vanishing_mid_request_leaves_the_server_serving(default_image, servers, how):
    server = servers.start(default_image)
    watcher = server.connect()  # connected throughout: other clients must not be disturbed
    for _ in range(8):
        drop_after_request(server.socket, how, default_image.size)
    # libnbd: a request in flight, then the handle is closed without waiting for it.
    for _ in range(4):
        h = nbd.NBD()
        h.connect_unix(server.socket)
        h.aio_pread(nbd.Buffer(default_image.size), 0)
        close_handle_now(h)
    assert server.alive()
    assert watcher.pread(default_image.size, 0) == default_image.expected()
    sock, size = raw_connect(server.socket)
    with sock:
        raw_read_request(sock, 1, 4096, 8192)
        error, data = raw_read_reply(sock, 1, 8192)
    assert (size, error, data) == (default_image.size, 0, default_image.expected(4096, 8192))
    assert server.connect().pread(default_image.size, 0) == default_image.expected()
    assert "Traceback" not in server.log()
    assert server.stop() == 0, server.log()


def close_handle_now(h) -> None:
    """Drop a libnbd handle with a request still in flight (no NBD_CMD_DISC first)."""
    handles.close(h, disconnect=False)


def test_many_sequential_connections(default_image, servers):
    """Connections come and go; no state leaks between them (file descriptors, threads)."""
    server = servers.start(default_image)
    fds_before = len(os.listdir(f"/proc/{server.pid}/fd"))
    for i in range(40):
        h = nbd.NBD()
        h.connect_unix(server.socket)
        assert h.pread(4096, i * 4096) == default_image.expected(i * 4096, 4096)
        close_handle(h)
    assert server.alive()
    # A leak would keep one descriptor per connection (40); the last few connections may
    # still be closing on the server's side, so allow a handful.
    assert len(os.listdir(f"/proc/{server.pid}/fd")) < fds_before + 8

"""Images on untrusted remote storage: HTTP through lighttpd and nbdkit's curl plugin
(`nbd-verity serve http://...`), and NBD upstreams (plain nbdkit `file` servers, with
nbdkit's error filter injecting failures). Whatever the upstream does, a client gets the
original bytes or EIO, never other bytes.
"""

from __future__ import annotations

import errno
import glob
import os
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

import nbd
import pytest

from .serverlib import (
    MIB,
    control_request,
    error_number,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    reads_across_an_outage,
)
from .upstreams import Lighttpd, NbdkitFile

CHUNK = 64 << 10


@pytest.fixture(scope="module")
def remote_image(tmp_path_factory):
    """2 MiB, 4096/4096 sha256: 512 data blocks, 4 level-0 blocks, 2 levels."""
    return make_image(tmp_path_factory.mktemp("remote"), random_bytes(13, 2 * MIB))


@pytest.fixture
def web(tmp_path, remote_image):
    """lighttpd serving a private copy of the image (data.img, hash.img)."""
    docroot = tmp_path / "www"
    docroot.mkdir()
    shutil.copyfile(remote_image.data, docroot / "data.img")
    shutil.copyfile(remote_image.hash, docroot / "hash.img")
    server = Lighttpd(docroot, tmp_path / "lighttpd").start()
    yield server
    server.stop()


@pytest.fixture
def http_served(web, servers, sockdir, remote_image, monkeypatch):
    """`nbd-verity serve http://.../data.img http://.../hash.img ROOT` with a control
    socket; the captive upstreams' sockets go in sockdir (RUNTIME_DIRECTORY)."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)

    def start(*options: str):
        control = os.path.join(sockdir, f"ctl{len(os.listdir(sockdir))}.sock")
        server = servers.serve_cli([web.url("data.img"), web.url("hash.img"),
                                    remote_image.root, "--control", control, *options])
        server.control_path = control
        return server
    return start


def read_all(h, size: int, chunk: int = CHUNK) -> bytes:
    return b"".join(h.pread(min(chunk, size - o), o) for o in range(0, size, chunk))


def stats(path: str) -> dict:
    return control_request(path, {"cmd": "stats"})["stats"]["totals"]


# -- HTTP -----------------------------------------------------------------------------


def test_http_reads_back_the_original(http_served, remote_image, sockdir):
    server = http_served()
    h = server.connect()
    assert h.get_size() == remote_image.size
    assert read_all(h, remote_image.size) == remote_image.expected()
    totals = stats(server.control_path)
    assert totals["source_errors"] == 0 and totals["corruptions"] == 0
    pid_files = glob.glob(f"{sockdir}/nbd-verity-up-*/*.pid")
    upstream_pids = [int(Path(p).read_text()) for p in pid_files]
    assert len(upstream_pids) == 2
    server.stop()  # the verifying nbdkit, by pid: its captive upstreams follow it
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in upstream_pids):
        assert time.monotonic() < deadline, "captive upstreams outlived the server"
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_http_upstream_cache(http_served, remote_image):
    server = http_served("--upstream-cache", "--upstream-cache-size", "16M")
    h = server.connect()
    assert read_all(h, remote_image.size) == remote_image.expected()
    assert read_all(h, remote_image.size, 4096 * 3) == remote_image.expected()


def test_http_corrupt_data_byte_fails_exactly_its_block(http_served, web, remote_image):
    block = 77
    flip_byte(web.docroot / "data.img", block * 4096 + 1234)
    server = http_served()
    h = server.connect()
    expect_eio(h, 4096, block * 4096)
    expect_eio(h, 3 * 4096, (block - 1) * 4096)
    for neighbour in (block - 1, block + 1):
        assert h.pread(4096, neighbour * 4096) == remote_image.expected(neighbour * 4096, 4096)
    assert stats(server.control_path)["corruptions"] >= 2


def test_http_corrupt_hash_byte_fails_exactly_its_leaf(http_served, web, remote_image):
    leaf = remote_image.leaf_offset(300)  # covers data blocks 256..383
    flip_byte(web.docroot / "hash.img", leaf + 100)
    server = http_served()
    h = server.connect()
    for block in (256, 300, 383):
        expect_eio(h, 4096, block * 4096)
    for block in (0, 255, 384, 511):
        assert h.pread(4096, block * 4096) == remote_image.expected(block * 4096, 4096)


def test_http_server_restarted_mid_read(http_served, web, remote_image):
    """Stop and restart lighttpd while a client reads: each read is EIO or correct."""
    server = http_served("--cache-size", "4K")  # hash blocks are re-read too
    h = server.connect()
    expected = remote_image.expected()

    def outage():
        web.stop()
        time.sleep(0.5)  # the outage itself
        web.start()

    outcomes = reads_across_an_outage(h, expected, outage, CHUNK)
    print(f"reads across the restart: {outcomes}")
    assert read_all(h, remote_image.size) == expected  # and served again afterwards


# -- NBD upstreams ----------------------------------------------------------------------


def upstream_pair(remote_image, sockdir, data_filters=(), data_keys=(), hash_filters=(),
                  hash_keys=(), tcp=False):
    data = NbdkitFile(remote_image.data, sockdir, "up-data", data_filters, data_keys, tcp)
    hashes = NbdkitFile(remote_image.hash, sockdir, "up-hash", hash_filters, hash_keys, tcp)
    return data.start(), hashes.start()


@pytest.mark.parametrize("tcp", [False, True], ids=["nbd+unix", "nbd"])
def test_nbd_upstream_reads_back(remote_image, sockdir, upstreams, servers, tcp):
    data, hashes = upstream_pair(remote_image, sockdir, tcp=tcp)
    upstreams += [data, hashes]
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.start(replace(remote_image, data=data.uri, hash=hashes.uri),
                           control=control)
    h = server.connect()
    assert read_all(h, remote_image.size, 12288) == remote_image.expected()
    assert stats(control)["source_errors"] == 0


def test_nbd_upstream_dropped_and_back(remote_image, sockdir, upstreams, servers):
    data, hashes = upstream_pair(remote_image, sockdir)
    upstreams += [data, hashes]
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.start(replace(remote_image, data=data.uri, hash=hashes.uri),
                           control=control)
    h = server.connect()
    assert h.pread(CHUNK, 0) == remote_image.expected(0, CHUNK)
    data.proc.kill()  # by pid: the upstream dies, the connection drops
    data.wait()
    expect_eio(h, CHUNK, CHUNK)
    expect_eio(h, CHUNK, 2 * CHUNK)  # still down: the reconnect itself fails
    data.start()
    assert h.pread(CHUNK, CHUNK) == remote_image.expected(CHUNK, CHUNK)
    totals = stats(control)
    assert totals["io_errors"] == 2 and totals["source_errors"] >= 2
    assert totals["reconnects"] >= 1 and totals["corruptions"] == 0


@pytest.mark.parametrize("side", ["data", "hash", "both"])
def test_error_filter_gives_eio_or_correct_bytes(remote_image, sockdir, upstreams, servers,
                                                 side):
    """nbdkit's error filter fails 20% of upstream reads: every client read is EIO or
    the original bytes, and the counters agree with what the client saw."""
    trigger = os.path.join(sockdir, "inject")  # errors only once the server is up
    error = (("error",), ("error-pread-rate=20%", f"error-file={trigger}"))
    data_f, data_k = error if side in ("data", "both") else ((), ())
    hash_f, hash_k = error if side in ("hash", "both") else ((), ())
    data, hashes = upstream_pair(remote_image, sockdir, data_f, data_k, hash_f, hash_k)
    upstreams += [data, hashes]
    control = os.path.join(sockdir, "ctl.sock")
    server = servers.start(replace(remote_image, data=data.uri, hash=hashes.uri),
                           control=control, cache_size="4K")
    h = server.connect()
    Path(trigger).touch()
    expected = remote_image.expected()
    failed = ok = 0
    offsets = list(range(0, remote_image.size, 16384))
    random.Random(7).shuffle(offsets)  # jumps: each read may need another level-0 block
    for _round in range(3):
        for offset in offsets:
            try:
                got = h.pread(16384, offset)
            except nbd.Error as e:
                assert error_number(e) == errno.EIO, e
                failed += 1
                continue
            assert got == expected[offset:offset + 16384], f"wrong bytes at {offset}"
            ok += 1
    totals = stats(control)
    assert failed > 0 and ok > 0
    assert totals["io_errors"] == failed
    assert totals["source_errors"] >= failed  # readahead failures are counted, not seen
    assert totals["corruptions"] == 0 and totals["reconnects"] == 0

"""An image truncated under a running server: EIO where it no longer reaches, one clear log
line, and everything it still covers keeps serving."""

from __future__ import annotations

import os

from .serverlib import expect_eio


def log_lines(server, *needles: str) -> list[str]:
    return [line for line in server.log().splitlines() if all(n in line for n in needles)]


def test_truncated_data_image(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    server = servers.start(image)
    h = server.connect()
    assert h.pread(image.size, 0) == image.expected()
    os.truncate(image.data, 512 * dbs + 100)  # inside data block 512
    for count, offset in [(dbs, 600 * dbs), (dbs, 512 * dbs), (1, 512 * dbs),
                          (2 * dbs, 511 * dbs), (dbs, image.size - dbs)]:
        expect_eio(h, count, offset)
    assert h.pread(512 * dbs, 0) == default_image.expected(0, 512 * dbs)
    assert server.connect().pread(dbs, 511 * dbs) == default_image.expected(511 * dbs, dbs)
    assert server.alive()
    assert log_lines(server, "nbd-verity:", str(image.data), "truncated"), server.log()
    assert "Traceback" not in server.log()


def test_truncated_hash_image(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    last_leaf = image.leaf_offset(image.data_blocks - 1)
    lost = {b for b in range(image.data_blocks - 200, image.data_blocks)
            if image.leaf_offset(b) == last_leaf}  # blocks whose leaf is cut off
    assert lost and max(lost) == image.data_blocks - 1
    server = servers.start(image, prefetch_cluster="4096")  # one leaf per cold read: the
    h = server.connect()  # last one is not cached with the first's cluster
    assert h.pread(dbs, 0) == image.expected(0, dbs)  # a small read: no readahead
    os.truncate(image.hash, last_leaf + 10)
    first_lost = min(lost)
    expect_eio(h, dbs, first_lost * dbs)
    expect_eio(h, 1, image.size - 1)
    expect_eio(h, 4 * dbs, (first_lost - 2) * dbs)
    assert h.pread(first_lost * dbs, 0) == image.expected(0, first_lost * dbs)
    assert server.alive()
    assert log_lines(server, "nbd-verity:", str(image.hash), "truncated"), server.log()
    assert "Traceback" not in server.log()


def test_truncation_log_says_where_the_image_ends(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    server = servers.start(image)
    h = server.connect()
    end = 512 * dbs + 100
    os.truncate(image.data, end)
    expect_eio(h, dbs, 600 * dbs)  # starts well past the end
    lines = log_lines(server, str(image.data), "ends at byte")
    assert lines and all(f"ends at byte {end}," in line for line in lines), lines

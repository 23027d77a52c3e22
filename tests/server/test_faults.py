"""Images changed under a live server: renamed, replaced, rewritten, truncated, regrown.

The server holds both images open, so a rename or a replacement (a new file at the same
path) changes nothing it reads: it keeps serving the bytes it verifies against the tree it
trusts. A rewrite in place changes the bytes it reads: those blocks fail with EIO, never
a wrong byte. In every case the server stays up for other clients (test_truncation.py
has the shortened images).
"""

from __future__ import annotations

import os

import nbd
import pytest

from nbd_verity.limits import MAX_REQUEST_SIZE

from .serverlib import expect_eio, random_bytes


def read_all_or_eio(h, image, chunk: int = 64 << 10) -> list[int]:
    """Read the device in chunks: each is the image's bytes or EIO; the failed offsets."""
    failed = []
    for offset in range(0, image.size, chunk):
        try:
            assert h.pread(chunk, offset) == image.expected(offset, chunk), offset
        except nbd.Error:
            failed.append(offset)
    return failed


@pytest.mark.parametrize("which", ["data", "hash"])
def test_renamed_images_keep_serving(default_image, servers, tmp_path, which):
    image = default_image.copy(tmp_path)
    server = servers.start(image)
    path = getattr(image, which)
    os.rename(path, path.with_suffix(".moved"))
    assert server.connect().pread(image.size, 0) == default_image.expected()
    assert server.alive()


@pytest.mark.parametrize("which", ["data", "hash"])
def test_replaced_images_are_never_read(default_image, servers, tmp_path, which):
    """A new file renamed over the path (how images are usually updated): the server
    still reads the open one; the new bytes are neither served nor trusted."""
    image = default_image.copy(tmp_path)
    server = servers.start(image)
    path = getattr(image, which)
    fresh = path.with_suffix(".new")
    fresh.write_bytes(random_bytes(99, path.stat().st_size))
    os.replace(fresh, path)
    h = server.connect()
    assert h.pread(image.size, 0) == default_image.expected()


def test_rewritten_data_fails_where_it_changed(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    server = servers.start(image)
    h = server.connect()
    assert h.pread(image.size, 0) == default_image.expected()
    with open(image.data, "r+b") as f:  # the same inode, other bytes in blocks 100..103
        f.seek(100 * dbs)
        f.write(random_bytes(5, 4 * dbs))
    for block in range(100, 104):
        expect_eio(h, dbs, block * dbs)
    assert read_all_or_eio(server.connect(), default_image) == [0x60000]  # 64K chunk 6
    assert server.alive()


def test_rewritten_hash_fails_only_where_it_is_not_cached(default_image, servers, tmp_path):
    """Verified hash blocks are kept (no check/use gap): a rewrite of the tree is seen only
    where a block was not yet cached; everything read stays right or EIO."""
    image = default_image.copy(tmp_path)
    server = servers.start(image, cache_size="4096")  # nothing but the top stays cached
    h = server.connect()
    size = image.hash.stat().st_size
    with open(image.hash, "r+b") as f:
        f.seek(4096)
        f.write(random_bytes(6, size - 4096))
    failed = read_all_or_eio(h, default_image)
    assert failed, "a rewritten tree must fail somewhere"
    assert server.alive()


def test_truncated_to_nothing_then_regrown(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    server = servers.start(image)
    h = server.connect()
    os.truncate(image.data, 0)
    expect_eio(h, dbs, 0)
    expect_eio(h, MAX_REQUEST_SIZE // 8, 0)
    image.data.write_bytes(default_image.data.read_bytes())  # the same inode, regrown
    assert h.pread(image.size, 0) == default_image.expected()
    assert server.alive()

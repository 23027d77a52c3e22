"""Corruption fails exactly the requests that cover it; the kernel's dm-verity error
modes (docs/server.md).

Every test damages a private copy of a shared image (image.copy), never the image itself.
"""

from __future__ import annotations

import subprocess

import pytest

from .serverlib import (
    ENGINES,
    MIB,
    close_handle,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    write_at,
)

BAD = 300  # the corrupted data block in these tests


@pytest.mark.parametrize("which", ["default_image", "small_block_image"])
@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_flipped_data_byte_fails_only_requests_covering_its_block(which, request, servers,
                                                                   tmp_path):
    image = request.getfixturevalue(which).copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, BAD * dbs + 7)
    server = servers.start(image)
    h = server.connect()
    bad = BAD * dbs
    for count, offset in [(dbs, bad), (1, bad + 7), (1, bad + dbs - 1), (2, bad - 1),
                          (dbs, bad - dbs // 2), (3 * dbs, bad - dbs), (64 * dbs, bad - 32 * dbs)]:
        expect_eio(h, count, offset)
    for count, offset in [(dbs, bad - dbs), (dbs, bad + dbs), (1, bad - 1), (1, bad + dbs),
                          (32 * dbs, bad - 32 * dbs), (32 * dbs, bad + dbs)]:
        assert h.pread(count, offset) == image.expected(offset, count), (offset, count)
    # The server keeps serving everything else, on this connection and on a new one.
    assert h.pread(bad, 0) == image.expected(0, bad)
    rest = image.size - bad - dbs
    assert server.connect().pread(rest, bad + dbs) == image.expected(bad + dbs, rest)
    assert server.alive()
    assert f"data block {BAD} is corrupted" in server.log()


@pytest.mark.parametrize("which", ["default_image", "small_block_image"])
@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_flipped_leaf_byte_fails_exactly_the_blocks_under_it(which, request, servers,
                                                             tmp_path):
    image = request.getfixturevalue(which).copy(tmp_path)
    dbs, hbs = image.data_block_size, image.hash_block_size
    leaf = image.leaf_offset(BAD)
    original_leaf = image.hash.read_bytes()[leaf:leaf + hbs]
    # The blocks whose digests this leaf holds, found from the bytes, not from geometry.
    under = {b for b in range(image.data_blocks)
             if image.block_digest(image.expected(b * dbs, dbs)) in original_leaf}
    assert BAD in under and len(under) > 1
    flip_byte(image.hash, leaf + hbs - 1)  # a byte far from BAD's own slot
    server = servers.start(image)
    h = server.connect()
    window = range(max(0, min(under) - 40), min(image.data_blocks, max(under) + 40))
    for block in window:
        if block in under:
            expect_eio(h, dbs, block * dbs)
        else:
            assert h.pread(dbs, block * dbs) == image.expected(block * dbs, dbs), block
    assert server.alive()
    assert f"metadata block {leaf // hbs} is corrupted" in server.log()


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_flipped_level1_byte_fails_every_block_below_it(small_block_image, servers, tmp_path):
    """The 3-level image: a level-1 block covers 16 leaves of 16 data blocks each."""
    image = small_block_image.copy(tmp_path)
    dbs, hbs = image.data_block_size, image.hash_block_size
    leaf = image.leaf_offset(BAD)
    parent = image.parent_offset(leaf)
    assert parent != image.top_block_offset()  # a middle level, not the top
    below = image.hash.read_bytes()[parent:parent + hbs]
    under = [b for b in range(image.data_blocks)
             if image.block_digest(image.hash.read_bytes()[image.leaf_offset(b):][:hbs])
             in below]
    assert len(under) == 256 and BAD in under
    flip_byte(image.hash, parent + hbs // 2)
    server = servers.start(image)
    h = server.connect()
    for block in range(image.data_blocks):
        if block in under:
            expect_eio(h, 1, block * dbs + 1)
        else:
            assert h.pread(dbs, block * dbs) == image.expected(block * dbs, dbs), block
    assert server.alive()
    assert f"metadata block {parent // hbs} is corrupted" in server.log()


def test_ignore_corruption_returns_the_data_on_disk(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, BAD * dbs + 100)
    leaf_victim = 900  # a block under a different, corrupted leaf
    flip_byte(image.hash, image.leaf_offset(leaf_victim) + 3)
    server = servers.start(image, error_mode="ignore-corruption")
    h = server.connect()
    assert h.pread(dbs, BAD * dbs) == image.expected(BAD * dbs, dbs)  # the flipped bytes
    assert h.pread(dbs, BAD * dbs) != default_image.expected(BAD * dbs, dbs)
    assert h.pread(dbs, leaf_victim * dbs) == image.expected(leaf_victim * dbs, dbs)
    assert h.pread(image.size, 0) == image.expected()
    log = server.log()
    assert f"data block {BAD} is corrupted" in log
    assert "metadata block" in log


def test_restart_on_corruption_exits_75_after_the_first_corrupt_read(default_image, servers,
                                                                     tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, BAD * dbs)
    server = servers.start(image, error_mode="restart-on-corruption")
    h = server.connect()
    assert h.pread(BAD * dbs, 0) == image.expected(0, BAD * dbs)
    assert server.alive()
    expect_eio(h, dbs, BAD * dbs)
    close_handle(h)  # nbdkit 1.32 finishes its shutdown only when the client has gone
    assert server.wait() == 75, server.log()
    log = server.log()
    assert f"data block {BAD} is corrupted" in log
    assert "restart-on-corruption" in log
    assert "Traceback" not in log


def test_restart_on_corruption_exits_while_a_client_stays_connected(default_image, servers,
                                                                    tmp_path):
    """An idle client (a kernel nbd device between requests) must not hold the server up:
    dm-verity restarts at once. Here a second client is connected and idle."""
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, BAD * dbs)
    server = servers.start(image, error_mode="restart-on-corruption")
    idle = server.connect()
    assert idle.pread(dbs, 0) == image.expected(0, dbs)
    h = server.connect()
    expect_eio(h, dbs, BAD * dbs)
    close_handle(h)
    try:
        status = server.wait(timeout=3)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still serving 3 s after restart-on-corruption:\n{server.log()}")
    assert status == 75, server.log()


@pytest.fixture(scope="module")
def zero_image(tmp_path_factory):
    """1 MiB where blocks 10..19 are zeros and the rest random."""
    content = bytearray(random_bytes(3, 1 * MIB))
    content[10 * 4096:20 * 4096] = bytes(10 * 4096)
    return make_image(tmp_path_factory.mktemp("zeros"), bytes(content))


@pytest.mark.parametrize("ignore_zero_blocks", [True, False])
def test_ignore_zero_blocks_returns_zeros_without_hashing(zero_image, servers, tmp_path,
                                                          ignore_zero_blocks):
    """ignore_zero_blocks: a block whose verified wanted digest is the zero block's digest reads as
    zeros, unhashed; so a zero block damaged on disk still reads as zeros."""
    image = zero_image.copy(tmp_path)
    dbs = image.data_block_size
    write_at(image.data, 12 * dbs + 5, b"not zero any more")
    flip_byte(image.data, 30 * dbs)  # a non-zero block: always checked
    keys = {"ignore_zero_blocks": "true"} if ignore_zero_blocks else {}
    h = servers.start(image, **keys).connect()
    if ignore_zero_blocks:
        assert h.pread(dbs, 12 * dbs) == bytes(dbs)
        assert h.pread(3 * dbs + 10, 11 * dbs - 5) == zero_image.expected(11 * dbs - 5,
                                                                          3 * dbs + 10)
    else:
        expect_eio(h, dbs, 12 * dbs)
    expect_eio(h, dbs, 30 * dbs)
    assert h.pread(dbs, 13 * dbs) == bytes(dbs)
    assert h.pread(10 * dbs, 0) == zero_image.expected(0, 10 * dbs)
    assert h.pread(dbs, 31 * dbs) == zero_image.expected(31 * dbs, dbs)


def test_ignore_zero_blocks_still_verifies_the_tree_path(zero_image, servers, tmp_path):
    """Zero blocks skip only the data hash: a corrupted leaf above them still fails."""
    image = zero_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.hash, image.leaf_offset(0) + 50)  # the leaf over zero blocks 10..19
    h = servers.start(image, ignore_zero_blocks="true").connect()
    expect_eio(h, dbs, 12 * dbs)
    assert h.pread(dbs, 200 * dbs) == image.expected(200 * dbs, dbs)


def test_corruption_log_is_capped_at_100_like_the_kernel(default_image, servers, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    for block in range(120):
        flip_byte(image.data, block * 2 * dbs + 1)  # every other block of the first 240
    server = servers.start(image, error_mode="ignore-corruption")
    h = server.connect()
    assert h.pread(image.size, 0) == image.expected()
    lines = server.log().splitlines()
    reports = [line for line in lines if line.startswith("nbd-verity: data block ")]
    # Large reads are verified in parallel chunks, so the 100 logged are not always the
    # first 100 by block number; each must be a corrupted block, and named once.
    corrupted = {f"nbd-verity: data block {2 * b} is corrupted" for b in range(120)}
    assert len(reports) == len(set(reports)) == 100, reports[-3:]
    assert set(reports) <= corrupted
    assert sum("reached maximum errors" in line for line in lines) == 1


@pytest.mark.parametrize("check_at_most_once", [True, False])
def test_check_at_most_once_skips_blocks_already_verified(default_image, servers, tmp_path,
                                                          check_at_most_once):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    keys = {"check_at_most_once": "true"} if check_at_most_once else {}
    h = servers.start(image, **keys).connect()
    assert h.pread(dbs, 40 * dbs) == image.expected(40 * dbs, dbs)
    assert h.pread(10, 50 * dbs + 100) == image.expected(50 * dbs + 100, 10)  # whole block
    for block in (40, 41, 50):  # offline tampering after the first reads
        flip_byte(image.data, block * dbs + 9)
    if check_at_most_once:
        assert h.pread(dbs, 40 * dbs) == image.expected(40 * dbs, dbs)  # not re-checked
        assert image.expected(40 * dbs, dbs) != default_image.expected(40 * dbs, dbs)
        assert h.pread(dbs, 50 * dbs) == image.expected(50 * dbs, dbs)
    else:
        expect_eio(h, dbs, 40 * dbs)
        expect_eio(h, dbs, 50 * dbs)
    expect_eio(h, dbs, 41 * dbs)  # never read before: checked, and corrupt
    expect_eio(h, 2 * dbs, 40 * dbs)  # a request that also covers an unverified block

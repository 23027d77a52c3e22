"""What the server counts, seen from outside: the control socket's stats (hash-image reads
after NBD_CMD_CACHE) and the counters of an in-process Device."""

from __future__ import annotations

import os

import pytest

from nbd_verity.errors import CorruptionError
from nbd_verity.prepare.config import config_from_pairs
from nbd_verity.serve.device import Connection, Device

from .serverlib import MIB, control_request, flip_byte, read_general

TAIL = (1 * MIB + 12345, 3 * MIB - 12345)  # to the device's end: nothing to read ahead


def totals(path: str, reset: bool = False) -> dict:
    return control_request(path, {"cmd": "stats", "reset": reset})["stats"]["totals"]


@pytest.mark.parametrize("use_cache", [True, False])
def test_cache_command_then_read_needs_no_hash_reads(default_image, servers, sockdir,
                                                     use_cache):
    """Through a real nbdkit: after CACHE of a range, reading it reads no hash blocks."""
    control = os.path.join(sockdir, "control.sock")
    offset, count = TAIL
    h = servers.start(default_image, control=control).connect()
    if use_cache:
        h.cache(count, offset)
        assert totals(control)["hash_reads"] > 0
    totals(control, reset=True)
    assert h.pread(count, offset) == default_image.expected(offset, count)
    after = totals(control)
    assert after["data_blocks_verified"] > 0  # the counters do move on this path
    if use_cache:
        assert after["hash_reads"] == 0, after
    else:
        assert after["hash_reads"] > 0, after


@pytest.mark.parametrize("check_at_most_once", ["false", "true"])
def test_each_block_read_is_counted_once(default_image, tmp_path, check_at_most_once):
    """data_blocks_verified counts the blocks that matched; under ignore-corruption a
    corrupt block, returned as read, counts in corruptions only (docs/control.md)."""
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    for block in (300, 301, 700):
        flip_byte(image.data, block * dbs)
    dev = Device(config_from_pairs(image.pairs(error_mode="ignore-corruption",
                                               check_at_most_once=check_at_most_once)))
    try:
        buf = bytearray(image.size)
        read_general(Connection(dev), memoryview(buf), 0)
        counts = dev.verifier.counters.snapshot()
    finally:
        dev.close()
    assert bytes(buf) == image.expected()  # the file as it is, corrupt bytes included
    assert counts["corruptions"] == 3
    assert counts["data_blocks_verified"] == image.data_blocks - 3, counts


def test_blocks_before_a_corruption_still_count(default_image, tmp_path):
    """Under eio a read of blocks 256..319 fails at block 300, but the 44 blocks before it
    matched and count (check-at-most-once takes them one by one)."""
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, 300 * dbs)
    dev = Device(config_from_pairs(image.pairs(check_at_most_once="true")))
    try:
        buf = bytearray(64 * dbs)
        with pytest.raises(CorruptionError):
            read_general(Connection(dev), memoryview(buf), 256 * dbs)
        counts = dev.verifier.counters.snapshot()
    finally:
        dev.close()
    assert (counts["corruptions"], counts["data_blocks_verified"]) == (1, 44), counts

"""What the server counts, seen from outside: the control socket's stats (hash-image reads
after NBD_CMD_CACHE) and the counters of an in-process Device."""

from __future__ import annotations

import os

import pytest
from serverlib import MIB, control_request, flip_byte

from nbd_verity.serve.config import config_from_pairs
from nbd_verity.serve.device import Connection, Device

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


def test_each_block_read_is_counted_once(default_image, tmp_path):
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, 300 * dbs)
    dev = Device(config_from_pairs(image.pairs(error_mode="ignore-corruption")))
    try:
        buf = bytearray(image.size)
        Connection(dev).read(memoryview(buf), 0)
        counts = dev.verifier.counters.snapshot()
    finally:
        dev.close()
    assert bytes(buf) == image.expected()
    assert counts["corruptions"] == 1
    assert counts["data_blocks_verified"] == image.data_blocks, counts

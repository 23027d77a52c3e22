"""NBD_CMD_CACHE warms the verified hash-block cache.

The "no hash reads after CACHE" assertion runs Device/Connection in-process, where
the counters are at hand (test_stats.py checks the same through a real nbdkit's control
socket); a real nbdkit then shows that CACHE works over the wire and never caches an
unverified block, and what the level-0 cache keeps or evicts.
"""

from __future__ import annotations

import pytest

from nbd_verity.prepare.config import config_from_pairs
from nbd_verity.serve.device import Connection, Device

from ..serverlib import MIB, expect_eio, flip_byte, read_general

# offset, count: unaligned, several level-0 blocks; the first runs to the device's end (so
# readahead has nothing past it to fetch), the second stops in the middle.
TAIL = (1 * MIB + 12345, 3 * MIB - 12345)
MIDDLE = (1 * MIB + 12345, 2 * MIB)


@pytest.fixture
def device(default_image):
    devices = []

    def make(**keys):
        dev = Device(config_from_pairs(default_image.pairs(**keys)))
        devices.append(dev)
        return dev

    yield make
    for dev in devices:
        dev.close()


def read_counting(dev, offset: int, count: int) -> tuple[bytes, dict]:
    """Read through a new Connection; return the bytes and the counters of that read."""
    dev.verifier.counters.reset()
    buf = bytearray(count)
    read_general(Connection(dev), memoryview(buf), offset)
    return bytes(buf), dev.verifier.counters.snapshot()


def cache_then_read(default_image, dev, offset: int, count: int) -> dict:
    dev.verifier.counters.reset()
    Connection(dev).cache(count, offset)
    assert dev.verifier.counters.snapshot()["hash_reads"] > 0
    data, counts = read_counting(dev, offset, count)
    assert data == default_image.expected(offset, count)
    return counts


@pytest.mark.parametrize("readahead", ["true", "false"])
def test_cache_command_leaves_nothing_to_read_from_the_hash_image(default_image, device,
                                                                   readahead):
    offset, count = TAIL
    data, cold = read_counting(device(readahead=readahead), offset, count)
    assert data == default_image.expected(offset, count)
    assert cold["hash_reads"] > 0  # the control: without CACHE this range needs hash blocks
    warm = cache_then_read(default_image, device(readahead=readahead), offset, count)
    assert warm["hash_reads"] == 0


def test_after_cache_only_readahead_past_the_range_reads_hashes(default_image, device):
    """In the middle of the device a large read also reads ahead past its own range; that
    is readahead's job, but every hash read it makes must be a readahead, none on demand."""
    offset, count = MIDDLE
    assert cache_then_read(default_image, device(readahead="false"), offset,
                           count)["hash_reads"] == 0
    warm = cache_then_read(default_image, device(readahead="true"), offset, count)
    assert warm["hash_reads"] == warm["readaheads"]


def test_cache_command_over_nbd(default_image, servers):
    offset, count = MIDDLE
    h = servers.start(default_image).connect()
    assert h.can_cache()
    h.cache(count, offset)
    h.cache(1, default_image.size - 1)
    assert h.pread(count, offset) == default_image.expected(offset, count)
    assert h.pread(default_image.size, 0) == default_image.expected()


def test_cache_command_never_caches_a_corrupt_leaf(default_image, servers, tmp_path):
    """CACHE is a hint: over a corrupted level-0 block it may succeed or fail, but the
    block must not become trusted: reads under it still fail, the rest still reads."""
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.hash, image.leaf_offset(300) + 1)
    h = servers.start(image).connect()
    try:
        h.cache(image.size, 0)
    except Exception as e:
        assert "EIO" in str(e), e
    expect_eio(h, dbs, 300 * dbs)
    assert h.pread(dbs, 100 * dbs) == image.expected(100 * dbs, dbs)
    assert h.pread(dbs, 500 * dbs) == image.expected(500 * dbs, dbs)


@pytest.mark.parametrize("cache_size", ["4096", "64M"])
def test_leaf_corrupted_after_use_is_caught_only_once_evicted(default_image, servers,
                                                              tmp_path, cache_size):
    """A verified leaf is kept and trusted (no check/use gap, as dm-bufio's hash_verified);
    with a one-block cache it is evicted, read again and checked again."""
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    h = servers.start(image, cache_size=cache_size).connect()
    assert h.pread(dbs, 0) == image.expected(0, dbs)  # caches block 0's leaf
    assert h.pread(dbs, 900 * dbs) == image.expected(900 * dbs, dbs)  # another leaf
    flip_byte(image.hash, image.leaf_offset(0) + 2)
    if cache_size == "4096":
        expect_eio(h, dbs, 0)
    else:
        assert h.pread(dbs, 0) == image.expected(0, dbs)
    # Every other block still reads correctly through a cache of one leaf.
    assert h.pread(image.size - 128 * dbs, 128 * dbs) == image.expected(128 * dbs)

"""Corruption reads as EIO on the pool path exactly as on the inline path.

The damaged image (conftest) has a flipped byte in data blocks 20 and 300 and is served
with the good tree. Each read is done once with a threshold that forces it inline and
once with one that forces it into the pool; the server's stats confirm which path ran.
"""

from __future__ import annotations

import errno

import nbd
import pytest

from .conftest import BAD_BLOCKS, BLOCK_SIZE

KIB = 1024
FORCE = {"inline": 1 << 20, "pool": 0}  # be threshold that sends every read here

BAD_READS = {
    "64k-covering-block-20": (64 * KIB, 64 * KIB),
    "one-byte-of-block-20": (BAD_BLOCKS[0] * BLOCK_SIZE + 1234, 1),
    "unaligned-64k": (64 * KIB + 100, 64 * KIB),
    # 256 KiB from 1 MiB: block 300 is in the second 128 KiB pool chunk, not the first
    "256k-bad-second-chunk": (1 << 20, 256 * KIB),
}
GOOD_READS = {
    "64k-before": (0, 64 * KIB),
    "64k-after": (128 * KIB, 64 * KIB),
    "block-19-and-21": (19 * BLOCK_SIZE, BLOCK_SIZE),
    "256k-after-block-300": (1280 * KIB, 256 * KIB),
}


@pytest.fixture(scope="module")
def server(module_servers, damaged_image):
    return module_servers.start(damaged_image)


@pytest.mark.parametrize("path", ["inline", "pool"])
@pytest.mark.parametrize(("offset", "length"), list(BAD_READS.values()), ids=list(BAD_READS))
def test_corrupted_range_is_eio(server, path, offset, length):
    server.set_thresholds(be=FORCE[path])
    server.reset_stats()
    with server.client("@be") as h:
        with pytest.raises(nbd.Error) as caught:
            h.pread(length, offset)
        # libnbd: .errnum is the number (.errno is its name, "EIO", in this version)
        assert caught.value.errnum == errno.EIO
        # the same connection goes on serving its neighbours
        assert h.pread(BLOCK_SIZE, 0) == server.image.expected(0, BLOCK_SIZE)
    # the table in force sent this connection's reads down `path` and nowhere else
    counts = server.counts()
    assert counts[("be", path)] >= 1, counts
    assert sum(counts.values()) == counts[("be", path)], counts


@pytest.mark.parametrize("path", ["inline", "pool"])
def test_failed_reads_are_counted_in_their_row(server, path):
    """A read that ends in EIO still took its path: the stats row must show it (else a
    corrupted read vanishes from `ctl stats`, and p99 leaves out the slowest requests)."""
    server.set_thresholds(be=FORCE[path])
    server.reset_stats()
    with server.client("@be") as h, pytest.raises(nbd.Error):
        h.pread(64 * KIB, 64 * KIB)
    row = server.stats()["classes"]["be"][path]
    assert (row["requests"], row["bytes"]) == (1, 64 * KIB)


@pytest.mark.parametrize("path", ["inline", "pool"])
@pytest.mark.parametrize(("offset", "length"), list(GOOD_READS.values()), ids=list(GOOD_READS))
def test_neighbouring_range_reads_fine(server, image, path, offset, length):
    server.set_thresholds(be=FORCE[path])
    server.reset_stats()
    with server.client("@be") as h:
        got = h.pread(length, offset)
    assert got == image.expected(offset, length)  # the good image: these bytes are intact
    assert server.counts()[("be", path)] == 1


def test_both_paths_count_corruption_the_same(server):
    """One failed read per path adds one corruption each, and the status is C."""
    counted = []
    for path in ("inline", "pool"):
        server.set_thresholds(be=FORCE[path])
        server.reset_stats()
        with server.client("@be") as h, pytest.raises(nbd.Error):
            h.pread(64 * KIB, 64 * KIB)
        stats = server.stats()
        counted.append((stats["totals"]["corruptions"], stats["status"]))
    assert counted == [(1, "C"), (1, "C")]

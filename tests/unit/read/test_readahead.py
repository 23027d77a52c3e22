"""The readahead window (nbd_verity.read.readahead) against a recording verifier: which leaves
a stream of requests prefetches, and when."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from nbd_verity.format.params import VerityParams
from nbd_verity.read.readahead import DATA_AHEAD, INITIAL_LEAVES, MAX_LEAVES, Readahead

KIB = 1 << 10
LEAF_DATA = 128 * 4 * KIB  # data bytes one level-0 block covers at 4096/4096 sha256


class Recorder:
    """A verifier stand-in: the geometry of a 1 GiB device, calls recorded."""

    def __init__(self, cache_blocks: int = 16384, slow_data: bool = False) -> None:
        self.geo = VerityParams(data_blocks=(1 << 30) // 4096).geometry()
        self.cache = SimpleNamespace(capacity=cache_blocks)
        self.calls: list[tuple] = []
        self.data = SimpleNamespace(  # a data source that reads ahead (sources/ahead.py)
            waits=lambda: slow_data,
            ahead=lambda offset, length: self.calls.append(("data", offset, length)))

    def prefetch(self, first_block: int, blocks: int) -> int:
        self.calls.append(("blocks", first_block, blocks))
        return 0

    def prefetch_leaves(self, lo: int, hi: int) -> int:
        self.calls.append(("leaves", lo, hi))
        return 0


def stream(ra: Readahead, size: int, total: int, start: int = 0) -> None:
    for offset in range(start, start + total, size):
        ra.before_read(offset, size)


def test_a_4k_stream_reads_ahead_in_growing_windows():
    v = Recorder()
    stream(Readahead(v, 128 * KIB), 4 * KIB, 64 * LEAF_DATA)
    leaves = [c for c in v.calls if c[0] == "leaves"]
    assert leaves[0] == ("leaves", 0, INITIAL_LEAVES)  # the second request starts it
    sizes = [hi - lo + 1 for _, lo, hi in leaves]
    # the leaf the request needs now, and a window beyond it that doubles: one read each
    assert sizes[:4] == [1 + INITIAL_LEAVES, 5, 9, 17]
    assert all(later[1] == earlier[2] + 1 for earlier, later in itertools.pairwise(leaves))
    assert len(leaves) <= 6  # 64 leaves of data in a handful of reads, not 64


def test_the_window_stops_growing_at_its_maximum():
    v = Recorder()
    stream(Readahead(v, 128 * KIB), 512 * KIB, 1024 * LEAF_DATA)
    sizes = [hi - lo + 1 for kind, lo, hi in v.calls if kind == "leaves"]
    assert max(sizes) == MAX_LEAVES + 1 and sizes[-2] == MAX_LEAVES + 1


def test_a_small_cache_bounds_the_window():
    v = Recorder(cache_blocks=8)
    stream(Readahead(v, 128 * KIB), 512 * KIB, 32 * LEAF_DATA)
    assert max(hi - lo for kind, lo, hi in v.calls if kind == "leaves") <= 2


@pytest.mark.parametrize("size", [4 * KIB, 64 * KIB])
def test_random_small_reads_read_nothing_ahead(size):
    v = Recorder()
    ra = Readahead(v, 128 * KIB)
    for offset in (10 * LEAF_DATA, 3 * LEAF_DATA, 700 * LEAF_DATA):
        ra.before_read(offset, size)
    assert v.calls == []


def test_a_large_random_read_reads_a_quarter_beyond_it():
    v = Recorder()
    Readahead(v, 128 * KIB).before_read(5 * LEAF_DATA, 512 * KIB)
    assert v.calls == [("blocks", 5 * 128, 128 + 32)]


def test_a_seek_ends_the_stream():
    v = Recorder()
    ra = Readahead(v, 128 * KIB)
    stream(ra, 4 * KIB, 4 * LEAF_DATA)
    ra.before_read(100 * LEAF_DATA, 4 * KIB)  # a jump: no stream, nothing ahead
    count = len(v.calls)
    ra.before_read(100 * LEAF_DATA + 4 * KIB, 4 * KIB)  # a new stream, window reset
    assert v.calls[count:] == [("leaves", 100, 100 + INITIAL_LEAVES)]


def test_a_stream_on_a_slow_data_source_starts_its_next_requests_reads():
    """On a data source that waits, each request that continues the stream starts the
    data reads of the next DATA_AHEAD requests of its size; on a fast one, none."""
    for slow in (False, True):
        verifier = Recorder(slow_data=slow)
        ra = Readahead(verifier, 128 * KIB)
        size = 128 * KIB
        ra.before_read(0, size)  # the stream's first request: nothing to continue
        ra.before_read(size, size)
        data = [c for c in verifier.calls if c[0] == "data"]
        want = [("data", 2 * size + i * size, size) for i in range(DATA_AHEAD)]
        assert data == (want if slow else []), data

"""The fast path (nbd_verity/serve/fastpath.py) answers exactly the common request, and what
it answers is the general path's answer: the same bytes, the same errors, the same counters.

In process, a Device per path reads the same requests (random sizes and offsets, aligned
or not, over a damaged copy) and their results and `stats` counters are compared; the
fast path's own decision is checked request by request. Through nbdkit, a server on each
path serves the same workload and the control socket's counters are compared. The same
holds for an image read over NBD (real nbdkit `file` upstreams): its fast path reads on
an idle connection of the source's pool, and a read the upstream fails fails alike,
whether the read and its check are one native call or two.
"""

from __future__ import annotations

import os
import random

import nbd
import pytest

from nbd_verity.errors import CorruptionError, ImageIOError, VerityError
from nbd_verity.format import digest
from nbd_verity.format.digest import NATIVE_NBD_ENV
from nbd_verity.ioclass import CLASSES
from nbd_verity.prepare.config import config_from_pairs
from nbd_verity.serve.device import Connection, Device
from nbd_verity.serve.fastpath import FAST_NATIVE_ENV, SAMPLE_EVERY, never

from ..serverlib import FAST_PATH_ENV, MIB, control_request, flip_byte, read_general
from ..upstreams import NbdkitFile

pytestmark = pytest.mark.skipif(digest._native is None, reason="the fast path needs the "
                                "native engine (not built, or NBD_VERITY_PURE=1)")
LEAF_SPAN = 128 * 4096  # data bytes under one level-0 block at 4096/4096 sha256
BAD_BLOCKS = (5, 130, 700)  # corrupted data blocks of the damaged copy


def device(image, monkeypatch, path: str = "fast", **keys) -> Device:
    if path == "general":
        monkeypatch.setenv(FAST_PATH_ENV, "0")
    else:
        monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    # the fixed table, pinned: under the default, the load decides (schedule/pool.py), and
    # two devices' inline/pool counts compared here must not depend on it
    keys.setdefault("threshold_preset", "fixed")
    return Device(config_from_pairs(image.pairs(readahead="false", **keys)))


@pytest.fixture
def damaged(default_image, tmp_path):
    image = default_image.copy(tmp_path)
    for block in BAD_BLOCKS:
        flip_byte(image.data, block * image.data_block_size + 17)
    return image


def requests(seed: int, size: int, count: int = 400) -> list[tuple[int, int]]:
    """(offset, length): mostly aligned 4 KiB, some larger, unaligned, or across leaves."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.6:
            length, offset = 4096, rng.randrange(size // 4096) * 4096
        elif kind < 0.8:
            length = rng.choice((8192, 65536, 256 << 10, LEAF_SPAN, 2 * LEAF_SPAN))
            offset = rng.randrange((size - length) // 4096 + 1) * 4096
        else:
            length = rng.randrange(1, 3 * 4096)
            offset = rng.randrange(size - length + 1)
        out.append((offset, length))
    return out


def outcome(conn: Connection, offset: int, length: int):
    buf = bytearray(length)
    try:
        if conn.fast(buf, offset) is not True:  # the general path
            read_general(conn, memoryview(buf), offset)
    except VerityError as e:
        return type(e).__name__, str(e)
    return bytes(buf)


def counted(dev: Device) -> dict:
    """stats without what is timed or describes the path itself."""
    stats = dev.stats()
    classes = {c: {p: (v["requests"], v["bytes"]) for p, v in paths.items()}
               for c, paths in stats["classes"].items()}
    return {"classes": classes, "totals": stats["totals"], "status": stats["status"]}


def compare_paths(devices: list[Device], damaged, mode: str, seed: int) -> list:
    """The same requests to a connection of each device (fast, general): the same
    answers, and the expected bytes under eio. The fast path's own answers are returned:
    it must take some, or it is untested."""
    conns = [Connection(d) for d in devices]
    answered = []
    bound = conns[0].fast
    conns[0].fast = lambda buf, offset: answered.append(bound(buf, offset)) or answered[-1]
    for offset, length in requests(seed, damaged.size):
        fast, general = (outcome(c, offset, length) for c in conns)
        assert fast == general, (offset, length)
        if isinstance(fast, bytes) and mode == "eio":
            assert fast == damaged.expected(offset, length)
    return answered


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("mode", ["eio", "ignore-corruption"])
def test_fast_and_general_paths_give_the_same_answers_and_counts(damaged, monkeypatch,
                                                                   mode, native):
    """Both fast paths of a local file: the native frame (FastRead.read) and the Python
    function it mirrors (NBD_VERITY_FAST_NATIVE=0), which stays the reference."""
    monkeypatch.setenv(FAST_NATIVE_ENV, "1" if native else "0")
    devices = [device(damaged, monkeypatch, path, error_mode=mode)
               for path in ("fast", "general")]
    try:
        assert [d.fast_path for d in devices] == [True, False]
        bound = Connection(devices[0]).fast
        assert (type(getattr(bound, "__self__", None)).__name__ == "FastRead") == native
        answered = compare_paths(devices, damaged, mode, 1)
        assert any(answered), "the fast path answered no request"
        assert counted(devices[0]) == counted(devices[1])
        assert devices[0].stats()["fast_path"] and not devices[1].stats()["fast_path"]
    finally:
        for d in devices:
            d.close()


def test_the_fast_path_answers_only_the_common_request(default_image, monkeypatch):
    dev = device(default_image, monkeypatch, prefetch_cluster=4096)  # one leaf per cold read
    try:
        conn = Connection(dev)
        buf = bytearray(4096)
        assert conn.fast(buf, 0) is None  # leaf 0 not cached yet
        read_general(conn, memoryview(buf), 0)  # the general path caches it
        for offset, length, taken in [
            (0, 4096, True), (4096 * 127, 4096, True), (0, LEAF_SPAN, True),
            (4096, LEAF_SPAN - 4096, True),
            (4096 * 127, 8192, False),  # across two leaves
            (1, 4096, False), (0, 4095, False), (0, 0, False),  # unaligned, empty
            (LEAF_SPAN, 4096, False),  # leaf 1: not cached
        ]:
            data = bytearray(length)
            assert (conn.fast(data, offset) is True) == taken, (offset, length)
            if taken:
                assert data == default_image.expected(offset, length)
        dev.dispatcher.set_table((4095,) * 4)  # over its class's threshold: the pool's
        assert conn.fast(bytearray(4096), 0) is None
    finally:
        dev.close()


@pytest.mark.parametrize("keys", [{"ignore_zero_blocks": "true"},
                                  {"check_at_most_once": "true"}, {"readahead": "true"}])
def test_options_that_change_the_success_path_turn_it_off(default_image, monkeypatch, keys):
    monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    pairs = default_image.pairs(**{"readahead": "false", **keys})
    dev = Device(config_from_pairs(pairs))
    try:
        assert Connection(dev).fast is never
    finally:
        dev.close()


def unpinned(image, monkeypatch, **keys) -> Device:
    """A device whose classes nobody pinned, at a table under one leaf's span: an aligned
    request of LEAF_SPAN (two pool chunks) takes the pool only when the pool takes it
    (schedule/pool.py: one client at a time with two workers), counted over a minute so
    that a slow machine does not end a client's turn."""
    dev = device(image, monkeypatch, workers=2, **keys)
    dev.dispatcher.set_table((LEAF_SPAN // 2,) * len(CLASSES), pinned=frozenset())
    dev.dispatcher.pool().load_s = 60.0
    return dev


def test_a_pool_sized_request_takes_the_fast_path_when_the_pool_does_not_take_it(
        default_image, monkeypatch):
    """One client alone: the pool's, left to the general path (counted once). Two at
    once: inline, answered by the fast path, timed and counted as the general path would
    (busy inline included)."""
    dev = unpinned(default_image, monkeypatch)
    try:
        a, b = Connection(dev), Connection(dev)
        read_general(a, memoryview(bytearray(4096)), 0)  # the general path caches leaf 0
        buf = bytearray(LEAF_SPAN)
        assert a.fast(buf, 0) is None  # one client: the pool's
        read_general(a, memoryview(buf), 0)
        assert buf == default_image.expected(0, LEAF_SPAN)
        for conn in (b, a) * 5:  # two clients: inline
            buf = bytearray(LEAF_SPAN)
            assert conn.fast(buf, 0) is True
            assert buf == default_image.expected(0, LEAF_SPAN)
        stats = dev.stats()
        paths = stats["classes"][CLASSES[a.io_class]]
        assert (paths["inline"]["requests"], paths["pool"]["requests"]) == (1 + 10, 1)
        assert paths["inline"]["bytes"] == 4096 + 10 * LEAF_SPAN
        assert stats["busy_inline"][CLASSES[a.io_class]] == 10
        assert len(dev.dispatcher.stats.latency(a.io_class, "inline")) == 1 + 10
        assert stats["totals"]["data_blocks_verified"] == 1 + 11 * (LEAF_SPAN // 4096)
    finally:
        dev.close()


def test_a_pinned_class_over_its_threshold_never_takes_the_fast_path(default_image,
                                                                     monkeypatch):
    dev = unpinned(default_image, monkeypatch)
    try:
        a, b = Connection(dev), Connection(dev)
        dev.dispatcher.set_table(dev.dispatcher.table, pinned=frozenset({a.io_class}))
        read_general(a, memoryview(bytearray(4096)), 0)
        for conn in (a, b) * 2:
            buf = bytearray(LEAF_SPAN)
            assert conn.fast(buf, 0) is None
            read_general(conn, memoryview(buf), 0)
            assert buf == default_image.expected(0, LEAF_SPAN)
        stats = dev.stats()
        assert stats["classes"][CLASSES[a.io_class]]["pool"]["requests"] == 4
        assert stats["busy_inline"][CLASSES[a.io_class]] == 0
    finally:
        dev.close()


def test_a_pool_sized_request_that_fails_on_the_fast_path_fails_alike(damaged, monkeypatch):
    """Leaf 0's span holds a corrupted block: the fast path's inline read fails, and the
    general path reads it again, on the path the load gives it, to the same error; the
    inline one is counted busy once."""
    dev = unpinned(damaged, monkeypatch)
    try:
        a, b = Connection(dev), Connection(dev)
        read_general(a, memoryview(bytearray(4096)), 0)  # block 0 is sound: leaf 0 cached
        for conn in (a, b):  # the pool's (one client), then inline's (two)
            buf = bytearray(LEAF_SPAN)
            assert conn.fast(buf, 0) is None
            with pytest.raises(CorruptionError, match="data block 5"):
                read_general(conn, memoryview(buf), 0)
        stats = dev.stats()
        paths = stats["classes"][CLASSES[a.io_class]]
        assert (paths["inline"]["requests"], paths["pool"]["requests"]) == (1 + 1, 1)
        assert stats["busy_inline"][CLASSES[a.io_class]] == 1
    finally:
        dev.close()


def test_one_request_in_sample_every_is_timed(default_image, monkeypatch):
    """Counts per request, latency samples per SAMPLE_EVERY requests of a thread."""
    dev = device(default_image, monkeypatch)
    try:
        conn = Connection(dev)
        buf = bytearray(4096)
        read_general(conn, memoryview(buf), 0)  # general: counted and timed
        for _ in range(2 * SAMPLE_EVERY):
            assert conn.fast(buf, 0) is True
        be = dev.dispatcher.stats
        assert len(be.latency(conn.io_class, "inline")) == 1 + 2
        assert dev.stats()["totals"]["data_blocks_verified"] == 1 + 2 * SAMPLE_EVERY
    finally:
        dev.close()


def test_through_nbdkit_both_paths_count_alike(damaged, servers, sockdir):
    """The same requests to a server on each path: same replies, same ctl stats counts."""
    results, counts = [], []
    for path in ("fast", "general"):
        control = os.path.join(sockdir, f"{path}.ctl")
        # one pinned table for both (a measured or learned default could split them apart)
        h = servers.start(damaged, path=path, control=control, readahead="false",
                          threshold_preset="fixed").connect()
        replies = []
        for offset, length in requests(2, damaged.size, 200):
            try:
                replies.append(bytes(h.pread(length, offset)))
            except nbd.Error as e:  # the errno is what is compared
                replies.append(e.errnum)
        stats = control_request(control, {"cmd": "stats"})["stats"]
        assert stats["fast_path"] == (path == "fast")
        results.append(replies)
        counts.append(({c: {p: (v["requests"], v["bytes"]) for p, v in paths.items()}
                        for c, paths in stats["classes"].items()}, stats["totals"]))
    assert results[0] == results[1]
    assert counts[0] == counts[1]
    assert any(isinstance(r, int) for r in results[0])  # some requests did fail
    assert sum(len(r) for r in results[0] if isinstance(r, bytes)) > 2 * MIB


def remote_device(image, monkeypatch, path: str, data_uri: str, hash_uri: str,
                  **keys) -> Device:
    """A Device reading image over NBD (Merkle and data readahead at their default for a
    network image: on), on the fast or the general path."""
    if path == "general":
        monkeypatch.setenv(FAST_PATH_ENV, "0")
    else:
        monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    pairs = [("data", data_uri), ("hash", hash_uri), ("root-hash", image.root),
             ("threshold-preset", "fixed")]
    return Device(config_from_pairs(pairs + [(k.replace("_", "-"), str(v))
                                             for k, v in keys.items()]))


def slow_hashes(image, sockdir: str) -> NbdkitFile:
    """The hash image's upstream, 1 ms per read: slow for every device alike, so that each
    fetches a cold request's leaf beside its data (read/beside.py) whatever the machine's
    load, and two devices' counters compare."""
    return NbdkitFile(image.hash, sockdir, "fp-hash", ("delay",), ("rdelay=1ms",)).start()


def native_nbd(monkeypatch, native: bool) -> None:
    """The fast path reads and verifies over NBD in one native call (the default), or in
    two (read_idle, then verify: NBD_VERITY_NATIVE_NBD=0)."""
    if native:
        monkeypatch.delenv(NATIVE_NBD_ENV, raising=False)
    else:
        monkeypatch.setenv(NATIVE_NBD_ENV, "0")


@pytest.mark.parametrize("native", [True, False], ids=["one-native-call", "two-calls"])
@pytest.mark.parametrize("mode", ["eio", "ignore-corruption"])
def test_over_nbd_both_paths_give_the_same_answers_and_counts(damaged, monkeypatch, sockdir,
                                                              upstreams, mode, native):
    data = NbdkitFile(damaged.data, sockdir, "fp-data").start()
    hashes = slow_hashes(damaged, sockdir)
    upstreams += [data, hashes]
    native_nbd(monkeypatch, native)
    devices = [remote_device(damaged, monkeypatch, path, data.uri, hashes.uri,
                             error_mode=mode) for path in ("fast", "general")]
    try:
        assert [d.fast_path for d in devices] == [True, False]
        assert (devices[0].verifier.fast_checked_reads is not None) == native
        answered = compare_paths(devices, damaged, mode, 3)
        assert answered.count(True) > 50, "the fast path answered too few requests"
        fast, general = (counted(d) for d in devices)
        assert fast == general, {k: (v, general["totals"][k])
                                 for k, v in fast["totals"].items() if v != general["totals"][k]}
    finally:
        for d in devices:
            d.close()


def test_over_nbd_the_fast_path_takes_only_a_random_read_under_a_cached_leaf(
        default_image, monkeypatch, sockdir, upstreams):
    """Not a stream's next request (the general path reads it ahead), not one as large as
    readahead-min-size; a leaf not cached is read beside the data (the hash upstream is
    slow), and cached. (A prefetch cluster of one leaf: the default one would fetch the
    image's 8 leaves with the first.)"""
    data = NbdkitFile(default_image.data, sockdir, "fp-data").start()
    hashes = slow_hashes(default_image, sockdir)
    upstreams += [data, hashes]
    dev = remote_device(default_image, monkeypatch, "fast", data.uri, hashes.uri,
                        readahead_min_size="64K", prefetch_cluster=4096)
    try:
        conn = Connection(dev)
        read_general(conn, memoryview(bytearray(4096)), 0)  # leaf 0 cached
        for offset, length, taken in [  # the stream's last: its reads ahead may wait
            (8 * 4096, 4096, True), (20 * 4096, 4096, True),
            (40 * 4096, 65536, False),  # as large as the minimum
            (100 * 4096, 8192, True),
            (LEAF_SPAN * 3, 4096, True),  # leaf 3 not cached: read beside the data
            (LEAF_SPAN * 3 + 4096, 4096, False),  # the stream's next: the general path's
        ]:
            buf = bytearray(length)
            assert (conn.fast(buf, offset) is True) == taken, (offset, length)
            if not taken:
                read_general(conn, memoryview(buf), offset)
            assert buf == default_image.expected(offset, length)
        assert dev.cache.contains(dev.geo.level_start[0] + 3)
        totals = dev.stats()["totals"]  # the root's read, leaf 0's, leaf 3's (beside the
        # data) and the stream's first window (leaves 4 and 5, by the general path)
        assert (totals["hash_reads"], totals["hash_blocks_read"]) == (4, 5)
    finally:
        dev.close()


@pytest.mark.parametrize("native", [True, False], ids=["one-native-call", "two-calls"])
def test_over_nbd_a_read_the_upstream_fails_fails_alike_on_both_paths(
        default_image, monkeypatch, sockdir, tmp_path, upstreams, native):
    """The fast path raises the general path's error (text and counters alike), keeps its
    connection (a server's error leaves it usable), and serves again once the upstream
    does."""
    trigger = tmp_path / "fail-reads"
    data = NbdkitFile(default_image.data, sockdir, "fp-data", ("error",),
                      ("error-pread-rate=100%", f"error-pread-file={trigger}")).start()
    hashes = slow_hashes(default_image, sockdir)
    upstreams += [data, hashes]
    native_nbd(monkeypatch, native)
    devices = [remote_device(default_image, monkeypatch, path, data.uri, hashes.uri)
               for path in ("fast", "general")]
    try:
        assert (devices[0].verifier.fast_checked_reads is not None) == native
        conns = [Connection(d) for d in devices]
        for conn in conns:
            read_general(conn, memoryview(bytearray(4096)), 0)  # leaf 0 cached
        trigger.touch()
        with pytest.raises(ImageIOError) as raised:  # raised, not declined
            conns[0].fast(bytearray(4096), 8 * 4096)
        with pytest.raises(ImageIOError) as general:
            read_general(conns[1], memoryview(bytearray(4096)), 8 * 4096)
        assert str(raised.value) == str(general.value)
        assert "read at byte 32768" in str(raised.value)
        fast, general = (counted(d) for d in devices)
        assert fast == general, {k: (v, general["totals"][k])
                                 for k, v in fast["totals"].items() if v != general["totals"][k]}
        assert counted(devices[0])["totals"]["io_errors"] == 1
        cold = LEAF_SPAN * 2  # leaf 2 not cached: fetched beside the failing data read
        with pytest.raises(ImageIOError) as raised:
            conns[0].fast(bytearray(4096), cold)
        with pytest.raises(ImageIOError) as general:
            read_general(conns[1], memoryview(bytearray(4096)), cold)
        assert str(raised.value) == str(general.value)
        assert counted(devices[0]) == counted(devices[1])
        assert counted(devices[0])["totals"]["io_errors"] == 2
        assert all(d.cache.contains(d.geo.level_start[0] + 2) for d in devices)
        trigger.unlink()
        buf = bytearray(4096)
        assert conns[0].fast(buf, 16 * 4096) is True
        assert buf == default_image.expected(16 * 4096, 4096)
        assert devices[0].stats()["totals"]["reconnects"] == 0
    finally:
        for d in devices:
            d.close()


def hash_reads_after(dev, image):
    """read(offset): a 4 KiB read on a new connection of dev, by the fast path where it
    answers, else the general one, checked against image; (hash reads, hash blocks read)
    so far."""
    conn = Connection(dev)

    def read(offset: int) -> tuple[int, int]:
        buf = bytearray(4096)
        if conn.fast(buf, offset) is not True:
            read_general(conn, memoryview(buf), offset)
        assert buf == image.expected(offset, 4096)
        totals = dev.stats()["totals"]
        return totals["hash_reads"], totals["hash_blocks_read"]
    read.conn = conn
    return read


@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_cold_read_fetches_its_leafs_aligned_prefetch_cluster_beside_its_data(
        default_image, monkeypatch, sockdir, upstreams, path):
    """dm-verity's level-0 prefetch cluster (prefetch-cluster=16K: 4 leaves at 4 KiB data
    blocks): a random read under a leaf not cached fetches the leaves of its aligned
    cluster in one read beside its data, each verified before it is cached; the next
    read in that cluster needs no hash read, one in the next cluster fetches that one."""
    data = NbdkitFile(default_image.data, sockdir, "fp-data").start()
    hashes = slow_hashes(default_image, sockdir)
    upstreams += [data, hashes]
    dev = remote_device(default_image, monkeypatch, path, data.uri, hashes.uri,
                        prefetch_cluster="16K")
    leaf0 = dev.geo.level_start[0]
    try:
        read = hash_reads_after(dev, default_image)
        before = dev.stats()["totals"]["hash_reads"]  # the root's, at start-up
        assert read(LEAF_SPAN * 5 + 8192) == (before + 1, before + 4)  # leaves 4-7
        assert [dev.cache.contains(leaf0 + i) for i in range(8)] == [False] * 4 + [True] * 4
        assert read(LEAF_SPAN * 7 + 4096) == (before + 1, before + 4)  # cached: no read
        assert read(LEAF_SPAN * 1) == (before + 2, before + 8)  # leaves 0-3
        assert all(dev.cache.contains(leaf0 + i) for i in range(8))
    finally:
        dev.close()


@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_local_images_missing_leaf_comes_with_its_prefetch_cluster(default_image,
                                                                     monkeypatch, tmp_path,
                                                                     path):
    """A local hash image (answering fast: nothing is fetched beside the data) reads a
    missing leaf with its aligned prefetch cluster too, in one read, as dm-verity's
    prefetch does whatever the device: here leaves 4-7 for a read under leaf 5. Each leaf
    is verified against its parent before it is cached: a corrupted leaf 6 is left out,
    and only the reads under it fail, each time (its own read reports it)."""
    image = default_image.copy(tmp_path)
    flip_byte(image.hash, image.leaf_offset(6 * LEAF_SPAN // 4096) + 100)
    dev = device(image, monkeypatch, path, prefetch_cluster="16K")
    leaf0 = dev.geo.level_start[0]
    try:
        read = hash_reads_after(dev, default_image)
        before = dev.stats()["totals"]["hash_reads"]  # the root's, at start-up
        assert read(LEAF_SPAN * 5 + 8192) == (before + 1, before + 4)  # leaves 4-7
        assert [dev.cache.contains(leaf0 + i) for i in range(8)] == [False] * 4 + [
            True, True, False, True]
        assert read(LEAF_SPAN * 7 + 4096) == (before + 1, before + 4)  # cached: no read
        for _ in range(2):
            with pytest.raises(CorruptionError):
                read_general(read.conn, memoryview(bytearray(4096)), LEAF_SPAN * 6)
        assert not dev.cache.contains(leaf0 + 6)
        assert dev.stats()["totals"]["corruptions"] == 2
        assert dev.stats()["totals"]["readaheads"] == 0  # a cluster is not readahead
    finally:
        dev.close()


def test_a_cold_read_fetches_its_leaf_alone_when_the_cache_has_no_room_for_a_cluster(
        default_image, monkeypatch, sockdir, upstreams):
    """A cache of 5 blocks holds the root and one cluster of 4 leaves: the next cold read
    fetches its own leaf only (a full cache would evict a cluster's worth of blocks for
    each one a random reader needs)."""
    data = NbdkitFile(default_image.data, sockdir, "fp-data").start()
    hashes = slow_hashes(default_image, sockdir)
    upstreams += [data, hashes]
    dev = remote_device(default_image, monkeypatch, "general", data.uri, hashes.uri,
                        prefetch_cluster="16K", cache_size="20K")
    try:
        conn = Connection(dev)

        def read(offset: int) -> int:
            buf = bytearray(4096)
            read_general(conn, memoryview(buf), offset)
            assert buf == default_image.expected(offset, 4096)
            return dev.stats()["totals"]["hash_blocks_read"]

        before = dev.stats()["totals"]["hash_blocks_read"]  # the root's
        assert dev.cache.capacity == 5
        assert read(LEAF_SPAN * 5) == before + 4  # the root and leaves 4-7: full
        assert read(LEAF_SPAN * 1) == before + 5  # leaf 1 alone
    finally:
        dev.close()

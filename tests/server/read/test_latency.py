"""Storage with latency, observed at the upstreams: a cold request's hash blocks fetched
beside its data (nbd_verity/read/beside.py), a connection's requests served together
where nbdkit allows, and a sequential stream's data read ahead (sources/ahead.py). Real
nbdkit `file` upstreams under the `delay` filter, with nbdkit's `log` filter outermost
recording when each read came and when it was answered. A block fetched early still
fails exactly its request, and no byte is served unverified.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import time
from dataclasses import replace

import nbd
import pytest

from nbd_verity.launch import NBDKIT
from nbd_verity.serve.nbdkit_compat import has_send_race, nbdkit_version
from nbd_verity.sources import handles

from ..serverlib import (
    MIB,
    control_request,
    error_number,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
)
from ..upstreams import NbdkitFile, fuse_file

DELAY = "150ms"  # every upstream read waits this long: far over sources/latency.SLOW_S
READ = re.compile(r"^(\S+ \S+) (connection=\d+) (\.\.\.)?Read id=(\d+)"
                  r"(?: offset=(0x[0-9a-f]+) count=(0x[0-9a-f]+))?")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """2 MiB, 4096/4096 sha256: 512 data blocks, 4 level-0 blocks under the root block."""
    return make_image(tmp_path_factory.mktemp("beside"), random_bytes(29, 2 * MIB))


def reads(log_path: str) -> list[tuple[int, int, datetime.datetime, datetime.datetime]]:
    """(offset, count, came, answered) of every read an upstream's log filter recorded."""
    started, done = {}, []
    with open(log_path) as f:
        for line in f:
            m = READ.match(line)
            if m is None:
                continue
            when = datetime.datetime.fromisoformat(m.group(1))
            key = m.group(2, 4)  # ids count per connection
            if m.group(3):  # the answer
                offset, count, came = started.pop(key)
                done.append((offset, count, came, when))
            else:
                started[key] = (int(m.group(5), 16), int(m.group(6), 16), when)
    return done


def delayed(path, sockdir: str, name: str, tmp_path, multi_conn: bool = True,
            delay: str = DELAY) -> tuple[NbdkitFile, str]:
    """A logged upstream whose reads wait DELAY (multi_conn False: it does not advertise
    multi-conn, as nbd-server or a writable qemu-nbd export)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = str(tmp_path / f"{name}.reads")
    filters, keys = ("log", "delay"), (f"rdelay={delay}", f"logfile={log}")
    if not multi_conn:
        filters, keys = ("log", "multi-conn", "delay"), (*keys, "multi-conn-mode=disable")
    upstream = NbdkitFile(path, sockdir, name, filters, keys).start()
    return upstream, log


def connections(log_path: str) -> set[str]:
    """The connections an upstream's log filter saw a read on."""
    with open(log_path) as f:
        return {m.group(2) for m in map(READ.match, f) if m is not None}


def serve(image, sockdir, tmp_path, servers, upstreams, readahead: bool = False,
          multi_conn: bool = True, delay: str = DELAY, hash_multi_conn: bool = True, **keys):
    """nbd-verity serve of image's data and hash images behind delayed, logged upstreams
    (readahead: Merkle and data readahead, off unless asked for; multi_conn,
    hash_multi_conn: whether the data and the hash upstream advertise it)."""
    data, data_log = delayed(image.data, sockdir, "up-data", tmp_path, multi_conn, delay)
    hashes, hash_log = delayed(image.hash, sockdir, "up-hash", tmp_path, hash_multi_conn)
    upstreams += [data, hashes]
    server = servers.start(replace(image, data=data.uri, hash=hashes.uri),
                           control=os.path.join(sockdir, "ctl.sock"),
                           readahead="true" if readahead else "false", **keys)
    return server, data_log, hash_log


ONE_OR_MANY = pytest.mark.parametrize("hash_multi_conn", [True, False],
                                      ids=["hash-multi-conn", "hash-one-connection"])


@ONE_OR_MANY
def test_a_cold_reads_hash_block_is_read_while_its_data_is(image, sockdir, tmp_path,
                                                           servers, upstreams,
                                                           hash_multi_conn):
    """The leaf of a cold 4 KiB read comes to the hash upstream before the data upstream
    has answered the data read: one wait covers both (a hash upstream with multi-conn
    or without: a pool's connection, or the one connection's pipe)."""
    server, data_log, hash_log = serve(image, sockdir, tmp_path, servers, upstreams,
                                       hash_multi_conn=hash_multi_conn)
    h = server.connect()
    block = 300  # under leaf 2, not cached: only the root block was read at start-up
    offset = block * image.data_block_size
    assert h.pread(4096, offset) == image.expected(offset, 4096)
    (data_read,) = [r for r in reads(data_log) if r[0] == offset]
    leaf = image.leaf_offset(block)
    leaf_reads = [r for r in reads(hash_log) if r[0] <= leaf < r[0] + r[1]]
    assert len(leaf_reads) == 1, reads(hash_log)
    assert leaf_reads[0][2] < data_read[3], (leaf_reads, data_read)  # came before answered
    assert data_read[2] < leaf_reads[0][3]  # and the data read came before the leaf's answer


def test_a_bad_data_block_fails_exactly_its_request(image, sockdir, tmp_path, servers,
                                                    upstreams):
    damaged = image.copy(tmp_path / "damaged")
    flip_byte(damaged.data, 300 * image.data_block_size + 17)
    server, _, _ = serve(damaged, sockdir, tmp_path, servers, upstreams)
    h = server.connect()
    expect_eio(h, 4096, 300 * 4096)
    for block in (299, 301, 0):  # the same leaf, now cached, and another
        assert h.pread(4096, block * 4096) == image.expected(block * 4096, 4096)
    expect_eio(h, 8192, 299 * 4096)  # a request that holds it fails whole


@ONE_OR_MANY
def test_a_bad_hash_block_fetched_beside_is_never_trusted(image, sockdir, tmp_path, servers,
                                                          upstreams, hash_multi_conn):
    """A corrupted leaf fetched beside the data fails every read under it, each time
    (it is never cached), and no other read; each fetch gives its connection back (one
    kept per fetch would open a new one for each request, and hang the 17th)."""
    damaged = image.copy(tmp_path / "damaged")
    flip_byte(damaged.hash, image.leaf_offset(300) + 100)  # leaf 2: data blocks 256..383
    server, _, hash_log = serve(damaged, sockdir, tmp_path, servers, upstreams,
                                delay="20ms", hash_multi_conn=hash_multi_conn)
    h = server.connect()
    bad = (300, 256, 383, 300, *range(257, 265))
    for block in bad:
        expect_eio(h, 4096, block * 4096)
    for block in (255, 384, 0):
        assert h.pread(4096, block * 4096) == image.expected(block * 4096, 4096)
    totals = control_request(os.path.join(sockdir, "ctl.sock"), {"cmd": "stats"})
    assert totals["stats"]["totals"]["corruptions"] == len(bad), totals
    fetched = [r for r in reads(hash_log) if r[0] == image.leaf_offset(300)]
    assert len(fetched) >= len(bad), len(fetched)  # fetched beside (and read again) each time
    assert len(connections(hash_log)) <= 2, connections(hash_log)


def send_at_once(h, offsets: list[int], size: int = 4096) -> list:
    """offsets read at once on one connection; their buffers once all are answered."""
    buffers = [nbd.Buffer(size) for _ in offsets]
    for buf, offset in zip(buffers, offsets, strict=True):
        h.aio_pread(buf, offset)
    deadline = time.monotonic() + 60
    while h.aio_in_flight() and time.monotonic() < deadline:
        h.poll(1000)
    assert not h.aio_in_flight()
    return buffers


def most_at_once(spans) -> int:
    """The most reads an upstream had in flight at one moment."""
    events = sorted([(came, 1) for _, _, came, _ in spans] +
                    [(answered, -1) for _, _, _, answered in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_requests_in_flight_on_one_connection_reach_the_upstream_as_the_model_says(
        image, sockdir, tmp_path, servers, upstreams):
    """K reads sent at once on one connection: in serialize-requests they reach the
    upstream one at a time, and the server said at start-up how to get more; in the
    parallel model (where this nbdkit allows it) all K are in flight there at once. The
    default (no thread-model given) is the parallel model for this network image where
    nbdkit has no disconnect race (1.34 on), serialize-requests on 1.32."""
    k = 8
    offsets = [block * 4096 for block in range(10, 10 + 64 * k, 64)]  # apart: no readahead
    safe = not has_send_race(nbdkit_version(NBDKIT))
    models = ["default", "serialize-requests"] + (["parallel"] if safe else [])
    for model in models:
        keys = {} if model == "default" else {"thread_model": model}
        server, data_log, _ = serve(image, sockdir, tmp_path / model, servers, upstreams,
                                    **keys)
        buffers = send_at_once(server.connect(), offsets)
        for buf, offset in zip(buffers, offsets, strict=True):
            assert buf.to_bytearray() == image.expected(offset, 4096)
        data_reads = [r for r in reads(data_log) if r[0] in offsets]
        assert sorted(r[0] for r in data_reads) == offsets
        if model == "parallel" or (model == "default" and safe):
            assert most_at_once(data_reads) == k
        else:
            assert most_at_once(data_reads) == 1
            assert "reach the image one at a time" in server.log_path.read_text()
        server.stop()
        for upstream in upstreams[-2:]:
            upstream.stop()


def test_a_local_image_not_in_the_page_cache_has_a_connections_requests_served_together(
        image, sockdir, tmp_path, servers, upstreams):
    """A local data image most of whose pages are not in the page cache waits on its disk,
    as a network image does: by default (no thread-model given) a connection's K reads
    reach the disk together where nbdkit allows it (1.34 on), and one at a time on 1.32,
    whose start-up says how to get more. The disk here is a FUSE file (nbdfuse) over a
    delayed, logged upstream, so the reads are counted where they arrive; the same image
    in the page cache is served as before (serialize-requests, nothing said)."""
    k = 8
    offsets = [block * 4096 for block in range(10, 10 + 64 * k, 64)]  # apart: no readahead
    up, up_log = delayed(image.data, sockdir, "disk", tmp_path)
    upstreams.append(up)
    with fuse_file(up.sock, tmp_path / "disk", connections=2 * k) as disk:
        server = servers.start(replace(image, data=str(disk)))
        said = server.log_path.read_text()
        assert "not in the page cache" in said, said
        buffers = send_at_once(server.connect(), offsets)
        for buf, offset in zip(buffers, offsets, strict=True):
            assert buf.to_bytearray() == image.expected(offset, 4096)
        # the reads of our blocks as they reached the disk (the page cache may widen them)
        disk_reads = [r for r in reads(up_log) if any(r[0] <= o < r[0] + r[1] for o in offsets)]
        assert len(disk_reads) == k, disk_reads
        if has_send_race(nbdkit_version(NBDKIT)):
            assert most_at_once(disk_reads) == 1
            assert "reach the image one at a time" in said, said
        else:
            assert most_at_once(disk_reads) == k
            assert "reach the image together" in said, said
        server.stop()
    cached = servers.start(image)  # the image as made: its pages are in the page cache
    said = cached.log_path.read_text()
    assert "not in the page cache" not in said and "thread-model" not in said, said


def test_one_connection_to_an_upstream_without_multi_conn_carries_reads_together(
        image, sockdir, tmp_path, servers, upstreams):
    """An upstream that does not advertise multi-conn gets one connection, and K reads in
    flight at our server (K clients: every thread model serves connections in parallel)
    are K reads in flight on that one connection at once; every byte is the image's.
    Then the upstream dies and is restarted: the next reads fail or are served, never
    wrong, and the source reconnects."""
    server, data_log, _ = serve(image, sockdir, tmp_path, servers, upstreams,
                                multi_conn=False)
    k = 8
    offsets = [block * 4096 for block in range(10, 10 + 64 * k, 64)]  # apart: no readahead
    clients = [server.connect() for _ in offsets]
    buffers = [nbd.Buffer(4096) for _ in offsets]
    for h, buf, offset in zip(clients, buffers, offsets, strict=True):
        h.aio_pread(buf, offset)
    deadline = time.monotonic() + 60
    while any(h.aio_in_flight() for h in clients) and time.monotonic() < deadline:
        for h in clients:
            h.poll(10)
    for buf, offset in zip(buffers, offsets, strict=True):
        assert buf.to_bytearray() == image.expected(offset, 4096)
    data_reads = [r for r in reads(data_log) if r[0] in offsets]
    assert sorted(r[0] for r in data_reads) == offsets
    assert most_at_once(data_reads) == k
    assert len(connections(data_log)) == 1, connections(data_log)
    data_upstream = upstreams[-2]
    data_upstream.proc.kill()  # with our connection open
    data_upstream.proc.wait()
    data_upstream.start()
    for block in (5, 6):  # the first may find the old connection gone: EIO, never a byte
        try:
            assert clients[0].pread(4096, block * 4096) == image.expected(block * 4096, 4096)
        except nbd.Error as e:
            assert e.errnum == errno.EIO and block == 5, e
    totals = control_request(os.path.join(sockdir, "ctl.sock"), {"cmd": "stats"})
    assert totals["stats"]["totals"]["reconnects"] >= 1, totals


def test_a_client_that_leaves_fails_no_other_read_on_the_one_upstream_connection(
        image, sockdir, tmp_path, servers, upstreams):
    """Two clients' reads in flight on the one connection to an upstream without
    multi-conn; one client leaves without a word while the upstream takes a second per
    read. Its request ends (its thread sees the client gone within a quarter second),
    and the other client's read, on the same upstream connection, is served whole."""
    server, data_log, _ = serve(image, sockdir, tmp_path, servers, upstreams,
                                multi_conn=False, delay="1000ms")
    leaving, staying = server.connect(), server.connect()
    assert staying.pread(4096, 0) == image.expected(0, 4096)  # both leaves' parents cached
    leaving.aio_pread(nbd.Buffer(4096), 300 * 4096)
    buf = nbd.Buffer(4096)
    cookie = staying.aio_pread(buf, 100 * 4096)
    deadline = time.monotonic() + 10
    while len(reads_started(data_log)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)  # both reads reached the upstream
    handles.close(leaving, disconnect=False)  # no NBD_CMD_DISC: gone mid-request
    while staying.aio_in_flight() and time.monotonic() < deadline + 20:
        staying.poll(100)
    assert staying.aio_command_completed(cookie)  # an error reply raises here
    assert buf.to_bytearray() == image.expected(100 * 4096, 4096)
    assert staying.pread(4096, 101 * 4096) == image.expected(101 * 4096, 4096)
    assert len(connections(data_log)) == 1, connections(data_log)


def reads_started(log_path: str) -> list[str]:
    """The reads an upstream's log filter saw come in (answered or not)."""
    with open(log_path) as f:
        return [line for line in f if (m := READ.match(line)) and not m.group(3)]


def test_a_sequential_stream_reads_ahead_of_its_client(image, sockdir, tmp_path, servers,
                                                       upstreams):
    """One client reading in order, one request at a time: after the stream's first
    requests the data upstream has several reads in flight at once (the stream's next
    requests, started ahead), and every byte served is the image's."""
    server, data_log, _ = serve(image, sockdir, tmp_path, servers, upstreams, readahead=True)
    h = server.connect()
    size = 64 << 10
    for offset in range(0, 16 * size, size):
        assert h.pread(size, offset) == image.expected(offset, size)
    assert most_at_once(reads(data_log)) >= 4


def test_a_stream_with_requests_in_flight_reads_nothing_ahead_of_them(image, sockdir,
                                                                     tmp_path, servers,
                                                                     upstreams):
    """In the parallel model a client keeping K requests of its stream in flight keeps
    the upstream busy itself: on a server that has not timed its upstream yet (so none of
    its reads are shared in chunks: the next tests), those K reads reach the data upstream
    together, and nothing is read beyond them (the stream's next requests' reads ahead
    cost more CPU than they saved there: docs/server.md); the same stream one request at
    a time on that connection is read ahead again. The
    client drains every reply before it leaves (nbdkit 1.32's parallel model aborts on a
    client that leaves with requests in flight, not on this one)."""
    server, data_log, _ = serve(image, sockdir, tmp_path, servers, upstreams, readahead=True,
                                thread_model="parallel")
    h = server.connect()
    size, k = 64 << 10, 8
    offsets = list(range(0, k * size, size))
    for buf, offset in zip(send_at_once(h, offsets, size), offsets, strict=True):
        assert buf.to_bytearray() == image.expected(offset, size)
    stream = [r for r in reads(data_log) if r[0] < k * size]
    assert most_at_once(stream) == k, stream
    assert not [r for r in reads(data_log) if r[0] >= k * size], reads(data_log)
    end = k * size
    for offset in range(end, end + 4 * size, size):  # now one at a time: read ahead
        assert h.pread(size, offset) == image.expected(offset, size)
    assert [r for r in reads(data_log) if r[0] >= end + 4 * size], reads(data_log)


def test_a_bad_block_read_ahead_fails_exactly_its_request(image, sockdir, tmp_path, servers,
                                                          upstreams):
    damaged = image.copy(tmp_path / "damaged")
    bad = 40  # data block: in the stream's sixth 32 KiB request
    flip_byte(damaged.data, bad * image.data_block_size + 5)
    server, _, _ = serve(damaged, sockdir, tmp_path, servers, upstreams, readahead=True)
    h = server.connect()
    size = 32 << 10
    for offset in range(0, 12 * size, size):
        if offset <= bad * 4096 < offset + size:
            expect_eio(h, size, offset)
        else:
            assert h.pread(size, offset) == image.expected(offset, size)


def answered_within(h, reads: dict[int, int], seconds: float) -> dict[int, bytearray]:
    """reads (offset -> size) in flight at once on h; their bytes, or AssertionError if
    any is unanswered after seconds (a read that waits forever fails, not hangs)."""
    bufs = {offset: nbd.Buffer(size) for offset, size in reads.items()}
    cookies = {offset: h.aio_pread(buf, offset) for offset, buf in bufs.items()}
    deadline = time.monotonic() + seconds
    while h.aio_in_flight() and time.monotonic() < deadline:
        h.poll(100)
    assert not h.aio_in_flight(), "reads waited for connections held by reads ahead"
    for cookie in cookies.values():
        assert h.aio_command_completed(cookie)  # an error reply raises here
    return {offset: buf.to_bytearray() for offset, buf in bufs.items()}


def test_reads_sent_ahead_for_streams_that_stopped_give_way_to_requests(
        image, sockdir, tmp_path, servers, upstreams):
    """Two clients' streams stop with their next reads sent ahead, holding connections
    of the data upstream's pool; every later read, theirs and a third client's many in
    flight, is answered (taking a connection back from those reads), with the image's
    bytes. The parallel model (on nbdkit 1.32 too: no client leaves mid-read here), so
    that the third client's reads need connections at once, more than are idle."""
    server, data_log, _ = serve(image, sockdir, tmp_path, servers, upstreams, readahead=True,
                                thread_model="parallel")
    size = 64 << 10
    streams = [server.connect(), server.connect()]
    for h, start in zip(streams, (0, 1 << 20), strict=True):
        for offset in range(start, start + 3 * size, size):
            got = answered_within(h, {offset: size}, 30)
            assert got[offset] == image.expected(offset, size)
    sent_ahead = len(reads_started(data_log)) - 6
    assert sent_ahead >= 8, sent_ahead  # the streams' next reads went out (and stay unread)
    client = server.connect()
    blocks = [200 + 3 * i for i in range(8)] + [460 + 3 * i for i in range(8)]  # not ahead
    got = answered_within(client, {block * 4096: 4096 for block in blocks}, 30)
    for block in blocks:
        assert got[block * 4096] == image.expected(block * 4096, 4096)
    for h in streams:
        h.shutdown()


def test_many_cold_requests_in_flight_each_missing_two_levels_are_all_answered(
        tmp_path, sockdir, servers, upstreams):
    """512-byte hash blocks: two levels under the root block, neither cached, for each
    of 16 requests sent at once in the parallel model, each fetching both beside its
    data: every request is answered with the image's bytes. (Requests that each held a
    hash connection and waited for a second would wait forever; whether they come to
    that here depends on the threads' timing, so the rule that prevents it is checked
    on its own: test_a_read_sent_beside_takes_a_free_connection_or_none.)"""
    image = make_image(tmp_path / "small", random_bytes(31, 2 * MIB), "--hash-block-size=512")
    server, _, hash_log = serve(image, sockdir, tmp_path, servers, upstreams,
                                thread_model="parallel")
    h = server.connect()
    blocks = [32 * i + 5 for i in range(16)]  # 16 leaves, under both level-1 blocks
    got = answered_within(h, {block * 4096: 4096 for block in blocks}, 60)
    for block in blocks:
        assert got[block * 4096] == image.expected(block * 4096, 4096)
    assert most_at_once(reads(hash_log)) >= 8  # the fetches were in flight together


def test_a_read_sent_beside_takes_a_free_connection_or_none(image, sockdir, tmp_path,
                                                            upstreams):
    """NbdSource.submit, what a cold request's hash fetch and a stream's reads ahead
    send: a read on a free connection of the pool, else None at once (a request holding
    one connection never waits for another); a read received or abandoned frees its
    connection."""
    from nbd_verity.sources.remote import NbdSource
    upstream, _ = delayed(image.hash, sockdir, "up-hash", tmp_path, delay="50ms")
    upstreams.append(upstream)
    expected = image.hash.read_bytes()
    source = NbdSource(upstream.uri, "hash", connections=1)
    try:
        first = source.submit(4096, 0)
        assert first is not None
        assert source.submit(4096, 4096) is None  # the one connection is held
        assert first.result() == expected[:4096]
        held = source.submit(4096, 4096)
        assert held is not None
        held.abandon()  # closed unread
        again = source.submit(8192, 4096)
        assert again is not None and again.result() == expected[4096:12288]
    finally:
        source.close()


def started_reads(log_path: str) -> list[tuple[int, int]]:
    """(offset, count) of every read an upstream's log filter saw come in, answered or
    not yet (a chunk's next one may be answered after the client had its bytes)."""
    return [(int(m.group(5), 16), int(m.group(6), 16))
            for m in map(READ.match, reads_started(log_path))]


def burst(h, offsets: list[int], size: int) -> dict[int, bytearray | int]:
    """offsets read at once on h (size each), all answered before it returns: each
    offset's bytes, or the errno its request failed with."""
    bufs = {offset: nbd.Buffer(size) for offset in offsets}
    cookies = {offset: h.aio_pread(bufs[offset], offset) for offset in offsets}
    deadline = time.monotonic() + 60
    while h.aio_in_flight() and time.monotonic() < deadline:
        h.poll(1000)
    assert not h.aio_in_flight()
    got = {}
    for offset, cookie in cookies.items():
        try:
            assert h.aio_command_completed(cookie)
            got[offset] = bufs[offset].to_bytearray()
        except nbd.Error as e:
            got[offset] = error_number(e)
    return got


def stream_in_flight(image, sockdir, tmp_path, servers, upstreams, k: int = 8,
                     size: int = 64 << 10):
    """A server in the parallel model, one client: two single reads (the upstream is
    slow: sources/latency.py), then a stream of k requests of size sent at once from 0.
    The server, the data upstream's log, the client and what the stream got."""
    server, data_log, _ = serve(image, sockdir, tmp_path, servers, upstreams, readahead=True,
                                thread_model="parallel")
    h = server.connect()
    for block in (400, 460):  # apart: QD1 reads of the fast path, timed
        assert h.pread(4096, block * 4096) == image.expected(block * 4096, 4096)
    return server, data_log, h, burst(h, [i * size for i in range(k)], size)


def test_a_stream_with_requests_in_flight_reads_them_in_shared_chunks(
        image, sockdir, tmp_path, servers, upstreams):
    """The stream's requests in flight together take their bytes from one read of their
    chunk (8 requests' bytes, aligned) instead of one read each, and the next chunk's read
    is sent with it; every byte served is the image's (the chunk's bytes are verified per
    request as any read)."""
    size, k = 64 << 10, 8
    chunk = k * size
    _, data_log, _, got = stream_in_flight(image, sockdir, tmp_path, servers, upstreams)
    for i in range(k):
        assert got[i * size] == image.expected(i * size, size), i
    stream = [r for r in reads(data_log) if r[0] < 2 * chunk]
    assert (0, chunk) in [r[:2] for r in stream], stream  # the chunk, in one read
    assert (chunk, chunk) in started_reads(data_log), stream  # the next one sent too
    assert len([r for r in stream if r[0] < chunk]) < k, stream


def test_a_bad_block_in_a_shared_chunk_fails_exactly_its_request(
        image, sockdir, tmp_path, servers, upstreams):
    """A damaged block in a chunk read for the stream's requests: the one request that
    holds it fails with EIO, every other gets the image's bytes."""
    damaged = image.copy(tmp_path / "damaged")
    size, k = 64 << 10, 8
    bad = 6 * size + 3 * 4096 + 9  # a byte in the seventh request
    flip_byte(damaged.data, bad)
    _, data_log, _, got = stream_in_flight(damaged, sockdir, tmp_path, servers, upstreams)
    assert (0, k * size) in [r[:2] for r in reads(data_log)], reads(data_log)
    for i in range(k):
        if i == 6:
            assert got[i * size] == errno.EIO
        else:
            assert got[i * size] == image.expected(i * size, size), i


def test_a_chunk_sent_for_a_stream_that_stopped_gives_way_to_requests(
        image, sockdir, tmp_path, servers, upstreams):
    """After a stream's requests in flight, its next chunk's read is sent and nobody takes
    it (the stream stopped): it holds a connection of the data upstream's pool, and a
    client's 16 reads in flight at once, needing them all, are each answered with the
    image's bytes (the chunk's read let go: its connection closed unread)."""
    server, data_log, h, _ = stream_in_flight(image, sockdir, tmp_path, servers, upstreams)
    chunk = 8 * (64 << 10)
    started = started_reads(data_log)
    assert (chunk, chunk) in started, started  # the next chunk's read went out
    client = server.connect()
    blocks = [300 + 7 * i for i in range(16)]  # far from the stream, its leaves cold
    got = answered_within(client, {block * 4096: 4096 for block in blocks}, 30)
    for block in blocks:
        assert got[block * 4096] == image.expected(block * 4096, 4096)
    for handle in (h, client):
        handle.shutdown()


def test_a_chunk_nobody_takes_lets_its_connection_go_after_a_while(
        image, sockdir, tmp_path, servers, upstreams):
    """The next chunk's read of a stream that stopped is let go after 5 s, as reads sent
    ahead are (sources/remote.py IDLE_S): its connection to the data upstream closes,
    so that an upstream stopping can exit; the client is served as before."""
    _, data_log, h, _ = stream_in_flight(image, sockdir, tmp_path, servers, upstreams)
    chunk = 8 * (64 << 10)
    (carrier,) = [m.group(2) for m in map(READ.match, reads_started(data_log))
                  if (int(m.group(5), 16), int(m.group(6), 16)) == (chunk, chunk)]
    deadline = time.monotonic() + 15
    closed = f"{carrier} Disconnect"
    while time.monotonic() < deadline:
        with open(data_log) as f:
            if any(closed in line for line in f):
                break
        time.sleep(0.25)
    with open(data_log) as f:
        assert any(closed in line for line in f), f"{carrier} still open"
    assert h.pread(4096, 200 * 4096) == image.expected(200 * 4096, 4096)
    h.shutdown()

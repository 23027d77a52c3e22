"""The default threshold table is a plain table (control/table.py DEFAULT: inline up to
one pool chunk, every class): `ctl thresholds` and `ctl stats` show it, explicit
thresholds win over it and pin their class, the fixed presets pin every class, and
`--preset default` brings it back at run time. Real `nbd-verity serve`, real control
socket, real NBD reads."""

from __future__ import annotations

import contextlib
import os

from nbd_verity.schedule.dispatch import POOL_CHUNK_SIZE, SHARED_MIN

from .harness import CLASSES, ctl

KIB = 1024
FIXED = 1 << 20


def test_the_default_table_is_one_pool_chunk_and_pins_no_class(servers, image):
    server = servers.start(image)
    reply = server.ask({"cmd": "thresholds"})
    assert reply["thresholds"] == dict.fromkeys(CLASSES, POOL_CHUNK_SIZE), reply
    assert reply["pinned"] == [], reply  # above its threshold, the load decides
    assert server.stats()["thresholds"] == reply["thresholds"]
    shown = ctl(server.control, "thresholds")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[:4] == [f"{c:<5} {POOL_CHUNK_SIZE}" for c in CLASSES]

    # one client's requests take the table's path: at the threshold inline, at twice it
    # the pool (one client: the pool takes it, schedule/pool.py). At 4096 bytes in
    # (4096-byte blocks), one of 512 KiB spans two leaf hash blocks: never the fast path
    start = 4096
    threshold = min(POOL_CHUNK_SIZE, image.size - start)
    above = image.size - start >= 2 * POOL_CHUNK_SIZE  # one over it fits here
    sizes = [threshold] + ([2 * threshold] if above else [])
    pooled = [size > POOL_CHUNK_SIZE for size in sizes]
    server.reset_stats()
    with server.client("@be") as h:
        for size in sizes:
            assert h.pread(size, start) == image.expected(start, size)
    be = server.stats()["classes"]["be"]
    assert (be["inline"]["requests"], be["pool"]["requests"]) == (
        pooled.count(False), pooled.count(True)), (sizes, be)


def test_explicit_thresholds_win_and_pin_and_fixed_presets_pin_every_class(servers, image):
    server = servers.start(image, "--threshold", "rt=0")
    table = server.thresholds()
    chunk = POOL_CHUNK_SIZE
    assert table == {"none": chunk, "rt": 0, "be": chunk, "idle": chunk}
    assert server.ask({"cmd": "thresholds"})["pinned"] == ["rt"]

    server.ask({"cmd": "thresholds", "preset": "kernel"})
    back = server.ask({"cmd": "thresholds", "preset": "default"})["thresholds"]
    assert back == table  # the default table with rt=0 over it, not the fixed one
    assert server.ask({"cmd": "thresholds", "preset": "fixed"})["thresholds"] == \
        dict.fromkeys(CLASSES, FIXED)

    kernel = servers.start(image, "--threshold-preset", "kernel")
    reply = kernel.ask({"cmd": "thresholds"})
    assert reply["thresholds"] == {"none": 8192, "rt": 8192, "be": 8192, "idle": 0}
    assert reply["pinned"] == list(CLASSES)


def test_requests_under_two_chunks_follow_the_table_whatever_the_load(servers, image):
    """An unpinned class's reads over its threshold but under two pool chunks are left
    to the table, every one, from many clients at once too: the load decides only for
    two chunks or more (SHARED_MIN; the pool splits one chunk no further)."""
    server = servers.start(image)  # the default table: no class pinned
    size = POOL_CHUNK_SIZE + 128 * KIB
    assert server.thresholds()["be"] < size < SHARED_MIN
    server.reset_stats()
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(server.client("@be")) for _ in range(3)]
        for i in range(30):
            offset = (i * size) % (image.size - image.size % size)
            assert handles[i % 3].pread(size, offset) == image.expected(offset, size)
    stats = server.stats()
    be = stats["classes"]["be"]
    assert be["pool"]["requests"] == 30 and be["pool"]["bytes"] == 30 * size, be
    assert stats["busy_inline"]["be"] == 0, stats["busy_inline"]


def test_many_clients_reads_of_two_chunks_are_verified_inline(servers, image):
    """One client's reads of two pool chunks or more take the pool; once more clients
    send them than half the workers that can run at once, each is verified in its own
    connection's thread, and `ctl stats` counts it busy inline."""
    server = servers.start(image)  # the default table: no class pinned
    size = SHARED_MIN
    workers = server.stats()["workers"]
    half = max(1, min(workers, len(os.sched_getaffinity(0))) // 2)
    count = half + 1  # clients: one more than the pool takes
    server.reset_stats()
    rounds = 4
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(server.client("@be")) for _ in range(count)]
        for i in range(rounds * count):  # every client, in turn: all within LOAD_S
            offset = (i * size) % (image.size - image.size % size)
            assert handles[i % count].pread(size, offset) == image.expected(offset, size)
    stats = server.stats()
    be = stats["classes"]["be"]
    # the first round's first `half` clients were at most half: the pool's; then inline
    assert (be["pool"]["requests"], be["inline"]["requests"]) == (
        half, rounds * count - half), be
    assert stats["busy_inline"]["be"] == rounds * count - half
    shown = ctl(server.control, "stats")
    assert shown.returncode == 0, shown.stderr
    assert f"busy inline be {rounds * count - half}" in shown.stdout, shown.stdout

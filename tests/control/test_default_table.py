"""The default threshold table is a plain table (control/table.py DEFAULT: inline up to
one pool chunk, every class): `ctl thresholds` and `ctl stats` show it, explicit
thresholds win over it and pin their class, the fixed presets pin every class, and
`--preset default` brings it back at run time. Real `nbd-verity serve`, real control
socket, real NBD reads."""

from __future__ import annotations

import os

from nbd_verity.schedule.dispatch import POOL_CHUNK_SIZE
from nbd_verity.schedule.learn import LEARN_MIN

from .harness import CLASSES, ctl

KIB = 1024
FIXED = 1 << 20


def test_the_default_table_is_one_pool_chunk_and_learns_above_it(servers, image):
    server = servers.start(image)
    reply = server.ask({"cmd": "thresholds"})
    assert reply["thresholds"] == dict.fromkeys(CLASSES, POOL_CHUNK_SIZE), reply
    assert reply["pinned"] == [], reply  # every class learns above its threshold
    assert server.stats()["thresholds"] == reply["thresholds"]
    shown = ctl(server.control, "thresholds")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[:4] == [f"{c:<5} {POOL_CHUNK_SIZE}" for c in CLASSES]

    # the first request of a size takes the table's path (at the threshold inline, at
    # twice it the pool), unless schedule/learn.py's rule says otherwise: one client, a
    # request of two pool chunks or more and two workers or more take the pool. At
    # 4096 bytes in (4096-byte blocks), one of 512 KiB spans two leaf hash blocks: never
    # the fast path, which verifies one within its threshold inline whatever the rule
    start = 4096
    threshold = min(POOL_CHUNK_SIZE, image.size - start)
    above = image.size - start >= 2 * POOL_CHUNK_SIZE  # one over it fits here
    sizes = [threshold] + ([2 * threshold] if above else [])
    rule = len(os.sched_getaffinity(0)) >= 2  # the server's workers: the CPUs here
    pooled = [size > POOL_CHUNK_SIZE or (
        rule and size >= LEARN_MIN and size >= 2 * POOL_CHUNK_SIZE) for size in sizes]
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


def test_requests_of_one_pool_chunk_are_not_learned_the_table_decides(servers, image):
    """An unpinned class's reads of one pool chunk are left to the table, every one: the
    learner takes no trial of them (a trial sends some to the other path, and trials
    sending one-chunk reads to the pool left a process slower for its life), so they
    all take the table's path and `learned` stays empty."""
    server = servers.start(image)  # the default table: no class pinned
    size = LEARN_MIN // 2  # one pool chunk
    assert size == POOL_CHUNK_SIZE
    path = "inline" if size <= server.thresholds()["be"] else "pool"
    leaf = 512 * KIB  # data under one leaf hash block: straddling two, never the fast path
    reads = 400  # past a trial's first run (at most SKIP_MAX + COUNT / 2 requests)
    server.reset_stats()
    with server.client("@be") as h:
        for i in range(reads):
            offset = leaf * (1 + i % 4) - size // 2
            assert h.pread(size, offset) == image.expected(offset, size)
    stats = server.stats()
    be = stats["classes"]["be"]
    assert be[path]["requests"] == reads and be[path]["bytes"] == reads * size, (path, be)
    assert stats["learned"] == {}, stats["learned"]

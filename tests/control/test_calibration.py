"""The default threshold table is measured when the server starts (schedule/calibrate.py):
what it chose is in `ctl thresholds` and `ctl stats`, explicit thresholds win over it,
the other presets are not calibrated, and `--preset default` brings the measured table
back at run time. Real `nbd-verity serve`, real control socket, real NBD reads."""

from __future__ import annotations

import os

from nbd_verity.limits import MAX_REQUEST_SIZE
from nbd_verity.schedule.dispatch import POOL_CHUNK_SIZE
from nbd_verity.schedule.learn import LEARN_MIN

from .harness import CLASSES, ctl

KIB = 1024
FIXED = 1 << 20


def allowed(threshold: int) -> bool:
    """What calibration may choose: half a crossover size (32 KiB .. 4 MiB), everything
    inline (no crossover), or the fixed table (over its budget)."""
    return threshold in {(32 * KIB) << i for i in range(8)} | {MAX_REQUEST_SIZE, FIXED}


def test_the_default_table_is_calibrated_and_says_how(servers, image):
    server = servers.start(image)
    reply = server.ask({"cmd": "thresholds"})
    calibration = reply["calibration"]
    values = set(reply["thresholds"].values())
    assert len(values) == 1 and values == {calibration["threshold"]}, reply
    assert allowed(calibration["threshold"]), calibration
    assert calibration["outcome"] in ("crossover", "inline wins", "one worker", "over budget")
    # measured in a child the server forked (two workers or more): not in the server
    assert calibration["where"] == ("in process" if calibration["outcome"] == "one worker"
                                    else "in a child"), calibration
    won = [row["pool_us"] <= 0.9 * row["inline_us"] for row in calibration["figures"]]
    if calibration["outcome"] == "crossover":  # two wins in a row, or one at 8 MiB: the end
        sizes = [row["size"] for row in calibration["figures"]]
        first = sizes.index(2 * calibration["threshold"])
        assert all(won[first:]) and len(won) - first in (1, 2), calibration
        assert not any(won[i] and won[i + 1] for i in range(first - 1)), calibration
    elif calibration["outcome"] == "inline wins":  # never two wins in a row, nor at 8 MiB
        assert not won[-1] and not any(won[i] and won[i + 1] for i in range(len(won) - 1))
    assert server.stats()["calibration"] == calibration
    shown = ctl(server.control, "thresholds")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-1].startswith(
        f"calibrated at start-up in {calibration['ms']:.0f} ms: "), shown.stdout

    # the first request of a size takes the table's path (at the threshold inline, at
    # twice it the pool), unless schedule/learn.py's rule says otherwise: one client, a
    # request of two pool chunks or more and two workers or more take the pool. At
    # 4096 bytes in (4096-byte blocks), one of 512 KiB spans two leaf hash blocks: never
    # the fast path, which verifies one within its threshold inline whatever the rule
    start = 4096
    threshold = min(calibration["threshold"], image.size - start)
    above = 2 * calibration["threshold"] <= image.size - start  # one over it fits here
    sizes = [threshold] + ([2 * threshold] if above else [])
    rule = len(os.sched_getaffinity(0)) >= 2  # the server's workers: the CPUs here
    pooled = [size > calibration["threshold"] or (
        rule and size >= LEARN_MIN and size >= 2 * POOL_CHUNK_SIZE) for size in sizes]
    server.reset_stats()
    with server.client("@be") as h:
        for size in sizes:
            assert h.pread(size, start) == image.expected(start, size)
    be = server.stats()["classes"]["be"]
    assert (be["inline"]["requests"], be["pool"]["requests"]) == (
        pooled.count(False), pooled.count(True)), (sizes, be)


def test_explicit_thresholds_win_and_presets_are_not_calibrated(servers, image):
    server = servers.start(image, "--threshold", "rt=0")
    table = server.thresholds()
    calibrated = server.ask({"cmd": "thresholds"})["calibration"]["threshold"]
    assert table == {"none": calibrated, "rt": 0, "be": calibrated, "idle": calibrated}

    server.ask({"cmd": "thresholds", "preset": "kernel"})
    back = server.ask({"cmd": "thresholds", "preset": "default"})["thresholds"]
    assert back == table  # the measured table (with rt=0 over it), not the fixed one
    assert server.ask({"cmd": "thresholds", "preset": "fixed"})["thresholds"] == \
        dict.fromkeys(CLASSES, FIXED)

    kernel = servers.start(image, "--threshold-preset", "kernel")
    reply = kernel.ask({"cmd": "thresholds"})
    assert reply["calibration"] is None
    assert reply["thresholds"] == {"none": 8192, "rt": 8192, "be": 8192, "idle": 0}
    every = servers.start(image, *[f"--threshold={c}=65536" for c in CLASSES])
    assert every.ask({"cmd": "thresholds"})["calibration"] is None  # nothing left to measure


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

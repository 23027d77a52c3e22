"""The learned inline-or-pool choice (serve/learn.py): a trial first (a run of the
table's path, then one of the other), then the cheaper one, with a trial every
EXPLORE-th request (EXPLORE_FAR-th when one path is far worse), or at once when the
chosen path's own requests cost far more than the other did; a run's first SKIP requests
not counted; one disturbed request does not move it; a request's cost is its client's
whole cycle; pinned classes and small requests never consult it."""

from __future__ import annotations

import threading
import time

from nbd_verity.control.table import INLINE, POOL
from nbd_verity.serve.dispatch import CYCLE_GAP_S, Dispatcher
from nbd_verity.serve.learn import EXPLORE, EXPLORE_FAR, LEARN_MIN, RUN, SKIP, Learner, bucket

BE, IDLE = 2, 3
MIB = 1 << 20


def test_buckets_are_powers_of_two_from_64k():
    assert bucket(LEARN_MIN) == bucket(2 * LEARN_MIN - 1) == 0
    assert bucket(2 * LEARN_MIN) == 1
    assert bucket(2 * MIB) == 5 and bucket(32 * MIB) == 9


def feed(learner: Learner, length: int, costs: dict, requests: int) -> list[str]:
    """requests choices for one size, each recorded at costs[path] seconds."""
    chosen = []
    for _ in range(requests):
        path = learner.choose(BE, length, INLINE)
        learner.record(BE, length, path, costs[path])
        chosen.append(path)
    return chosen


def test_table_first_then_the_other_then_the_cheaper_with_exploration():
    learner = Learner()
    warm = 2 * RUN
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0009}, warm + 4 * EXPLORE)
    assert chosen[:warm] == [INLINE] * RUN + [POOL] * RUN  # a run of each, the table's first
    rest = chosen[warm:]
    assert rest.count(INLINE) == 4 * RUN, rest  # a trial every EXPLORE (under 1.5x cheaper)
    assert rest[EXPLORE - warm:EXPLORE - warm + 2 * RUN] == [POOL] * RUN + [INLINE] * RUN
    snap = learner.snapshot()["be"]
    assert snap["pool_from"] == 2 * MIB
    row = snap["buckets"][str(2 * MIB)]
    assert row["choice"] == POOL and row["requests"] == warm + 4 * EXPLORE
    assert row["pool_us_per_mib"] < row["inline_us_per_mib"]


def test_a_far_worse_path_is_tried_less_often():
    learner = Learner()
    chosen = feed(learner, MIB, {INLINE: 0.0005, POOL: 0.0020}, 2 * RUN + 2 * EXPLORE_FAR)
    assert chosen[2 * RUN:].count(POOL) == 2 * RUN


def test_a_runs_first_requests_are_not_counted():
    """The first requests on a path after others pay for its idle CPUs: not samples."""
    learner = Learner()
    for _ in range(RUN):
        assert learner.choose(BE, 2 * MIB, INLINE) == INLINE
        learner.record(BE, 2 * MIB, INLINE, 0.0020)
    for i in range(RUN):
        assert learner.choose(BE, 2 * MIB, INLINE) == POOL  # the run of the pool
        learner.record(BE, 2 * MIB, POOL, 0.0500 if i < SKIP else 0.0010)
    row = learner.snapshot()["be"]["buckets"][str(2 * MIB)]
    assert row["choice"] == POOL and row["pool_us_per_mib"] < row["inline_us_per_mib"]


def test_one_disturbed_request_does_not_move_the_choice():
    learner = Learner()
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0006}, 2 * RUN + 8)
    assert learner.choose(BE, 2 * MIB, INLINE) == POOL
    learner.record(BE, 2 * MIB, POOL, 0.040)  # preempted once
    assert learner.snapshot()["be"]["buckets"][str(2 * MIB)]["choice"] == POOL


def test_the_choice_follows_a_change_of_load():
    learner = Learner()
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0006}, 100)
    assert learner.choose(BE, 2 * MIB, INLINE) == POOL
    # now the cores are taken: the pool's requests wait; inline costs what it did
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0030}, 4 * EXPLORE)
    assert chosen[-EXPLORE:].count(POOL) <= RUN, chosen[-EXPLORE:]


def test_classes_and_sizes_learn_apart():
    learner = Learner()
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, 2 * RUN + 8)
    assert learner.choose(IDLE, 2 * MIB, INLINE) == INLINE  # idle: its first, the table's
    assert learner.choose(BE, 128 << 10, INLINE) == INLINE  # another size: its first
    assert set(learner.snapshot()) == {"be", "idle"}


def dispatcher(pinned: frozenset) -> tuple[Dispatcher, list]:
    seen: list[int] = []
    lock = threading.Lock()

    def read(view, offset):
        with lock:
            seen.append(len(view))

    return Dispatcher(read, 4096, (256 << 10,) * 4, workers=2, pinned=pinned), seen


def test_pinned_classes_and_small_requests_follow_the_table_alone():
    d, _ = dispatcher(frozenset({BE}))
    try:
        buf = memoryview(bytearray(2 * MIB))
        for _ in range(20):
            d.read(buf, 0, BE)  # pinned: over its threshold, the pool every time
            d.read(buf[:LEARN_MIN - 4096], 0, IDLE)  # small: inline, as the table says
        snap = d.stats.snapshot()
        assert snap["be"]["pool"]["requests"] == 20 and snap["be"]["inline"]["requests"] == 0
        assert snap["idle"]["inline"]["requests"] == 20
        assert d.learner.snapshot() == {}
    finally:
        d.stop()


def test_an_unpinned_class_learns_through_the_dispatcher():
    d, _ = dispatcher(frozenset())
    try:
        buf = memoryview(bytearray(2 * MIB))
        for _ in range(2 * RUN + 8):
            d.read(buf, 0, BE)
        snap = d.stats.snapshot()["be"]
        assert snap["inline"]["requests"] >= 1 and snap["pool"]["requests"] >= 1  # both tried
        row = d.learner.snapshot()["be"]["buckets"][str(2 * MIB)]
        assert row["requests"] == 2 * RUN + 8 and row["choice"] in (INLINE, POOL)
    finally:
        d.stop()


def test_a_learned_requests_cost_is_its_clients_whole_cycle():
    """The time from a request's start to its connection's next one is its sample (the
    reply's way out and the next request's way in are part of what its path costs the
    client), unless the client was quiet for longer than CYCLE_GAP_S in between."""
    for gap, least, most in ((0.005, 0.005, CYCLE_GAP_S), (CYCLE_GAP_S + 0.02, 0, 0.005)):
        d, _ = dispatcher(frozenset())
        clock = [0.0, 0.0, 0, None, 0]
        try:
            buf = memoryview(bytearray(2 * MIB))
            for _ in range(2 * RUN + 1):  # a trial, and the request that ends its last
                d.read(buf, 0, BE, clock)
                time.sleep(gap)
            row = d.learner.snapshot()["be"]["buckets"][str(2 * MIB)]
        finally:
            d.stop()
        for path in ("inline", "pool"):
            seconds = row[f"{path}_us_per_mib"] * 2 / 1e6  # per 2 MiB request
            assert least <= seconds < most, (gap, row)


def test_any_next_request_ends_a_learned_requests_cycle():
    """A small request after a learned one ends its cycle there (the sample is taken),
    rather than a later learned request stretching it over the small ones."""
    d, _ = dispatcher(frozenset())
    clock = [0.0, 0.0, 0, None, 0]
    try:
        d.read(memoryview(bytearray(2 * MIB)), 0, BE, clock)
        assert clock[0] > 0  # its sample waits for the connection's next request
        d.read(memoryview(bytearray(4096)), 0, BE, clock)  # under LEARN_MIN: the table's
        assert clock[0] == 0.0
    finally:
        d.stop()

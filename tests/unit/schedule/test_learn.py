"""The learned inline-or-pool choice (schedule/learn.py): the rule's path, a trial EXPLORE
requests in (runs of the rule's path, the other, the rule's again), then the cheaper one
by the pool/inline ratio once two trials agree (a lone one does not overturn the rule,
and the next comes EXPLORE on), with the next trial EXPLORE requests later, twice as far after
each that kept the choice (up to EXPLORE_FAR; EXPLORE_FAR once two trials in a row found
one path far worse; EXPLORE again when the chosen path's own requests cost more than the
other did for WATCH_S); a run's first requests not counted (the pool's first WARM_S after
inline's); one disturbed request or burst does not move it; a request's cost is its
client's whole cycle, and a pool request verified inline because no worker was free is a
sample of the pool; pinned classes and small requests never consult it."""

from __future__ import annotations

import os
import threading
import time

from nbd_verity.control.table import INLINE, POOL
from nbd_verity.schedule.dispatch import CYCLE_GAP_S, POOL_CHUNK_SIZE, Client, Cycle, Dispatcher
from nbd_verity.schedule.learn import (
    BUCKETS,
    COUNT,
    EXPLORE,
    EXPLORE_FAR,
    LEARN_MIN,
    LOAD_FRESH_S,
    LOAD_LAST,
    LOAD_S,
    QUIET_S,
    RUN_MAX,
    SKIP,
    SKIP_MAX,
    WATCH_S,
    WINDOW,
    Learner,
    bucket,
)

BE, IDLE = 2, 3
MIB = 1 << 20
# a trial's runs, each its SKIP requests not counted and then its samples (no warm time)
RUNS = (SKIP + COUNT // 2, SKIP + COUNT, SKIP + COUNT // 2)
TRIAL = sum(RUNS)


def test_buckets_are_powers_of_two_from_two_pool_chunks():
    assert LEARN_MIN == 2 * POOL_CHUNK_SIZE  # a smaller request is one pool task at most
    assert bucket(LEARN_MIN) == bucket(2 * LEARN_MIN - 1) == 0
    assert bucket(2 * LEARN_MIN) == 1
    assert bucket(2 * MIB) == 2 and bucket(32 * MIB) == BUCKETS - 1 == 6


def feed(learner: Learner, length: int, costs: dict, requests: int,
         load: int = 0) -> list[str]:
    """requests choices for one size, each recorded at costs[path] seconds."""
    chosen = []
    for _ in range(requests):
        path = learner.choose(BE, length, INLINE, load)
        learner.record(BE, length, path, costs[path], load=load)
        chosen.append(path)
    return chosen


def trial(path: str) -> list[str]:
    """A trial's choices with path the chosen one: its run, the other's, its again."""
    other = POOL if path == INLINE else INLINE
    first, others, again = RUNS
    return [path] * first + [other] * others + [path] * again


def trial_starts(chosen: list[str], path: str) -> list[int]:
    """Where the trials with path chosen started."""
    want = trial(path)
    return [i for i in range(len(chosen) - TRIAL + 1) if chosen[i:i + TRIAL] == want]


def test_table_first_then_the_other_then_the_table_then_the_cheaper_once_two_agree():
    """The first trial finds the pool cheaper: alone it does not overturn the table's
    path, and the next comes EXPLORE on; the second agrees, and the pool is chosen."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, TRIAL + 4 * EXPLORE)
    row = EXPLORE - TRIAL  # requests on the chosen path between trials EXPLORE apart
    assert chosen == (trial(INLINE) + [INLINE] * row + trial(INLINE) + [POOL] * row
                      + trial(POOL) + [POOL] * (row + EXPLORE) + trial(POOL))  # twice as far
    snap = learner.snapshot()["be"]["loads"]["1"]
    assert snap["pool_from"] == 2 * MIB
    row = snap["buckets"][str(2 * MIB)]
    assert row["choice"] == POOL and row["requests"] == TRIAL + 4 * EXPLORE
    assert row["pool_us_per_mib"] < row["inline_us_per_mib"]
    assert abs(row["pool_to_inline"] - 0.8) < 1e-6 and row["trials"] == 4
    assert row["last_trials"] == [0.8] * 3


def test_trials_come_twice_as_far_apart_while_they_keep_the_choice():
    """The second trial moved the choice to the pool: the next comes EXPLORE after it;
    each that keeps the pool puts the next twice as far, up to EXPLORE_FAR."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, 16 * EXPLORE)
    assert EXPLORE_FAR == 4 * EXPLORE
    assert trial_starts(chosen, INLINE) == [0, EXPLORE]
    assert trial_starts(chosen, POOL) == [2 * EXPLORE, 4 * EXPLORE, 8 * EXPLORE, 12 * EXPLORE]
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["trials"] == 6 and row["early_trials"] == 0


def test_a_change_of_load_brings_trials_explore_apart_again():
    """Trials 2 x EXPLORE apart: the pool's own requests come to cost 1.6 times what they
    did, so the next trial comes EXPLORE after the last, and the ones after it EXPLORE
    apart: the second moves the choice to inline (the median of the last three)."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, 2 * EXPLORE + TRIAL)  # kept: 2x
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0013}, 4 * EXPLORE)
    at = [n * EXPLORE - (2 * EXPLORE + TRIAL) for n in (3, 4, 5)]  # in chosen
    assert set(chosen[:at[0]]) == {POOL}
    for start in at[:2]:
        assert chosen[start:start + TRIAL] == trial(POOL)
    assert set(chosen[at[1] + TRIAL:at[2]]) == {INLINE}
    assert chosen[at[2]:at[2] + TRIAL] == trial(INLINE)
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["choice"] == INLINE and row["early_trials"] == 1


def test_a_far_worse_path_is_tried_less_often_once_two_trials_in_a_row_found_it():
    """The pool costs four times inline's: the first trial's verdict alone does not put
    the next EXPLORE_FAR away (one trial may have been disturbed): it comes as after any
    that kept the choice (2 x EXPLORE); after two in a row, EXPLORE_FAR."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    chosen = feed(learner, MIB, {INLINE: 0.0005, POOL: 0.0020},
                  2 * EXPLORE + 2 * EXPLORE_FAR + TRIAL)
    assert trial_starts(chosen, INLINE) == [0, 2 * EXPLORE, 2 * EXPLORE + EXPLORE_FAR,
                                            2 * EXPLORE + 2 * EXPLORE_FAR]


def test_a_rows_first_trial_comes_explore_requests_in_the_rules_path_until_then():
    """Two workers: one client's 2 MiB requests take the pool (the rule's path, not the
    table's inline) from the first, and the first trial comes EXPLORE requests in."""
    learner = Learner(warm_s=0, cores=2, spread=512 << 10, watch_s=0)
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, EXPLORE)
    assert chosen == [POOL] * EXPLORE
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["trials"] == 0 and row["choice"] is None and row["pool_to_inline"] is None
    first, other, again = RUNS
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, TRIAL)
    assert chosen == [POOL] * first + [INLINE] * other + [POOL] * again
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["trials"] == 1 and row["choice"] == POOL


def timed(learner: Learner, costs: dict, requests: int, at: float, every: float) -> float:
    """requests 2 MiB choices, started every seconds from at; the next one's start."""
    for _ in range(requests):
        path = learner.choose(BE, 2 * MIB, INLINE)
        learner.record(BE, 2 * MIB, path, costs[path], started=at)
        at += every
    return at


def test_a_burst_of_costly_requests_does_not_bring_a_trial_sooner():
    """Trials over EXPLORE apart: the chosen path's requests cost three times as much for
    half a second (a burst of CPU steal): no trial comes sooner; when they cost it for
    longer than WATCH_S (1 s), the next trial comes EXPLORE after the last."""
    learner = Learner(warm_s=0, cores=2, spread=512 << 10)  # the pool, the rule's path
    cheap, costly = {INLINE: 0.0010, POOL: 0.0008}, {INLINE: 0.0010, POOL: 0.0024}
    at = timed(learner, cheap, EXPLORE + TRIAL + WINDOW, 0.0, 0.001)  # kept: 2 x EXPLORE
    at = timed(learner, costly, 500, at, 0.001)
    at = timed(learner, cheap, WINDOW, at, 0.001)
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["early_trials"] == 0 and row["trials"] == 1
    timed(learner, costly, EXPLORE - 500 - 2 * WINDOW, at, 0.002)  # 3 s: to 2 x EXPLORE
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["early_trials"] == 1 and row["trials"] == 2


def test_the_verdict_is_the_ratio_within_each_trial():
    """The machine slows from trial to trial, and one trial's pool run is disturbed: the
    ratios within each trial decide (0.8, 1.8, 0.82: the pool), not each path's costs
    mixed from different trials' moments (medians 1.1 inline, 2.0 pool: inline)."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, EXPLORE)
    feed(learner, 2 * MIB, {INLINE: 0.0011, POOL: 0.0020}, EXPLORE)
    # inline's cost moves (1.1 to 2.5): the watch brings the third trial at once
    feed(learner, 2 * MIB, {INLINE: 0.0025, POOL: 0.00205}, TRIAL + 8)
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["trials"] == 3 and row["pool_us_per_mib"] > row["inline_us_per_mib"], row
    assert row["choice"] == POOL and abs(row["pool_to_inline"] - 0.82) < 1e-6


def test_the_rule_the_pool_with_idle_workers_inline_when_every_one_has_a_client():
    """Two workers, the pool splitting 512 KiB and more across two: one client's 2 MiB
    requests take the pool first, two clients' inline first, one client's 256 KiB the
    table's path; one worker: the table's always."""
    learner = Learner(warm_s=0, first=0, watch_s=0, cores=2, spread=512 << 10)
    one, two, four = 0, 1, 2
    assert learner.rule(one, 2 * MIB, INLINE) == POOL
    assert learner.rule(two, 2 * MIB, POOL) == INLINE == learner.rule(four, 2 * MIB, POOL)
    assert learner.rule(one, 256 << 10, INLINE) == INLINE
    assert learner.rule(one, 256 << 10, POOL) == POOL
    assert Learner(cores=1, spread=512 << 10).rule(one, 2 * MIB, INLINE) == INLINE
    assert learner.choose(BE, 2 * MIB, INLINE, one) == POOL  # its trial: the rule's first
    assert learner.choose(BE, 2 * MIB, POOL, four) == INLINE


def test_the_rules_workers_are_those_that_can_run_at_once():
    cpus = len(os.sched_getaffinity(0))
    for workers, cores in ((64, cpus), (1, 1)):
        d = Dispatcher(lambda view, offset: None, 4096, (0,) * 4, workers=workers)
        assert d.learner.cores == cores and d.learner.spread == 2 * d.chunk_size


def test_trials_overturn_the_rule_only_by_the_margin():
    """A trial rates the pool's requests worse than a stream of them runs (the path not
    chosen pays for its CPUs' change): within MARGIN either way the rule's path stays;
    beyond it, once two trials found it (the rule's path until the second)."""
    for load, rule, ratio, choice in ((0, POOL, 1.1, POOL), (0, POOL, 1.2, INLINE),
                                      (2, INLINE, 0.9, INLINE), (2, INLINE, 0.85, POOL)):
        learner = Learner(warm_s=0, first=0, watch_s=0, cores=2, spread=512 << 10)
        chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0010 * ratio},
                      EXPLORE + TRIAL + 8, load)
        assert chosen[:TRIAL] == trial(rule), (load, ratio)
        assert set(chosen[TRIAL:EXPLORE]) == {rule}, (load, ratio)
        assert chosen[-8:] == [choice] * 8, (load, ratio)


def test_a_lone_disturbed_trial_does_not_overturn_the_rule():
    """One client's requests, the pool the rule's path: a trial rates the pool twice
    inline's cost (its run disturbed). The pool stays chosen, and the next trial comes
    EXPLORE on, not twice as far; when it finds the pool cheaper, the pool stays."""
    learner = Learner(warm_s=0, first=0, watch_s=0, cores=2, spread=512 << 10)
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0021}, TRIAL)
    chosen += feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, 2 * EXPLORE)
    row = EXPLORE - TRIAL
    assert chosen == trial(POOL) + [POOL] * row + trial(POOL) + [POOL] * (row + TRIAL)
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["choice"] == POOL and row["last_trials"] == [2.1, 0.8], row
    assert row["pool_to_inline"] == 1.0  # two trials that disagree: even


def test_a_runs_first_requests_are_not_counted():
    """The first requests on a path after the other pay for its idle CPUs: not samples."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    first, other, _ = RUNS
    for _ in range(first):
        assert learner.choose(BE, 2 * MIB, INLINE) == INLINE
        learner.record(BE, 2 * MIB, INLINE, 0.0020)
    for i in range(other):
        assert learner.choose(BE, 2 * MIB, INLINE) == POOL  # the run of the pool
        learner.record(BE, 2 * MIB, POOL, 0.0500 if i < SKIP else 0.0010)
    feed(learner, 2 * MIB, {INLINE: 0.0020, POOL: 0.0010}, RUNS[2])
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["pool_to_inline"] == 0.5, row  # the first SKIP pool samples not in it
    assert learner._rows[BE][0][bucket(2 * MIB)].samples[POOL] == [0.0010 / (2 * MIB)] * COUNT


def test_after_a_change_of_path_the_pools_first_warm_seconds_are_not_counted():
    """The pool's requests that started within warm_s of its run's first are not samples,
    up to SKIP_MAX of them (the rest count, however soon they started); inline's run after
    the pool's counts from its SKIP-th (it runs no slower at first)."""
    learner = Learner(warm_s=1000.0, first=0)  # every request of the test starts within it
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, RUNS[0])
    assert chosen == [INLINE] * RUNS[0]  # the chosen path's first run: warm already
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, SKIP_MAX + COUNT)
    assert chosen == [POOL] * (SKIP_MAX + COUNT)
    assert learner.choose(BE, 2 * MIB, INLINE) == INLINE  # the last run: the table's again
    learner = Learner(warm_s=1000.0, first=0, cores=2, spread=512 << 10)  # the pool first
    first, other, _ = RUNS
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, first + other)
    assert chosen == [POOL] * first + [INLINE] * other
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, SKIP_MAX + COUNT // 2)
    assert chosen == [POOL] * (SKIP_MAX + COUNT // 2)
    assert learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]["trials"] == 1
    assert learner.choose(BE, 2 * MIB, INLINE) == POOL  # decided; the next trial far off


def test_a_run_whose_samples_do_not_come_is_given_up():
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, RUNS[0])
    for _ in range(RUN_MAX):  # handed out to the pool, never recorded
        assert learner.choose(BE, 2 * MIB, INLINE) == POOL
    assert learner.choose(BE, 2 * MIB, INLINE) == INLINE  # the table's, until a next trial
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["choice"] is None and row["pool_to_inline"] is None


def test_one_disturbed_request_does_not_move_the_choice():
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0006}, EXPLORE + TRIAL + 8)
    assert learner.choose(BE, 2 * MIB, INLINE) == POOL
    learner.record(BE, 2 * MIB, POOL, 0.040)  # preempted once
    assert learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]["choice"] == POOL


def test_the_choice_follows_a_change_of_load():
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0006}, EXPLORE + TRIAL + 8)
    assert learner.choose(BE, 2 * MIB, INLINE) == POOL
    # now the cores are taken: the pool's requests wait; inline costs what it did
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0030}, 4 * EXPLORE)
    assert chosen[-EXPLORE:].count(POOL) <= RUNS[1], chosen[-EXPLORE:]


def test_far_apart_trials_come_sooner_when_the_choice_costs_more():
    """Trials EXPLORE_FAR apart: when the chosen path comes to cost more than the other
    did in the last trial, the next one comes EXPLORE after the last, and the one after
    it EXPLORE on (the median of the last three trials moves with the second)."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0030, POOL: 0.0010}, EXPLORE + TRIAL + 8)  # far, twice
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0030, POOL: 0.0060}, EXPLORE)
    at = EXPLORE - (TRIAL + 8)  # the trial EXPLORE after the last
    assert chosen[:at] == [POOL] * at  # until then the pool, the costlier now
    assert chosen[at:at + TRIAL] == [POOL] * RUNS[0] + [INLINE] * RUNS[1] + [POOL] * RUNS[2]
    assert set(chosen[at + TRIAL:]) == {POOL}  # the median of three: still the pool's
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0030, POOL: 0.0060}, EXPLORE)
    assert set(chosen[:at]) == {POOL}  # the next trial, EXPLORE on, moves it
    assert chosen[at:at + TRIAL] == [POOL] * RUNS[0] + [INLINE] * RUNS[1] + [POOL] * RUNS[2]
    assert set(chosen[at + TRIAL:]) == {INLINE}
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["early_trials"] == 1 and row["choice"] == INLINE and row["trials"] == 4


def test_far_apart_trials_come_sooner_when_the_choice_costs_much_less():
    """Four clients made inline far cheaper; then one is left: inline costs half what it
    did, and the pool is cheaper now. The next trial comes EXPLORE after the last (not
    2 x EXPLORE), and the one after it EXPLORE on agrees: the pool."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0040, POOL: 0.0080}, TRIAL + 8)  # inline, far
    chosen = feed(learner, 2 * MIB, {INLINE: 0.0018, POOL: 0.0015}, 2 * EXPLORE)
    at = EXPLORE - (TRIAL + 8)
    assert chosen == ([INLINE] * at + trial(INLINE) + [INLINE] * (EXPLORE - TRIAL)
                      + trial(INLINE) + [POOL] * 8)
    row = learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
    assert row["early_trials"] == 1 and row["choice"] == POOL


def feed_at(learner: Learner, costs: dict, start: float, seconds: float,
            every: float = 0.01) -> None:
    """One client's 2 MiB requests, one every `every` seconds from start for seconds."""
    for i in range(round(seconds / every)):
        path = learner.choose(BE, 2 * MIB, INLINE)
        learner.record(BE, 2 * MIB, path, costs[path], started=start + i * every)


def test_a_pause_starts_the_watch_afresh():
    """The chosen path out of line for less than WATCH_S, a pause of QUIET_S and more, and
    again for less than WATCH_S: no trial sooner (the two spells are not one); held out
    of line past WATCH_S after it, one."""
    learner = Learner(warm_s=0, first=0, watch_s=WATCH_S)
    feed(learner, 2 * MIB, {INLINE: 0.0030, POOL: 0.0010}, EXPLORE + TRIAL + 8)  # far, twice
    dearer = {INLINE: 0.0030, POOL: 0.0030}  # the pool's now three times its trials'

    def early() -> int:
        return learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]["early_trials"]

    start = time.perf_counter() + 10
    spell = 0.6 * WATCH_S
    feed_at(learner, dearer, start, spell)
    feed_at(learner, dearer, start + spell + 2 * QUIET_S, spell)
    assert early() == 0
    then = start + 2 * spell + 2 * QUIET_S
    # a sample that started long before (a client back from a pause of its own) is not
    # a pause of the group's
    learner.record(BE, 2 * MIB, POOL, dearer[POOL], started=then - 2 * QUIET_S)
    feed_at(learner, dearer, then, spell)  # no pause: held
    assert early() == 1


def test_a_load_counted_moments_ago_stands_for_a_connection_in_it():
    """The load is counted again LOAD_FRESH_S after the last count, or at once for a
    connection not in it: within that, a connection's own requests keep the count."""
    learner = Learner()
    assert [learner.load(c, 1.0) for c in "ab"] == [0, 1]
    assert [learner.load("a", 1.0) for _ in range(LOAD_LAST)][-1] == 1  # b's gone, not yet
    assert learner.load("a", 1.0 + LOAD_FRESH_S) == 0  # counted again: a alone


def test_classes_and_sizes_learn_apart():
    learner = Learner(warm_s=0, first=0, watch_s=0)
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0005}, TRIAL + 8)
    assert learner.choose(IDLE, 2 * MIB, INLINE) == INLINE  # idle: its first, the table's
    assert learner.choose(BE, LEARN_MIN, INLINE) == INLINE  # another size: its first
    assert set(learner.snapshot()) == {"be", "idle"}


def test_a_requests_load_is_the_clients_of_the_last_learned_requests():
    """1, 2, 3-4, 5-8, 9-16 connections among the last LOAD_LAST within LOAD_S."""
    learner = Learner()
    assert [learner.load("a", 1.0) for _ in range(LOAD_LAST)] == [0] * LOAD_LAST
    assert learner.load("b", 1.0) == 1
    assert [learner.load(c, 1.0) for c in "cd"] == [2, 2]
    assert learner.load("e", 1.0) == 3
    assert [learner.load(c, 1.0) for c in range(LOAD_LAST)][-1] == 4
    assert learner.load("a", 1.0 + LOAD_S + 0.01) == 0  # the others' were too long ago


def test_loads_learn_apart():
    """Four clients' requests learn inline, one client's the pool, and going back to
    four clients takes their choice at once: a change of load needs no new trials."""
    learner = Learner(warm_s=0, first=0, watch_s=0)
    four, one = 2, 0
    feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0015}, TRIAL + 8, four)
    assert feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0008}, EXPLORE + TRIAL + 8,
                one)[-8:] == [POOL] * 8
    assert feed(learner, 2 * MIB, {INLINE: 0.0010, POOL: 0.0015}, 8, four) == [INLINE] * 8
    loads = learner.snapshot()["be"]["loads"]
    assert {name: r["buckets"][str(2 * MIB)]["choice"] for name, r in loads.items()} == {
        "1": POOL, "3-4": INLINE}


def dispatcher(pinned: frozenset) -> tuple[Dispatcher, list]:
    seen: list[int] = []
    lock = threading.Lock()

    def read(view, offset):
        with lock:
            seen.append(len(view))

    d = Dispatcher(read, 4096, (256 << 10,) * 4, workers=2, pinned=pinned)
    d.learner.warm_s = 0  # no request waits here for the CPUs to wake
    d.learner.first = d.learner.watch_s = 0  # the first trial at once
    d.learner.reset()
    return d, seen


def test_pinned_classes_and_small_requests_follow_the_table_alone():
    d, _ = dispatcher(frozenset({BE}))
    try:
        buf = memoryview(bytearray(2 * MIB))
        for _ in range(20):
            d.read(buf, 0, Client(BE))  # pinned: over its threshold, the pool every time
            d.read(buf[:64 << 10], 0, Client(IDLE))  # small: inline, as the table says
            d.read(buf[:LEARN_MIN - 4096], 0, Client(IDLE))  # under LEARN_MIN: the table
        snap = d.stats.snapshot()
        assert snap["be"]["pool"]["requests"] == 20 and snap["be"]["inline"]["requests"] == 0
        assert snap["idle"]["inline"]["requests"] == 20
        assert snap["idle"]["pool"]["requests"] == 20
        assert d.learner.snapshot() == {}
    finally:
        d.stop()


def test_one_chunk_requests_the_table_verifies_inline_never_start_the_pool():
    """An unpinned class's requests of one pool chunk, under the table's threshold, are
    verified inline, every one: no trial sends them to the pool, whose threads never
    start (a process that ran its pool served such reads slower for its life)."""
    seen: list[int] = []
    d = Dispatcher(lambda view, offset: seen.append(len(view)), 4096,
                   (POOL_CHUNK_SIZE,) * 4, workers=2)
    d.learner.warm_s = 0
    try:
        buf = memoryview(bytearray(POOL_CHUNK_SIZE))
        for _ in range(TRIAL + 8):
            d.read(buf, 0, Client(BE, Cycle()))
        snap = d.stats.snapshot()["be"]
        assert (snap["inline"]["requests"], snap["pool"]["requests"]) == (TRIAL + 8, 0), snap
        assert d._pool is None and d.learner.snapshot() == {}
    finally:
        d.stop()


def test_an_unpinned_class_learns_through_the_dispatcher():
    d, _ = dispatcher(frozenset())
    try:
        buf = memoryview(bytearray(2 * MIB))
        for _ in range(TRIAL + 8):
            d.read(buf, 0, Client(BE))
        snap = d.stats.snapshot()["be"]
        assert snap["inline"]["requests"] >= 1 and snap["pool"]["requests"] >= 1  # both tried
        row = d.learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
        assert row["requests"] == TRIAL + 8 and row["choice"] in (INLINE, POOL)
    finally:
        d.stop()


def test_the_dispatcher_learns_per_load():
    """Two connections' requests in turn are learned as two clients', one's alone as one
    client's."""
    d, _ = dispatcher(frozenset())
    clocks = [Cycle() for _ in range(2)]
    try:
        buf = memoryview(bytearray(2 * MIB))
        for i in range(2 * (TRIAL + 1)):
            d.read(buf, 0, Client(BE, clocks[i % 2]))
        time.sleep(LOAD_S + 0.01)
        for _ in range(LOAD_LAST + TRIAL + 1):
            d.read(buf, 0, Client(BE, clocks[0]))
        loads = d.learner.snapshot()["be"]["loads"]
        two, one = (loads[n]["buckets"][str(2 * MIB)] for n in ("2", "1"))
        assert two["requests"] == 2 * (TRIAL + 1) - 1 and two["trials"] == 1, loads
        # the very first request saw one client
        assert one["requests"] == 1 + LOAD_LAST + TRIAL + 1 and one["trials"] == 1, loads
        assert two["pool_us_per_mib"] and one["pool_us_per_mib"], loads
    finally:
        d.stop()


def test_a_learned_requests_cost_is_its_clients_whole_cycle():
    """The time from a request's start to its connection's next one is its sample (the
    reply's way out and the next request's way in are part of what its path costs the
    client), unless the client was quiet for longer than CYCLE_GAP_S in between."""
    for gap, least, most in ((0.005, 0.005, CYCLE_GAP_S), (CYCLE_GAP_S + 0.02, 0, 0.005)):
        d, _ = dispatcher(frozenset())
        clock = Cycle()
        try:
            buf = memoryview(bytearray(2 * MIB))
            # a trial: a sample is recorded once the next request's path is chosen, so
            # each run hands out one request more (the last run's ends its last cycle)
            for _ in range(TRIAL + len(RUNS)):
                d.read(buf, 0, Client(BE, clock))
                time.sleep(gap)
            row = d.learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
        finally:
            d.stop()
        for path in ("inline", "pool"):
            seconds = row[f"{path}_us_per_mib"] * 2 / 1e6  # per 2 MiB request
            assert least <= seconds < most, (gap, row)


def test_any_next_request_ends_a_learned_requests_cycle():
    """A small request after a learned one ends its cycle there (the sample is taken),
    rather than a later learned request stretching it over the small ones."""
    d, _ = dispatcher(frozenset())
    clock = Cycle()
    try:
        d.read(memoryview(bytearray(2 * MIB)), 0, Client(BE, clock))
        assert clock.started > 0  # its sample waits for the connection's next request
        d.read(memoryview(bytearray(4096)), 0, Client(BE, clock))  # under LEARN_MIN
        assert clock.started == 0.0
    finally:
        d.stop()


def test_a_pool_request_verified_inline_for_want_of_a_worker_is_a_pool_sample():
    """Choosing the pool gets the client the pool or, when no worker is free, inline: the
    trial's pool run counts both (with the workers all taken, its samples still come)."""
    d, _ = dispatcher(frozenset())
    try:
        buf = memoryview(bytearray(2 * MIB))
        pool = d.start()
        for run in RUNS:  # the table's 256 KiB: the pool first, inline, the pool again
            pool.claim(0)  # another connection's pool request: no worker is free
            for _ in range(run):
                d.read(buf, 0, Client(BE))
            pool.release(0)
        assert d.busy_inline()["be"] == RUNS[0] + RUNS[2]  # the pool's runs, all inline
        assert d.stats.snapshot()["be"]["pool"]["requests"] == 0
        row = d.learner.snapshot()["be"]["loads"]["1"]["buckets"][str(2 * MIB)]
        assert row["pool_us_per_mib"] is not None and row["choice"] in (INLINE, POOL)
    finally:
        d.stop()

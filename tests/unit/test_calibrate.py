"""schedule/calibrate.py: its choice follows its own measurements, one worker never
calibrates, and the budget bounds it; the server's way (calibrate_apart) measures in a
forked child and leaves the calling process as it was, or measures in process when the
child does not answer in time."""

from __future__ import annotations

import os
import resource
import threading
import time

from nbd_verity.control.table import FIXED
from nbd_verity.format.digest import Digester
from nbd_verity.limits import MAX_REQUEST_SIZE
from nbd_verity.schedule import calibrate as calibrate_module
from nbd_verity.schedule.calibrate import (
    CONFIRM,
    POOL_WINS,
    SIZES,
    calibrate,
    calibrate_apart,
    describe,
)


def digester() -> Digester:
    return Digester("sha256", bytes(range(32)), 1)


def wins(figures) -> list[bool]:
    return [pool <= POOL_WINS * inline for _, inline, pool in figures]


def test_the_choice_follows_the_figures():
    check_choice(calibrate(digester(), 4096, 2))


def check_choice(c) -> None:
    sizes = [s for s, _, _ in c.figures]
    assert sizes == list(SIZES[:len(sizes)])
    won = wins(c.figures)
    streaks = [all(won[i:i + CONFIRM]) for i in range(len(won) - CONFIRM + 1)]
    if c.outcome == "crossover":  # the first CONFIRM wins in a row (or a win at 8 MiB)
        first = next((i for i, ok in enumerate(streaks) if ok), len(won) - 1)
        assert all(won[first:]) and not any(streaks[:first])
        assert c.threshold == sizes[first] // 2
        assert f"inline up to {c.threshold >> 10} KiB" in describe(c.as_dict())
    elif c.outcome == "inline wins":
        assert len(c.figures) == len(SIZES) and c.threshold == MAX_REQUEST_SIZE
    else:
        assert c.outcome == "over budget" and c.threshold == FIXED[0]
    assert describe(c.as_dict()).startswith("calibrated at start-up in ")


def test_one_worker_keeps_everything_inline_without_measuring():
    c = calibrate(digester(), 4096, 1)
    assert (c.threshold, c.outcome, c.figures) == (MAX_REQUEST_SIZE, "one worker", ())


def test_an_empty_budget_keeps_the_fixed_table():
    c = calibrate(digester(), 4096, 2, budget=0.0)
    assert (c.threshold, c.outcome) == (FIXED[0], "over budget")
    assert "fixed table is kept" in describe(c.as_dict())


def test_format_0_and_small_blocks_calibrate_too():
    c = calibrate(Digester("sha256", b"salt", 0), 512, 2)
    assert c.outcome in ("crossover", "inline wins", "over budget")


def tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def children() -> str:
    with open(f"/proc/self/task/{os.getpid()}/children") as f:
        return f.read().strip()


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped children only
    return usage.ru_utime + usage.ru_stime


def settled_tasks() -> set[str]:
    """tasks() once no thread is still leaving: an earlier test's joined threads run their
    OS thread's exit (thread-local destructors: OpenSSL's) after join() has returned."""
    now = tasks()
    for _ in range(100):
        time.sleep(0.01)
        now, before = tasks(), now
        if now == before:
            break
    return now


def test_apart_measures_in_a_child_and_leaves_this_process_as_it_was():
    before, threads, cpu = settled_tasks(), threading.active_count(), children_cpu()
    c = calibrate_apart(digester(), 4096, 2)
    assert c.where == "in a child" and c.as_dict()["where"] == "in a child"
    assert children_cpu() > cpu  # the hashing was a reaped child's CPU time, not ours
    check_choice(c)  # the same rules as in process: the child ran calibrate() itself
    assert c.figures or c.outcome == "over budget"
    # no thread of its pool here, before or after, and the child reaped
    assert tasks() == before and threading.active_count() == threads
    assert children() == ""


def test_apart_with_one_worker_measures_nothing_anywhere():
    c = calibrate_apart(digester(), 4096, 1)
    assert (c.outcome, c.where, c.figures) == ("one worker", "in process", ())


def test_a_child_that_does_not_answer_in_time_is_killed_and_measured_here(monkeypatch):
    monkeypatch.setattr(calibrate_module, "CHILD_WAIT_S", 0.0)  # no time to answer
    c = calibrate_apart(digester(), 4096, 2)
    assert c.where == "in process"
    check_choice(c)
    assert children() == ""  # killed and reaped, not left behind

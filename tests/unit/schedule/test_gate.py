"""The class gate (schedule/gate.py) with real threads: a request of a worse class waits while
a better one is busy, runs once it has been quiet, never waits longer than the bound, and
nothing waits or is counted when there is nothing to rank."""

from __future__ import annotations

import threading
import time

from nbd_verity.schedule.gate import ClassGate

NONE, RT, BE, IDLE = range(4)


def timed_enter(gate: ClassGate, io_class: int, out: list) -> threading.Thread:
    """Enter on a thread of its own; out gets (seconds waited, must leave)."""
    def run():
        started = time.monotonic()
        marked = gate.enter(io_class)
        out.append((time.monotonic() - started, marked))
        if marked:
            gate.leave(io_class)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_idle_waits_while_be_is_in_flight_and_runs_after_the_quiet_time():
    gate = ClassGate(quiet_s=0.05, wait_s=10)
    gate.opened(BE)
    gate.opened(IDLE)
    assert gate.enter(BE) is True  # an idle connection is open: be is watched
    out: list = []
    thread = timed_enter(gate, IDLE, out)
    time.sleep(0.3)
    assert out == []  # still waiting: be is in flight
    gate.leave(BE)
    thread.join(5)
    waited, marked = out[0]
    assert 0.3 + 0.05 <= waited < 2, waited  # the be request, then the quiet time
    assert marked is False  # nothing worse than idle watches it
    assert gate.snapshot()["idle"] == {"connections": 1, "waited": 1, "aged": 0,
                                       "waited_s": round(gate.waited_s[2], 3)}


def test_no_request_waits_longer_than_the_bound():
    gate = ClassGate(quiet_s=0.05, wait_s=0.4)
    gate.opened(RT)
    gate.opened(BE)
    assert gate.enter(RT) is True  # never leaves: a constant rt load
    out: list = []
    timed_enter(gate, BE, out).join(5)
    waited, marked = out[0]
    assert 0.4 <= waited < 1.5, waited
    assert marked is False  # no idle connection watches be
    assert gate.aged[1] == 1 and gate.waits[1] == 1


def test_rt_never_waits_and_idle_waits_for_be_as_for_rt():
    gate = ClassGate(quiet_s=0.05, wait_s=10)
    for c in (RT, BE, IDLE):
        gate.opened(c)
    assert gate.enter(IDLE) is False  # idle in flight holds nobody back
    assert gate.enter(BE) is True  # be in flight: watched by the idle connection
    started = time.monotonic()
    assert gate.enter(RT) is True  # rt does not wait for be or idle in flight
    assert time.monotonic() - started < 1  # a wait would last until wait_s, 10 s
    gate.leave(RT)
    out: list = []
    thread = timed_enter(gate, IDLE, out)
    time.sleep(0.2)
    assert out == []  # be still in flight
    gate.leave(BE)
    thread.join(5)
    assert 0.2 <= out[0][0] < 2
    assert gate.waits == [0, 0, 1]


def test_be_waits_for_rt_even_with_its_none_twin():
    """none and be share a rank: neither waits for the other; both wait for rt."""
    gate = ClassGate(quiet_s=0.05, wait_s=10)
    for c in (RT, NONE, BE):
        gate.opened(c)
    assert gate.enter(NONE) is False  # nothing worse is open: not watched
    started = time.monotonic()
    assert gate.enter(BE) is False
    # none in flight holds be back not at all (a wait would last until wait_s, 10 s)
    assert time.monotonic() - started < 1 and gate.waits[1] == 0
    assert gate.enter(RT) is True
    out: list = []
    thread = timed_enter(gate, NONE, out)
    time.sleep(0.2)
    assert out == []
    gate.leave(RT)
    thread.join(5)
    assert out[0][0] >= 0.2


def test_nothing_waits_without_a_better_connection():
    gate = ClassGate(quiet_s=10, wait_s=10)
    gate.opened(IDLE)
    started = time.monotonic()
    for _ in range(1000):
        assert gate.enter(IDLE) is False
    assert time.monotonic() - started < 1
    assert gate.waits == [0, 0, 0]


def test_a_better_connection_that_closes_lets_the_waiters_go():
    gate = ClassGate(quiet_s=0.05, wait_s=10)
    gate.opened(BE)
    gate.opened(IDLE)
    assert gate.enter(BE) is True
    out: list = []
    thread = timed_enter(gate, IDLE, out)
    time.sleep(0.2)
    gate.leave(BE)
    gate.closed(BE)  # no be connection left: the quiet time does not matter
    thread.join(5)
    assert 0.2 <= out[0][0] < 2


def test_switched_off_counts_nothing_and_never_waits():
    gate = ClassGate(quiet_s=10, wait_s=10, enabled=False)
    gate.opened(RT)
    gate.opened(IDLE)
    assert gate.enter(RT) is False  # not counted: no leave owed
    started = time.monotonic()
    assert gate.enter(IDLE) is False
    assert time.monotonic() - started < 1
    assert gate.snapshot()["rt"]["connections"] == 0


def test_ranked_only_while_two_ranks_are_open_and_enter_is_a_no_op_otherwise():
    """plugin.pread skips the gate while `ranked` is False: with connections of one rank
    open (or none), enter() must do nothing then, for every class."""
    gate = ClassGate(quiet_s=10, wait_s=10)  # a wait would show: the quiet time is 10 s
    assert gate.ranked is False
    for io_class in (NONE, RT, BE, IDLE):
        gate.opened(io_class)
        gate.opened(io_class)
        assert gate.ranked is False
        started = time.monotonic()
        assert gate.enter(io_class) is False
        assert time.monotonic() - started < 1
        gate.closed(io_class)
        gate.closed(io_class)
    gate.opened(NONE)
    gate.opened(BE)  # none and be are one rank
    assert gate.ranked is False
    gate.opened(IDLE)
    assert gate.ranked is True
    gate.closed(BE)
    assert gate.ranked is True  # none is still open beside idle
    gate.closed(NONE)
    assert gate.ranked is False
    gate.opened(RT)
    assert gate.ranked is True
    gate.closed(IDLE)
    gate.closed(RT)
    assert gate.ranked is False


def test_a_disabled_gate_is_never_ranked():
    gate = ClassGate(enabled=False)
    gate.opened(RT)
    gate.opened(IDLE)
    assert gate.ranked is False

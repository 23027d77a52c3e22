"""The verification pool's queue: rt before be before idle, oldest first within a class,
and no chunk waits for ever (it rises a class every AGE_S); real threads, a real pool."""

from __future__ import annotations

import os
import threading
import time

from nbd_verity.ioclass import CLASSES
from nbd_verity.schedule import priority
from nbd_verity.schedule.gate import ClassGate
from nbd_verity.schedule.pool import AGE_S, ClassPool

NONE, RT, BE, IDLE = range(4)


def held(pool: ClassPool) -> threading.Event:
    """Every worker of pool busy until the returned event is set."""
    release = threading.Event()
    started = threading.Barrier(pool.workers + 1)

    def hold():
        started.wait()
        release.wait(30)

    for _ in range(pool.workers):
        pool.submit(BE, hold)
    started.wait(10)
    return release


def test_queued_chunks_run_rt_first_idle_last():
    pool = ClassPool(1)
    try:
        release = held(pool)
        order: list[str] = []
        futures = [pool.submit(c, order.append, f"{CLASSES[c]}{i}")
                   for i, c in enumerate((IDLE, BE, RT, NONE, IDLE, RT, BE))]
        assert pool.idle_workers() < 0  # busy, and more promised than there are workers
        release.set()
        for future in futures:
            future.result(10)
        assert order == ["rt2", "rt5", "be1", "none3", "be6", "idle0", "idle4"]
    finally:
        pool.shutdown()


def test_a_waiting_idle_chunk_rises_above_newer_rt_ones():
    """After 3 x AGE_S in the queue an idle chunk goes before an rt chunk queued later."""
    pool = ClassPool(1)
    try:
        release = held(pool)
        order: list[str] = []
        old = pool.submit(IDLE, order.append, "idle-old")
        time.sleep(3.5 * AGE_S)
        new = [pool.submit(RT, order.append, f"rt{i}") for i in range(3)]
        release.set()
        for future in (old, *new):
            future.result(10)
        assert order[0] == "idle-old", order
    finally:
        pool.shutdown()


def test_an_error_reaches_the_caller_and_the_worker_goes_on():
    pool = ClassPool(2)
    try:
        def fail():
            raise ValueError("chunk failed")
        future = pool.submit(BE, fail)
        try:
            future.result(10)
        except ValueError as e:
            assert str(e) == "chunk failed"
        else:
            raise AssertionError("no error")
        assert pool.submit(RT, lambda: 7).result(10) == 7
    finally:
        pool.shutdown()


def test_workers_take_each_chunks_class_priority():
    """Where this process may raise a thread's priority (root here), a worker runs an
    idle chunk at nice 19, an rt chunk at -10, a be chunk at 0."""
    assert priority.may_raise(), "the tests run as root"
    pool = ClassPool(1)
    try:
        def nice():
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert [pool.submit(c, nice).result(10) for c in (IDLE, RT, BE, NONE)] == \
            [19, -10, 0, 0]
    finally:
        pool.shutdown()


def test_workers_lower_idle_only_while_the_followed_gate_has_another_rank_open():
    """A server's pool follows its class gate: an idle chunk runs at nice 0 while only
    idle connections are open, at 19 while a be one is open too, at 0 again after."""
    gate = ClassGate()
    pool = ClassPool(1)

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    priority.follow(gate)
    try:
        gate.opened(IDLE)
        alone = pool.submit(IDLE, nice).result(10)
        gate.opened(BE)
        beside = pool.submit(IDLE, nice).result(10)
        gate.closed(BE)
        after = pool.submit(IDLE, nice).result(10)
        assert (alone, beside, after) == (0, 19, 0)
        assert pool.submit(RT, nice).result(10) == -10  # rt alone: raised all the same
    finally:
        priority.follow(None)
        pool.shutdown()


def test_claim_takes_the_pool_only_while_cores_are_spare():
    """With 2 workers one pool-sized request at a time takes the pool; a second at the
    same time is verified inline, and takes it once the first is released; with every
    worker busy none takes it."""
    pool = ClassPool(2)
    try:
        assert pool.claim(1) is True
        assert pool.claim(2) is False
        pool.release(1)
        pool.release(2)
        assert pool.claim(3) is True
        pool.release(3)
        release = held(pool)
        assert pool.claim(4) is False
        pool.release(4)
        release.set()
    finally:
        pool.shutdown()


def test_a_request_whose_chunks_the_pool_stops_taking_waits_for_those_it_took():
    """A pool that stops (shutdown) between one request's chunks refuses the rest; the
    request fails, but only once the chunks already queued have ended: they write into
    its buffer, which nbdkit reuses once the request has returned."""
    from nbd_verity.schedule.dispatch import Dispatcher

    class Stopping(ClassPool):
        """Takes two chunks, then refuses as a stopping pool does."""

        def submit(self, io_class, fn, *args):
            self.taken = getattr(self, "taken", 0) + 1
            if self.taken > 2:
                raise RuntimeError("the verification pool is stopping")
            return super().submit(io_class, fn, *args)

    ended: list[int] = []

    def read(view, offset):
        time.sleep(0.05)
        ended.append(offset)

    pool = Stopping(2)
    d = Dispatcher(read, 4096, (0,) * 4, workers=2, shared_pool=lambda: pool,
                   pinned=frozenset(range(4)))
    try:
        buf = memoryview(bytearray(2 << 20))
        try:
            d.read(buf, 0, BE)
        except RuntimeError as e:
            assert "stopping" in str(e)
        else:
            raise AssertionError("the request did not fail")
        assert sorted(ended) == [0, d.chunk_size]  # both taken chunks had ended
    finally:
        pool.shutdown(wait=True)

"""The verification pool: queued chunks run in the order they came, errors reach their
caller, claim() takes the pool only while cores are spare; real threads, a real pool."""

from __future__ import annotations

import threading
import time

from nbd_verity.schedule.pool import LOAD_FRESH_S, LOAD_S, ClassPool

BE = 2  # an I/O class (ioclass.CLASSES)


def held(pool: ClassPool) -> threading.Event:
    """Every worker of pool busy until the returned event is set."""
    release = threading.Event()
    started = threading.Barrier(pool.workers + 1)

    def hold():
        started.wait()
        release.wait(30)

    for _ in range(pool.workers):
        pool.submit(hold)
    started.wait(10)
    return release


def test_queued_chunks_run_in_the_order_they_came():
    pool = ClassPool(1)
    try:
        release = held(pool)
        order: list[int] = []
        futures = [pool.submit(order.append, i) for i in range(7)]
        assert pool.idle_workers() < 0  # busy, and more promised than there are workers
        release.set()
        for future in futures:
            future.result(10)
        assert order == list(range(7))
    finally:
        pool.shutdown()


def test_an_error_reaches_the_caller_and_the_worker_goes_on():
    pool = ClassPool(2)
    try:
        def fail():
            raise ValueError("chunk failed")
        future = pool.submit(fail)
        try:
            future.result(10)
        except ValueError as e:
            assert str(e) == "chunk failed"
        else:
            raise AssertionError("no error")
        assert pool.submit(lambda: 7).result(10) == 7
    finally:
        pool.shutdown()


def test_take_gives_the_pool_while_few_clients_send_and_a_worker_is_free():
    """With 2 workers the pool takes one client's requests; a second client sending
    within LOAD_S makes the load two, and both are verified inline until the second has
    been quiet for LOAD_S; with every worker busy the pool takes none."""
    pool = ClassPool(2)
    try:
        assert pool.take(1, 10.0) is True
        assert pool.take(1, 10.001) is True
        assert pool.take(2, 10.002) is False  # a new client: counted at once
        assert pool.take(1, 10.003) is False  # within LOAD_FRESH_S: the same count
        assert pool.take(1, 10.002 + LOAD_FRESH_S) is False  # counted again: still two
        later = 10.002 + LOAD_S + LOAD_FRESH_S
        assert pool.take(1, later) is True  # client 2 quiet for LOAD_S: one client
        assert pool.take(2, later + 0.001) is False  # client 2 back: two again
        assert pool.take(1, later + 0.002 + LOAD_S) is True  # quiet again: one
        release = held(pool)
        assert pool.take(1, later + 1.0) is False  # one client, but no worker free
        release.set()
    finally:
        pool.shutdown()


def test_a_request_whose_chunks_the_pool_stops_taking_waits_for_those_it_took():
    """A pool that stops (shutdown) between one request's chunks refuses the rest; the
    request fails, but only once the chunks already queued have ended: they write into
    its buffer, which nbdkit reuses once the request has returned."""
    from nbd_verity.schedule.dispatch import Client, Dispatcher

    class Stopping(ClassPool):
        """Takes two chunks, then refuses as a stopping pool does."""

        def submit(self, fn, *args):
            self.taken = getattr(self, "taken", 0) + 1
            if self.taken > 2:
                raise RuntimeError("the verification pool is stopping")
            return super().submit(fn, *args)

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
            d.read(buf, 0, Client(BE))
        except RuntimeError as e:
            assert "stopping" in str(e)
        else:
            raise AssertionError("the request did not fail")
        assert sorted(ended) == [0, d.chunk_size]  # both taken chunks had ended
    finally:
        pool.shutdown(wait=True)

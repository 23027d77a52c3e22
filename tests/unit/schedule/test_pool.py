"""The verification pool: queued chunks run in the order they came, errors reach their
caller, claim() takes the pool only while cores are spare; real threads, a real pool."""

from __future__ import annotations

import threading
import time

from nbd_verity.schedule.pool import ClassPool

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

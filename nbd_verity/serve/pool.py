"""The verification pool: workers that take queued chunks in class order, not first come.

A chunk is queued with its request's I/O class; a free worker takes the oldest chunk of
the best class: rt, then be and none, then idle, as the block layer's schedulers serve
them. So that no chunk waits for ever behind a constant stream of better ones, a queued
chunk rises one class for every AGE_S it has waited: after 3 x AGE_S (150 ms) nothing
queued later can go before it, and it waits at most that long plus the chunks the
workers already hold (each a few hundred microseconds: POOL_CHUNK_SIZE of hashing).
A worker runs each chunk at its class's CPU priority (serve/priority.py) where this
process may raise a thread's priority again (CAP_SYS_NICE): a worker lowered for an
idle chunk must come back for the next rt one; without the privilege the workers stay
at the server's own priority and only the queue order ranks the classes.

The lock guards the queues, the busy count and the stop flag; it is never held while a
chunk is verified. demand() counts under a lock of its own and reads the idle workers
unlocked (a hint): a request that took the workers' lock to ask waited behind them
(measured in process, one client's 2 MiB requests of no-op chunks: 7-10 µs more per
request than the same requests not asking, 5 µs with the lock of its own).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future

from . import priority

AGE_S = 0.05  # a queued chunk rises one class for every AGE_S it waits
RANK = (1, 0, 1, 2)  # queue of each class (none, rt, be, idle): rt, then be/none, then idle


class ClassPool:
    """A fixed set of worker threads, made at the first submit (after nbdkit's fork)."""

    def __init__(self, workers: int, name: str = "verify") -> None:
        self.workers = workers
        self.name = name
        self._queues: list[deque] = [deque(), deque(), deque()]  # by rank
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._demand = 0  # pool-sized requests being served now (demand())
        self._demand_lock = threading.Lock()  # ... counted under this lock
        self._stopping = False
        self._prioritise: bool | None = None  # may workers change class (probed once)

    def submit(self, io_class: int, fn, *args) -> Future:
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the verification pool is stopping")
            if not self._threads:
                self._start()
            self._queues[RANK[io_class]].append((time.monotonic(), io_class, future, fn,
                                                 args))
            self._cond.notify()
        return future

    def idle_workers(self) -> int:
        """Workers neither busy nor promised to a queued chunk (a hint, unlocked)."""
        return self.workers - self._busy - sum(len(q) for q in self._queues)

    @contextlib.contextmanager
    def demand(self):
        """Count a pool-sized request for as long as it is served (either path), server
        wide; yields whether it should take the pool: only while such requests are at
        most half the workers (each then still gets two cores) and a worker is free."""
        with self._demand_lock:  # not the workers' lock: they hold it at every chunk
            self._demand += 1
            demand = self._demand
        try:
            yield demand <= max(1, self.workers // 2) and self.idle_workers() > 0
        finally:
            with self._demand_lock:
                self._demand -= 1

    def _start(self) -> None:
        self._prioritise = priority.enabled() and priority.may_raise()
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _take(self):
        """The chunk to run next (under the lock): the best class after aging, the older
        of two equal ones; None when every queue is empty."""
        now = time.monotonic()
        best, best_rank = None, None
        for rank, queue in enumerate(self._queues):
            if queue:
                effective = rank - int((now - queue[0][0]) / AGE_S)
                if best is None or effective < best_rank:
                    best, best_rank = queue, effective
        return best.popleft() if best is not None else None

    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._take()
                while task is None and not self._stopping:
                    self._cond.wait()
                    task = self._take()
                if task is None:
                    return
                self._busy += 1
            _, io_class, future, fn, args = task
            try:
                if future.set_running_or_notify_cancel():
                    if self._prioritise:
                        priority.apply(io_class)
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:
                        future.set_exception(e)
            finally:
                with self._cond:
                    self._busy -= 1

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the workers."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

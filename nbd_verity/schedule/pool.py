"""The verification pool: workers that take queued chunks in class order, not first come.

A chunk is queued with its request's I/O class; a free worker takes the oldest chunk of
the best class: rt, then be and none, then idle, as the block layer's schedulers serve
them. So that no chunk waits for ever behind a constant stream of better ones, a queued
chunk rises one class for every AGE_S it has waited: after 3 x AGE_S (150 ms) nothing
queued later can go before it, and it waits at most that long plus the chunks the
workers already hold (each a few hundred microseconds: POOL_CHUNK_SIZE of hashing).
A worker runs each chunk at its class's CPU priority (schedule/priority.py) where this
process may raise a thread's priority again (CAP_SYS_NICE): a worker lowered for an
idle chunk must come back for the next rt one; without the privilege the workers stay
at the server's own priority and only the queue order ranks the classes.

Workers wait on a queue of tokens, one put per queued chunk (and one None per worker to
stop), as concurrent.futures' workers wait on theirs, and take the best chunk from the
class queues (deques: their appends and pops need no lock); a worker marks its own slot
busy. A condition variable over the queues instead, which every submit took and
notified and every worker woke on, served one client's 2 MiB reads on the pool at 0.977
(quartiles 0.960-0.987) of the baseline's ThreadPoolExecutor; the tokens, 0.992
(0.982-1.008) (32 pairs of fresh processes each, bench/ab.py). The lock guards only the
start and the stop flag (a submit racing shutdown). claim() counts the requests in a
set (its add, len and discard are each one step under the GIL: no lock) and reads the
idle workers unlocked (a hint): when it asked under the lock the workers then took at
every chunk, a request waited behind them (measured in process, one client's 2 MiB
requests of no-op chunks: 7-10 µs more per request than the same requests not asking,
5 µs with a lock of its own; in the server, a context manager with a lock of its own
took 7.2-7.5 µs of each 2 MiB request, timed around it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

from ..ioclass import RANK
from . import priority

AGE_S = 0.05  # a queued chunk rises one class for every AGE_S it waits


class ClassPool:
    """A fixed set of worker threads, made at the first submit (after nbdkit's fork)."""

    def __init__(self, workers: int, name: str = "verify") -> None:
        self.workers = workers
        self.name = name
        self._queues: list[deque] = [deque(), deque(), deque()]  # by rank
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()  # one per chunk; None: stop
        self._lock = threading.Lock()  # the start and the stop flag
        self._threads: list[threading.Thread] = []
        self._busy = [0] * workers  # per worker, its own: 1 while it runs a chunk
        self._demand: set = set()  # the pool-sized requests being served now (claim())
        self._half = max(1, workers // 2)  # ... while at most this many, the pool pays
        self._stopping = False
        self._prioritise: bool | None = None  # may workers change class (probed once)

    def submit(self, io_class: int, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:  # a C lock no worker takes: not a chunk after shutdown's tokens
            if self._stopping:
                raise RuntimeError("the verification pool is stopping")
            if not self._threads:
                self._start()
            self._queues[RANK[io_class]].append((time.monotonic(), io_class, future, fn,
                                                 args))
            self._tokens.put(True)
        return future

    def idle_workers(self) -> int:
        """Workers neither busy nor promised to a queued chunk (a hint, unlocked)."""
        return self.workers - sum(self._busy) - sum(map(len, self._queues))

    def claim(self, request: int) -> bool:
        """Count a pool-sized request (a key no other one being served has: its buffer's
        id) until release(request), whichever path serves it; whether it should take the
        pool: only while such requests are at most half the workers (each then still gets
        two cores) and a worker is free."""
        demand = self._demand
        demand.add(request)
        return len(demand) <= self._half and self.idle_workers() > 0

    def release(self, request: int) -> None:
        """The end of a request claim() counted."""
        self._demand.discard(request)

    def _start(self) -> None:
        self._prioritise = priority.enabled() and priority.may_raise()
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, args=(i,), name=f"{self.name}-{i}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _take(self):
        """The chunk to run next, for a worker that holds a token (so one is queued, if
        another worker may take it first: then look again): the best class after aging,
        the older of two equal ones."""
        while True:
            now = time.monotonic()
            best, best_rank = None, None
            for rank, chunks in enumerate(self._queues):
                try:
                    queued = chunks[0][0]
                except IndexError:
                    continue
                effective = rank - int((now - queued) / AGE_S)
                if best is None or effective < best_rank:
                    best, best_rank = chunks, effective
            if best is not None:
                try:
                    return best.popleft()
                except IndexError:
                    pass

    def _work(self, slot: int) -> None:
        tokens, busy = self._tokens, self._busy
        while True:
            if tokens.get() is None:
                return
            busy[slot] = 1
            try:
                _, io_class, future, fn, args = self._take()
                if future.set_running_or_notify_cancel():
                    if self._prioritise:
                        priority.apply(io_class)
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:
                        future.set_exception(e)
            finally:
                busy[slot] = 0

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued (its tokens come first), then stop the workers."""
        with self._lock:
            self._stopping = True
            threads = list(self._threads)
        for _ in threads:
            self._tokens.put(None)
        if wait:
            for thread in threads:
                thread.join()

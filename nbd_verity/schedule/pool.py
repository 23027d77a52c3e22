"""The verification pool: a fixed set of workers that verify queued chunks in the order
they came.

A request sent to the pool is split into chunks (dispatch.py), each queued and taken by
the first free worker; the request completes when every chunk has. Classes are ranked
before a request starts, by the class gate (gate.py), which is what every QoS bar needs;
the pool's own class order and per-class nice values met no bar the gate alone did not
(docs/decisions/priority.md), so workers take chunks first come, first served.
Locking: workers wait on a queue of tokens, one put per queued chunk (and one None per
worker to stop), as concurrent.futures' workers wait on theirs, and pop the chunk from a
deque (its appends and pops need no lock); a worker marks its own slot busy. The lock
guards only the start and the stop flag (a submit racing shutdown). claim() counts the
requests in a set (its add, len and discard are each one step under the GIL) and reads
the idle workers unlocked (a hint).
Why tokens and a lock-free claim, with the figures: docs/decisions/pool.md.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future


class ClassPool:
    """A fixed set of worker threads, made at the first submit (after nbdkit's fork)."""

    def __init__(self, workers: int, name: str = "verify") -> None:
        self.workers = workers
        self.name = name
        self._queue: deque = deque()  # (future, fn, args), oldest first
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()  # one per chunk; None: stop
        self._lock = threading.Lock()  # the start and the stop flag
        self._threads: list[threading.Thread] = []
        self._busy = [0] * workers  # per worker, its own: 1 while it runs a chunk
        self._demand: set = set()  # the pool-sized requests being served now (claim())
        self._half = max(1, workers // 2)  # ... while at most this many, the pool pays
        self._stopping = False

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:  # a C lock no worker takes: not a chunk after shutdown's tokens
            if self._stopping:
                raise RuntimeError("the verification pool is stopping")
            if not self._threads:
                self._start()
            self._queue.append((future, fn, args))
            self._tokens.put(True)
        return future

    def idle_workers(self) -> int:
        """Workers neither busy nor promised to a queued chunk (a hint, unlocked)."""
        return self.workers - sum(self._busy) - len(self._queue)

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
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, args=(i,), name=f"{self.name}-{i}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self, slot: int) -> None:
        tokens, busy, chunks = self._tokens, self._busy, self._queue
        while True:
            if tokens.get() is None:
                return
            busy[slot] = 1
            try:
                future, fn, args = chunks.popleft()  # a token: one is queued for it
                if future.set_running_or_notify_cancel():
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

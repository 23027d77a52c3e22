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
guards only the start and the stop flag (a submit racing shutdown). take() keeps each
client's last time in a dict (a store, a copy and a pop are each one step under the
GIL) and reads the idle workers unlocked (a hint).
Why tokens and a lock-free take(), with the figures: docs/decisions/pool.md.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from concurrent.futures import Future

LOAD_S = 0.25  # the load: clients that sent a pool-sized request within this many seconds
LOAD_FRESH_S = 0.01  # ... counted again this long after the last count (a new client: now)


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
        self._recent: dict = {}  # client -> when it last sent a pool-sized request (take())
        self._count = (float("-inf"), 0)  # (when counted, clients within load_s then)
        self.load_s = LOAD_S
        # the pool pays while its clients are at most half the workers that can run at once
        self._half = max(1, min(workers, len(os.sched_getaffinity(0))) // 2)
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

    def take(self, client: int, now: float) -> bool:
        """Whether a pool-sized request of client (a key: its connection's id) at now
        (perf_counter) should take the pool: only while the clients that sent such requests
        within LOAD_S, this one included, are at most half the workers that can run at
        once (each then still gets two cores), and a worker is free. The count is redone
        LOAD_FRESH_S after the last, or at once for a client not in it."""
        recent = self._recent
        new = client not in recent
        recent[client] = now
        when, clients = self._count
        if new or not 0 <= now - when < LOAD_FRESH_S:
            cutoff = now - self.load_s
            for key, last in list(recent.items()):  # a copy: others store meanwhile
                if last < cutoff:
                    recent.pop(key, None)
            clients = len(recent)
            self._count = (now, clients)  # one assignment: a reader sees both or neither
        return clients <= self._half and self.idle_workers() > 0

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

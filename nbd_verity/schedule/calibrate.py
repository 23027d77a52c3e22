"""The default threshold table, measured at start-up: where inline stops paying here.

A request up to its class's threshold is verified inline, on the nbdkit thread; a larger
one is split across the pool (dispatch.py). The pool wins once the hashing it spreads
over the cores saves more than its hand-off costs, and both depend on the machine: the
cores, the hash engine (SHA-NI or not), the load. So the `default` preset is not a
constant: when the server starts (nbdkit's after_fork, once the pool may have threads)
it times the same Dispatcher both ways, on an in-memory run of zero blocks checked by
the server's own digester, at 64 KiB, 128 KiB, ... 8 MiB, each size alternately inline
and pooled, REPEATS times, keeping the fastest of each (the least disturbed by other
work). The crossover is the first size at which the pool takes at most POOL_WINS of
inline's time, there and at the next size too (CONFIRM: near the crossover the two are
close, and one lucky size moved a single-size rule between 256 KiB and 2 MiB from one
start to the next on a quiet machine); every class's threshold is the size below it.
No crossover up to 8 MiB (one
core, or a pool of one) keeps every request inline (the maximum, 32 MiB).

It is bounded: it stops at the crossover, and gives up after BUDGET_S, keeping the fixed
table (table.FIXED) and saying so. What it measured is in `ctl stats` and `ctl
thresholds` (calibration), so a user can see why the table is what it is; explicit
thresholds (--threshold) always win over it, and the presets `fixed`, `seed` and
`kernel` are not calibrated. Reading the image is left out: it costs the same on both
paths per byte, and a start-up read could wait on a disk or a network.

The server measures in a child it forks for the purpose (calibrate_apart), which sends
the result back over a pipe and exits: the serving process itself never runs the
measuring pool. Measured in the serving process, the calibration cost 64 KiB random
reads from eight clients 7% for the process's whole life (B/A 1.073, quartiles
1.026-1.112, 48 pairs of fresh servers, docs/benchmarks.md), and its pool's hashing was
what did it: the same calibration timing inline only left no trace (0.997), one on the
server's own pool, whose threads then lived on, did (0.916). Where the child cannot be
had (fork refused, the child failed or overran CHILD_WAIT_S), it measures in process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
import warnings
from dataclasses import dataclass

from ..control.table import FIXED
from ..ioclass import CLASSES
from ..limits import MAX_REQUEST_SIZE
from .dispatch import Dispatcher

SIZES = tuple((64 << 10) << i for i in range(8))  # 64 KiB .. 8 MiB
REPEATS = 5
POOL_WINS = 0.9  # the pool must take at most this share of inline's time
CONFIRM = 2  # ... at this many sizes in a row (the first of them is the crossover)
BUDGET_S = 0.3
CHILD_WAIT_S = 5.0  # the most the server waits for the forked child's answer


@dataclass(frozen=True)
class Calibration:
    threshold: int  # every class's threshold: the largest request verified inline
    seconds: float  # how long the measuring took
    figures: tuple[tuple[int, float, float], ...]  # (size, inline µs, pool µs), fastest
    outcome: str  # "crossover", "inline wins" (no crossover), "one worker", "over budget"
    where: str = "in process"  # or "in a child": where it was measured (calibrate_apart)

    def as_dict(self) -> dict:
        return {"threshold": self.threshold, "ms": round(self.seconds * 1e3, 1),
                "outcome": self.outcome, "where": self.where,
                "figures": [{"size": s, "inline_us": round(i, 1), "pool_us": round(p, 1)}
                            for s, i, p in self.figures]}


def describe(calibration: dict) -> str:
    """One line for people (Calibration.as_dict's form, as `ctl` receives it)."""
    head = f"calibrated at start-up in {calibration['ms']:.0f} ms: "
    outcome, figures = calibration["outcome"], calibration["figures"]
    if outcome == "one worker":
        return head + "one pool worker, so every request is verified inline"
    if outcome == "over budget":
        return head + f"over its {BUDGET_S:g} s budget, so the fixed table is kept"
    last = next((f for f in figures if f["size"] == 2 * calibration["threshold"]),
                figures[-1])  # the crossover, or the largest size measured
    at = (f"{last['size'] >> 10} KiB (inline {last['inline_us']:.0f} µs, pool "
          f"{last['pool_us']:.0f} µs)")
    if outcome == "inline wins":
        return head + f"the pool did not win up to {at}: every request inline"
    return (head + f"the pool wins from {at}: inline up to "
            f"{calibration['threshold'] >> 10} KiB")


def calibrate(digester, block_size: int, workers: int,
              budget: float = BUDGET_S) -> Calibration:
    """Time inline against pool as the server would run them; see the module docstring."""
    started = time.perf_counter()
    if workers < 2:
        return Calibration(MAX_REQUEST_SIZE, 0.0, (), "one worker")
    largest = SIZES[-1]
    buf = memoryview(bytearray(largest))
    slot = digester.digest(bytes(block_size)).ljust(digester.slot_size, b"\0")
    slots = slot * (largest // block_size)
    verify = digester.verify

    def read(view, offset: int) -> None:
        if verify(view, block_size, slots[offset // block_size * len(slot):]) != -1:
            raise RuntimeError("calibration: a zero block did not match its own digest")

    inline, pooled = (MAX_REQUEST_SIZE,) * len(CLASSES), (0,) * len(CLASSES)
    dispatcher = Dispatcher(read, block_size, inline, workers,  # the table alone decides
                            pinned=frozenset(range(len(CLASSES))))
    dispatcher.start()
    figures: list[tuple[int, float, float]] = []
    try:
        dispatcher.set_table(pooled)
        dispatcher.read(buf[:SIZES[0]], 0, 0)  # the pool's threads start here, untimed
        streak = 0  # sizes in a row at which the pool won
        for size in SIZES:
            best = {inline: float("inf"), pooled: float("inf")}
            for _ in range(REPEATS):
                for table in (inline, pooled):
                    dispatcher.set_table(table)
                    t = time.perf_counter()
                    dispatcher.read(buf[:size], 0, 0)
                    best[table] = min(best[table], time.perf_counter() - t)
                if time.perf_counter() - started > budget:
                    return Calibration(FIXED[0], time.perf_counter() - started,
                                       tuple(figures), "over budget")
            figures.append((size, best[inline] * 1e6, best[pooled] * 1e6))
            streak = streak + 1 if best[pooled] <= POOL_WINS * best[inline] else 0
            if streak == CONFIRM or (streak and size == SIZES[-1]):
                crossover = figures[-streak][0]
                return Calibration(max(block_size, crossover // 2),
                                   time.perf_counter() - started, tuple(figures), "crossover")
    finally:
        dispatcher.stop()
    return Calibration(MAX_REQUEST_SIZE, time.perf_counter() - started, tuple(figures),
                       "inline wins")


def calibrate_apart(digester, block_size: int, workers: int,
                    budget: float = BUDGET_S) -> Calibration:
    """calibrate() in a child forked for it, so that the calling process keeps nothing of
    the measuring (see the module docstring); in process where no child can be had.
    Call it before the process starts threads of its own: the child has only the caller's."""
    if workers < 2:
        return calibrate(digester, block_size, workers, budget)  # nothing to measure
    started = time.perf_counter()
    read_end, write_end = os.pipe()
    try:
        with warnings.catch_warnings():  # 3.12+: a fork beside threads (not ours) warns
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return calibrate(digester, block_size, workers, budget)
    if pid == 0:  # the child: measure, answer, leave without running any exit handler
        status = 1
        try:
            os.close(read_end)
            measured = calibrate(digester, block_size, workers, budget)
            answer = json.dumps([measured.threshold, measured.seconds,
                                 measured.figures, measured.outcome]).encode()
            while answer:
                answer = answer[os.write(write_end, answer):]
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    answer = b""
    try:
        answer = _read_until(read_end, time.monotonic() + CHILD_WAIT_S)
    finally:
        os.close(read_end)
        _reap(pid, kill=not answer)
    try:
        threshold, seconds, figures, outcome = json.loads(answer)
        return Calibration(int(threshold), float(seconds),
                           tuple((int(s), float(i), float(p)) for s, i, p in figures),
                           str(outcome), "in a child")
    except (ValueError, TypeError):  # no answer, or a torn one: measure here after all
        spent = time.perf_counter() - started
        return calibrate(digester, block_size, workers, max(0.0, budget - spent))


def _read_until(fd: int, deadline: float) -> bytes:
    """Everything a pipe gives until its end or the deadline (b"" then)."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int, kill: bool) -> None:
    """Wait for the child (that answered, so is leaving), or kill it first (that did not)."""
    try:
        if kill:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):  # reaped already (SIGCHLD ignored)
        pass

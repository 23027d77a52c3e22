"""Where releasing the GIL pays in nbd_verity._native: runs of N blocks, T threads.

Each thread loops over "a request": some Python work (the bookkeeping a request costs in
the server, about PY_US microseconds) and one native verify() of a run of N 4 KiB blocks,
with the GIL released for every run (release_size 0) or never (release_size huge). The
figure is hashed MB/s summed over the threads, best of REPEAT; the threshold is the
smallest run for which releasing wins at every thread count above one.
Usage: python bench/native_gil.py [SECONDS_PER_POINT]  (default 1.0)
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbd_verity.digest import Digester  # noqa: E402

BLOCK = 4096
RUNS = (1, 2, 4, 8, 16, 32, 64)
THREADS = (1, 2, 4, 8)
PY_US = 10  # Python work per request, microseconds (hotpath.py: inline bookkeeping)
REPEAT = 3
NEVER = 1 << 62


def _python_work(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def point(blocks: int, threads: int, release: bool, seconds: float) -> float:
    """MB/s hashed by `threads` threads verifying runs of `blocks` blocks."""
    digester = Digester("sha256", os.urandom(32), 1)
    hasher = digester.native
    hasher.release_size = 0 if release else NEVER
    data = os.urandom(blocks * BLOCK)
    want = hasher.slots(data, BLOCK)
    done = [0] * threads
    stop = threading.Event()

    def loop(k: int) -> None:
        verify, n = hasher.verify, 0
        while not stop.is_set():
            _python_work(PY_US)
            if verify(data, BLOCK, want) != -1:
                raise AssertionError("mismatch")
            n += 1
        done[k] = n

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(seconds)  # the measurement window itself, not a readiness barrier
    stop.set()
    for w in workers:
        w.join()
    return sum(done) * blocks * BLOCK / (time.perf_counter() - started) / 1e6


def main(argv: list[str]) -> int:
    seconds = float(argv[0]) if argv else 1.0
    if Digester("sha256", b"", 1).native is None:
        print("native engine not available", file=sys.stderr)
        return 1
    print(f"runs of N x 4 KiB, sha256, {PY_US} us of Python per request; MB/s "
          f"min/median/max of {REPEAT} (held -> released)")
    print("| blocks | " + " | ".join(f"{t} threads held | {t} released" for t in THREADS) + " |")
    print("|---" * (1 + 2 * len(THREADS)) + "|")
    for blocks in RUNS:
        cells = []
        for threads in THREADS:
            for release in (False, True):
                xs = sorted(point(blocks, threads, release, seconds) for _ in range(REPEAT))
                cells.append(f"{xs[0]:.0f}/{statistics.median(xs):.0f}/{xs[-1]:.0f}")
        print(f"| {blocks} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Bounded logs: at most `log-rate` lines a minute, then one summary line a minute.

Two kinds of line reach the server's stderr on a failing request: ours (`nbd-verity: data
block N is corrupted`, `... truncated`), written by nbd_verity.log, and nbdkit's own, which
nbdkit 1.32 writes for every failed callback (`nbdkit: python.3: error: plugin.py: pread:
error: MESSAGE`, plugins/python/errors.c) and which no plugin API can silence, or
`write reply: ...: Broken pipe` for each request of a client that left with requests in
flight. Both count against one RateLimit of `lines` per 60 s window; what it holds back
is counted and, when the window closes, summarised in one line that also says how many
corruptions and failed reads the window saw (the summary itself is never held back).

Our lines are limited where they are written (synchronously: a line is out before the
request's reply). nbdkit's are limited by a filter on file descriptor 2, installed in
after_fork (BoundedLog below): fd 2 becomes a pipe whose reader thread passes every other
line through unchanged. The pipe's write end is non-blocking
because nbdkit writes to stderr while it holds the GIL (check_python_failure): a blocking
write on a full pipe would deadlock against the reader, which needs the GIL; with 1 MiB of
pipe a line is dropped only if the reader is that far behind. cleanup() puts the real
stderr back, and the reader drains the pipe and writes the last summary before it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable

WINDOW_S = 60.0
DEFAULT_LOG_RATE = 120  # lines a minute: room for the kernel's 100 corruption lines
STDERR_PIPE_SIZE = 1 << 20  # the pipe that stands in for fd 2 (see above)
MAX_LOG_LINE = 8192  # longer lines are cut (a single line cannot hold the reader's memory)
# nbdkit's error lines: a failed callback ("nbdkit: python[3]: error: SCRIPT: pread: error:
# ...") and a client gone mid-request ("nbdkit: python[4]: error: write reply: ...: Broken
# pipe"), one per request. Its other lines (debug with -v, start-up) are not limited.
NBDKIT_ERROR = re.compile(rb"^nbdkit: (?:[^:]*: )?error: ")
OURS = b"nbd-verity: "


class RateLimit:
    """Lines allowed per window; counts what it refuses. Thread-safe."""

    def __init__(self, lines: int, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lines, self.window_s, self.clock = lines, window_s, clock
        self._lock = threading.Lock()
        self.started = clock()
        self.shown = self.held = 0

    def admit(self) -> bool:
        """Whether one more line may go out in the current window (counts it either way)."""
        with self._lock:
            if self.shown < self.lines:
                self.shown += 1
                return True
            self.held += 1
            return False

    def roll(self) -> tuple[int, float] | None:
        """At the end of a window: start a new one; (lines held back, seconds) or None."""
        with self._lock:
            now = self.clock()
            elapsed = now - self.started
            if elapsed < self.window_s:
                return None
            held = self.held
            self.started, self.shown, self.held = now, 0, 0
            return held, elapsed


class Totals:
    """Monotonic counts of what the summary reports, read as differences per window."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read  # -> (corruptions, failed reads) since start
        self._last = read()

    def delta(self) -> tuple[int, int]:
        now = self._read()
        delta = tuple(max(0, a - b) for a, b in zip(now, self._last, strict=True))
        self._last = now
        return delta


def summary(held: int, seconds: float, corruptions: int, failed: int, rate: int) -> str:
    return (f"nbd-verity: {corruptions} more corruptions, {failed} failed reads in the last "
            f"{seconds:.0f} s; {held} log lines not shown (log-rate={rate} a minute)\n")


class BoundedLog:
    """The limiter, the stderr filter and the summary of one server process."""

    def __init__(self, lines: int, totals: Callable[[], tuple[int, int]]) -> None:
        self.limit = RateLimit(lines)
        self.totals = Totals(totals)
        self.out_fd = 2  # the real stderr; a private duplicate once the filter runs
        self._thread: threading.Thread | None = None
        self._read_fd = -1

    # -- our own lines ------------------------------------------------------------------

    def emit(self, line: str) -> None:
        self._summarise_if_due()
        if self.limit.admit():
            self._write(line.encode(errors="replace"))

    # -- nbdkit's lines -----------------------------------------------------------------

    def start_filter(self) -> None:
        """Put a pipe on fd 2 and start its reader (call after nbdkit forked)."""
        sys.stderr.flush()
        self.out_fd = os.dup(2)
        read_fd, write_fd = os.pipe()
        fcntl.fcntl(write_fd, fcntl.F_SETFL, fcntl.fcntl(write_fd, fcntl.F_GETFL)
                    | os.O_NONBLOCK)
        with contextlib.suppress(OSError):  # F_SETPIPE_SZ may exceed pipe-max-size
            fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, STDERR_PIPE_SIZE)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd = read_fd
        self._thread = threading.Thread(target=self._pump, name="log-filter", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Give fd 2 back to the real stderr; the reader drains the pipe and ends."""
        if self._thread is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self.out_fd, 2)  # closes the pipe's only write end: the reader sees EOF
        self._thread.join(timeout)
        self._thread = None

    def _pump(self) -> None:
        pending, held_line = b"", False
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], 1.0)
            self._summarise_if_due()
            if not ready:
                continue
            chunk = os.read(self._read_fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LOG_LINE:
                lines.append(pending[:MAX_LOG_LINE])
                pending = b""
            for line in lines:
                held_line = self._forward(line[:MAX_LOG_LINE], held_line)
        os.close(self._read_fd)
        if pending:
            self._forward(pending, held_line)
        self._summarise(force=True)

    def _forward(self, line: bytes, held_line: bool) -> bool:
        """Write or hold one line of the pipe; returns whether it was held. A line that
        does not start a message (a traceback's continuation) follows its first line."""
        if NBDKIT_ERROR.match(line) or line.startswith(OURS):
            held = not self.limit.admit()
        elif line.startswith(b"nbdkit: "):
            held = False
        else:
            held = held_line
        if not held:
            self._write(line + b"\n")
        return held

    # -- summaries ----------------------------------------------------------------------

    def _summarise_if_due(self) -> None:
        if self.limit.clock() - self.limit.started >= self.limit.window_s:
            self._summarise()

    def _summarise(self, force: bool = False) -> None:
        if force:
            self.limit.started -= self.limit.window_s  # close the window now
        rolled = self.limit.roll()
        if rolled is None:
            return
        held, seconds = rolled
        corruptions, failed = self.totals.delta()
        if held:
            self._write(summary(held, seconds, corruptions, failed, self.limit.lines).encode())

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            while data:
                data = data[os.write(self.out_fd, data):]


_active: BoundedLog | None = None


def install(lines: int, totals: Callable[[], tuple[int, int]]) -> BoundedLog | None:
    """Bound this process's logs (lines=0: no bound); after nbdkit forked."""
    global _active
    if lines <= 0:
        return None
    _active = BoundedLog(lines, totals)
    _active.start_filter()
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def emit(line: str) -> None:
    """Write one of our lines: through the bound when installed, else to sys.stderr."""
    if _active is not None:
        _active.emit(line)
        return
    sys.stderr.write(line)
    with contextlib.suppress(OSError):
        sys.stderr.flush()

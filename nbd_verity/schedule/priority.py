"""I/O classes as CPU priority: a request's verification runs at a priority that follows its
class, rt before be before idle, as the kernel's block schedulers serve them.

- An nbdkit thread serves one connection for its life, so it takes its connection's class
  at its first request (`apply`, per request a compare in C: _threadstate.set_nice) and
  keeps it. The verification pool's workers take each task's class while they run it,
  and the pool's queue is ordered by class (dispatch.ClassPool).
- NICE per class: rt -10, be and none 0, idle 19. Raising a thread above nice 0 needs
  CAP_SYS_NICE or an RLIMIT_NICE that allows it (the units grant LimitNICE=+0; rt's
  -10 takes a LimitNICE=-10 drop-in, docs/systemd.md): without it rt runs at 0,
  logged once, and still goes first in the pool's queue; lowering works as any user,
  but a thread lowered cannot come back without the same privilege, so unprivileged
  pool workers stay at 0 for every class (queue order still ranks them).
- Alone, idle is not lowered: an idle thread runs at nice 19 only while the server has
  connections of another rank open (the class gate's `ranked`, which follow() hands
  here), and at the server's own (ALONE_NICE) otherwise, as the gate makes nothing wait
  then: at nice 19 an idle load alone gave way to its own clients' processes on a busy
  2-core machine (idle 0.88-1.01 of be's throughput, 4 clients of 2 MiB reads, 8
  probes). Back up to 0 needs the privilege below; without it a thread lowered once
  stays at 19.
- nice 19, not SCHED_IDLE, for idle: a thread holding the GIL when it is preempted must
  run again soon, or every thread waiting for the GIL waits with it (priority
  inversion). A SCHED_IDLE thread may not run at all while other processes keep the
  CPUs busy; at nice 19 it keeps a small share (weight 15 against 1024) and lets go
  within its slices (docs/control.md has what was measured).
- Nice values do not rank the GIL's waiters: whole requests are ranked before they start
  by the class gate (gate.py), which this module's switch turns off too.
"""

from __future__ import annotations

import errno
import os
import threading

from ..ioclass import CLASSES
from ..log import log

NICE = {"none": 0, "rt": -10, "be": 0, "idle": 19}
CLASS_NICE = tuple(NICE[name] for name in CLASSES)  # by class index
ALONE_NICE = tuple(min(0, nice) for nice in CLASS_NICE)  # ... with no other rank open
PRIORITY_ENV = "NBD_VERITY_CLASS_PRIORITY"  # 0: every thread at the server's own nice

try:
    from .._threadstate import set_nice as _set_nice
except ImportError:  # built without a compiler: the same in Python, per thread
    _local = threading.local()

    def _set_nice(nice: int):
        if getattr(_local, "nice", None) == nice:
            return None
        _local.nice = nice
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # Linux: the calling thread
        except OSError as e:
            return e.errno
        return None

_refusal_logged = threading.Event()


def enabled() -> bool:
    return os.environ.get(PRIORITY_ENV, "") not in ("0", "false", "no", "off")


_ranks = None  # the server's class gate (follow()): its `ranked` picks the nice values


def follow(gate) -> None:
    """Lower a class below nice 0 only while the gate has connections of another rank
    open (gate.ranked): a server's, set by the plugin. Without one every class always
    runs at its own (CLASS_NICE)."""
    global _ranks
    _ranks = gate


def nice_of(io_class: int) -> int:
    """io_class's nice value now: CLASS_NICE while the followed gate has two ranks open
    (or no gate is followed), else ALONE_NICE (idle alone runs at the server's own)."""
    ranks = _ranks
    return (CLASS_NICE if ranks is None or ranks.ranked else ALONE_NICE)[io_class]


def apply(io_class: int) -> None:
    """The calling thread at io_class's priority (nothing to do if it already is)."""
    nice = nice_of(io_class)
    refused = _set_nice(nice)
    if refused is not None:
        refusal(io_class, refused, nice)


def setter():
    """For the plugin's per-request path, which calls it with nice_of(io_class)'s value
    (CLASS_NICE or ALONE_NICE, picked inline) and hands a refusal (an errno, not None) to
    refusal(): set_nice itself, one C call (no frame of apply's), or None when class
    priority is off (nothing to set)."""
    return _set_nice if enabled() else None


def refusal(io_class: int, refused: int, nice: int | None = None) -> None:
    """A refused nice value of io_class's: logged once per process."""
    if not _refusal_logged.is_set():
        _refusal_logged.set()
        nice = CLASS_NICE[io_class] if nice is None else nice
        log(f"class {CLASSES[io_class]}: cannot set nice {nice} "
            f"({errno.errorcode.get(refused, refused)}; raising a thread's priority needs "
            f"CAP_SYS_NICE or an RLIMIT_NICE that allows it, systemd's LimitNICE=): it "
            f"keeps the nice it has")


def may_raise() -> bool:
    """Whether this process may raise a thread above nice 0 (asked on a thread of its
    own, which ends: nothing of the caller changes)."""
    answer: list[bool] = []

    def probe() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -1)
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, name="nice-probe")
    thread.start()
    thread.join()
    return answer[0]


def thread_nice(tid: int) -> int:
    """The nice value of a thread of this process (tests, ctl stats)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


if not enabled():
    def apply(io_class: int) -> None:  # switched off: every thread at the server's own nice
        return None

"""Keep an nbdkit thread's Python thread state from one request to the next.

nbdkit's Python plugin makes a new Python thread state for every callback on its own
threads and deletes it afterwards; that costs more than a 4 KiB request's verification
(a fresh frame stack is mapped and unmapped each time, and the unmap flushes the other
cores' TLBs). keep(), called at the top of pread, takes one more reference on the state
the first time a thread calls it, so the state lives as long as the thread
(_threadstate.c says how it is given back: release() from the close callback for the
connection's own thread, a destructor at thread exit for nbdkit's worker threads).

On by default wherever the extension was built; NBD_VERITY_KEEP_THREAD_STATE=0 turns it
off (for measuring it, and for the tests that run a server both ways). kept() is the
number of thread states kept now (`ctl stats` shows it): the tests check it goes back
down when clients leave.
"""

from __future__ import annotations

from ..limits import switched_off

KEEP_ENV = "NBD_VERITY_KEEP_THREAD_STATE"

try:
    from nbd_verity import _threadstate
except ImportError:  # built without a compiler: every request makes its own state
    _threadstate = None


def _never() -> bool:
    return False


def _none() -> int:
    return 0


def enabled() -> bool:
    return (_threadstate is not None
            and not switched_off(KEEP_ENV))


if enabled():
    keep, release, kept = _threadstate.keep, _threadstate.release, _threadstate.kept
else:
    keep, release, kept = _never, _never, _none

"""What we work around in the nbdkit that runs us: its version, and how a callback fails.

Two defects of nbdkit 1.32 (Debian 12's 1.32.5), found in its source:

1. **The disconnect race** (server/connections.c raw_send_socket, 1.32.4 to 1.33.9; fixed in
   1.34.0, commit 9d82aa4f). In the PARALLEL thread model, when a client disconnects with two or
   more requests in flight, one worker closes the socket after EPIPE while another still sends
   on it: `Assertion 'sock >= 0' failed`, and the whole server aborts. Every serialised model
   runs one worker per connection and cannot hit it, so the default thread model is
   SERIALIZE_REQUESTS (config.THREAD_MODELS).

2. **The failed-callback leak** (plugins/python/errors.c check_python_failure, read in 1.32.5
   and up to 1.33.11; nbdkit 1.42.3, Debian 13's, still has it: measured, every failed
   callback's exception stays alive): PyErr_Fetch's three references (type, exception,
   traceback) are never released, so each failed request keeps its exception, its traceback and
   every frame of it with all their locals (buffers, hash blocks) alive forever: about 4 KB per
   failed read for us. `FailureRaiser` makes the exception nbdkit sees cheap and gives the
   references back:
   - it is raised fresh, outside any `except` block (no __context__ chain), from a frame that
     holds nothing but the request's arguments;
   - nbdkit formats it with traceback.format_exception, called from C (no Python frame above
     it): our formatter recognises the exception this thread just raised, returns its message as
     one line, and, where nbdkit keeps the references, releases the three with Py_DecRef (0
     bytes per failure, measured over 20,000);
   - whether nbdkit keeps them is known for the versions read (1.32.0 to 1.33.11) and found out
     on any other: a thread's first failure only has its frames cleared and is watched through a
     weak reference; at that thread's next failure its callback has long returned, so the
     exception is alive only if nbdkit kept it. Kept: release from then on (the first stays, one
     per thread). Freed: never release (a release there would free what nbdkit frees too).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import subprocess
import sys
import threading
import traceback
import weakref

from ..log import log
from ..prepare.config import PARALLEL, SERIALIZE_REQUESTS

RACE_FIRST = (1, 32, 4)  # the first version with the disconnect race
RACE_FIXED = (1, 34, 0)  # commit 9d82aa4f "server: Fix race in raw_send_socket"
LEAK_KNOWN = ((1, 32, 0), (1, 33, 11))  # versions whose check_python_failure we read


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, micro) from `nbdkit --dump-config`'s `version=1.32.5`."""
    match = re.search(r"^version=(\d+)\.(\d+)\.(\d+)", text, re.MULTILINE)
    return tuple(int(part) for part in match.groups()) if match else None


@functools.cache
def nbdkit_version(binary: str = "/proc/self/exe") -> tuple[int, int, int] | None:
    """The version of an nbdkit binary (by default the one running us), asked once per
    binary, or None when it cannot be run or does not say."""
    try:
        out = subprocess.run([binary, "--dump-config"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return parse_version(out)


def has_send_race(version: tuple[int, int, int] | None) -> bool:
    """Whether PARALLEL can abort on a client's disconnect (unknown: assume it can)."""
    return version is None or RACE_FIRST <= version < RACE_FIXED


def leaks_failures(version: tuple[int, int, int] | None) -> bool | None:
    """True where this version is known to leak every failed callback's exception;
    None where it is not known (FailureRaiser finds out)."""
    known = version is not None and LEAK_KNOWN[0] <= version <= LEAK_KNOWN[1]
    return True if known else None


def auto_thread_model(waits: bool, version, can_hang_up: bool) -> str:
    """thread-model=auto: a connection's requests served together (PARALLEL) where the
    image's reads wait (waits: read over a network, or a local image mostly not in the
    page cache), this nbdkit has no disconnect race, and a read that the
    server's stop ends can shut its connection (can_hang_up: nbdkit.disconnect; without it
    a parallel server waits on SIGTERM for every client to hang up); SERIALIZE_REQUESTS
    otherwise, and for an image that waits a start-up line that says how to get more in
    flight (docs/server.md, "Storage with latency")."""
    if waits and not has_send_race(version) and can_hang_up:
        return PARALLEL
    if waits:
        say_one_at_a_time(version)
    return SERIALIZE_REQUESTS


def say_one_at_a_time(version) -> None:
    """The start-up line of an image that waits, served in serialize-requests: a client's
    requests on one connection reach the storage one at a time, and how to get more in
    flight (docs/server.md, "Storage with latency")."""
    risk = (f"; on nbdkit {version_text(version)} a client can abort its parallel model"
            if has_send_race(version) else "")
    log(f"thread-model serialize-requests: a connection's requests reach the image one at "
        f"a time; for several in flight open several connections (nbd-client -C N) or "
        f"pass --thread-model parallel{risk}")


def version_text(version: tuple[int, int, int] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


class RequestFailed(Exception):
    """What a callback raises to make nbdkit reply with the errno set by set_error."""


_decref = ctypes.pythonapi.Py_DecRef
_decref.argtypes = [ctypes.py_object]
_decref.restype = None


class FailureRaiser:
    """Raises request failures for nbdkit without leaking (see the module docstring).

    install() replaces traceback.format_exception once (the only place that does);
    `fallback` formats everything that is not a pending request failure (the plugin's
    one-line formatter for VerityError). compensate (True: release the references nbdkit
    keeps; False: nbdkit frees them; None: find out) may be set after install()."""

    def __init__(self, set_error, compensate: bool | None,
                 fallback=traceback.format_exception, on_verdict=None):
        self._set_error = set_error
        self.compensate = compensate
        self._on_verdict = on_verdict  # called once with what was found out, if set
        self._fallback = fallback
        self._pending = threading.local()  # .error: raised, not yet formatted
        self._watched = threading.local()  # .ref: this thread's first failure, while unknown

    def install(self) -> None:
        traceback.format_exception = self.format_exception
        self._self_test()

    def fail(self, errnum: int, message: str):
        """Set the errno and raise a fresh, shallow exception. Call it outside `except`."""
        if self.compensate is None:
            self._judge()
        self._set_error(errnum)
        error = RequestFailed(message)
        self._pending.error = error
        raise error

    def format_exception(self, exc, value=None, tb=None, *args, **kwargs):
        pending = getattr(self._pending, "error", None)
        error = value if value is not None else exc
        # nbdkit's print_python_traceback calls us from C: no Python frame above ours.
        if pending is not None and error is pending and sys._getframe().f_back is None:
            self._pending.error = None
            if self.compensate:
                for ref in (exc, value, tb):  # the references check_python_failure keeps
                    if ref is not None:
                        _decref(ref)
            else:
                _clear_frames(tb)
                if self.compensate is None and getattr(self._watched, "ref", None) is None:
                    self._watched.ref = weakref.ref(pending)
            return [str(pending)]
        return self._fallback(exc, value, tb, *args, **kwargs)

    def _judge(self) -> None:
        """Whether nbdkit kept this thread's watched failure: asked only by the thread
        that raised it, so the callback that failed has returned to nbdkit, which has
        released by now whatever it releases (our own references went with the frames)."""
        watched = getattr(self._watched, "ref", None)
        if watched is not None:
            self._watched.ref = None
            self.compensate = watched() is not None
            if self._on_verdict is not None:
                self._on_verdict(self.compensate)

    def _self_test(self) -> None:
        """A Python caller still gets a real traceback and keeps its references."""
        try:
            raise ValueError("self-test")
        except ValueError as e:
            before = sys.getrefcount(e)
            text = traceback.format_exception(type(e), e, e.__traceback__)
            passed = sys.getrefcount(e) == before and any("self-test" in t for t in text)
        if not passed:
            raise RuntimeError("nbdkit_compat: format_exception self-test failed")


def _clear_frames(tb) -> None:
    """Free the locals of every frame of a traceback (frame.clear; running ones stay)."""
    while tb is not None:
        with contextlib.suppress(RuntimeError):  # a frame still executing stays
            tb.tb_frame.clear()
        tb = tb.tb_next


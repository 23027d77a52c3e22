"""The control socket of a many-export server (serve/exportset.py): the commands of one
server's (thresholds, stats, status) over all its exports, and `exports`.

Requests, beside protocol.py's:
  {"cmd": "exports"}                      -> every export: name, file, size, status V/C,
                                             corruptions, clients, trust, description
  {"cmd": "exports", "reload": true}      -> re-read the directory: added, changed,
                                             removed, unchanged, refused {file: why};
                                             "deadline": S (default 30) bounds the time
                                             spent opening files; answered when done,
                                             other requests meanwhile
  {"cmd": "stats"}                        -> {"exports": {NAME: one export's stats}, ...}
  {"cmd": "stats", "export": "NAME"}      -> that export's stats, as a one-image server's
  {"cmd": "status"} / with "export"       -> every export's status, or one's
Thresholds are the server's, one table for every export.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from .protocol import Control, ProtocolError, _field, answered

RELOAD_DEADLINE_S = 30.0  # seconds a reload may spend opening export files, in all
MAX_DEADLINE_S = 600.0  # the longest a reload may be given

FIELDS = {
    "thresholds": {"cmd", "set", "preset"},
    "stats": {"cmd", "reset", "export"},
    "status": {"cmd", "export"},
    "stop": {"cmd"},
    "exports": {"cmd", "reload", "deadline"},
}


class ExportsControl(Control):
    """Answers control requests against an ExportSet (no sockets here)."""

    FIELDS = FIELDS

    def _stats(self, request: dict) -> dict:
        name = _field(request, "export", str)
        target = self.device if name is None else self.device.export(name).device
        reply = {"stats": target.stats()}
        if _field(request, "reset", bool, False):
            target.reset_stats()
        return reply

    def _status(self, request: dict) -> dict:
        name = _field(request, "export", str)
        if name is None:
            return {"status": self.device.status()}
        return {"status": self.device.export(name).device.status()}

    def _exports(self, request: dict) -> dict | Future:
        if _field(request, "reload", bool, False):
            limit = {} if "deadline" not in request else {"deadline_s": _deadline(request)}
            return _in_background(lambda: {"reload": self.device.reload(**limit),
                                           "exports": self.device.listing()})
        return {"exports": self.device.listing()}


def _deadline(request: dict) -> float:
    """The reload's deadline in seconds: a number in (0, MAX_DEADLINE_S]."""
    value = request["deadline"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= MAX_DEADLINE_S:
        raise ProtocolError(f"deadline: {value!r} is not a number of seconds in "
                            f"(0, {MAX_DEADLINE_S:g}]")
    return float(value)


def _in_background(work) -> Future:
    """A Future of work's reply, done on a thread of its own: the control thread answers
    other requests meanwhile, and this one when it is done."""
    future: Future = Future()

    threading.Thread(target=lambda: future.set_result(answered(work)),
                     name="control-reload", daemon=True).start()
    return future

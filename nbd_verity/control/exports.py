"""The control socket of a many-export server (serve/exports.py): the commands of one
server's (thresholds, stats, status) over all its exports, and `exports`.

Requests, beside protocol.py's:
  {"cmd": "exports"}                      -> every export: name, file, size, status V/C,
                                             corruptions, clients, trust, description
  {"cmd": "exports", "reload": true}      -> re-read the directory: added, changed,
                                             removed, unchanged, refused {file: why}
  {"cmd": "stats"}                        -> {"exports": {NAME: one export's stats}, ...}
  {"cmd": "stats", "export": "NAME"}      -> that export's stats, as a one-image server's
  {"cmd": "status"} / with "export"       -> every export's status, or one's
Thresholds are the server's, one table for every export.
"""

from __future__ import annotations

from .protocol import Control, _field

FIELDS = {
    "thresholds": {"cmd", "set", "preset"},
    "stats": {"cmd", "reset", "export"},
    "status": {"cmd", "export"},
    "exports": {"cmd", "reload"},
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

    def _exports(self, request: dict) -> dict:
        if _field(request, "reload", bool, False):
            with self._lock:
                report = self.device.reload()
            return {"reload": report, "exports": self.device.listing()}
        return {"exports": self.device.listing()}

"""Many verified images from one server: the exports of a directory of export files.

`nbd-verity serve --exports DIR` serves every DIR/NAME.conf (prepare/exportfile.py) as the
export NAME, as nbd-server serves the sections of its config file and qemu-storage-daemon
its block exports. Each export is a Device of its own (its sources, root of trust, tree,
FEC, cache, counters, corruption status); what they share is the server's: one
verification pool, one threshold table per class, one control socket, one hash-block
cache budget (`cache-size` of the server, split evenly; an export's own `--cache-size`
caps its share).

A client picks an export by name (`nbd-client -N NAME`, `nbd+unix:///NAME?socket=...`),
`NAME@CLASS` choosing the class as before; with `--list-exports`, `nbdinfo --list` lists
them with a description.
A name that is not served fails the handshake with ENOENT (nbdkit answers the client's
NBD_OPT_GO with an error; the connection stays open for another try).

reload() (`ctl exports reload`) re-reads the directory: a new file is opened completely
before any client can see it; a refused file is one redacted line, and every other export
keeps serving; a file whose identity changed (it, or what its trust rests on:
trust_identity) is opened anew and replaces its export for new connections; if it no
longer opens, a broken edit keeps the old export, a changed trust drops it. A removed file
refuses new connections at once; a replaced or removed export closes with its last client.

Locking: `_reloading` makes reloads one at a time; files are opened without any lock, on
threads of their own within a deadline (open_all); `_lock` guards only the swap of the
map (replaced whole, never changed in place: open() reads it under `_lock`, status
without), connection counts and `_retired`. So a slow upstream holds neither new clients
of other exports nor the control socket (docs/server.md, "Many exports").
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace

from ..control.exports import RELOAD_DEADLINE_S
from ..control.table import loaded, table_dict
from ..errors import ConfigError, VerityError
from ..ioclass import class_index
from ..log import log
from ..prepare.config import ServerConfig, config_from_pairs, explicit_thresholds
from ..prepare.exportfile import ExportFile, export_files, read_export_file
from ..prepare.keys import image_pairs
from ..schedule.pool import ClassPool
from ..sources.remote import redact_text
from ..sources.upstream import stop_upstreams
from ..trust.remote_sidecar import close_private
from .device import Connection, Device, Hooks, Shared
from .nbdkit_compat import nbdkit_version, version_text
from .opening import file_identity, open_all, quiet, trust_identity, why


@dataclass
class Export:
    """One served export: its name, file, device, and the clients it has."""

    name: str
    path: str
    identity: tuple  # (file_identity, trust_identity) when it was opened
    device: Device
    upstreams: list = field(default_factory=list)  # captive nbdkits of its URLs
    spec: ExportFile | None = None  # what its file said (its trust is checked again)
    connections: int = 0
    retired: bool = False  # replaced or removed: closed once its clients have gone

    def description(self) -> str:
        """What `nbdinfo --list` shows beside the name."""
        return self.device.description()

    def close(self) -> None:
        self.device.close()
        stop_upstreams(self.upstreams)


@dataclass
class _Job:
    """One export file a reload opens (or refused before opening: identity empty)."""

    name: str
    path: str
    old: Export | None  # the export it replaces
    identity: tuple  # (file_identity, trust_identity) of what is opened
    keep_old: bool  # on failure the old export serves on (a broken edit, trust unchanged)


class ExportSet:
    """The exports of one directory, and what they share (see the module docstring)."""

    def __init__(self, config: ServerConfig, hooks: Hooks | None = None,
                 say=log) -> None:
        self.config = config
        self.say = say  # log lines (start-up's check passes a quiet one)
        self.directory = config.exports
        self.hooks = hooks or Hooks()
        self._exports: dict[str, Export] = {}  # replaced whole, never changed in place
        self._retired: list[Export] = []
        self.refused: dict[str, str] = {}  # file -> why, from the last (re)load
        self._lock = threading.RLock()  # the map's swap, connection counts, _retired
        self._reloading = threading.Lock()  # one reload at a time (never held by open())
        self.explicit = explicit_thresholds(config)  # --threshold: always wins
        self.dispatcher = TableOfAll(self, *loaded(config.threshold_preset, self.explicit))
        self.workers = config.workers or os.cpu_count() or 1
        self._pool: ClassPool | None = None
        self.default_class = class_index(config.default_class, "default-class")
        self.started = time.monotonic()
        self.control = None
        if config.control:
            from ..control.exports import ExportsControl
            from ..control.server import ControlServer
            self.control = ControlServer(config.control, ExportsControl(self))

    # -- what the plugin calls -------------------------------------------------------

    def pool(self) -> ClassPool:
        """The one verification pool (made on first use: after nbdkit forked)."""
        with self._lock:
            if self._pool is None:
                self._pool = ClassPool(self.workers)
            return self._pool

    def start_threads(self) -> None:
        """After nbdkit's fork: start the control thread (the pool starts at its first
        chunk)."""
        if self.control is not None:
            self.control.start()

    def open(self, export_name: str) -> Connection:
        """A connection to the export export_name names (NAME or NAME@CLASS)."""
        name = export_name.rpartition("@")[0] if "@" in export_name else export_name
        with self._lock:
            export = self._exports.get(name)
            if export is None:
                served = ", ".join(sorted(self._exports)) or "none"
                raise ConfigError(f"export {name!r}: not served here (served: {served})")
            export.connections += 1
        try:
            connection = Connection.open(export.device, export_name)
        except BaseException:
            self._left(export)
            raise
        connection.export = export
        return connection

    def closed(self, connection: Connection) -> None:
        """A client has gone (a connection open() made)."""
        self._left(connection.export)

    def _left(self, export: Export) -> None:
        """A client of export has gone; a retired export closes with its last client."""
        with self._lock:
            export.connections -= 1
            last = export.retired and export.connections == 0
            if last:
                self._retired.remove(export)
        if last:
            export.close()
            log(f"export {export.name}: closed (its last client left)")

    def list(self) -> list[tuple[str, str]]:
        """(name, description) of every export, for NBD_OPT_LIST."""
        return [(e.name, e.description()) for e in sorted(self._exports.values(),
                                                            key=lambda e: e.name)]

    def exports(self) -> dict[str, Export]:
        return self._exports

    def corruptions(self) -> int:
        with self._lock:
            devices = [e.device for e in (*self._exports.values(), *self._retired)]
        return sum(d.verifier.counters.corruptions for d in devices)

    # -- loading ---------------------------------------------------------------------

    def reload(self, deadline_s: float = RELOAD_DEADLINE_S) -> dict:
        """Re-read the directory (see the module docstring); what changed, and why any
        file was refused. New and changed files are opened outside _lock, at most
        deadline_s seconds in all; the map is swapped under it."""
        with self._reloading:
            report: dict = {"added": [], "changed": [], "removed": [], "unchanged": [],
                            "refused": {}}
            try:
                paths = export_files(self.directory)
            except ConfigError as e:  # the directory itself is gone: change nothing
                self._refuse(report, self.directory, str(e))
                self._publish(dict(self._exports), report)
                return report
            current = dict(self._exports)  # only reloads replace it, one at a time
            jobs = {}
            for path in paths:
                job = self._plan(path, current, report)
                if job is not None:
                    jobs[path] = job
            opened = open_all({path: (self._load, path, job.identity)
                                for path, job in jobs.items() if job.identity}, deadline_s)
            for path, job in jobs.items():
                self._settle(job, opened.get(path), current, report)
            named = {os.path.basename(p).removesuffix(".conf") for p in paths}
            for name in sorted(set(current) - named):
                del current[name]
                report["removed"].append(name)
                self.say(f"export {name}: removed; new connections are refused")
            self._publish(current, report)
            return report

    def _plan(self, path: str, current: dict, report: dict) -> _Job | None:
        """A file to open (new, or it or its trust changed), or None: unchanged, or
        refused before anything is opened."""
        name = os.path.basename(path).removesuffix(".conf")
        old = current.get(name)
        try:
            identity = file_identity(path)
            trust = trust_identity(self.config, read_export_file(path, warn=quiet))
        except (VerityError, OSError) as e:
            self._refuse(report, path, why(e))
            if old is None or old.path != path:
                return None
            # a broken edit keeps the old export, unless what its trust rests on changed
            same = old.spec is None or trust_identity(self.config, old.spec) == old.identity[1]
            return _Job(name, path, old, (), keep_old=same)
        if old is not None and old.identity == (identity, trust) and old.path == path:
            report["unchanged"].append(name)
            return None
        # a changed trust (a certificate gone, a new signature) never keeps the old one
        keep_old = old is not None and old.identity[1] == trust and old.path == path
        return _Job(name, path, old, (identity, trust), keep_old)

    def _settle(self, job: _Job, outcome, current: dict, report: dict) -> None:
        """Put an opened export in current, or refuse its file (keeping or dropping the
        export it replaces)."""
        if not job.identity:  # refused by _plan: the old export stays, unless its trust
            if not job.keep_old:  # changed
                self._revoke(job, current, report)
            return
        if isinstance(outcome, str):
            self._refuse(report, job.path, outcome)
            if job.old is not None and not job.keep_old:
                self._revoke(job, current, report)
            return
        if job.old is not None:
            report["changed"].append(job.name)
            self.say(f"export {job.name}: replaced for new connections "
                     f"({outcome.description()})")
        else:
            report["added"].append(job.name)
            self.say(f"export {job.name}: serving ({outcome.description()})")
        current[job.name] = outcome

    def _revoke(self, job: _Job, current: dict, report: dict) -> None:
        current.pop(job.name, None)
        report["removed"].append(job.name)
        self.say(f"export {job.name}: its trust changed and it no longer opens; new "
                 f"connections are refused")

    def _refuse(self, report: dict, path: str, why: str) -> None:
        why = redact_text(why if why.startswith(path) else f"{path}: {why}")
        report["refused"][path] = why
        self.say(f"refused: {why}")

    def _publish(self, current: dict, report: dict) -> None:
        """Swap the new map in under _lock: new exports take the server's table now, the
        ones replaced or removed retire (those without a client are closed after it:
        stopping an upstream may take seconds)."""
        with self._lock:
            old = self._exports
            for name, export in current.items():
                if old.get(name) is not export:
                    export.device.dispatcher.set_table(self.dispatcher.table,
                                                       self.dispatcher.pinned)
            self._exports = current
            idle = [export for name, export in old.items()
                    if current.get(name) is not export and self._retire(export)]
            self.refused = dict(report["refused"])
            self._resize_caches()
        for export in idle:
            export.close()

    def _load(self, path: str, identity: tuple) -> Export:
        """Open one export file's image completely, or raise in one line."""
        spec = read_export_file(path, warn=self.say)
        server_only = spec.server_options()
        if server_only:
            raise ConfigError(f"{path}: ARGS: {', '.join(server_only)} is the server's "
                              f"(give it to `nbd-verity serve --exports`)")
        options = dict(spec.options, data=spec.data, hash_image=spec.hash_image,
                       root_hash=spec.root_hash,  # trust is the server's, for every export
                       require_signatures=self.config.require_signatures,
                       trusted_certs=self.config.trusted_certs,
                       default_class=self.config.default_class)  # the server's classes
        upstreams: list = []
        pairs: list = []
        try:
            pairs = image_pairs(options, upstreams)
            config = config_from_pairs(pairs)
            shared = Shared(self.dispatcher.table, self.workers, self.pool,
                            self.dispatcher.pinned)
            device = Device(replace(config, control=None), self.hooks, shared)
        except BaseException:
            stop_upstreams(upstreams)
            raise
        finally:  # a fetched signature's memory file: checked by now, or refused
            close_private(dict(pairs).get("root-hash-signature"))
        return Export(spec.name, path, identity, device, upstreams, spec)

    def _retire(self, export: Export) -> bool:
        """No new connection to export (under _lock); True when it has no client, to be
        closed now; else it is closed with its last (closed())."""
        export.retired = True
        if export.connections == 0:
            return True
        self._retired.append(export)
        return False

    def _resize_caches(self) -> None:
        """Share the server's cache budget evenly; an export's own cache-size caps it."""
        exports = list(self._exports.values())
        if not exports:
            return
        share = self.config.cache_size // len(exports)
        for export in exports:
            export.device.cache.resize(min(share, export.device.config.cache_size))

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        with self._lock:
            every = [*self._exports.values(), *self._retired]
            self._exports, self._retired = {}, []
        for export in every:
            export.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- the control socket ----------------------------------------------------------

    def export(self, name: str) -> Export:
        export = self._exports.get(name)
        if export is None:
            raise ConfigError(f"export: {name!r} is not served (see `exports`)")
        return export

    def status(self) -> dict:
        return {"exports": {name: {**e.device.status(), "connections": e.connections}
                            for name, e in sorted(self._exports.items())},
                "uptime_s": round(time.monotonic() - self.started, 3)}

    def stats(self) -> dict:
        return {"exports": {name: e.device.stats() for name, e in sorted(self._exports.items())},
                "thresholds": table_dict(self.dispatcher.table), "workers": self.workers,
                "nbdkit": version_text(nbdkit_version())}  # the nbdkit running us

    def reset_stats(self) -> None:
        for export in list(self._exports.values()):
            export.device.reset_stats()

    def listing(self) -> list[dict]:
        """`ctl exports`: each export with its file, status and clients."""
        out = []
        for name, export in sorted(self._exports.items()):
            device = export.device
            out.append({"name": name, "file": export.path, "size": device.size,
                        "status": device.verifier.counters.status,
                        "corruptions": device.verifier.counters.corruptions,
                        "connections": export.connections, "trust": device.trust.status(),
                        "description": export.description()})
        return out


class TableOfAll:
    """The server-wide threshold table, set on every export's dispatcher at once (what
    the control socket's `thresholds` changes, as a Device's dispatcher for one)."""

    def __init__(self, exports: ExportSet, table: tuple[int, ...],
                 pinned: frozenset = frozenset()) -> None:
        self._exports = exports
        self.table = table
        self.pinned = pinned

    def set_table(self, table: tuple[int, ...], pinned: frozenset | None = None) -> None:
        with self._exports._lock:  # a reload in progress takes the new table too
            self.table = table
            if pinned is not None:
                self.pinned = frozenset(pinned)
            for export in (*self._exports.exports().values(), *self._exports._retired):
                export.device.dispatcher.set_table(table, self.pinned)

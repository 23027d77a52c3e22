"""Many verified images from one server: the exports of a directory of export files.

`nbd-verity serve --exports DIR` serves every DIR/NAME.conf (serve/exportfile.py) as the
export NAME, as nbd-server serves the sections of its config file and qemu-storage-daemon
its block exports. Each export is a Device of its own (its sources, root of trust, tree,
FEC, cache, counters, corruption status); what they share is the server's: one
verification pool, one threshold table per class, one control socket, one hash-block
cache budget (`cache-size` of the server, split evenly; an export's own `--cache-size`
caps its share).

A client picks an export by name (`nbd-client -N NAME`, `nbd+unix:///NAME?socket=...`),
`NAME@CLASS` choosing the class as before; `nbdinfo --list` lists them with a description.
A name that is not served fails the handshake with ENOENT (nbdkit answers the client's
NBD_OPT_GO with an error; the connection stays open for another try).

reload() (`ctl exports reload`) re-reads the directory: a new file is opened completely
(root hash, signature, sizes, the top of the tree) before any client can see it; a file
that is refused is one line in the reply and in the log, and every other export keeps
serving; a changed file (size, mtime or inode) is opened anew and replaces its export for
new connections only; a removed file refuses new connections at once. A replaced or
removed export stays open for the clients it has and is closed when the last one leaves.

The export map is replaced whole under the reload lock: open() reads it without a lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field, replace

from ..control.table import CALIBRATED, CLASSES, class_index, preset, table_dict, updated_table
from ..errors import ConfigError, VerityError
from ..log import log
from .calibrate import calibrate_apart
from .config import ServerConfig, config_from_pairs, parse_size
from .device import Connection, Device, Hooks, Shared
from .exportfile import export_files, read_export_file
from .image import image_pairs
from .nbdkit_compat import nbdkit_version, version_text
from .pool import ClassPool


@dataclass
class Export:
    """One served export: its name, file, device, and the clients it has."""

    name: str
    path: str
    identity: tuple  # (size, mtime_ns, inode) of the file when it was read
    device: Device
    upstreams: list = field(default_factory=list)  # captive nbdkits of its URLs
    connections: int = 0
    retired: bool = False  # replaced or removed: closed once its clients have gone

    def description(self) -> str:
        """What `nbdinfo --list` shows beside the name."""
        trust = self.device.trust
        signer = (f"signed by {trust.signature.signer.subject}" if trust.signature
                  else "unsigned")
        return (f"verified, {self.device.size} bytes, root hash {trust.root_hex[:16]}..., "
                f"{signer}")

    def close(self) -> None:
        self.device.close()
        for server in self.upstreams:
            server.stop()


def file_identity(path: str) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev


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
        self._lock = threading.RLock()  # reloads and connection counts
        self._explicit = {name: parse_size(f"threshold {name}", value)
                          for name, value in config.thresholds.items()}
        self.dispatcher = TableOfAll(self, updated_table(preset(config.threshold_preset),
                                                         self._explicit),
                                     self.explicit_classes()
                                     if config.threshold_preset == CALIBRATED
                                     else frozenset(range(len(CLASSES))))
        self.workers = config.workers or os.cpu_count() or 1
        self._pool: ClassPool | None = None
        self.calibration = None
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
        """After nbdkit's fork: measure the `default` table, start the control thread."""
        exports = list(self._exports.values())
        if (self.config.threshold_preset == CALIBRATED and exports
                and len(self._explicit) < len(CLASSES)):
            device = exports[0].device
            self.calibration = calibrate_apart(device.verifier.digester,
                                               device.geo.data_block_size, self.workers)
            self.dispatcher.set_table(self.preset_table(CALIBRATED))
        if self.control is not None:
            self.control.start()

    def explicit_classes(self) -> frozenset:
        return frozenset(class_index(name) for name in self._explicit)

    def preset_table(self, name: str) -> tuple[int, ...]:
        if name == CALIBRATED and self.calibration is not None:
            return updated_table((self.calibration.threshold,) * len(CLASSES),
                                 self._explicit)
        return preset(name)

    def calibration_dict(self) -> dict | None:
        return None if self.calibration is None else self.calibration.as_dict()

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
            connection = Connection.open(export.device)
        except BaseException:
            self.closed(export)
            raise
        connection.export = export
        return connection

    def closed(self, export: Export) -> None:
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

    def reload(self) -> dict:
        """Re-read the directory (see the module docstring); what changed, and why any
        file was refused."""
        with self._lock:
            current = dict(self._exports)
            report: dict = {"added": [], "changed": [], "removed": [], "unchanged": [],
                            "refused": {}}
            try:
                paths = export_files(self.directory)
            except ConfigError as e:  # the directory itself is gone: change nothing
                report["refused"][self.directory] = str(e)
                self.refused = dict(report["refused"])
                return report
            seen = set()
            for path in paths:
                self._reload_one(path, current, report, seen)
            for name in sorted(set(current) - seen):
                self._retire(current.pop(name))
                report["removed"].append(name)
                self.say(f"export {name}: removed; new connections are refused")
            self._exports = current
            self.refused = dict(report["refused"])
            self._resize_caches()
            return report

    def _reload_one(self, path: str, current: dict, report: dict, seen: set) -> None:
        try:
            spec_name = os.path.basename(path).removesuffix(".conf")
            old = current.get(spec_name)
            identity = file_identity(path)
            if old is not None and old.identity == identity and old.path == path:
                seen.add(spec_name)
                report["unchanged"].append(spec_name)
                return
            export = self._load(path, identity)
        except (VerityError, OSError) as e:
            why = str(e) if isinstance(e, VerityError) else e.strerror
            why = why if why.startswith(path) else f"{path}: {why}"
            report["refused"][path] = why
            self.say(f"refused: {why}")
            if old is not None:  # a broken edit keeps the export that was serving
                seen.add(spec_name)
            return
        seen.add(export.name)
        if old is not None:
            self._retire(old)
            report["changed"].append(export.name)
            self.say(f"export {export.name}: replaced for new connections "
                     f"({export.description()})")
        else:
            report["added"].append(export.name)
            self.say(f"export {export.name}: serving ({export.description()})")
        current[export.name] = export

    def _load(self, path: str, identity: tuple) -> Export:
        """Open one export file's image completely, or raise in one line."""
        spec = read_export_file(path)
        server_only = spec.server_options()
        if server_only:
            raise ConfigError(f"{path}: ARGS: {', '.join(server_only)} is the server's "
                              f"(give it to `nbd-verity serve --exports`)")
        options = dict(spec.options, data=spec.data, hash_image=spec.hash_image,
                       root_hash=spec.root_hash)
        if self.config.require_signatures:  # --require-signatures for all
            options["require_signatures"] = True
        if options.get("trusted_certs") is None and self.config.trusted_certs:
            options["trusted_certs"] = self.config.trusted_certs
        upstreams: list = []
        try:
            config = config_from_pairs(image_pairs(options, upstreams))
            shared = Shared(self.dispatcher.table, self.workers, self.pool,
                            self.dispatcher.pinned)
            device = Device(replace(config, control=None), self.hooks, shared)
        except BaseException:
            for server in upstreams:
                server.stop()
            raise
        _close_private(config.root_hash_signature)
        return Export(spec.name, path, identity, device, upstreams)

    def _retire(self, export: Export) -> None:
        """No new connection to export; closed now if it has no client, else at the last."""
        export.retired = True
        if export.connections == 0:
            export.close()
        else:
            self._retired.append(export)

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
                "calibration": self.calibration_dict(),
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


def _close_private(path: str | None) -> None:
    """A fetched signature was handed over in a memory file (trust/remote_sidecar.py):
    once the Device has checked it, its descriptor goes."""
    if path and path.startswith("/proc/self/fd/"):
        with contextlib.suppress(ValueError, OSError):
            os.close(int(path.rsplit("/", 1)[1]))

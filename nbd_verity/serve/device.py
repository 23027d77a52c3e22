"""One served image (Device) and its clients (Connection): what the callbacks serve.

A Device is an image opened, trusted and checked (prepare/opened.py) with what serves it:
its dispatcher (schedule/dispatch.py, over the verifier's read), its readahead choice,
its fast path and, for a one-image server, its control socket; a Connection is one
client, with its I/O class, its Merkle readahead window and its fast path.
serve/callbacks.py calls them and turns their exceptions into errno values (and decides
what restart-on-corruption does). This module does not import nbdkit, so it also runs
(and is tested) outside nbdkit; the nbdkit services it needs (peer pid, shutdown,
permission to name a class) are passed in as Hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control.protocol import Control
from ..control.server import ControlServer
from ..control.table import loaded, table_dict
from ..format.blocks import block_span
from ..ioclass import CLASSES, class_index, connection_class
from ..prepare.config import ServerConfig, explicit_thresholds
from ..prepare.opened import OpenedImage
from ..read.readahead import Readahead
from ..schedule.dispatch import Client, Dispatcher
from ..schedule.gate import gate
from ..sources.remote import is_uri
from . import fastpath, threadstate
from .nbdkit_compat import nbdkit_version, version_text


@dataclass
class Shared:
    """What the exports of one many-export server share (serve/exportset.py): one
    verification pool and one threshold table; None for a server of one image."""

    table: tuple[int, ...]
    workers: int
    pool: Callable | None  # () -> the server's ClassPool, made on first use (None: own)
    pinned: frozenset = frozenset()  # classes set explicitly (dispatch.py)


@dataclass
class Hooks:
    """nbdkit services, provided by the plugin (defaults outside nbdkit)."""

    peer_pid: Callable[[], int] = lambda: -1
    may_name: Callable[[int], bool] = lambda io_class: True  # a class above the default
    stopping: Callable[[], bool] = lambda: False  # nbdkit shutting down: NBD waits end
    stop: Callable[[], dict] = lambda: {}  # `ctl stop`: drain the clients, then shut down


class Device:
    """One served image: the opened image, its dispatcher and what it reports."""

    def __init__(self, config: ServerConfig, hooks: Hooks | None = None,
                 shared: Shared | None = None) -> None:
        self.config = config
        self.hooks = hooks or Hooks()
        image = OpenedImage(config, self.hooks.stopping)
        self.image = image
        self.ddi, self.trust, self.data, self.hashes = (image.ddi, image.trust, image.data,
                                                        image.hashes)
        self.hash_path, self.params, self.geo = image.hash_path, image.params, image.geo
        self.cache, self.fec, self.verifier = image.cache, image.fec, image.verifier
        self.explicit = explicit_thresholds(config)  # --threshold: always wins
        self.default_class = class_index(config.default_class, "default-class")
        if shared is None:  # its own table and pool; else the many-export server's
            table, pinned = loaded(config.threshold_preset, self.explicit)
        serving = shared or Shared(table, config.workers, None, pinned)
        self.dispatcher = Dispatcher(self.verifier.read, self.geo.data_block_size,
                                     serving.table, serving.workers, shared_pool=serving.pool,
                                     pinned=serving.pinned, counters=self.verifier.counters)
        # Readahead by default only where reads have latency of their own: for a local
        # file the kernel's page cache reads the hash image ahead already (benchmarks.md).
        self.readahead = (config.readahead if config.readahead is not None
                          else is_uri(config.data if self.ddi else self.hash_path))
        self.control = (ControlServer(config.control, Control(self))
                        if config.control and shared is None else None)
        self.fast_path = fastpath.enabled(self)  # per connection also: no readahead
        self.started = time.monotonic()

    def start_threads(self) -> None:
        """Start the pool and the control thread (in nbdkit's after_fork)."""
        self.dispatcher.start()
        if self.control is not None:
            self.control.start()

    # -- what the callbacks call, as of an ExportSet (serve/exportset.py) -------------

    def open(self, export_name: str) -> Connection:
        """A client's connection (the name may choose its class: `@CLASS`)."""
        return Connection.open(self, export_name)

    def closed(self, connection: Connection) -> None:
        """A client has gone (nothing of the image's to release)."""

    def list(self) -> list[tuple[str, str]]:
        """The one export, unnamed, for NBD_OPT_LIST."""
        return [("", self.description())]

    def description(self) -> str:
        """What `nbdinfo --list` shows beside the export's name, and NBD_INFO_DESCRIPTION
        in the handshake: `nbd-verity attach` reads the image's root hash in it."""
        trust = self.trust
        signer = (f"signed by {trust.signature.signer.subject}" if trust.signature
                  else "unsigned")
        return f"verified, {self.size} bytes, root hash {trust.root_hex}, {signer}"

    def corruptions(self) -> int:
        return self.verifier.counters.corruptions

    @property
    def size(self) -> int:
        return self.geo.data_size

    def stats(self) -> dict:
        """Everything the control socket's `stats` reports."""
        totals = self.verifier.counters.snapshot()
        totals.update(cache_hits=self.cache.hits, cache_misses=self.cache.misses,
                      cached_hash_blocks=len(self.cache), cache_evictions=self.cache.evictions,
                      **self.source_counters())
        return {"classes": self.dispatcher.stats.snapshot(), "totals": totals,
                **self.status(), "thresholds": table_dict(self.dispatcher.table),
                "workers": self.dispatcher.workers,
                "pinned": [CLASSES[c] for c in sorted(self.dispatcher.pinned)],
                "busy_inline": self.dispatcher.busy_inline(),
                "class_gate": gate.snapshot(),  # the server's, shared by its exports
                "chunk_size": self.dispatcher.chunk_size, "fast_path": self.fast_path,
                "kept_thread_states": threadstate.kept(),
                "nbdkit": version_text(nbdkit_version())}  # the nbdkit running us

    def source_counters(self) -> dict:
        return self.image.source_counters()

    def reset_stats(self) -> None:
        self.image.reset_source_counters()
        self.verifier.counters.reset()
        self.cache.reset_counters()
        self.dispatcher.stats.reset()

    def status(self) -> dict:
        counters = self.verifier.counters
        return {"status": counters.status, "corruptions": counters.corruptions,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "mode": self.config.mode, "trust": self.trust.status()}

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self.dispatcher.stop()
        self.image.close()


class Connection(Client):
    """One client: the scheduling layer's Client (its I/O class and Merkle readahead
    window), its device, and its fast path (fastpath.py: fast(buf,
    offset) answers the common request, or hands it to device.dispatcher.read)."""

    def __init__(self, device: Device, io_class: int | None = None) -> None:
        super().__init__(device.default_class if io_class is None else io_class,
                         Readahead(device.verifier, device.config.readahead_min_size)
                         if device.readahead else None)
        self.device = device
        self.fast = fastpath.bind(self)

    @classmethod
    def open(cls, device: Device, export_name: str = "") -> Connection:
        """A new connection, its class chosen by export name, peer ioprio or default."""
        hooks = device.hooks
        io_class = connection_class(export_name, hooks.peer_pid(),
                                    device.default_class, hooks.may_name)
        return cls(device, io_class)

    def cache(self, count: int, offset: int) -> None:
        """NBD_CMD_CACHE: verify and cache the hash blocks of a range."""
        if count:
            first, blocks = block_span(offset, count, self.device.geo.data_block_size)
            self.device.verifier.prefetch(first, blocks)

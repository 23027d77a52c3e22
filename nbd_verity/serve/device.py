"""One verified export (Device) and its clients (Connection): what the plugin serves.

A Device opens the images, checks the root, and owns the cache, verifier, dispatcher and
control socket; a Connection is one client, with its I/O class. nbd_verity.serve.callbacks calls
them and turns their exceptions into errno values (and decides what restart-on-corruption
does). This module does not import nbdkit, so it also runs (and is tested) outside nbdkit;
the nbdkit services it needs (export name, peer pid) are passed in as Hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control.protocol import Control
from ..control.server import ControlServer
from ..control.table import loaded, table_dict
from ..errors import ConfigError, CorruptionError, ImageIOError
from ..format.areas import check_layout
from ..format.blocks import block_span
from ..format.params import load_params
from ..format.roothash import root_digest
from ..ioclass import CLASSES, class_index, connection_class
from ..log import log
from ..prepare.config import ServerConfig, explicit_thresholds
from ..read.cache import HashBlockCache
from ..read.readahead import Readahead
from ..read.verifier import Verifier, VerifyOptions
from ..schedule.dispatch import Cycle, Dispatcher
from ..schedule.gate import gate
from ..sources.remote import is_uri, open_source
from ..trust.root import TrustedRoot, resolve_root
from . import fastpath, threadstate
from .nbdkit_compat import nbdkit_version, version_text


@dataclass
class Shared:
    """What the exports of one many-export server share (serve/exportset.py): one
    verification pool and one threshold table; None for a server of one image."""

    table: tuple[int, ...]
    workers: int
    pool: Callable  # () -> the server's ClassPool, made on first use
    pinned: frozenset = frozenset()  # classes set explicitly (dispatch.py)


@dataclass
class Hooks:
    """nbdkit services, provided by the plugin (defaults outside nbdkit)."""

    export_name: Callable[[], str] = lambda: ""
    peer_pid: Callable[[], int] = lambda: -1
    may_name: Callable[[int], bool] = lambda io_class: True  # a class above the default
    stopping: Callable[[], bool] = lambda: False  # nbdkit shutting down: NBD waits end


class Device:
    """One verified export: images, parameters, cache and verifier."""

    def __init__(self, config: ServerConfig, hooks: Hooks | None = None,
                 shared: Shared | None = None) -> None:
        self.config = config
        self.hooks = hooks or Hooks()
        self.shared = shared
        self.ddi = open_ddi_of(config)  # a Discoverable Disk Image, or None
        if self.ddi is None:
            self.trust = trusted_root(config)
            wait = (self.hooks.stopping, config.source_timeout)  # for an NBD URI
            self.data = open_source(config.data, "data", *wait)  # or a local file
            self.hashes = open_source(self.trust.hash_image, "hash", *wait)
        else:  # both partitions of the one image, the root from the command line or GPT
            self.trust, self.data, self.hashes = self.ddi.trust, self.ddi.data, self.ddi.hashes
        self.hash_path = self.trust.hash_image
        self.params = load_params(self.hash_path, config.tree, self.data.size(),
                                  source=self.hashes)
        self.geo = self.params.geometry()
        root = root_digest(self.trust.root_hex, self.params.digester().digest_size)
        self._check_sizes()
        if config.check_at_most_once and self.geo.data_blocks > 2**31 - 1:
            raise ConfigError("check-at-most-once: more than INT_MAX data blocks")
        self.cache = HashBlockCache(self.geo.hash_block_size, config.cache_size)
        options = VerifyOptions(config.mode, config.ignore_zero_blocks,
                                config.check_at_most_once)
        self.fec = open_fec(config, self)
        if self.ddi is None:  # a DDI's partitions are placed by its GPT
            check_layout(self.params, config.data, self.hash_path,
                         self.fec and self.fec.geo, config.fec_device)
        self.verifier = Verifier(self.params, self.data, self.hashes, root, self.cache,
                                 options, self.fec)
        try:
            self.verifier.check_root()
        except CorruptionError as e:
            raise ConfigError(f"root-hash: does not match the top of the tree ({e}): wrong "
                              f"root hash, or a corrupted hash image") from None
        self.explicit = explicit_thresholds(config)  # --threshold: always wins
        table, pinned = loaded(config.threshold_preset, self.explicit)
        self.default_class = class_index(config.default_class, "default-class")
        self.dispatcher = (
            Dispatcher(self.verifier.read, self.geo.data_block_size, table, config.workers,
                       pinned=pinned)
            if shared is None else
            Dispatcher(self.verifier.read, self.geo.data_block_size, shared.table,
                       shared.workers, shared_pool=shared.pool, pinned=shared.pinned))
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

    def _check_sizes(self) -> None:
        """Refuse images smaller than the geometry at start-up (later truncation → EIO)."""
        need = self.geo.data_size
        if self.data.size() < need:
            raise ImageIOError(f"data: {self.data.path} is {self.data.size()} bytes, the "
                               f"tree covers {need}")
        if self.hashes.size() < self.geo.hash_image_size:
            raise ImageIOError(f"hash: {self.hash_path} is {self.hashes.size()} bytes, its "
                               f"geometry needs {self.geo.hash_image_size}")

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
                "learned": self.dispatcher.learner.snapshot(),
                "class_gate": gate.snapshot(),  # the server's, shared by its exports
                "chunk_size": self.dispatcher.chunk_size, "fast_path": self.fast_path,
                "kept_thread_states": threadstate.kept(),
                "nbdkit": version_text(nbdkit_version())}  # the nbdkit running us

    def source_counters(self) -> dict:
        """source_errors and reconnects, summed over the NBD sources (0 for files)."""
        totals = {"source_errors": 0, "reconnects": 0}
        for source in (self.data, self.hashes):
            for name, value in getattr(source, "counters", dict)().items():
                totals[name] += value
        return totals

    def reset_stats(self) -> None:
        for source in (self.data, self.hashes):
            getattr(source, "reset_counters", lambda: None)()
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
        self.data.close()
        self.hashes.close()
        if self.fec is not None:
            self.fec.close()


def open_ddi_of(config: ServerConfig):
    """The DDI config names (prepare/disk.py), opened with its root settled; None when the
    data image is not served as one."""
    from ..prepare.disk import is_ddi, open_ddi  # the GPT code only for a disk image
    if config.partition is None and not is_ddi(config.data, config.hash):
        return None
    if config.hash is not None:
        raise ConfigError("hash: a DDI holds its own verity partition (give no hash image)")
    if config.fec_device is not None:
        raise ConfigError("fec-device: not supported for a DDI")
    return open_ddi(config.data, config.partition or "auto", config.root_hash,
                    config.root_hash_signature, config.trusted_certs,
                    config.require_signatures)


def open_fec(config: ServerConfig, device: Device):
    """The FEC device of config (fec-device), opened and checked; None without one."""
    if config.fec_device is None:
        if config.fec_roots != 2 or config.fec_offset:
            raise ConfigError("fec-roots, fec-offset: given without fec-device")
        return None
    from ..fec.served import ServedFec  # the codec only when FEC is configured
    return ServedFec(device.params, device.data, device.hashes, device.hash_path,
                     config.fec_device, config.fec_roots, config.fec_offset)


def trusted_root(config: ServerConfig) -> TrustedRoot:
    """The root hash to serve and what vouches for it: given, or found beside the data
    image, its signature (if any) checked; resolved once, at start-up."""
    return resolve_root(config.data, config.hash, config.root_hash,
                        config.root_hash_signature, config.trusted_certs,
                        config.require_signatures)


class Connection:
    """Per-client state: its I/O class, its Merkle readahead (readahead.py) and its fast
    path (fastpath.py: fast(buf, offset) answers the common request, or returns False)."""

    def __init__(self, device: Device, io_class: int | None = None) -> None:
        self.device = device
        self.io_class = device.default_class if io_class is None else io_class
        self.readahead = (Readahead(device.verifier, device.config.readahead_min_size)
                          if device.readahead else None)
        self.cycle = Cycle()  # its last learned request (Dispatcher.read)
        self.fast = fastpath.bind(self)  # after cycle, which it holds

    @classmethod
    def open(cls, device: Device) -> Connection:
        """A new connection, its class chosen by export name, peer ioprio or default."""
        hooks = device.hooks
        io_class = connection_class(hooks.export_name(), hooks.peer_pid(),
                                    device.default_class, hooks.may_name)
        return cls(device, io_class)

    def read(self, buf: memoryview, offset: int, chosen=None) -> None:
        """Verified read of len(buf) bytes at offset, with Merkle readahead; chosen: the
        fast path's dispatch.Choice for it, or None."""
        device = self.device
        if len(buf) == 0:
            return
        if self.readahead is not None:
            self.readahead.before_read(offset, len(buf))
        try:
            device.dispatcher.read(buf, offset, self.io_class, self.cycle, chosen)
        except ImageIOError as e:
            device.verifier.counters.add(io_errors=1)
            log(str(e))
            raise

    def cache(self, count: int, offset: int) -> None:
        """NBD_CMD_CACHE: verify and cache the hash blocks of a range."""
        if count:
            first, blocks = block_span(offset, count, self.device.geo.data_block_size)
            self.device.verifier.prefetch(first, blocks)

"""An image opened, trusted and checked: the one place the server opens an image.

OpenedImage takes a ServerConfig (prepare/config.py) to the state every read starts
from: the root of trust settled (trust/: given, or found beside the image and its
signature checked), the data and hash sources open (a local file, a block device or an
NBD URI; a DDI's two partitions), the tree's parameters read and validated
(format/params.py), the images at least as large as the tree, the areas apart
(format/areas.py), FEC opened where configured, and the top of the tree checked against
the root through the verifier that will serve it (read/verifier.py), as cryptsetup's
VERITY_verify_params precedes any activation. A one-image server and every export of a
many-export server open their image here; what serves it (schedule/, serve/) is built
on top. Anything wrong is one ConfigError or ImageIOError line, at start-up (or at the
reload that opens an export), never a request's.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError, CorruptionError, ImageIOError
from ..format.areas import check_layout
from ..format.params import VerityParams, load_params
from ..format.roothash import root_digest
from ..read.cache import HashBlockCache
from ..read.verifier import Verifier, VerifyOptions
from ..sources.ahead import AheadSource
from ..sources.remote import is_url, open_source
from ..trust.root import TrustedRoot, resolve_root
from .config import ServerConfig


class OpenedImage:
    """The sources, trust, parameters, cache, FEC and verifier of one image."""

    def __init__(self, config: ServerConfig,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.data = self.hashes = self.fec = None
        try:
            self._open(config, stopping)
        except BaseException:  # refused: what was opened is closed (a reload refuses again)
            self.close()
            raise

    def _open(self, config: ServerConfig, stopping: Callable[[], bool]) -> None:
        self.ddi = open_ddi_of(config)  # a Discoverable Disk Image, or None
        if self.ddi is None:
            self.trust = trusted_root(config)
            wait = (stopping, config.source_timeout)  # for an NBD URI
            self.data = open_source(config.data, "data", *wait)  # or a local file
            if is_url(config.data):  # a stream's next reads may start ahead of it
                self.data = AheadSource(self.data)
            self.hashes = open_source(self.trust.hash_image, "hash", *wait)
        else:  # both partitions of the one image, the root from the command line or GPT
            self.trust, self.data, self.hashes = self.ddi.trust, self.ddi.data, self.ddi.hashes
        self.hash_path = self.trust.hash_image
        self.params = checked_params(config.tree, self.data, self.hashes, self.hash_path)
        self.geo = self.params.geometry()
        root = root_digest(self.trust.root_hex, self.params.digester().digest_size)
        if config.check_at_most_once and self.geo.data_blocks > 2**31 - 1:
            raise ConfigError("check-at-most-once: more than INT_MAX data blocks")
        self.cache = HashBlockCache(self.geo.hash_block_size, config.cache_size)
        options = VerifyOptions(config.mode, config.ignore_zero_blocks,
                                config.check_at_most_once, config.prefetch_cluster)
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

    def source_counters(self) -> dict:
        """source_errors and reconnects, summed over the NBD sources (0 for files)."""
        totals = {"source_errors": 0, "reconnects": 0}
        for source in (self.data, self.hashes):
            for name, value in getattr(source, "counters", dict)().items():
                totals[name] += value
        return totals

    def reset_source_counters(self) -> None:
        for source in (self.data, self.hashes):
            getattr(source, "reset_counters", lambda: None)()

    def close(self) -> None:
        for opened in (self.data, self.hashes, self.fec):  # their waits end (NbdSource)
            if opened is not None:
                opened.close()
        verifier = getattr(self, "verifier", None)
        if verifier is not None:  # then the hash reads in flight, failed or done, end
            verifier.beside.stop()


def checked_params(tree, data, hashes, hash_path: str, whole_hash: bool = True) -> VerityParams:
    """The tree's parameters of opened sources, read and validated (format/params.py, with
    tree: the options given), and the images at least as large as the tree: what serve,
    every export and `verify` check before a block is read (later truncation: EIO).
    whole_hash: the hash image too, to its geometry's end (verify reads it as
    veritysetup does, and says what is missing when it gets there)."""
    params = load_params(hash_path, tree, data.size(), source=hashes)
    geo = params.geometry()
    if data.size() < geo.data_size:
        raise ImageIOError(f"data: {data.path} is {data.size()} bytes, the tree covers "
                           f"{geo.data_size}")
    if whole_hash and hashes.size() < geo.hash_image_size:
        raise ImageIOError(f"hash: {hash_path} is {hashes.size()} bytes, its geometry "
                           f"needs {geo.hash_image_size}")
    return params


def open_ddi_of(config: ServerConfig):
    """The DDI config names (prepare/disk.py), opened with its root settled; None when the
    data image is not served as one."""
    from .disk import is_ddi, open_ddi  # the GPT code only for a disk image
    if config.partition is None and not is_ddi(config.data, config.hash):
        return None
    if config.hash is not None:
        raise ConfigError("hash: a DDI holds its own verity partition (give no hash image)")
    if config.fec_device is not None:
        raise ConfigError("fec-device: not supported for a DDI")
    return open_ddi(config.data, config.partition or "auto", config.root_hash,
                    config.root_hash_signature, config.trusted_certs,
                    config.require_signatures)


def open_fec(config: ServerConfig, image: OpenedImage):
    """The FEC device of config (fec-device), opened and checked; None without one."""
    if config.fec_device is None:
        if config.fec_roots != 2 or config.fec_offset:
            raise ConfigError("fec-roots, fec-offset: given without fec-device")
        return None
    from ..fec.served import ServedFec  # the codec only when FEC is configured
    return ServedFec(image.params, image.data, image.hashes, image.hash_path,
                     config.fec_device, config.fec_roots, config.fec_offset)


def trusted_root(config: ServerConfig) -> TrustedRoot:
    """The root hash to serve and what vouches for it: given, or found beside the data
    image, its signature (if any) checked; resolved once, at start-up."""
    return resolve_root(config.data, config.hash, config.root_hash,
                        config.root_hash_signature, config.trusted_certs,
                        config.require_signatures)

"""FEC for a served image: the parity file, its geometry and a repairer, opened once.

The verifier calls repair() only on its error path: after a data block failed its digest
and its re-read, or a hash block failed its parent's slot (or could not be read). As in
the kernel (dm-verity-fec.c), FEC is not re-entered while it runs: looking for erasures
hashes the other blocks of the group, and a hash block it needs for that may itself fail;
that nested failure is reported, not repaired. The guard is per thread (one request's
thread state), so requests on other threads repair side by side: the repairer reads with
pread and keeps no state between calls (keep_group off: a block fixed on disk is seen).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import ImageIOError
from ..format.params import VerityParams
from ..sources.source import ImageFile
from .image import same_file
from .layout import FecGeometry, FecRepairer, MessageReader


class ServedFec:
    """The FEC device of one served image, and the one call the verifier makes."""

    def __init__(self, params: VerityParams, data: ImageFile, hashes: ImageFile,
                 hash_path: str, fec_path: str, roots: int, fec_offset: int = 0) -> None:
        self.geo = FecGeometry.from_params(params, roots, hashes.size(), fec_offset,
                                           same_file(hash_path, fec_path))
        self.file = ImageFile(fec_path, "fec")
        size = self.file.size()
        if size < self.geo.parity_end:
            self.file.close()
            raise ImageIOError(f"fec-device: {fec_path} is {size} bytes, its parity ends "
                               f"at byte {self.geo.parity_end}")
        self.repairer = FecRepairer(self.geo, MessageReader(self.geo, data, hashes), self.file)
        self._local = threading.local()

    def repair(self, index: int, check: Callable[[bytes], bool],
               suspect: Callable[[int, bytes], bool] | None = None,
               zero: Callable[[int], bool] | None = None) -> bytes | None:
        """Message block index rebuilt and matching check, or None (also when this thread
        is already inside FEC)."""
        if getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            return self.repairer.repair(index, check, suspect, zero)
        finally:
            self._local.busy = False

    def close(self) -> None:
        self.file.close()

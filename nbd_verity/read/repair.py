"""FEC on a verifier's error path (the kernel's verity_fec_decode): a data block that
failed its digest and its re-read, or that the source cannot read, rebuilt from its
codeword group (fec/served.py) and used only if it matches its trusted digest.

FecRepairs is mixed into read/verifier.py's Verifier, whose state it uses (fec, geo,
digester, counters, zero_digest, _data_want); it is apart only to keep each file to one
concern: the verifier reads and checks, this rebuilds.
"""

from __future__ import annotations

from ..errors import CorruptionError, ImageIOError
from ..log import log
from .counters import MAX_LOGGED_ERRORS


class FecRepairs:
    """The FEC half of a Verifier (see the module docstring)."""

    def _repair_data(self, block: int, piece: memoryview, want: bytes) -> bool:
        """Rebuild a data block that failed its digest and its re-read into piece."""
        if self.fec is None:
            return False
        fixed = self._repair("data", block, block, want)
        if fixed is None:
            return False
        piece[:] = fixed
        return True

    def _rebuild_unreadable(self, block: int, piece: memoryview, error: ImageIOError) -> None:
        """Rebuild into piece a data block the source cannot read, or raise its read error:
        as in the kernel, what FEC cannot rebuild then is an I/O error, not a corruption.
        The block is never marked checked (check-at-most-once): it was not read."""
        want = self._data_want(block)
        if self.zero_digest is not None and want == self.zero_digest:
            piece[:] = self._zero_block  # ignore-zero-blocks: zeros, whatever the disk
            return
        fixed = self._repair("data", block, block, want, error)
        if fixed is None:
            raise error
        piece[:] = fixed
        self.counters.verified(1)  # it matched its digest, as a repaired corrupt block

    def _repair(self, kind: str, block: int, index: int, want: bytes,
                unreadable: ImageIOError | None = None) -> bytes | None:
        """Message block index rebuilt by FEC and matching want, or None; counted and
        logged (the log capped as corruption lines are). unreadable: the error of a block
        that could not be read (counted in io_errors_repaired too)."""
        digest = self.digester.digest
        zero = self._fec_zero if self.zero_digest is not None else None
        fixed = self.fec.repair(index, lambda b: digest(b) == want, self._fec_suspect, zero)
        if fixed is None:
            self.counters.add(fec_failed=1)
            return None
        if unreadable is not None:
            self.counters.add(io_errors_repaired=1)
        if self.counters.fec_corrected() <= MAX_LOGGED_ERRORS:
            why = f" after a read error ({unreadable})" if unreadable is not None else ""
            log(f"{kind} block {block} repaired with FEC{why}")
        return fixed

    def _data_digest(self, block: int) -> bytes | None:
        """A data block's trusted digest for FEC's erasure search; None if its leaf
        cannot be had (the kernel then does not mark the block an erasure)."""
        try:
            return self._data_want(block)
        except (CorruptionError, ImageIOError):
            return None

    def _fec_suspect(self, index: int, block: bytes) -> bool:
        """Whether message block index is a data block that fails its own digest."""
        if index >= self.geo.data_blocks:
            return False
        want = self._data_digest(index)
        return want is not None and self.digester.digest(block) != want

    def _fec_zero(self, index: int) -> bool:
        """ignore-zero-blocks: a data block whose wanted digest is the zero block's."""
        return index < self.geo.data_blocks and self._data_digest(index) == self.zero_digest

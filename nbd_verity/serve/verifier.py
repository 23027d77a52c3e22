"""Verify byte ranges of the data image against the trusted tree, as dm-verity does.

Trust flows down only: the root digest is trusted; a hash block is used only after its
digest matched its slot in a verified parent (recursively up to the root), and is then
kept in the HashBlockCache and never re-read (no check/use gap). A data block is read
straight into the buffer that will be sent, hashed there, and compared with its slot in
a verified level-0 block [kernel verity_hash_for_block, verity_verify_io]. On a data
mismatch the block is re-read once into a private buffer (the kernel's verity_recheck)
before it counts as corrupt. With an FEC device, a block that still fails (and a hash block
that fails its parent's slot or cannot be read) is then rebuilt from its codeword group
and used only if it matches its trusted digest (fec/served.py, the kernel's
verity_fec_decode); only what FEC cannot rebuild counts as corrupt. What happens next
depends on the error mode (docs/server.md, "Error modes"). A data read the source fails is,
with an FEC device, read again block by block and each block that still cannot be read is
rebuilt the same way (the kernel's verity_end_io goes on to verification when FEC is
enabled); one that cannot be rebuilt fails the request with its read error (EIO), not as a
corruption.
Merkle readahead (fs-verity) fetches many level-0 blocks in one read and verifies them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import CorruptionError, DataCorruption, HashCorruption, ImageIOError
from ..format.blocks import split_request
from ..format.digest import READ_FAILED
from ..format.params import VerityParams
from ..log import log
from ..sources.source import ImageFile
from .cache import HashBlockCache
from .config import EIO, IGNORE_CORRUPTION
from .tally import Tally

if TYPE_CHECKING:
    from ..fec.served import ServedFec

MAX_LOGGED_ERRORS = 100  # the kernel's DM_VERITY_MAX_CORRUPTED_ERRS


@dataclass(frozen=True)
class VerifyOptions:
    """dm-verity's optional behaviours (the kernel's table arguments; docs/server.md)."""

    mode: str = EIO
    ignore_zero_blocks: bool = False
    check_at_most_once: bool = False


class Counters:
    """Totals kept for the control socket, counted per thread without a lock (tally.py)."""

    FIELDS = ("data_blocks_verified", "hash_reads", "hash_blocks_read", "corruptions",
              "readaheads", "io_errors", "fec_corrected", "fec_failed",
              "io_errors_repaired")
    _INDEX: ClassVar[dict[str, int]] = {name: i for i, name in enumerate(FIELDS)}

    def __init__(self) -> None:
        self._tally = Tally(len(self.FIELDS))
        self._lock = threading.Lock()  # orders corruptions for the log cap only
        self._seen = 0
        self._repaired = 0  # FEC repairs, ordered for the log cap
        self.corrupted = False  # status 'C' once any corruption was seen; never cleared

    def reset(self) -> None:
        self._tally.reset()
        with self._lock:
            self._seen = self._repaired = 0

    def row(self) -> list[int]:
        """This thread's row, in FIELDS order (serve/fastpath.py adds to it in place)."""
        return self._tally.row()

    def add(self, **amounts: int) -> None:
        row = self._tally.row()
        for name, amount in amounts.items():
            row[self._INDEX[name]] += amount

    def verified(self, blocks: int) -> None:
        """The hot path's one counter: data blocks that matched their trusted digest
        (data_blocks_verified; a corrupt block counts in corruptions instead)."""
        self._tally.row()[0] += blocks

    def corruption(self) -> int:
        """Count a corruption; return how many were seen, this one included (in order)."""
        self.corrupted = True
        self.add(corruptions=1)
        with self._lock:
            self._seen += 1
            return self._seen

    def fec_corrected(self) -> int:
        """Count a block FEC rebuilt; return how many were, this one included. The status
        stays 'V': as the kernel, only what FEC cannot repair is a corruption."""
        self.add(fec_corrected=1)
        with self._lock:
            self._repaired += 1
            return self._repaired

    def snapshot(self) -> dict:
        return dict(zip(self.FIELDS, self._tally.totals(), strict=True))

    @property
    def corruptions(self) -> int:
        return self.snapshot()["corruptions"]

    @property
    def status(self) -> str:
        """'V' while every check passed, 'C' after a corruption (as dmsetup status)."""
        return "C" if self.corrupted else "V"


class Verifier:
    """Reads and verifies data ranges of one verity device."""

    def __init__(self, params: VerityParams, data: ImageFile, hashes: ImageFile, root: bytes,
                 cache: HashBlockCache, options: VerifyOptions = VerifyOptions(),
                 fec: ServedFec | None = None) -> None:
        self.params = params
        self.geo = params.geometry()
        self.digester = params.digester()
        self.data, self.hashes, self.root = data, hashes, root
        self.cache, self.options = cache, options
        self.fec = fec
        self.counters = Counters()
        dbs = self.geo.data_block_size
        self._zero_block = bytes(dbs)
        self.zero_digest = (self.digester.digest(self._zero_block)
                            if options.ignore_zero_blocks else None)
        self._verified_bitmap = (bytearray((self.geo.data_blocks + 7) // 8)
                                 if options.check_at_most_once else None)
        # Runs of blocks can be compared with their leaf at once unless a block may be
        # skipped (check-at-most-once), zero-filled (ignore-zero-blocks) or is the root.
        self._whole_runs = not (self.geo.levels == 0 or options.check_at_most_once
                                or options.ignore_zero_blocks)
        # The native engine reads and verifies an aligned run within one leaf in one call,
        # from a local file's descriptor (an NBD source reads through libnbd instead).
        self._hasher = self.digester.native if self._whole_runs else None
        self._reads_native = self._hasher is not None and isinstance(data, ImageFile)
        # serve/fastpath.py may answer aligned reads under one cached leaf itself: its
        # success path is _read_verify's, and everything else comes back here.
        self.fast_path_ready = self._reads_native

    # -- start-up ---------------------------------------------------------------------

    def check_root(self) -> None:
        """Verify the top of the tree against the root hash; raise if it does not match."""
        if self.geo.levels == 0:
            block = self.data.read(self.geo.data_block_size, 0)
            if self.digester.digest(block) != self.root:
                raise DataCorruption(0, "does not match the root hash")
            return
        top = self.geo.levels - 1
        self._hash_block(top, 0, strict=True)

    # -- hash blocks ------------------------------------------------------------------

    def _hash_block(self, level: int, index: int, strict: bool = False) -> bytes:
        """The verified hash block `index` of `level`, from the cache or checked now."""
        block = self.geo.level_start[level] + index
        data = self.cache.get(block)
        if data is not None:
            return data
        hbs = self.geo.hash_block_size
        unreadable = None
        try:
            data = bytes(self.hashes.read(hbs, block * hbs))
        except ImageIOError as e:
            if self.fec is None:
                raise
            data, unreadable = None, e  # FEC may rebuild it, as the kernel tries
        self.counters.add(hash_reads=1, hash_blocks_read=1)
        want = self._wanted_for_hash_block(level, index)
        if data is not None and self.digester.digest(data) == want:
            self.cache.put(block, level, data)
            return data
        if self.fec is not None:
            fixed = self._repair("metadata", block,
                                 self.fec.geo.index_of_hash_block(block), want, unreadable)
            if fixed is not None:  # checked against want: verified, so cached
                self.cache.put(block, level, fixed)
                return fixed
            if unreadable is not None:
                raise unreadable
        error = HashCorruption(block, level)
        if strict:
            raise error
        self._corruption(error)
        return data  # ignore-corruption: used, but never cached as verified

    def _wanted_for_hash_block(self, level: int, index: int) -> bytes:
        """The trusted digest a hash block must have: the root, or its parent's slot."""
        if level == self.geo.levels - 1:
            return self.root
        parent_index, offset = self.geo.parent_slot(index)
        return self.digester.stored(self._hash_block(level + 1, parent_index), offset)

    def prefetch(self, first_block: int, blocks: int) -> int:
        """Merkle readahead: read the level-0 blocks for these data blocks in one read,
        verify each against its parent and cache it. Returns how many were added."""
        geo = self.geo
        if geo.levels == 0 or blocks <= 0:
            return 0
        return self.prefetch_leaves(geo.parent_slot(first_block)[0],
                                    geo.parent_slot(first_block + blocks - 1)[0])

    def prefetch_leaves(self, lo: int, hi: int) -> int:
        """Read level-0 blocks lo..hi (clipped to the tree) in one read, verify each
        against its parent and cache it; cached ends are not read again. Returns how
        many were added. A failed read adds none: readahead is a hint, and the read
        that needs a block reports the problem."""
        geo = self.geo
        if geo.levels == 0:
            return 0
        hi = min(hi, geo.level_blocks[0] - 1)
        start = geo.level_start[0]
        while lo <= hi and self.cache.contains(start + lo):  # trim cached ends
            lo += 1
        while hi >= lo and self.cache.contains(start + hi):
            hi -= 1
        if lo > hi:
            return 0
        hbs = geo.hash_block_size
        try:
            run = self.hashes.read((hi - lo + 1) * hbs, (start + lo) * hbs)
        except ImageIOError:
            return 0
        self.counters.add(hash_reads=1, hash_blocks_read=hi - lo + 1, readaheads=1)
        added = 0
        # One call hashes the whole run (the native engine pairs blocks on SHA-NI).
        slots, slot_size = self.digester.slots_of(run, hbs), self.digester.slot_size
        for index in range(lo, hi + 1):
            if self.cache.contains(start + index):
                continue
            data = bytes(run[(index - lo) * hbs:(index - lo + 1) * hbs])
            try:
                want = self._wanted_for_hash_block(0, index)
            except (CorruptionError, ImageIOError):
                return added
            if self.digester.stored(slots, (index - lo) * slot_size) == want:
                self.cache.put(start + index, 0, data)
                added += 1
        return added

    # -- data -------------------------------------------------------------------------

    def read(self, buf: memoryview, offset: int) -> None:
        """Fill buf with verified bytes of the device at offset (any alignment).

        A run shorter than the digester's release_size is hashed with the GIL held, so
        that one thread's request runs start to end without handing the GIL to the other
        nbdkit threads at every block; a longer one (a pool chunk, a large inline read)
        is hashed with it released, on several cores at once."""
        dbs = self.geo.data_block_size
        if not offset % dbs and not len(buf) % dbs:  # aligned: the common case, no split
            if self._reads_native and self._read_verify(buf, offset):
                return
            self._read_blocks(buf, offset // dbs, len(buf) // dbs)
            return
        for seg in split_request(offset, len(buf), dbs):
            if seg.whole:
                target = buf[seg.buf_offset:seg.buf_offset + seg.length]
                self._read_blocks(target, seg.first_block, seg.blocks)
            else:
                scratch = memoryview(bytearray(dbs))
                self._read_blocks(scratch, seg.first_block, 1)
                buf[seg.buf_offset:seg.buf_offset + seg.length] = (
                    scratch[seg.skip:seg.skip + seg.length])

    def _read_verify(self, buf: memoryview, offset: int) -> bool:
        """Native: read an aligned run that lies under one leaf and verify it in one call
        (preadv into buf, then hash). False, having done nothing, if the run spans leaves."""
        geo = self.geo
        dbs = geo.data_block_size
        first, count = offset // dbs, len(buf) // dbs
        if geo.run_under_parent(first, count) < count:
            return False
        leaf_index, start = geo.parent_slot(first)
        leaf = self._hash_block(0, leaf_index)  # the slots at start: no slice, no copy
        bad = self._hasher.read_verify(self.data.fd, buf, offset, dbs, leaf, start)
        if bad == -1:
            self.counters.verified(count)
            return True
        if bad == READ_FAILED:  # read again in Python: the exact ImageIOError, or FEC
            self._read_blocks(buf, first, count)
            return True
        self._after_run(buf, first, count, bad)
        return True

    def _read_blocks(self, mv: memoryview, first: int, count: int) -> None:
        """Read `count` data blocks from `first` into mv and verify them; with FEC, a read
        the source fails goes on block by block (_read_or_rebuild)."""
        try:
            self.data.read_into(mv, first * self.geo.data_block_size)
        except ImageIOError as error:
            if self.fec is None:
                raise
            self._read_or_rebuild(mv, first, count, error)
            return
        self._verify_blocks(mv, first, count)

    def _read_or_rebuild(self, mv: memoryview, first: int, count: int,
                         error: ImageIOError) -> None:
        """The source failed a read of these blocks: read them one at a time, verify those
        that read and rebuild those that do not, so that one bad block fails no other."""
        if count == 1:
            self._rebuild_unreadable(first, mv, error)
            return
        dbs = self.geo.data_block_size
        for i in range(count):
            block, piece = first + i, mv[i * dbs:(i + 1) * dbs]
            try:
                self.data.read_into(piece, block * dbs)
            except ImageIOError as block_error:
                self._rebuild_unreadable(block, piece, block_error)
                continue
            self._verify_blocks(piece, block, 1)

    def _after_run(self, mv: memoryview, first: int, count: int, bad: int) -> None:
        """Count a checked run; from its first differing block on, take the general path."""
        if bad < 0:
            self.counters.verified(count)
            return
        self.counters.verified(bad)
        dbs = self.geo.data_block_size
        self._verify_blocks_one_by_one(mv[bad * dbs:], first + bad, count - bad)

    def _verify_blocks(self, mv: memoryview, first: int, count: int) -> None:
        """Check `count` consecutive data blocks held in mv (in place), one level-0 block
        at a time: the run is hashed and compared with its slots in one call, and only
        from a block that differs on is it examined block by block."""
        if not self._whole_runs:
            self._verify_blocks_one_by_one(mv, first, count)
            return
        geo = self.geo
        dbs, slot = geo.data_block_size, geo.slot_size
        verify = self.digester.verify
        done = 0
        while done < count:
            block = first + done
            run = geo.run_under_parent(block, count - done)
            leaf_index, start = geo.parent_slot(block)
            leaf = self._hash_block(0, leaf_index)
            piece = mv[done * dbs:(done + run) * dbs]
            bad = verify(piece, dbs, leaf[start:start + run * slot])
            self._after_run(piece, block, run, bad)
            done += run

    def _verify_blocks_one_by_one(self, mv: memoryview, first: int, count: int) -> None:
        """The general path: zero blocks, check-at-most-once, recheck and errors. Only
        blocks that matched their digest (as read, re-read or rebuilt) count as verified,
        also those before a corruption that fails the request."""
        geo, d = self.geo, self.digester
        dbs = geo.data_block_size
        bitmap, zero = self._verified_bitmap, self.zero_digest
        leaves: dict[int, bytes] = {}  # the leaf of this run, fetched once
        matched = 0
        try:
            for i in range(count):
                block = first + i
                if bitmap is not None and bitmap[block >> 3] & (1 << (block & 7)):
                    continue
                want = self._data_want(block, leaves)
                piece = mv[i * dbs:(i + 1) * dbs]
                if zero is not None and want == zero:
                    piece[:] = self._zero_block  # the kernel returns zeros without hashing
                    continue
                if d.digest(piece) != want and not self._recheck(block, piece, want):
                    if self._repair_data(block, piece, want):
                        matched += 1  # not marked checked: the block on disk is still bad
                    else:
                        self._corruption(DataCorruption(block))  # counted there, not here
                    continue
                matched += 1
                if bitmap is not None:
                    bitmap[block >> 3] |= 1 << (block & 7)
        finally:
            self.counters.verified(matched)

    def _recheck(self, block: int, piece: memoryview, want: bytes) -> bool:
        """Re-read a mismatching block privately; if it now matches, use that copy. With
        FEC, a re-read that fails leaves the block to FEC."""
        dbs = self.geo.data_block_size
        try:
            fresh = self.data.read(dbs, block * dbs)
        except ImageIOError:
            if self.fec is None:
                raise
            return False
        if self.digester.digest(fresh) != want:
            return False
        piece[:] = fresh
        return True

    # -- forward error correction: the error path only --------------------------------

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

    def _data_want(self, block: int, leaves: dict[int, bytes] | None = None) -> bytes:
        """A data block's trusted digest: the root, or its slot in its verified leaf
        (kept in leaves, when given, for the next block of the same run)."""
        if self.geo.levels == 0:
            return self.root
        leaf_index, offset = self.geo.parent_slot(block)
        if leaves is None:
            return self.digester.stored(self._hash_block(0, leaf_index), offset)
        leaf = leaves.get(leaf_index)
        if leaf is None:
            leaves.clear()
            leaf = leaves[leaf_index] = self._hash_block(0, leaf_index)
        return self.digester.stored(leaf, offset)

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

    # -- errors -----------------------------------------------------------------------

    def _corruption(self, error: CorruptionError) -> None:
        """Count and log a corruption; raise it unless the mode is ignore-corruption (what
        restart-on-corruption then does is the plugin's decision, at the edge)."""
        seen = self.counters.corruption()
        if seen <= MAX_LOGGED_ERRORS:
            log(str(error))
        if seen == MAX_LOGGED_ERRORS:
            log("reached maximum errors; further corruptions are counted, not logged")
        if self.options.mode == IGNORE_CORRUPTION:
            return
        raise error

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

from time import perf_counter
from typing import TYPE_CHECKING

from ..errors import CorruptionError, DataCorruption, HashCorruption, ImageIOError
from ..format.blocks import block_span, split_request
from ..format.digest import READ_FAILED, native_nbd_ready
from ..format.params import VerityParams
from ..log import log
from ..sources.source import ImageFile
from .beside import Beside
from .cache import HashBlockCache
from .counters import IGNORE_CORRUPTION, MAX_LOGGED_ERRORS, Counters, VerifyOptions
from .repair import FecRepairs

if TYPE_CHECKING:
    from ..fec.served import ServedFec

class Verifier(FecRepairs):
    """Reads and verifies data ranges of one verity device."""

    def __init__(self, params: VerityParams, data: ImageFile, hashes: ImageFile, root: bytes,
                 cache: HashBlockCache, options: VerifyOptions | None = None,
                 fec: ServedFec | None = None) -> None:
        self.params = params
        self.geo = params.geometry()
        self.digester = params.digester()
        self.data, self.hashes, self.root = data, hashes, root
        options = options or VerifyOptions()
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
        # ... and aligned reads under one cached leaf from an NBD source's idle connection
        # (read_idle), verified with the same native call as verify_blocks' runs.
        self.fast_reads = (getattr(data, "read_idle", None) if self._hasher is not None
                           else None)
        # ... both in one native call where it runs (read_verify_idle, Hasher.nbd_read_verify)
        checked = getattr(data, "read_verify_idle", None) if self.fast_reads else None
        self.fast_checked_reads = checked if checked and native_nbd_ready() else None
        # a cold request's hash blocks read beside its data
        self.beside = Beside(self, options.prefetch_cluster)

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
        if level == 0 and not strict:  # a missing leaf comes with its prefetch cluster
            lo, hi = self.uncached(0, *self.beside.widen(index, index))
            if lo < hi and self.prefetch_leaves(lo, hi, readahead=False):  # not it alone
                data = self.cache.get(block)
                if data is not None:
                    return data
        hbs = self.geo.hash_block_size
        unreadable = None
        try:
            started = perf_counter()
            data = bytes(self.hashes.read(hbs, block * hbs))
            self.beside.latency.add(perf_counter() - started)
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

    def uncached(self, level: int, lo: int, hi: int) -> tuple[int, int]:
        """Blocks lo..hi of a level without their cached ends (lo > hi: all cached)."""
        start = self.geo.level_start[level]
        while lo <= hi and self.cache.contains(start + lo):
            lo += 1
        while hi >= lo and self.cache.contains(start + hi):
            hi -= 1
        return lo, hi

    def prefetch_leaves(self, lo: int, hi: int, readahead: bool = True) -> int:
        """Read level-0 blocks lo..hi (clipped to the tree) in one read, verify each
        against its parent and cache it; cached ends are not read again. Returns how
        many were added. A failed read adds none: readahead is a hint, and the read
        that needs a block reports the problem. readahead: counted as Merkle readahead
        (False: a missing leaf's prefetch cluster, _hash_block)."""
        geo = self.geo
        if geo.levels == 0:
            return 0
        lo, hi = self.uncached(0, lo, min(hi, geo.level_blocks[0] - 1))
        if lo > hi:
            return 0
        start = geo.level_start[0]
        hbs = geo.hash_block_size
        try:
            run = self.hashes.read((hi - lo + 1) * hbs, (start + lo) * hbs)
        except ImageIOError:
            return 0
        self.counters.add(hash_reads=1, hash_blocks_read=hi - lo + 1,
                          readaheads=int(readahead))
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
        if not len(buf):
            return
        first, count = block_span(offset, len(buf), dbs)
        fetch = self.beside.start(first, count)  # None: cached, or the hashes answer fast
        if not offset % dbs and not len(buf) % dbs:  # aligned: the common case, no split
            if fetch is None and self._reads_native and self._read_verify(buf, offset):
                return
            self._read_blocks(buf, first, count, fetch)
            return
        if fetch is not None:  # the levels at once, before the split's reads
            fetch.finish()
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

    def _read_blocks(self, mv: memoryview, first: int, count: int, fetch=None) -> None:
        """Read `count` data blocks from `first` into mv and verify them; with FEC, a read
        the source fails goes on block by block (_read_or_rebuild). fetch: their hash
        blocks' reads in flight (beside.py), finished once the data is in."""
        try:
            self.data.read_into(mv, first * self.geo.data_block_size)
        except ImageIOError as error:
            if fetch is not None:
                fetch.finish()
            if self.fec is None:
                raise
            self._read_or_rebuild(mv, first, count, error)
            return
        if fetch is not None:
            fetch.finish()
        self.verify_blocks(mv, first, count)

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
            self.verify_blocks(piece, block, 1)

    def _after_run(self, mv: memoryview, first: int, count: int, bad: int) -> None:
        """Count a checked run; from its first differing block on, take the general path."""
        if bad < 0:
            self.counters.verified(count)
            return
        self.counters.verified(bad)
        dbs = self.geo.data_block_size
        self._verify_blocks_one_by_one(mv[bad * dbs:], first + bad, count - bad)

    def verify_blocks(self, mv: memoryview, first: int, count: int) -> None:
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

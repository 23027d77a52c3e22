"""Build a verity tree (`format`) and check a whole image offline (`verify`).

One tree walk serves both, as cryptsetup's create_or_verify (lib/verity/verity_hash.c):
walk_level packs the slots of one level (the data for level 0) into the hash blocks of
the level above and writes them (format) or compares them with the disk (verify).
Format walks data → level 0, then level 1 .. top, then takes the root; verify makes the
same passes in compare mode from the root down, the data last, so that each block is
judged only under trusted ones.

Both stream: the data is mapped window by window and hashed by one process per CPU
(this one and forked workers, see data_slot_chunks); upper levels are read back from the
hash image level by level. Memory depends on the window size, not on the image size.
All I/O goes through nbd_verity.sources.source: the data image is only ever opened read-only
(ImageFile), the hash image for writing only by format (HashImageWriter).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from ..errors import CorruptionError, DataCorruption, HashCorruption, ImageIOError
from ..sources.source import HashImageWriter, ImageFile
from .digest import Digester
from .geometry import TreeGeometry
from .params import VerityParams
from .superblock import SUPERBLOCK_SIZE

SB_WRITE_BLOCK = 4096  # veritysetup's largest superblock write for a file (see below)
LEVEL_READ_SIZE = 8 << 20  # bytes of hash image per read when walking a level
WINDOW_SIZE = 32 << 20  # bytes of data one worker maps and hashes at a time
WORKER_PIPE_SIZE = 1 << 20  # a worker's pipe holds the slots of a few windows
Progress = Callable[[int], None]  # called with bytes of data just processed


def data_slot_chunks(data: ImageFile, geo: TreeGeometry, digester: Digester,
                     progress: Progress | None = None,
                     workers: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield (first data block, concatenated slots) for all data blocks, in order.

    Window i is hashed by worker i % workers: worker 0 is this process, the others are
    forked children that send their windows' slots back through a pipe. Processes, not
    threads: hashlib releases the GIL while it hashes a block, but each block also needs
    about 0.5 µs of Python with the GIL held, and two threads handing it to each other
    250 000 times per GiB cost more (1 GiB here: 0.55 s wall and 0.95 s CPU with two
    threads, 0.42 s and 0.82 s with two processes). We fork only while no other
    thread runs; otherwise, or for a single window, this process hashes everything.
    """
    reader = WindowReader(data, geo)
    per_window = max(WINDOW_SIZE, geo.data_block_size) // geo.data_block_size
    windows = [(start, min(per_window, geo.data_blocks - start))  # (first block, count)
               for start in range(0, geo.data_blocks, per_window)]
    workers = min(workers or default_workers(), len(windows)) if _may_fork() else 1
    children: list[tuple[int, BinaryIO]] = []  # (pid, the pipe its slots come through)
    done = False
    try:
        for k in range(1, workers):
            children.append(_fork_worker(reader, digester, windows[k::workers]))
        for i, (start, count) in enumerate(windows):
            k = i % workers
            if k == 0:
                slots = digester.slots_of(reader.view(start, count), geo.data_block_size)
            else:
                slots = _receive(children[k - 1][1], data.path)
            if progress:
                progress(count * geo.data_block_size)
            yield start, slots
        done = True
    finally:
        for pid, pipe in children:
            pipe.close()
            if not done:  # the caller gave up, or a worker failed: stop the others
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def default_workers() -> int:
    """One hashing process per CPU this process may run on, at most four."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _may_fork() -> bool:
    """fork() is safe only while this process runs a single thread."""
    return hasattr(os, "fork") and threading.active_count() == 1


class WindowReader:
    """The data image as windows of whole blocks (ImageFile.window: mapped if it can be).

    A mapped image must not shrink (SIGBUS), so its size is checked first; veritysetup
    gives wrong results in that case anyway.
    """

    def __init__(self, image: ImageFile, geo: TreeGeometry) -> None:
        size = image.size()
        if size < geo.data_size:
            raise ImageIOError(f"{image.path}: image ends at byte {size}, "
                               f"{geo.data_size} needed")
        self.image, self.geo = image, geo

    def view(self, start: int, count: int) -> memoryview:
        """The bytes of count blocks from block start (windows are page-aligned)."""
        dbs = self.geo.data_block_size
        return self.image.window(start * dbs, count * dbs)


def _fork_worker(reader: WindowReader, digester: Digester,
                 windows: list[tuple[int, int]]) -> tuple[int, BinaryIO]:
    """Fork a child that hashes windows in order and sends each one's slots; return
    (pid, the pipe to read them from)."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # room for a few windows' slots: fewer stalls
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, WORKER_PIPE_SIZE)
    pid = os.fork()
    if pid:
        os.close(write_end)
        return pid, os.fdopen(read_end, "rb")
    status = 0  # the child: never returns, never runs the parent's cleanup
    try:
        os.close(read_end)
        pipe = os.fdopen(write_end, "wb")
        for start, count in windows:
            _send(pipe, 0, digester.slots_of(reader.view(start, count),
                                             reader.geo.data_block_size))
    except BaseException as e:  # every failure, even ^C, is reported to the parent
        status = 1
        with contextlib.suppress(BaseException):
            _send(pipe, 1, (str(e) or f"{reader.image.path}: hashing stopped ({e!r})").encode())
    finally:
        os._exit(status)


_HEADER = struct.Struct("<BQ")  # kind (0 slots, 1 error message), payload bytes


def _send(pipe: BinaryIO, kind: int, payload: bytes) -> None:
    pipe.write(_HEADER.pack(kind, len(payload)))
    pipe.write(payload)
    pipe.flush()


def _receive(pipe: BinaryIO, what: str) -> bytes:
    """The next window's slots from a worker, or its failure as ImageIOError."""
    header = pipe.read(_HEADER.size)  # a buffered read returns all of it, or less at EOF
    kind, size = _HEADER.unpack(header) if len(header) == _HEADER.size else (2, 0)
    payload = pipe.read(size)
    if kind > 1 or len(payload) < size:
        raise ImageIOError(f"{what}: a hashing process stopped unexpectedly")
    if kind:
        raise ImageIOError(payload.decode(errors="replace"))
    return payload


def pack_blocks(slots: bytes, geo: TreeGeometry) -> bytes:
    """Lay slots into hash blocks: hpb slots each, the rest of each block zero."""
    per_block = geo.hashes_per_block * geo.slot_size
    if per_block == geo.hash_block_size:  # format 1: slots fill blocks exactly
        tail = len(slots) % per_block
        return slots + bytes(per_block - tail) if tail else slots
    pad = bytes(geo.hash_block_size - per_block)
    out = []
    for off in range(0, len(slots), per_block):
        piece = slots[off:off + per_block]
        out.append(piece + bytes(per_block - len(piece)) + pad)
    return b"".join(out)


def level_slot_chunks(hashes: ImageFile, geo: TreeGeometry, level: int,
                      digester: Digester) -> Iterator[tuple[int, bytes]]:
    """Yield (first block, concatenated slots) for the blocks of one level, in order,
    read LEVEL_READ_SIZE bytes at a time: what the level above holds."""
    hbs = geo.hash_block_size
    total = geo.level_blocks[level]
    per_read = max(1, LEVEL_READ_SIZE // hbs)
    for first in range(0, total, per_read):
        n = min(per_read, total - first)
        buf = hashes.read_exact(n * hbs, (geo.level_start[level] + first) * hbs)
        yield first, digester.slots_of(buf, hbs)


def walk_level(hashes: ImageFile, geo: TreeGeometry, level: int,
               slot_chunks: Generator[tuple[int, bytes], None, None],
               check: LevelCheck | None = None) -> None:
    """One pass of cryptsetup's create_or_verify: pack the slots of the level below (the
    data blocks for level 0), in order, into the hash blocks of level, and write those
    (format: hashes is a HashImageWriter) or, given a check, compare them with the blocks
    on disk (verify). Slots arrive in chunks that need not end on a hash block."""
    per_block = geo.hashes_per_block * geo.slot_size
    index = 0  # the next block of this level
    carry = b""  # slots of a block the next chunk completes
    with contextlib.closing(slot_chunks):  # on an error, data workers are stopped now
        for _, slots in slot_chunks:
            pending = carry + slots if carry else slots
            whole = len(pending) - len(pending) % per_block
            carry = pending[whole:]
            index = _put_blocks(hashes, geo, level, index, pending[:whole], check)
    _put_blocks(hashes, geo, level, index, carry, check)  # the last block, zero-filled


def _put_blocks(hashes: ImageFile, geo: TreeGeometry, level: int, index: int, slots: bytes,
                check: LevelCheck | None) -> int:
    """Write or check the blocks of level from index on that hold slots; the next index."""
    if not slots:
        return index
    count = -(-len(slots) // (geo.hashes_per_block * geo.slot_size))
    offset = (geo.level_start[level] + index) * geo.hash_block_size
    if check is None:
        hashes.pwrite_all(pack_blocks(slots, geo), offset)
    else:
        check.compare(index, slots, hashes.read_exact(count * geo.hash_block_size, offset))
    return index + count


def top_digest(data: ImageFile, hashes: ImageFile, geo: TreeGeometry,
               digester: Digester) -> bytes:
    """What the root hash is the digest of: the top hash block, or the only data block
    of a tree with no level."""
    if geo.levels == 0:
        return digester.digest(data.read_exact(geo.data_block_size, 0))
    return digester.digest(hashes.read_exact(geo.hash_block_size,
                                             geo.level_start[-1] * geo.hash_block_size))


def build_tree(data_path: str, hash_path: str, params: VerityParams,
               progress: Progress | None = None) -> bytes:
    """Write the superblock (unless disabled) and the tree; return the root digest.
    A hash image this call created is removed again if the build fails."""
    params.check()
    with ImageFile(data_path, "data") as data, HashImageWriter(hash_path) as hashes:
        try:
            return _build(data, hashes, params, progress)
        except BaseException:
            hashes.discard()
            raise


def _build(data: ImageFile, hashes: HashImageWriter, params: VerityParams,
           progress: Progress | None) -> bytes:
    """Data → level 0, then each level from the one below it up to the top; the root."""
    geo, digester = params.geometry(), params.digester()
    if geo.levels:  # a block device must hold the whole tree: checked before writing
        hashes.check_room(geo.hash_image_size)
    elif params.superblock:
        hashes.check_room(_superblock_end(params))
    if params.superblock:
        hashes.pwrite_all(params.to_superblock().pack(), params.hash_offset)
    if geo.levels == 0:
        if params.superblock:
            hashes.extend_to(_superblock_end(params))
        return top_digest(data, hashes, geo, digester)
    walk_level(hashes, geo, 0, data_slot_chunks(data, geo, digester, progress))
    for level in range(1, geo.levels):
        walk_level(hashes, geo, level, level_slot_chunks(hashes, geo, level - 1, digester))
    root = top_digest(data, hashes, geo, digester)
    hashes.sync()
    return root


def _superblock_end(params: VerityParams) -> int:
    """Where the hash image ends when a superblock but no tree is written, as veritysetup
    2.6.1 leaves it: it writes one whole block of min(hash block size, 4096) bytes
    (measured: hbs 512 → offset + 512, hbs 8192 → offset + 4096)."""
    block = min(params.hash_block_size, SB_WRITE_BLOCK)
    return -(-(params.hash_offset + SUPERBLOCK_SIZE) // block) * block


@dataclass
class VerifyReport:
    """What an offline verify found: the first bad blocks, and how many in all."""

    bad: list[CorruptionError] = field(default_factory=list)
    bad_count: int = 0
    limit: int = 10

    def add(self, error: CorruptionError) -> None:
        self.bad_count += 1
        if len(self.bad) < self.limit:
            self.bad.append(error)

    @property
    def ok(self) -> bool:
        return self.bad_count == 0


@dataclass
class LevelCheck:
    """walk_level's compare mode for one level: which of its blocks are untrusted, and
    what the blocks below them turn out to be.

    A block is untrusted when it failed its own check or sits under one that did. The
    children of an untrusted block are untrusted too but not reported: only the highest
    bad block of a branch is (the kernel could not tell more either). The rest of a block
    after its slots (format 0's padding, the last block's unused slots) is not compared.
    """

    geo: TreeGeometry
    digester: Digester
    report: VerifyReport
    untrusted: bytearray  # one byte per block of this level, 1 = untrusted
    corruption: Callable[[int], CorruptionError]  # the error for a bad child, by index
    children_untrusted: bytearray | None = None  # filled in, unless the children are data

    def compare(self, index: int, slots: bytes, stored: bytes) -> None:
        """Compare the slots of blocks index.. with the same blocks as stored."""
        geo = self.geo
        per_block, hbs = geo.hashes_per_block * geo.slot_size, geo.hash_block_size
        for k, at in enumerate(range(0, len(slots), per_block)):
            ours = slots[at:at + per_block]
            theirs = stored[k * hbs:k * hbs + len(ours)]
            first_child = geo.first_child(index + k)
            if self.untrusted[index + k]:
                self._distrust(first_child, len(ours) // geo.slot_size)
            elif theirs != ours:
                self._compare_slots(first_child, ours, theirs)

    def _compare_slots(self, first_child: int, ours: bytes, theirs: bytes) -> None:
        """Report each child whose digest differs from the one stored (padding aside)."""
        for k in self.digester.differing_slots(ours, theirs):
            self._distrust(first_child + k, 1)
            self.report.add(self.corruption(first_child + k))

    def _distrust(self, first_child: int, count: int) -> None:
        if self.children_untrusted is not None:
            self.children_untrusted[first_child:first_child + count] = b"\x01" * count


def verify_image(data_path: str, hash_path: str, params: VerityParams, root: bytes,
                 progress: Progress | None = None, limit: int = 10) -> VerifyReport:
    """Check every hash block top-down from the root, then every data block."""
    with ImageFile(data_path, "data") as data, ImageFile(hash_path, "hash") as hashes:
        return verify_opened(data, hashes, params, root, progress, limit)


def verify_opened(data, hashes, params: VerityParams, root: bytes,
                  progress: Progress | None = None, limit: int = 10) -> VerifyReport:
    """verify_image on opened images (ImageFile, or a DDI's PartitionSource)."""
    geo, report = params.geometry(), VerifyReport(limit=limit)
    hash_size = hashes.size()
    if geo.levels and geo.hash_image_size > hash_size:  # no level reads no hash block
        raise ImageIOError(f"{hashes.path}: hash image is {hash_size} bytes,"
                           f" its geometry needs {geo.hash_image_size}")
    _verify(data, hashes, params, root, report, progress)
    return report


def _verify(data: ImageFile, hashes: ImageFile, params: VerityParams, root: bytes,
            report: VerifyReport, progress: Progress | None) -> None:
    """Format's passes in compare mode: the root, then each level from the top down
    (checked by the slots of the level below it), the data last."""
    geo, digester = params.geometry(), params.digester()
    untrusted = bytearray([top_digest(data, hashes, geo, digester) != root])
    if geo.levels == 0:
        if untrusted[0]:
            report.add(DataCorruption(0))
        return
    top = geo.levels - 1
    if untrusted[0]:
        report.add(HashCorruption(geo.level_start[top], top))
    for level in range(top, 0, -1):
        check = LevelCheck(geo, digester, report, untrusted,
                           _hash_corruption(geo, level - 1),
                           bytearray(geo.level_blocks[level - 1]))
        walk_level(hashes, geo, level, level_slot_chunks(hashes, geo, level - 1, digester),
                   check)
        untrusted = check.children_untrusted
    check = LevelCheck(geo, digester, report, untrusted, DataCorruption)
    walk_level(hashes, geo, 0, data_slot_chunks(data, geo, digester, progress), check)


def _hash_corruption(geo: TreeGeometry, level: int) -> Callable[[int], CorruptionError]:
    """The error for block index of level."""
    return lambda index: HashCorruption(geo.level_start[level] + index, level)

"""Build a verity tree (`format`) and check a whole image offline (`verify`).

Both stream: the data is mapped window by window and hashed by one process per CPU
(this one and forked workers, see data_slot_chunks); upper levels are read back from the
hash image level by level. Memory depends on the window size, not on the image size.
The data image is only ever opened read-only.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from .digest import Digester
from .errors import CorruptionError, DataCorruption, HashCorruption, ImageIOError
from .geometry import TreeGeometry
from .params import VerityParams
from .superblock import SUPERBLOCK_SIZE

SB_WRITE_BLOCK = 4096  # veritysetup's largest superblock write for a file (see below)
CHUNK_SIZE = 8 << 20  # bytes of hash image per read when walking a level
WINDOW_SIZE = 32 << 20  # bytes of data one worker maps and hashes at a time
PIPE_SIZE = 1 << 20  # a worker's pipe holds the slots of a few windows
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the window in at once
Progress = Callable[[int], None]  # called with bytes of data just processed


def pread_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    """Read exactly size bytes or raise ImageIOError naming the image (what)."""
    chunks = []
    got = 0
    while got < size:
        try:
            buf = os.pread(fd, size - got, offset + got)
        except OSError as e:
            raise ImageIOError(f"{what}: {e.strerror} (reading at byte {offset + got})") from None
        if not buf:
            raise ImageIOError(f"{what}: image ends at byte {offset + got}, {offset + size} needed")
        chunks.append(buf)
        got += len(buf)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def pwrite_all(fd: int, buf: bytes, offset: int, what: str) -> None:
    """Write all of buf at offset or raise ImageIOError naming the image (what)."""
    view = memoryview(buf)
    while view:
        try:
            done = os.pwrite(fd, view, offset)
        except OSError as e:
            raise ImageIOError(f"{what}: {e.strerror} (writing at byte {offset})") from None
        view, offset = view[done:], offset + done


def open_ro(path: str) -> int:
    """Open an image read-only; the only way builder opens a data image."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ImageIOError(f"{path}: {e.strerror}") from None


def data_slot_chunks(fd: int, geo: TreeGeometry, digester: Digester,
                     progress: Progress | None = None, workers: int | None = None,
                     what: str = "data") -> Iterator[tuple[int, bytes]]:
    """Yield (first data block, concatenated slots) for all data blocks, in order.

    Window i is hashed by worker i % workers: worker 0 is this process, the others are
    forked children that send their windows' slots back through a pipe. Processes, not
    threads: hashlib releases the GIL while it hashes a block, but each block also needs
    about 0.5 µs of Python with the GIL held, and two threads handing it to each other
    250 000 times per GiB cost more (1 GiB here: 0.55 s wall and 0.95 s CPU with two
    threads, 0.42 s and 0.82 s with two processes). We fork only while no other
    thread runs; otherwise, or for a single window, this process hashes everything.
    """
    reader = WindowReader(fd, geo, what)
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
                slots = _receive(children[k - 1][1], what)
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
    """The data image as windows of whole blocks, each mapped rather than read.

    Hashing a mapped window (MAP_POPULATE) reads the page cache directly and saves
    copying every byte once (about 10% of format's CPU here); an image that cannot be
    mapped is read instead. The image must not shrink while mapped (SIGBUS), so its size
    is checked first; veritysetup gives wrong results in that case anyway.
    """

    def __init__(self, fd: int, geo: TreeGeometry, what: str) -> None:
        size = os.lseek(fd, 0, os.SEEK_END)  # st_size is 0 for a block device
        if size < geo.data_size:
            raise ImageIOError(f"{what}: image ends at byte {size}, {geo.data_size} needed")
        self.fd, self.geo, self.what = fd, geo, what
        self.use_mmap = True

    def view(self, start: int, count: int) -> memoryview:
        """The bytes of count blocks from block start (windows are page-aligned)."""
        dbs = self.geo.data_block_size
        if self.use_mmap:
            try:
                return memoryview(mmap.mmap(self.fd, count * dbs, offset=start * dbs,
                                            flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                            prot=mmap.PROT_READ))
            except (OSError, ValueError):  # e.g. a character device: read from now on
                self.use_mmap = False
        return memoryview(pread_exact(self.fd, count * dbs, start * dbs, self.what))


def _fork_worker(reader: WindowReader, digester: Digester,
                 windows: list[tuple[int, int]]) -> tuple[int, BinaryIO]:
    """Fork a child that hashes windows in order and sends each one's slots; return
    (pid, the pipe to read them from)."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # room for a few windows' slots: fewer stalls
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
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
            _send(pipe, 1, (str(e) or f"{reader.what}: hashing stopped ({e!r})").encode())
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


def level_blocks(fd: int, geo: TreeGeometry, level: int,
                 what: str = "hash") -> Iterator[tuple[int, bytes]]:
    """Yield (index in level, block bytes) for every block of one level, read in chunks."""
    hbs = geo.hash_block_size
    total = geo.level_blocks[level]
    per_read = max(1, CHUNK_SIZE // hbs)
    for first in range(0, total, per_read):
        n = min(per_read, total - first)
        buf = pread_exact(fd, n * hbs, (geo.level_start[level] + first) * hbs, what)
        for i in range(n):
            yield first + i, buf[i * hbs:(i + 1) * hbs]


def build_tree(data_path: str, hash_path: str, params: VerityParams,
               progress: Progress | None = None) -> bytes:
    """Write the superblock (unless disabled) and the tree; return the root digest.
    A hash image this call created is removed again if the build fails."""
    params.check()
    data_fd = open_ro(data_path)
    created = not os.path.exists(hash_path)
    try:
        hash_fd = os.open(hash_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        os.close(data_fd)
        raise ImageIOError(f"{hash_path}: {e.strerror}") from None
    try:
        return _build(data_fd, hash_fd, params, progress, (data_path, hash_path))
    except OSError as e:  # fsync, ftruncate: the hash image (reads and writes say which)
        failure: Exception = ImageIOError(f"{hash_path}: {e.strerror}")
    except BaseException as e:
        failure = e
    finally:
        os.close(data_fd)
        os.close(hash_fd)
    if created:
        with contextlib.suppress(OSError):
            os.unlink(hash_path)
    raise failure


def _build(data_fd: int, hash_fd: int, params: VerityParams, progress: Progress | None,
           names: tuple[str, str]) -> bytes:
    geo, digester = params.geometry(), params.digester()
    data_name, hash_name = names
    if params.superblock:
        pwrite_all(hash_fd, params.to_superblock().pack(), params.hash_offset, hash_name)
    if geo.levels == 0:  # one data block: its digest is the root
        block = pread_exact(data_fd, geo.data_block_size, 0, data_name)
        if params.superblock:
            _pad_superblock(hash_fd, params)
        return digester.digest(block)
    _write_level0(data_fd, hash_fd, geo, digester, progress, names)
    for level in range(1, geo.levels):
        slots = [digester.slot(b) for _, b in level_blocks(hash_fd, geo, level - 1, hash_name)]
        pwrite_all(hash_fd, pack_blocks(b"".join(slots), geo),
                   geo.level_start[level] * geo.hash_block_size, hash_name)
    top = pread_exact(hash_fd, geo.hash_block_size,
                      geo.level_start[-1] * geo.hash_block_size, hash_name)
    os.fsync(hash_fd)
    return digester.digest(top)


def _pad_superblock(fd: int, params: VerityParams) -> None:
    """Extend the hash image past a superblock no tree follows, as veritysetup 2.6.1 does:
    it writes one whole block of min(hash block size, 4096) bytes (measured: hbs 512 →
    offset + 512, hbs 8192 → offset + 4096). With no superblock it writes nothing."""
    block = min(params.hash_block_size, SB_WRITE_BLOCK)
    end = -(-(params.hash_offset + SUPERBLOCK_SIZE) // block) * block
    if os.lseek(fd, 0, os.SEEK_END) < end:
        os.ftruncate(fd, end)


def _write_level0(data_fd: int, hash_fd: int, geo: TreeGeometry, digester: Digester,
                  progress: Progress | None, names: tuple[str, str]) -> None:
    """Hash all data blocks and write level 0 as whole hash blocks."""
    data_name, hash_name = names
    per_block = geo.hashes_per_block * geo.slot_size
    offset = geo.level_start[0] * geo.hash_block_size
    carry = b""
    # closing(): on an error the workers are stopped now, not when the frame is freed
    with contextlib.closing(data_slot_chunks(data_fd, geo, digester, progress,
                                             what=data_name)) as chunks:
        for _, slots in chunks:
            slots = carry + slots
            whole = len(slots) - len(slots) % per_block
            carry = slots[whole:]
            packed = pack_blocks(slots[:whole], geo)
            pwrite_all(hash_fd, packed, offset, hash_name)
            offset += len(packed)
    if carry:
        pwrite_all(hash_fd, pack_blocks(carry, geo), offset, hash_name)


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


def verify_image(data_path: str, hash_path: str, params: VerityParams, root: bytes,
                 progress: Progress | None = None, limit: int = 10) -> VerifyReport:
    """Check every hash block top-down from the root, then every data block."""
    geo, digester = params.geometry(), params.digester()
    report = VerifyReport(limit=limit)
    data_fd, hash_fd = open_ro(data_path), open_ro(hash_path)
    try:
        hash_size = os.lseek(hash_fd, 0, os.SEEK_END)  # st_size is 0 for a block device
        if geo.levels and geo.hash_image_size > hash_size:  # zero levels read no hash block
            raise ImageIOError(f"{hash_path}: hash image is {hash_size} bytes,"
                               f" its geometry needs {geo.hash_image_size}")
        if geo.levels == 0:
            if digester.digest(pread_exact(data_fd, geo.data_block_size, 0, data_path)) != root:
                report.add(DataCorruption(0))
            return report
        bad = _verify_hash_levels(hash_fd, geo, digester, root, report, hash_path)
        _verify_data(data_fd, hash_fd, geo, digester, bad, report, progress,
                     (data_path, hash_path))
        return report
    finally:
        os.close(data_fd)
        os.close(hash_fd)


def _verify_hash_levels(fd: int, geo: TreeGeometry, digester: Digester, root: bytes,
                        report: VerifyReport, hash_name: str) -> bytearray:
    """Verify levels top-down; return the bad-block map of level 0 (1 = untrusted)."""
    top = geo.levels - 1
    top_block = pread_exact(fd, geo.hash_block_size,
                            geo.level_start[top] * geo.hash_block_size, hash_name)
    parent_bad = bytearray(1)
    if digester.digest(top_block) != root:
        report.add(HashCorruption(geo.level_start[top], top))
        parent_bad[0] = 1
    for level in range(top - 1, -1, -1):
        bad = bytearray(geo.level_blocks[level])
        upper = level_blocks(fd, geo, level + 1, hash_name)
        current = (-1, b"")
        for index, block in level_blocks(fd, geo, level, hash_name):
            parent_index = index >> geo.hpb_bits
            if parent_bad[parent_index]:
                bad[index] = 1  # untrusted, but only its bad ancestor is reported
                continue
            while current[0] != parent_index:
                current = next(upper)
            _, slot = geo.slot_of(level + 1, index)
            want = current[1][slot:slot + digester.digest_size]
            if digester.digest(block) != want:
                bad[index] = 1
                report.add(HashCorruption(geo.level_start[level] + index, level))
        parent_bad = bad
    return parent_bad


def _verify_data(data_fd: int, hash_fd: int, geo: TreeGeometry, digester: Digester,
                 bad_leaves: bytearray, report: VerifyReport,
                 progress: Progress | None, names: tuple[str, str]) -> None:
    """Compare each data block's digest with its slot in a verified level-0 block."""
    data_name, hash_name = names
    per_block = geo.hashes_per_block * geo.slot_size
    leaves = level_blocks(hash_fd, geo, 0, hash_name)
    carry = b""
    with contextlib.closing(data_slot_chunks(data_fd, geo, digester, progress,
                                             what=data_name)) as chunks:
        for first, slots in chunks:
            pending = carry + slots if carry else slots
            last = first + len(slots) // geo.slot_size == geo.data_blocks
            whole = len(pending) if last else len(pending) - len(pending) % per_block
            carry = pending[whole:]
            for offset in range(0, whole, per_block):  # one leaf's worth of slots
                ours, (leaf_index, leaf) = pending[offset:offset + per_block], next(leaves)
                if bad_leaves[leaf_index] or leaf[:len(ours)] == ours:
                    continue  # a bad leaf is reported itself; its data cannot be judged
                for j in range(len(ours) // geo.slot_size):
                    s = slice(j * geo.slot_size, j * geo.slot_size + digester.digest_size)
                    if ours[s] != leaf[s]:
                        report.add(DataCorruption((leaf_index << geo.hpb_bits) + j))

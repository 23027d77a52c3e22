"""How much of a local image is in the page cache: whether its reads wait on the disk.

A local image that is in the page cache is read at memory speed, and a connection's
requests are served fastest one at a time (no hand-offs between nbdkit's workers); one
that is not waits on the disk for every read, and a client's queue depth reaches the
disk only when the connection's requests are served together (docs/server.md, "Storage
with latency"). serve decides once, at start-up (serve/callbacks.py thread_model): it
asks the kernel, with mincore(2) on a read-only shared mapping, which of SAMPLES pages
spread evenly over the file are resident; nothing is read, so asking changes nothing.
A page in a hole of a sparse file (lseek SEEK_DATA) counts as resident: it is read as
zeros without the disk. A file whose share is under COLD_SHARE is cold. Where the kernel
cannot be asked (not a regular file or a block device, an empty file, no mapping), the
answer is None and the image counts as page-cached, as before this was measured.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat

SAMPLES = 256  # pages asked about, spread evenly over the image
COLD_SHARE = 0.5  # under this share of resident pages the image waits on its disk

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_share(path: str, samples: int = SAMPLES) -> float | None:
    """The share (0.0 to 1.0) of `samples` pages, spread evenly over the file or block
    device at path, that are in the page cache; None when the kernel cannot say."""
    try:  # a regular file or a block device only: a FIFO is never opened (source.py)
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        if size <= 0:
            return None
        base = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base in (None, _MAP_FAILED):
            return None
        try:
            return _share(fd, base, size, samples)
        finally:
            _munmap(base, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _share(fd: int, base: int, size: int, samples: int) -> float | None:
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    picked = sorted({pages * i // samples for i in range(samples)})
    vec = ctypes.create_string_buffer(1)
    resident = 0
    for index in picked:
        if _mincore(base + index * page, page, vec) != 0:
            return None
        resident += vec.raw[0] & 1 or _in_hole(fd, index * page, page)
    return resident / len(picked)


def _in_hole(fd: int, offset: int, page: int) -> bool:
    """Whether the page at offset lies in a hole (no data before its end)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + page
    except OSError as e:  # ENXIO: no data from offset on; another: it cannot be asked
        return e.errno == errno.ENXIO


def cold(path: str | None) -> tuple[bool, float | None]:
    """(whether a local image at path waits on its disk, the share measured)."""
    if path is None:
        return False, None
    share = resident_share(path)
    return share is not None and share < COLD_SHARE, share

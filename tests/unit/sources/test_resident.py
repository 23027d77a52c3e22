"""sources/resident.py: the share of a local image in the page cache, asked of the
kernel (mincore) on real files on the disk's file system: one just written is resident,
one evicted (POSIX_FADV_DONTNEED on clean pages) is not, a read brings back what it read,
a hole counts as resident (it is read without the disk), and an empty or missing file
has no answer."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from nbd_verity.sources import resident

MIB = 1 << 20


@pytest.fixture
def disk_dir():
    """On the disk (tmpfs pages cannot be evicted, and /tmp may be one)."""
    path = Path(tempfile.mkdtemp(prefix="nv-resident-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back: clean pages, which DONTNEED drops
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_written_file_is_resident_and_an_evicted_one_is_cold(disk_dir):
    data = disk_dir / "data.img"
    data.write_bytes(os.urandom(16 * MIB))
    assert resident.resident_share(str(data)) == 1.0
    assert resident.cold(str(data)) == (False, 1.0)
    evict(data)
    assert resident.resident_share(str(data)) == 0.0
    assert resident.cold(str(data)) == (True, 0.0)
    fd = os.open(data, os.O_RDONLY)
    try:  # the first half read back, nothing read ahead: half resident
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset in range(0, 8 * MIB, MIB):
            os.pread(fd, MIB, offset)
    finally:
        os.close(fd)
    assert resident.resident_share(str(data)) == 0.5


def test_a_hole_counts_as_resident(disk_dir):
    """A sparse image (64 MiB with 1 MiB of data at 32 MiB), evicted: only the samples in
    its data are cold."""
    data = disk_dir / "sparse.img"
    with open(data, "wb") as f:
        f.truncate(64 * MIB)
        f.seek(32 * MIB)
        f.write(os.urandom(MIB))
    evict(data)
    share = resident.resident_share(str(data))
    assert share is not None and 0.9 <= share < 1.0, share
    assert not resident.cold(str(data))[0]


def test_no_answer_is_not_cold(disk_dir):
    empty = disk_dir / "empty.img"
    empty.write_bytes(b"")
    fifo = disk_dir / "fifo"
    os.mkfifo(fifo)  # never opened: no writer would ever come
    for path in (str(empty), str(disk_dir / "missing.img"), "/dev/null", str(fifo),
                 str(disk_dir)):
        assert resident.resident_share(path) is None
        assert resident.cold(path) == (False, None)
    assert resident.cold(None) == (False, None)

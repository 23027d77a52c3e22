"""read_verify asks a file system for RWF_NOWAIT once: one that refuses it (a FUSE file,
here nbdfuse over nbdkit's file plugin) is not asked again by that hasher, and a file
that takes it is asked on every short read whose pages are cached. A file whose pages
are not cached (NOWAIT_MISSES short answers in a row) is read for the next NOWAIT_SKIP
short reads without asking, then asked once: a miss skips twice as many reads as the last
time, a cached answer ends the skipping. The preadv2 calls are counted by strace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nbd_verity.format import _native

from .upstreams import NbdkitFile, fuse_file

READS = 50
NOWAIT_MISSES, NOWAIT_SKIP = 4, 64  # _native.c's
SCRIPT = """
import os, sys
from nbd_verity.format.digest import Digester
path, evicted, cached = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = Digester("sha256", b"salt", 1)
fd = os.open(path, os.O_RDONLY)
marker = os.open("/dev/zero", os.O_RDONLY)
# No readahead: pages the kernel read ahead are still in flight when the next block is
# evicted, cannot be evicted then, and answer a later ask from the cache.
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
buf = bytearray(4096)
for i in range(evicted + cached):
    at = (i * 67 % 256) * 4096  # in no order the kernel would read ahead of
    want = d.digest(os.pread(fd, 4096, at))
    if i < evicted:  # the block's pages leave the page cache: read_verify goes to the disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    assert d.native.read_verify(fd, buf, at, 4096, want) == -1
    if i == evicted - 1:  # a block read from the disk that does not match: its index
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert d.native.read_verify(fd, buf, 4096, 4096, d.digest(bytes(4096))) == 0
        try:  # where the evicted reads end, in the trace: a preadv2 on another file
            os.preadv(marker, [bytearray(1)], 0, os.RWF_NOWAIT)
        except OSError:
            pass
print(fd, marker, d.native.nowait_refused)
"""


def preadv2_calls(path: Path, tmp_path: Path, reads: int = READS,
                  evicted: int = 0) -> tuple[list[str], list[str], str]:
    """The answers to read_verify's preadv2 calls (strace's text after "= ") while
    `evicted` short read_verify calls read path, each of a block evicted from the page
    cache just before (then one of a block that does not match), and while `reads` more
    read a block cached just before; and nowait_refused."""
    trace = tmp_path / "trace"
    run = subprocess.run(["strace", "-f", "-e", "trace=preadv2", "-o", str(trace),
                          sys.executable, "-c", SCRIPT, str(path), str(evicted),
                          str(reads)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    fd, marker, refused = run.stdout.split()
    phases: list[list[str]] = [[]]
    for line in trace.read_text().splitlines():
        if f"preadv2({marker}," in line:
            phases.append([])
        elif f"preadv2({fd}," in line:
            phases[-1].append(line.rpartition("= ")[2])
    return (phases[0], phases[-1], refused) if evicted else ([], phases[0], refused)


@pytest.fixture
def disk_dir():
    """A directory on the disk's file system (tmpfs before Linux 6.6 refuses RWF_NOWAIT
    too, and /tmp may be one)."""
    path = Path(tempfile.mkdtemp(prefix="nv-nowait-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(_native is None, reason="the native engine is not built")
def test_a_file_system_that_refuses_nowait_is_asked_once(tmp_path, sockdir, disk_dir):
    data = disk_dir / "data.img"
    data.write_bytes(os.urandom(1 << 20))
    _, asks, refused = preadv2_calls(data, tmp_path)
    # a file system that takes RWF_NOWAIT is asked on every short read; one that refuses
    # it, once (on the disk here: the first; the FUSE file below: the second)
    assert (len(asks), refused) in ((READS, "0"), (1, "1"))
    upstream = NbdkitFile(data, sockdir, "fuse-up").start()
    try:
        with fuse_file(upstream.sock, tmp_path / "fuse") as path:
            _, asks, refused = preadv2_calls(path, tmp_path)
    finally:
        upstream.stop()
    assert (len(asks), refused) == (1, "1")


@pytest.mark.skipif(_native is None, reason="the native engine is not built")
def test_a_file_not_in_the_page_cache_is_read_without_asking_then_asked_again(tmp_path,
                                                                              disk_dir):
    data = disk_dir / "data.img"
    data.write_bytes(os.urandom(1 << 20))
    os.sync()  # written back: clean pages, which POSIX_FADV_DONTNEED evicts
    _, asks, refused = preadv2_calls(data, tmp_path)
    if refused == "1":
        pytest.skip("this file system refuses RWF_NOWAIT")
    assert len(asks) == READS  # cached: asked every time
    # Evicted: NOWAIT_MISSES asks, NOWAIT_SKIP reads that do not ask, one ask (a miss),
    # twice as many that do not, one ask (a miss): 6 asks, and 4 * NOWAIT_SKIP reads
    # left to skip. The block that does not match is one of them (its index, as from
    # the page cache). Then cached reads: the skip's last reads do not ask, the first
    # that asks is answered from the cache, and from there every read asks again.
    # A loaded machine can keep an evicted page cached (the kernel does not drop a page
    # another CPU still holds a reference to): an ask that then finds it restarts the
    # schedule, as it should; such a run is not this test's case, and runs again.
    evicted = NOWAIT_MISSES + NOWAIT_SKIP + 1 + 2 * NOWAIT_SKIP + 1
    for _ in range(3):
        while_evicted, while_cached, _ = preadv2_calls(
            data, tmp_path, reads=4 * NOWAIT_SKIP - 1 + 10, evicted=evicted)
        if not any(answer == "4096" for answer in while_evicted):
            break
    assert len(while_evicted) == NOWAIT_MISSES + 2
    assert all(answer.startswith("-1 EAGAIN") for answer in while_evicted)
    assert while_cached == ["4096"] * 10

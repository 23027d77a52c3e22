"""The documented memory bound under load (docs/server.md, "Limits and guarantees"):

    RSS <= cache-size + FIXED_OVERHEAD + connections x (largest request + 1 MiB)

on a 64 GiB sparse image with a real tree, read at random by 8 fio jobs (one connection
each, 4 KiB to 1 MiB requests). Hashing 64 GiB would take minutes, so the tree of the
all-zero image is written by bench/zerotree.py (each level is one repeated block); that it
is veritysetup's tree is checked here on a smaller sparse image, byte for byte, and the
server checks the 64 GiB tree's top against the root at start-up and every block it uses.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import threading
import uuid

import pytest

from .serverlib import MIB, PROJECT, VERITYSETUP, Image

sys.path.insert(0, str(PROJECT / "bench"))
from zerotree import write_zero_tree, zero_params

GIB = 1 << 30
FIXED_OVERHEAD = 48 * MIB  # interpreter, nbdkit, modules, threads (idle: about 23 MB)
CACHE_SIZE = 16 * MIB
JOBS = 8
LARGEST = MIB
SALT = bytes(range(32))
UUID = uuid.UUID("12345678-1234-5678-1234-567812345678")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def sparse_zero_image(directory, size: int) -> Image:
    data, hash_path = directory / "data.img", directory / "hash.img"
    with open(data, "wb") as f:
        f.truncate(size)
    root = write_zero_tree(str(hash_path), zero_params(size, SALT, UUID.bytes))
    return Image(data=data, hash=hash_path, root=root.hex(), salt=SALT, hash_type=1,
                 algorithm="sha256", data_block_size=4096, hash_block_size=4096,
                 data_blocks=size // 4096)


def test_zerotree_writes_veritysetups_tree(tmp_path):
    image = sparse_zero_image(tmp_path, 64 * MIB)
    reference = tmp_path / "veritysetup.hash"
    out = subprocess.run([VERITYSETUP, "format", f"--salt={SALT.hex()}", f"--uuid={UUID}",
                          str(image.data), str(reference)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert image.root in out
    assert filecmp.cmp(image.hash, reference, shallow=False)


@pytest.fixture(scope="module")
def huge_image(tmp_path_factory):
    return sparse_zero_image(tmp_path_factory.mktemp("huge"), 64 * GIB)


def test_rss_stays_within_the_bound_under_random_reads(huge_image, servers, sockdir):
    control = os.path.join(sockdir, "mem.ctl")
    server = servers.start(huge_image, cache_size=CACHE_SIZE, control=control)
    samples = [rss_bytes(server.pid)]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.2):
            samples.append(rss_bytes(server.pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        subprocess.run(["fio", "--name=rand", "--ioengine=nbd",
                        f"--uri=nbd+unix:///?socket={server.socket}", "--rw=randread",
                        "--bsrange=4k-1m", f"--numjobs={JOBS}", "--iodepth=1",
                        "--runtime=20", "--time_based", f"--size={64 * GIB}",
                        "--output-format=terse"],
                       check=True, stdout=subprocess.DEVNULL, timeout=120)
    finally:
        stop.set()
        sampler.join()
    from nbd_verity.control.protocol import checked_request
    stats = checked_request(control, {"cmd": "stats"})["stats"]
    cached = stats["totals"]["cached_hash_blocks"]
    assert CACHE_SIZE // 8192 < cached <= CACHE_SIZE // 4096  # filled, and within budget
    bound = CACHE_SIZE + FIXED_OVERHEAD + JOBS * (LARGEST + MIB)
    peak = max(samples)
    assert peak <= bound, f"peak RSS {peak >> 20} MiB over the bound {bound >> 20} MiB"
    assert stats["totals"]["corruptions"] == 0 and server.alive()
    print(f"RSS {min(samples) >> 20}..{peak >> 20} MiB, bound {bound >> 20} MiB")

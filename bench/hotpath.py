"""The server's per-request cost without nbdkit: one caller, no GIL contention, no sockets.

Builds the Device that nbdkit would (nbd_verity.serve.device) in this process and times
Connection.read (the general path) on random size-aligned offsets of a cached image, with
the table forcing every request inline or to the pool, and what the plugin's pread does
(the fast path, serve/fastpath.py, else the general path; the offsets are aligned to
the request's size, so up to 512 KiB each lies under one leaf), next to the two
costs no verifier can avoid: preadv
into the buffer, and SHA-256 of its blocks in a bare loop. What is left is the Python
bookkeeping (inline) or the thread hand-off (pool), in microseconds per request; it is the
figure to watch when changing the hot path, and it is far less noisy than fio on a shared
machine.  Usage: python bench/hotpath.py [DATA HASH ROOT_HASH]  (default: the bench image)
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbd_verity.limits import MAX_REQUEST_SIZE
from nbd_verity.prepare.config import config_from_pairs
from nbd_verity.serve.device import Connection, Device

SIZES = (4096, 65536, 524288)
TOTAL = 160 << 20  # bytes read per measurement (at least 200 requests)


def _offsets(size: int, device: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(device // size) * size for _ in range(max(200, TOTAL // size))]


def _per_request(fn, offsets: list[int]) -> float:
    for offset in offsets[:20]:  # warm caches
        fn(offset)
    started = time.perf_counter()
    for offset in offsets:
        fn(offset)
    return (time.perf_counter() - started) / len(offsets)


def measure(data: str, hash_path: str, root: str) -> list[dict]:
    """µs per request for each size: fast, inline, pool, preadv only, SHA-256 only."""
    device = Device(config_from_pairs([("data", data), ("hash", hash_path), ("root-hash", root),
                                       ("readahead", "false")]))
    device.start_threads()
    conn, fd = Connection(device), os.open(data, os.O_RDONLY)
    read = device.dispatcher.read  # the general path, as pread takes it
    rows = []
    try:
        for size in SIZES:
            buf = memoryview(bytearray(size))
            offsets = _offsets(size, device.size, size)
            row = {"size": size}
            for mode, threshold in (("inline", MAX_REQUEST_SIZE), ("pool", 0)):
                device.dispatcher.set_table((threshold,) * 4)
                row[mode] = _per_request(lambda o, b=buf: read(b, o, conn), offsets)
            device.dispatcher.set_table((MAX_REQUEST_SIZE,) * 4)
            row["fast"] = _per_request(  # the fast path, else the general one with its choice
                lambda o, b=buf: (c := conn.fast(b, o)) is True or read(b, o, conn, c), offsets)
            row["preadv"] = _per_request(lambda o, b=buf: os.preadv(fd, [b], o), offsets)
            base = hashlib.sha256(os.urandom(32))

            def hash_blocks(_offset: int, b=buf, base=base) -> None:
                for k in range(0, len(b), 4096):
                    h = base.copy()
                    h.update(b[k:k + 4096])
                    h.digest()
            row["sha256"] = _per_request(hash_blocks, offsets)
            rows.append(row)
    finally:
        os.close(fd)
        device.close()
    return rows


def table(rows: list[dict]) -> str:
    header = ("| request | fast path µs | inline µs | pool µs | preadv µs | SHA-256 µs "
              "| fast bookkeeping µs | inline bookkeeping µs "
              "| pool hand-off µs (pool - inline) | fast MB/s | inline MB/s |")
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        us = {k: r[k] * 1e6 for k in ("fast", "inline", "pool", "preadv", "sha256")}
        floor = us["preadv"] + us["sha256"]
        lines.append(f"| {r['size'] >> 10}k | {us['fast']:.1f} | {us['inline']:.1f} | "
                     f"{us['pool']:.1f} | {us['preadv']:.1f} | {us['sha256']:.1f} | "
                     f"{us['fast'] - floor:.1f} | {us['inline'] - floor:.1f} | "
                     f"{us['pool'] - us['inline']:.1f} | {r['size'] / r['fast'] / 1e6:.0f} | "
                     f"{r['size'] / r['inline'] / 1e6:.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) not in (0, 3):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    if not argv:
        import images
        image = images.random_image(1 << 30)
        argv = [str(image.data), str(image.hash), image.root]
    print(table(measure(*argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make soak`: a long run of everything at once against one default `nbd-verity serve`.

For --minutes (default 10): 8 jobs read 4 KiB to 1 MiB sequentially and at random (each
its own connection) and compare every byte with the image; a tuner changes the threshold
table continuously through the control socket; a killer starts clients that send reads
and are killed (SIGKILL) mid-request; every minute `nbdcopy` dumps the whole device and the
dump is compared with the image. Reported: requests, errors, wrong bytes, the server's
RSS over time, its log lines, and whether it is still alive. Exit status 1 when any error
or wrong byte was seen, the server died, or RSS grew past the documented bound.

Usage: python bench/soak.py [--minutes N] [--size MIB]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import images  # noqa: E402
import servers  # noqa: E402

MIB = 1 << 20
JOBS = 8
FIXED_OVERHEAD = 48 * MIB  # docs/server.md, "Limits and guarantees"
CACHE_SIZE = 64 * MIB
DUMP_EVERY_S = float(os.environ.get("SOAK_DUMP_EVERY", "60"))
VICTIM = """
import nbd, sys
h = nbd.NBD(); h.connect_unix(sys.argv[1]); size = h.get_size()
bufs = [nbd.Buffer(1 << 20) for _ in range(8)]
while True:
    for i, b in enumerate(bufs):
        h.aio_pread(b, (i << 20) % (size - (1 << 20)))
    while h.aio_in_flight() > 0:
        h.poll(-1)
"""


class Tally:
    """Counters shared by the workers, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict(requests=0, bytes=0, errors=0, wrong=0, kills=0, dumps=0,
                           bad_dumps=0, threshold_changes=0)
        self.messages: list[str] = []

    def add(self, message: str | None = None, **amounts: int) -> None:
        with self.lock:
            for key, value in amounts.items():
                self.counts[key] += value
            if message and len(self.messages) < 20:
                self.messages.append(message)


def reader(uri: str, expected: mmap.mmap, size: int, seed: int, stop: threading.Event,
           tally: Tally) -> None:
    import nbd
    rng = random.Random(seed)
    h = nbd.NBD()
    h.connect_uri(uri)
    offset = 0
    while not stop.is_set():
        length = 4096 << rng.randrange(9)  # 4 KiB .. 1 MiB
        if rng.random() < 0.5:  # random
            offset = rng.randrange(0, size - length + 1, 512)
        elif offset + length > size:  # sequential, wrapping
            offset = 0
        try:
            data = h.pread(length, offset)
        except nbd.Error as e:
            tally.add(f"read {length} at {offset}: {e}", requests=1, errors=1)
        else:
            wrong = data != expected[offset:offset + length]
            tally.add(f"wrong bytes at {offset}+{length}" if wrong else None, requests=1,
                      bytes=length, wrong=int(wrong))
        offset += length
    h.shutdown()


def tuner(server: servers.Server, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(7)
    while not stop.wait(0.2):
        table = {c: rng.choice([0, 4096, 65536, 1 << 20, 32 << 20])
                 for c in ("none", "rt", "be", "idle")}
        try:
            server.ctl({"cmd": "thresholds", "set": table})
            tally.add(threshold_changes=1)
        except Exception as e:
            tally.add(f"thresholds: {e}", errors=1)


def killer(socket_path: str, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(9)
    while not stop.wait(0.5):
        victim = subprocess.Popen([sys.executable, "-c", VICTIM, socket_path],
                                  stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 0.4))
        victim.kill()  # by its own pid, mid-request
        victim.wait()
        tally.add(kills=1)


def dumper(uri: str, want: str, stop: threading.Event, tally: Tally, workdir: str) -> None:
    target = os.path.join(workdir, "dump.img")
    while not stop.wait(DUMP_EVERY_S):
        result = subprocess.run(["nbdcopy", uri, target], capture_output=True, text=True,
                                timeout=300, check=False)
        got = _sha256(target) if result.returncode == 0 else None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        bad = got != want
        tally.add(f"nbdcopy: {result.stderr.strip() or 'dump differs'}" if bad else None,
                  dumps=1, bad_dumps=int(bad))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--size", type=int, default=256, help="image size in MiB")
    args = parser.parse_args()
    image = images.random_image(args.size * MIB)
    want = _sha256(str(image.data))
    workdir = tempfile.mkdtemp(prefix="nv-soak-")
    tally, stop = Tally(), threading.Event()
    server = servers.verity_server("soak", image, []).start()
    rss: list[tuple[float, int]] = []
    started = time.monotonic()
    with open(image.data, "rb") as f:
        expected = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    threads = [threading.Thread(target=reader, args=(server.uri(), expected, image.size, n,
                                                     stop, tally)) for n in range(JOBS)]
    threads += [threading.Thread(target=tuner, args=(server, stop, tally)),
                threading.Thread(target=killer, args=(server.socket, stop, tally)),
                threading.Thread(target=dumper, args=(server.uri(), want, stop, tally,
                                                      workdir))]
    for thread in threads:
        thread.start()
    try:
        while time.monotonic() - started < args.minutes * 60 and server.alive():
            rss.append((time.monotonic() - started, server.rss_kib() * 1024))
            time.sleep(10)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
        alive = server.alive()
        log = server.log()
        server.stop()
    return report(args, tally, rss, alive, log)


def report(args, tally: Tally, rss: list[tuple[float, int]], alive: bool, log: str) -> int:
    counts = tally.counts
    bound = CACHE_SIZE + FIXED_OVERHEAD + (JOBS + 2) * 2 * MIB
    peak = max((r for _, r in rss), default=0)
    lines = log.splitlines()
    print(f"soak: {args.minutes:g} min, {args.size} MiB image, {JOBS} jobs (4K-1M, sequential"
          f" and random), thresholds changed continuously, clients killed mid-request")
    print(f"requests {counts['requests']}  bytes {counts['bytes'] / 2**30:.1f} GiB  "
          f"errors {counts['errors']}  wrong-byte reads {counts['wrong']}")
    print(f"nbdcopy dumps {counts['dumps']} (differing {counts['bad_dumps']})  clients killed "
          f"{counts['kills']}  threshold changes {counts['threshold_changes']}")
    print("RSS (MiB) over time: " + "  ".join(f"{t / 60:.1f}m:{r >> 20}" for t, r in rss))
    print(f"RSS peak {peak >> 20} MiB, bound {bound >> 20} MiB; server alive: {alive}")
    print(f"log lines {len(lines)} (nbd-verity {sum(x.startswith('nbd-verity:') for x in lines)}"
          f", nbdkit errors {sum(': error: ' in x for x in lines)})")
    for message in tally.messages:
        print(f"  {message}")
    ok = (alive and not counts["errors"] and not counts["wrong"] and not counts["bad_dumps"]
          and peak <= bound)
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Read a whole device with O_DIRECT, pass after pass, until told to stop (guest side).

usage: reader.py DEVICE WORK [--chunk BYTES]

Each pass's SHA-256 goes to WORK/reader.passes, one line each; the number of passes done to
WORK/reader.progress (replaced whole). A read that fails is retried at once and counted in
WORK/reader.errors ("OFFSET ERRNO LABEL"); a read slower than SLOW_S goes to WORK/reader.slow
("LABEL SECONDS"), LABEL being what the host last wrote to WORK/sync/event (the event it is
causing). It stops at the end of the pass during which WORK/sync/stop-reader appears.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import time

SLOW_S = 0.05


def label(work: str) -> str:
    try:
        with open(os.path.join(work, "sync", "event")) as f:
            return f.read().strip() or "-"
    except OSError:
        return "-"


def append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("device")
    parser.add_argument("work")
    parser.add_argument("--chunk", type=int, default=128 << 10)
    args = parser.parse_args()
    fd = os.open(args.device, os.O_RDONLY | os.O_DIRECT)
    size = os.lseek(fd, 0, os.SEEK_END)
    buf = mmap.mmap(-1, args.chunk)  # page-aligned, as O_DIRECT needs
    work = args.work
    passes = 0
    while not os.path.exists(os.path.join(work, "sync", "stop-reader")):
        digest = hashlib.sha256()
        offset = 0
        while offset < size:
            want = min(args.chunk, size - offset)
            started = time.monotonic()
            try:
                got = os.preadv(fd, [memoryview(buf)[:want]], offset)
            except OSError as e:
                append(os.path.join(work, "reader.errors"), f"{offset} {e.errno} {label(work)}")
                time.sleep(0.05)
                continue
            took = time.monotonic() - started
            if took > SLOW_S:
                append(os.path.join(work, "reader.slow"), f"{label(work)} {took:.3f}")
            if got != want:
                append(os.path.join(work, "reader.errors"), f"{offset} short {label(work)}")
                continue
            digest.update(memoryview(buf)[:want])
            offset += want
        passes += 1
        append(os.path.join(work, "reader.passes"), digest.hexdigest())
        tmp = os.path.join(work, ".reader.progress.tmp")
        with open(tmp, "w") as f:
            f.write(str(passes))
        os.rename(tmp, os.path.join(work, "reader.progress"))
    os.close(fd)


if __name__ == "__main__":
    main()

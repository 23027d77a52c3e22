"""Read an export back through libnbd and compare it with the image it serves.

    python3 readback.py SOCKET IMAGE [BAD_BLOCK]

Waits (up to 60 s) for the server's Unix socket to accept, reads every 4 KiB block and
compares it with IMAGE; BAD_BLOCK, a block corrupted after `format`, must fail with EIO
and every other block must match. One line and exit 1 on any difference.
"""

from __future__ import annotations

import errno
import sys
import time

import nbd

BLOCK = 4096


def connect(sock: str, timeout: float = 60.0) -> nbd.NBD:
    deadline = time.monotonic() + timeout
    while True:
        h = nbd.NBD()
        try:
            h.connect_unix(sock)
            return h
        except nbd.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the server is still starting; its socket does not accept yet


def main(argv: list[str]) -> int:
    sock, image = argv[1], argv[2]
    bad = int(argv[3]) if len(argv) > 3 else None
    with open(image, "rb") as f:
        expected = f.read()
    h = connect(sock)
    if h.get_size() != len(expected):
        print(f"readback: size {h.get_size()}, image {len(expected)}", file=sys.stderr)
        return 1
    for index in range(len(expected) // BLOCK):
        try:
            got = h.pread(BLOCK, index * BLOCK)
        except nbd.Error as e:
            if index == bad and e.errnum == errno.EIO:
                continue
            print(f"readback: block {index}: {e}", file=sys.stderr)
            return 1
        if index == bad:
            print(f"readback: corrupted block {index} was served", file=sys.stderr)
            return 1
        if got != expected[index * BLOCK:(index + 1) * BLOCK]:
            print(f"readback: block {index} differs from the image", file=sys.stderr)
            return 1
    h.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

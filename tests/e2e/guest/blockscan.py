"""Read every 4 KiB block of a block device with direct I/O and list the blocks that fail.

Runs inside the guest under the host's /usr/bin/python3. One `preadv` per block, so each
read is exactly one request to the device (with `nbd-client -b 4096`, one NBD read); the
page cache is bypassed, so a block that failed once is asked again, not served from memory.
Output: one "INDEX ERRNO" line per failing block, then nothing else.
"""

import mmap
import os
import sys

BLOCK_SIZE = 4096


def scan(device: str) -> list[tuple[int, int]]:
    """Return (block index, errno) for each block whose read failed or came back short."""
    failures = []
    # O_DIRECT needs an aligned buffer: an anonymous mmap is page-aligned.
    buf = mmap.mmap(-1, BLOCK_SIZE)
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        for index in range(size // BLOCK_SIZE):
            try:
                got = os.preadv(fd, [buf], index * BLOCK_SIZE)
            except OSError as e:
                failures.append((index, e.errno))
                continue
            if got != BLOCK_SIZE:
                failures.append((index, 0))
    finally:
        os.close(fd)
    return failures


def main() -> None:
    device, out = sys.argv[1:]
    failures = scan(device)
    with open(out, "w") as f:
        f.writelines(f"{index} {errno}\n" for index, errno in failures)
    print(f"blockscan {device}: {len(failures)} failing blocks")


if __name__ == "__main__":
    main()

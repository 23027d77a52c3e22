"""Read every 4 KiB block of a block device with direct I/O and list the blocks that fail.

Runs inside the guest under the host's /usr/bin/python3. The device is read in chunks
(1 MiB by default) with direct I/O, so the page cache never answers and a block that
failed once is asked again; every block of a chunk whose read failed is then read on its
own, one `preadv` of 4 KiB each (with `nbd-client -b 4096`, one NBD read). The list of
failing blocks is the same as reading every block on its own, for a device whose answers
do not depend on what was read before, at a fraction of the round trips: the guest runs
under software emulation, where each request costs milliseconds. `--chunk 4096` reads
every block on its own (for devices whose answers depend on the order of reads).
Output: one "INDEX ERRNO" line per failing block, then nothing else.
"""

import argparse
import mmap
import os

BLOCK_SIZE = 4096
CHUNK_SIZE = 1024 * 1024


def scan(device: str, chunk: int = CHUNK_SIZE) -> list[tuple[int, int]]:
    """Return (block index, errno) for each block whose read failed or came back short."""
    failures = []
    # O_DIRECT needs an aligned buffer: an anonymous mmap is page-aligned.
    big = mmap.mmap(-1, chunk)
    one = memoryview(big)[:BLOCK_SIZE]
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        blocks = os.lseek(fd, 0, os.SEEK_END) // BLOCK_SIZE
        per_chunk = chunk // BLOCK_SIZE
        for first in range(0, blocks, per_chunk):
            count = min(per_chunk, blocks - first)
            if count > 1:
                try:
                    if os.preadv(fd, [memoryview(big)[:count * BLOCK_SIZE]],
                                 first * BLOCK_SIZE) == count * BLOCK_SIZE:
                        continue
                except OSError:
                    pass
            for index in range(first, first + count):
                try:
                    got = os.preadv(fd, [one], index * BLOCK_SIZE)
                except OSError as e:
                    failures.append((index, e.errno))
                    continue
                if got != BLOCK_SIZE:
                    failures.append((index, 0))
    finally:
        os.close(fd)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("device")
    parser.add_argument("out")
    parser.add_argument("--chunk", type=int, default=CHUNK_SIZE,
                        help="bytes per first read, a multiple of 4096")
    args = parser.parse_args()
    if args.chunk <= 0 or args.chunk % BLOCK_SIZE:
        parser.error(f"--chunk {args.chunk}: not a positive multiple of {BLOCK_SIZE}")
    failures = scan(args.device, args.chunk)
    with open(args.out, "w") as f:
        f.writelines(f"{index} {errno}\n" for index, errno in failures)
    print(f"blockscan {args.device}: {len(failures)} failing blocks")


if __name__ == "__main__":
    main()

"""Write the verity tree of an all-zero (sparse) data image without reading or hashing it.

Formatting a 1 TiB image hashes 2^28 blocks (minutes); but when every data block is zero,
every level holds one repeated "full" block plus at most one different last block (the
one with fewer children, or whose last child is itself a last block). So each level costs
two digests, and writing is the only real work. Geometry, digests, slots and the
superblock come from nbd_verity (geometry.py, digest.py, params.py), the same code
`nbd-verity format` uses; bench/run.py checks the result byte for byte against a real
`nbd-verity format` of a smaller sparse image, and the server's start-up root check and
its reads verify it again.

Usage: python bench/zerotree.py DATA_SIZE HASH_PATH [SALT_HEX]  (prints the root hash)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbd_verity.format.params import VerityParams, random_salt, random_uuid

WRITE_CHUNK = 8 << 20  # bytes per pwrite of repeated blocks


def _block(slots: list[bytes], hash_block_size: int) -> bytes:
    """A hash block holding these slots, zero-padded."""
    body = b"".join(slots)
    return body + bytes(hash_block_size - len(body))


def _write_repeated(fd: int, block: bytes, count: int, offset: int) -> int:
    """Write block count times from offset; return the offset after it."""
    if count <= 0:
        return offset
    per_chunk = max(1, WRITE_CHUNK // len(block))
    chunk = block * min(per_chunk, count)
    while count > 0:
        n = min(per_chunk, count)
        piece = chunk if n * len(block) == len(chunk) else chunk[:n * len(block)]
        os.pwrite(fd, piece, offset)
        offset += len(piece)
        count -= n
    return offset


def write_zero_tree(hash_path: str, params: VerityParams) -> bytes:
    """Write superblock and tree for data_blocks zero blocks; return the root digest."""
    params.check()
    geo, digester = params.geometry(), params.digester()
    if geo.levels == 0:
        raise ValueError("a one-block image has no tree to write")
    hbs, hpb = geo.hash_block_size, geo.hashes_per_block
    pad = bytes(geo.slot_size - digester.digest_size)
    full = last = digester.digest(bytes(geo.data_block_size))  # level 0's children
    children = geo.data_blocks
    fd = os.open(hash_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        if params.superblock:
            os.pwrite(fd, params.to_superblock().pack(), params.hash_offset)
        for level in range(geo.levels):
            blocks = geo.level_blocks[level]
            full_block = _block([full + pad] * hpb, hbs)
            tail = children - (blocks - 1) * hpb  # children of the level's last block
            last_block = _block([full + pad] * (tail - 1) + [last + pad], hbs)
            end = _write_repeated(fd, full_block, blocks - 1, geo.level_start[level] * hbs)
            os.pwrite(fd, last_block, end)
            full, last = digester.digest(full_block), digester.digest(last_block)
            children = blocks
        os.fsync(fd)
    finally:
        os.close(fd)
    return last  # the top level has one block: its digest is the root


def zero_params(data_size: int, salt: bytes | None = None,
                uuid: bytes | None = None) -> VerityParams:
    """Default geometry (4096/4096, sha256, format 1, superblock) for data_size bytes."""
    return VerityParams(data_blocks=data_size // 4096,
                        salt=random_salt() if salt is None else salt,
                        uuid=random_uuid() if uuid is None else uuid).check()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    salt = bytes.fromhex(argv[2]) if len(argv) == 3 else None
    root = write_zero_tree(argv[1], zero_params(int(argv[0]), salt))
    print(root.hex())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

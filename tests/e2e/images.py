"""Images for the guest runs: a data image and its tree from veritysetup, and their damage.

The hash tree always comes from `veritysetup format`, never from nbd-verity: the guest's
kernel dm-verity and the server under test must agree on the tool's own output. Where a
test needs to know which hash block covers which data blocks it uses level0_hash_block, a
few lines of arithmetic written from cryptsetup's hash_levels and kept apart from the
project's geometry module on purpose (an oracle must not share the code it checks).
"""

from __future__ import annotations

import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .harness import Export

BLOCK_SIZE = 4096
SHA256_SIZE = 32
# veritysetup's default layout: the 512-byte superblock padded to one hash block, then the
# tree, root-most level first.
HASH_START_BLOCK = 1


def random_file(path: Path, size: int, seed: int) -> Path:
    """size bytes that do not compress and are the same on every run."""
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def verity_format(data: Path, hash_image: Path) -> Export:
    """Build hash_image from data with veritysetup's defaults (sha256, 4096/4096, salted)."""
    root_file = hash_image.with_suffix(".root")
    subprocess.run(["veritysetup", "format", str(data), str(hash_image),
                    f"--root-hash-file={root_file}"], check=True, capture_output=True)
    return Export(data=data, hash=hash_image, root_hash=root_file.read_text().strip())


def flip_block(path: Path, index: int, block_size: int = BLOCK_SIZE) -> None:
    """Corrupt block index of path in place: every byte of its first 16 inverted."""
    with open(path, "r+b") as f:
        f.seek(index * block_size)
        head = f.read(16)
        f.seek(index * block_size)
        f.write(bytes(b ^ 0xFF for b in head))


def corrupt_copy(src: Path, dst: Path, blocks: list[int]) -> Path:
    """A copy of src with the given blocks flipped."""
    shutil.copyfile(src, dst)
    for index in blocks:
        flip_block(dst, index)
    return dst


@dataclass(frozen=True)
class Level0Block:
    """One level-0 hash block: where it is in the hash image, which data blocks it covers."""

    hash_block_index: int
    first_data_block: int
    data_blocks: int

    @property
    def covered(self) -> list[int]:
        return list(range(self.first_data_block, self.first_data_block + self.data_blocks))


def level0_hash_block(data_blocks: int, k: int) -> Level0Block:
    """The k-th level-0 hash block of a default sha256 4096/4096 tree over data_blocks.

    Mirrors cryptsetup's hash_levels: level i has ceil(N / 128**(i+1)) blocks, and levels
    are stored from the root-most (L-1) down to level 0, starting at HASH_START_BLOCK.
    """
    per_block = BLOCK_SIZE // SHA256_SIZE
    sizes = []
    remaining = data_blocks
    while remaining > 1:
        remaining = -(-remaining // per_block)
        sizes.append(remaining)
    if not sizes:
        raise ValueError(f"{data_blocks} data blocks: a tree of one block has no hash blocks")
    if not 0 <= k < sizes[0]:
        raise ValueError(f"level 0 has {sizes[0]} blocks, not {k + 1}")
    level0_start = HASH_START_BLOCK + sum(sizes[1:])
    first = k * per_block
    return Level0Block(hash_block_index=level0_start + k, first_data_block=first,
                       data_blocks=min(per_block, data_blocks - first))


def ext4_image(path: Path, size: int, files: dict[str, bytes], staging: Path) -> Path:
    """An ext4 image of size bytes (4 KiB blocks) holding files, built without mounting."""
    staging.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (staging / name).write_bytes(content)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", str(BLOCK_SIZE), "-d", str(staging),
                    "-L", "e2e", str(path), f"{size // 1024}k"], check=True, capture_output=True)
    return path


def ext4_file_blocks(image: Path, name: str) -> list[int]:
    """The filesystem blocks (4 KiB, so also image block indexes) that hold file name."""
    out = subprocess.run(["debugfs", "-R", f"blocks /{name}", str(image)],
                         check=True, capture_output=True, text=True).stdout
    return [int(word) for word in out.split()]

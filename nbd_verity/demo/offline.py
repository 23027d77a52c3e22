"""The demo's offline steps: make an image, format it, dump, verify, catch corruption."""

from __future__ import annotations

import random
import shutil

from ..format.params import VerityParams
from .walkthrough import CORRUPT_DATA_BLOCK, StepFailed, Walkthrough, flip_byte

IMAGE_SIZE = 64 << 20  # 16384 data blocks of 4096 bytes: a two-level tree (128 + 1)
IMAGE_SEED = 2024
# A fixed salt and UUID make the root hash the same on every run (format picks random ones).
SALT = "6e62642d7665726974792064656d6f2073616c74"
UUID = "5b1f0a52-7a3c-4d27-9d8e-1f1e0d3c2b4a"


def make_image(w: Walkthrough) -> None:
    """Create a 64 MiB sample data image (the same bytes on every run)."""
    w.data.write_bytes(random.Random(IMAGE_SEED).randbytes(IMAGE_SIZE))
    w.hash.unlink(missing_ok=True)  # format, like veritysetup, never truncates it
    w.say(f"wrote {w.data.name}: {IMAGE_SIZE >> 20} MiB of seeded random data")


def format_image(w: Walkthrough) -> None:
    """Build the hash tree and print the root hash (publish this value, or sign it)."""
    done = w.run("format", w.data.name, w.hash.name, f"--salt={SALT}", f"--uuid={UUID}")
    for line in done.stdout.splitlines():
        if line.startswith("Root hash:"):
            w.root = line.split()[-1]
    if len(w.root) != 64:
        raise StepFailed("format printed no SHA-256 root hash")
    w.say(f"root hash: {w.root}")


def dump_superblock(w: Walkthrough) -> None:
    """Read back the superblock, as `veritysetup dump` shows it."""
    done = w.run("dump", w.hash.name)
    w.expect_in("Data blocks:     \t16384", done.stdout)


def verify_image(w: Walkthrough) -> None:
    """Check every block of the image against the tree and the trusted root hash."""
    done = w.run("verify", w.data.name, w.hash.name, w.root)
    w.expect_in("Verified 16384 data blocks: OK", done.stdout)


def verify_corrupted_data(w: Walkthrough) -> None:
    """Flip one byte of a copy of the data: verify names the corrupted data block."""
    copy = w.workdir / "corrupt-data.img"
    shutil.copyfile(w.data, copy)
    flip_byte(copy, CORRUPT_DATA_BLOCK * 4096 + 100)
    w.say(f"flipped byte 100 of data block {CORRUPT_DATA_BLOCK} in {copy.name}")
    done = w.run("verify", copy.name, w.hash.name, w.root, expect=1)
    w.expect_in(f"data block {CORRUPT_DATA_BLOCK} is corrupted", done.stderr)
    copy.unlink()


def verify_corrupted_tree(w: Walkthrough) -> None:
    """Flip one byte of a copy of the tree: verify names the hash block and its level."""
    copy = w.workdir / "corrupt.hash"
    shutil.copyfile(w.hash, copy)
    # The leaf that holds the digest of CORRUPT_DATA_BLOCK: the superblock is block 0,
    # then the root-most level first (level 1: block 1; level 0: 128 blocks from 2).
    geometry = VerityParams(data_blocks=IMAGE_SIZE // 4096).geometry()
    leaf, _ = geometry.slot_of(0, CORRUPT_DATA_BLOCK)
    flip_byte(copy, leaf * 4096 + 7)
    first = (leaf - geometry.level_start[0]) * geometry.hashes_per_block
    w.say(f"flipped byte 7 of hash block {leaf} (level 0: the digests of data blocks "
          f"{first}-{first + geometry.hashes_per_block - 1}) in {copy.name}")
    done = w.run("verify", w.data.name, copy.name, w.root, expect=1)
    w.expect_in(f"metadata block {leaf} is corrupted (level 0)", done.stderr)
    copy.unlink()


STEPS = (make_image, format_image, dump_superblock, verify_image, verify_corrupted_data,
         verify_corrupted_tree)

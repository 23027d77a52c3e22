"""Benchmark images, made once and kept in a cache directory (BENCH_CACHE).

- a random data image with its tree from `nbd-verity format` (the side-by-side runs);
- sparse all-zero images (truncate -s) for the scaling runs: small ones formatted for
  real, large ones with bench/zerotree.py, which is first checked to write the same hash
  image byte for byte as `nbd-verity format` of a sparse image, with the same salt and
  UUID (and, at 64 GiB in a full run, the same root).
An image counts as made only once its `.done` marker exists, so an interrupted run
starts that image again instead of using half of it.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import zerotree
from servers import NBD_VERITY

CACHE = Path(os.environ.get("BENCH_CACHE", "/var/tmp/nbd-verity-bench"))
SALT = "e48da609055204e89ae53b655ca2216dd983cf3cb829f34f63a297d106d53e2d"
UUID = "a60c98d2-ae9b-4865-bfcb-b4e3ace11033"
WRITE_CHUNK = 8 << 20


@dataclass(frozen=True)
class Image:
    data: Path
    hash: Path
    root: str
    size: int
    how: str  # how the tree was made, for the report


def _paths(name: str) -> tuple[Path, Path, Path, Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    return (CACHE / f"{name}.img", CACHE / f"{name}.hash", CACHE / f"{name}.root",
            CACHE / f"{name}.done")


def _format(data: Path, hash_path: Path, root_file: Path) -> str:
    """`nbd-verity format` with the fixed salt and UUID; returns the root hash."""
    subprocess.run([NBD_VERITY, "format", "--salt", SALT, "--uuid", UUID,
                    "--root-hash-file", str(root_file), str(data), str(hash_path)],
                   check=True, stdout=subprocess.DEVNULL)
    return root_file.read_text().strip()


def random_image(size: int) -> Image:
    """size bytes from os.urandom and their tree (made once, then reused)."""
    return random_image_named(f"random-{size >> 20}m", size)


def random_image_named(name: str, size: int) -> Image:
    """A random image of its own name (benches that need many distinct ones)."""
    data, hash_path, root_file, done = _paths(name)
    if not done.exists():
        with open(data, "wb") as f:
            for _ in range(0, size, WRITE_CHUNK):
                f.write(os.urandom(WRITE_CHUNK))
            f.truncate(size)
        _format(data, hash_path, root_file)
        done.touch()
    return Image(data, hash_path, root_file.read_text().strip(), size, "nbd-verity format")


def sparse_image(size: int, formatted: bool) -> Image:
    """A sparse all-zero image; its tree by `nbd-verity format` or by zerotree.py."""
    name = f"sparse-{size >> 20}m-{'format' if formatted else 'zerotree'}"
    data, hash_path, root_file, done = _paths(name)
    if not done.exists():
        with open(data, "wb") as f:
            f.truncate(size)
        if formatted:
            _format(data, hash_path, root_file)
        else:
            root_file.write_text(_zero_tree(size, hash_path))
        done.touch()
    how = "nbd-verity format" if formatted else "bench/zerotree.py"
    return Image(data, hash_path, root_file.read_text().strip(), size, how)


def _zero_tree(size: int, hash_path: Path) -> str:
    params = zerotree.zero_params(size, bytes.fromhex(SALT), uuid.UUID(UUID).bytes)
    return zerotree.write_zero_tree(str(hash_path), params).hex()


def check_zerotree(size: int = 64 << 20) -> str:
    """zerotree.py against `nbd-verity format` on a sparse image: identical hash images."""
    formatted = sparse_image(size, formatted=True)
    probe = CACHE / "zerotree-check.hash"
    root = _zero_tree(size, probe)
    same = filecmp.cmp(formatted.hash, probe, shallow=False)
    probe.unlink()
    if not same or root != formatted.root:
        raise RuntimeError(f"zerotree.py disagrees with nbd-verity format at {size} bytes")
    return f"zerotree.py wrote the same hash image as nbd-verity format ({size >> 20} MiB)"


def check_same_root(formatted: Image) -> str:
    """The zerotree root of a formatted sparse image's size equals its real root."""
    probe = CACHE / "zerotree-check.hash"
    root = _zero_tree(formatted.size, probe)
    probe.unlink()
    if root != formatted.root:
        raise RuntimeError(f"zerotree.py root differs from nbd-verity format at "
                           f"{formatted.size} bytes")
    return f"zerotree.py root = nbd-verity format root at {formatted.size >> 30} GiB"


def warm_random_image(size: int) -> Image:
    """random_image(size) with its data and hash in the page cache."""
    image = random_image(size)
    warm(image.data)
    warm(image.hash)
    return image


def warm(path: Path) -> None:
    """Read a file once so every server starts from the same warm page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(WRITE_CHUNK)
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)

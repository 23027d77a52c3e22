"""Fixtures of the dispatch and control tests: one image, a damaged copy, real servers.

The image is 8 MiB of seeded random data with a veritysetup tree (4096/4096, sha256,
2 levels). The damaged copy has one byte flipped in data blocks 20 and 300 and is served
with the good tree, so reads covering those blocks must fail and every other read must
not. Servers live in a short temporary directory (sun_path holds 108 bytes) and are
stopped by pid when their scope ends, whatever happened.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from .harness import NBD_VERITY, VERITYSETUP, Image, Servers, veritysetup_format

IMAGE_SIZE = 8 << 20
BLOCK_SIZE = 4096
BAD_BLOCKS = (20, 300)  # in the first and in the second 128 KiB pool chunk of a read


def _require(*paths: str) -> None:
    for path in paths:
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: run `make setup`")


@pytest.fixture(scope="session")
def image(tmp_path_factory) -> Image:
    _require(NBD_VERITY, VERITYSETUP)
    directory = tmp_path_factory.mktemp("control-image")
    data = directory / "data.img"
    data.write_bytes(random.Random(20250611).randbytes(IMAGE_SIZE))
    hash_path = directory / "hash.img"
    return Image(data, hash_path, veritysetup_format(data, hash_path))


@pytest.fixture(scope="session")
def damaged_image(image, tmp_path_factory) -> Image:
    """The image's data with one byte flipped in each of BAD_BLOCKS; the good tree."""
    data = tmp_path_factory.mktemp("control-damaged") / "data.img"
    shutil.copyfile(image.data, data)
    with open(data, "r+b") as f:
        for block in BAD_BLOCKS:
            f.seek(block * BLOCK_SIZE + 1234)
            old = f.read(1)
            f.seek(block * BLOCK_SIZE + 1234)
            f.write(bytes([old[0] ^ 0x01]))
    return Image(data, image.hash, image.root)


def _short_dir() -> Path:
    """A fresh directory under /tmp: sockets need short paths (sun_path is 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="nvc-"))


@pytest.fixture
def servers():
    """Function-scoped: start(image, *serve_options) → a ready Server, stopped at the end."""
    directory = _short_dir()
    pool = Servers(directory)
    yield pool
    pool.stop_all()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def module_servers():
    """The same, shared by one test module (each test sets the thresholds it needs)."""
    directory = _short_dir()
    pool = Servers(directory)
    yield pool
    pool.stop_all()
    shutil.rmtree(directory, ignore_errors=True)

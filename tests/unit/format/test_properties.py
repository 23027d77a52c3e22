"""Property-based tests over random geometries and contents (hypothesis).

1. The tree we build equals an independent, deliberately naive model of
   cryptsetup's tree layout (hash_levels).
2. Flipping any single byte of any data block or of any hash block makes `verify` exit 1
   and name exactly that block: "data block N is corrupted" or "metadata block N is
   corrupted (level L)", N being the absolute block number in the hash image.
Each example runs on one of the engines present for its algorithm (hashlib, OpenSSL's
EVP, and for sha256 SHA-NI with one to three streams where the CPU has it).
The CLI runs in-process (click's CliRunner) so that hundreds of examples stay fast; the
subprocess tests elsewhere check the installed console script itself.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbd_verity.cli import main
from nbd_verity.format.builder import build_tree
from nbd_verity.format.digest import Digester, engines_present
from nbd_verity.format.params import VerityParams

from ...cli_runner import cli_runner
from ...damage import flip_byte

# Algorithms whose hashlib name equals veritysetup's, so the model can call hashlib directly.
MODEL_ALGORITHMS = ["sha256", "sha1", "md5", "sha512", "sha224"]
FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Layout:
    """One random verity layout and the data it protects."""

    algorithm: str
    hash_type: int
    data_block_size: int
    hash_block_size: int
    data_blocks: int
    tail: int  # bytes after the last whole block: not protected, not read
    salt: bytes
    superblock: bool
    hash_offset: int
    seed: int
    engine: str  # the Digester engine that builds and verifies

    def params(self) -> VerityParams:
        return VerityParams(data_blocks=self.data_blocks, hash_type=self.hash_type,
                            algorithm=self.algorithm, data_block_size=self.data_block_size,
                            hash_block_size=self.hash_block_size, salt=self.salt,
                            uuid=bytes(range(16)), hash_offset=self.hash_offset,
                            superblock=self.superblock)

    def data(self) -> bytes:
        size = self.data_blocks * self.data_block_size + self.tail
        return random.Random(self.seed).randbytes(size)

    def cli_options(self) -> list[str]:
        """Options `verify` needs: all of them without a superblock, else only the offset."""
        options = ["--hash-offset", str(self.hash_offset)]
        if not self.superblock:
            options += ["--no-superblock", "--format", str(self.hash_type),
                        "--hash", self.algorithm, "--salt", self.salt.hex() or "-",
                        "--data-block-size", str(self.data_block_size),
                        "--hash-block-size", str(self.hash_block_size)]
        return options


def on_engine(engine: str):
    """Every VerityParams in the block (the builder's, the CLI's) hashes on engine."""
    return mock.patch.object(VerityParams, "digester", lambda self: Digester(
        self.algorithm, self.salt, self.hash_type, engine=engine))


@st.composite
def layouts(draw) -> Layout:
    algorithm = draw(st.sampled_from(MODEL_ALGORITHMS))
    return Layout(
        algorithm=algorithm,
        hash_type=draw(st.sampled_from([0, 1])),
        data_block_size=draw(st.sampled_from([512, 1024, 4096])),
        hash_block_size=draw(st.sampled_from([512, 1024, 4096])),
        # Up to 300 blocks: with 512-byte hash blocks that is up to three levels.
        data_blocks=draw(st.one_of(st.integers(1, 300), st.sampled_from([1, 2, 17, 257]))),
        tail=draw(st.sampled_from([0, 0, 1, 511])),
        salt=draw(st.binary(max_size=80)),
        superblock=draw(st.booleans()),
        hash_offset=draw(st.sampled_from([0, 512, 4096, 8192 + 512])),
        seed=draw(st.integers(0, 2**32)),
        engine=draw(st.sampled_from(engines_present(algorithm))),
    )


def model_tree(layout: Layout) -> tuple[bytes, list[list[bytes]]]:
    """Root digest and hash blocks per level (0 = leaves), computed the naive way."""
    def digest(block: bytes) -> bytes:
        salted = layout.salt + block if layout.hash_type == 1 else block + layout.salt
        return hashlib.new(layout.algorithm, salted).digest()

    dbs, hbs = layout.data_block_size, layout.hash_block_size
    data = layout.data()
    size = hashlib.new(layout.algorithm).digest_size
    slot = size if layout.hash_type == 0 else 1 << (size - 1).bit_length()
    per_block = 1
    while per_block * 2 * size <= hbs:  # the largest power of two that fits
        per_block *= 2
    digests = [digest(data[i * dbs:(i + 1) * dbs]) for i in range(layout.data_blocks)]
    levels: list[list[bytes]] = []
    while len(digests) > 1:
        blocks = [b"".join(d.ljust(slot, b"\0") for d in digests[i:i + per_block]).ljust(
            hbs, b"\0") for i in range(0, len(digests), per_block)]
        levels.append(blocks)
        digests = [digest(b) for b in blocks]
    return digests[0], levels


@FAST
@given(layout=layouts())
def test_tree_matches_a_naive_model(layout):
    root, levels = model_tree(layout)
    geo = layout.params().geometry()
    assert geo.level_blocks == tuple(len(blocks) for blocks in levels)
    with tempfile.TemporaryDirectory() as tmp, on_engine(layout.engine):
        data, hash_image = Path(tmp, "data"), Path(tmp, "hash")
        data.write_bytes(layout.data())
        assert build_tree(str(data), str(hash_image), layout.params()) == root
        written = hash_image.read_bytes()
    hbs = layout.hash_block_size
    tree = b"".join(b"".join(blocks) for blocks in reversed(levels))  # root-most first
    start = geo.hash_start_block * hbs
    assert written[start:start + len(tree)] == tree
    # As veritysetup: a fresh hash image ends where the tree ends; with neither a tree
    # nor a superblock to write (one data block, no superblock) it stays empty.
    assert len(written) == (geo.hash_image_size if geo.levels or layout.superblock else 0)


@st.composite
def corruptions(draw) -> tuple[Layout, str, int, int, int, int]:
    """A layout and one byte to flip: (layout, "data"|"hash", level, index, byte, xor)."""
    layout = draw(layouts())
    geo = layout.params().geometry()
    if geo.levels and draw(st.booleans()):
        level = draw(st.integers(0, geo.levels - 1))
        index = draw(st.integers(0, geo.level_blocks[level] - 1))
        byte = draw(st.integers(0, layout.hash_block_size - 1))
        return layout, "hash", level, index, byte, draw(st.integers(1, 255))
    index = draw(st.integers(0, layout.data_blocks - 1))
    byte = draw(st.integers(0, layout.data_block_size - 1))
    return layout, "data", -1, index, byte, draw(st.integers(1, 255))


@FAST
@given(case=corruptions())
def test_any_corrupted_byte_is_found_and_named(case):
    layout, target, level, index, byte, xor = case
    geo = layout.params().geometry()
    runner = cli_runner()
    with tempfile.TemporaryDirectory() as tmp, on_engine(layout.engine):
        data, hash_image = Path(tmp, "data"), Path(tmp, "hash")
        data.write_bytes(layout.data())
        root = build_tree(str(data), str(hash_image), layout.params()).hex()
        argv = ["verify", str(data), str(hash_image), root, *layout.cli_options()]
        assert runner.invoke(main, argv).exit_code == 0
        if target == "data":
            flip_byte(data, index * layout.data_block_size + byte, xor)
            expected = f"nbd-verity: data block {index} is corrupted"
        else:
            block = geo.level_start[level] + index
            flip_byte(hash_image, block * layout.hash_block_size + byte, xor)
            expected = f"nbd-verity: metadata block {block} is corrupted (level {level})"
        result = runner.invoke(main, argv)
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        expected, "nbd-verity: verification failed: 1 corrupted block(s)"]
    assert result.stdout == ""

"""FecRepairer on real files: the call a verifier makes when a block fails its hash."""

from __future__ import annotations

import hashlib
import random

import pytest

from nbd_verity.fec import image as fec_image
from nbd_verity.fec.layout import FecRepairer, MessageReader
from nbd_verity.format.params import VerityParams
from nbd_verity.sources.source import ImageFile

BS = 4096
BLOCKS = 768  # with roots 2: fec_blocks 775, rsn 253, 4 rounds; 5, 9, 13 share a group


@pytest.fixture
def image(tmp_path):
    rnd = random.Random(4)
    content = bytearray(rnd.randbytes(BLOCKS * BS))
    content[13 * BS:14 * BS] = bytes(BS)  # a zero block, for ignore_zero_blocks
    (tmp_path / "data").write_bytes(content)
    params = VerityParams(data_blocks=BLOCKS, salt=b"\x01" * 32)
    fec_image.format_with_fec(str(tmp_path / "data"), str(tmp_path / "hash"),
                              str(tmp_path / "fec"), params, 2)
    geo = fec_image.fec_geometry(params, str(tmp_path / "hash"), str(tmp_path / "fec"), 2)
    return tmp_path, geo, bytes(content)


def corrupt(path, blocks):
    with open(path, "r+b") as f:
        for b in blocks:
            f.seek(b * BS)
            f.write(random.Random(b).randbytes(BS))


def repairer(tmp_path, geo):
    data, hashes = ImageFile(str(tmp_path / "data"), "data"), ImageFile(
        str(tmp_path / "hash"), "hash")
    return FecRepairer(geo, MessageReader(geo, data, hashes), ImageFile(
        str(tmp_path / "fec"), "fec"))


def digest_check(content: bytes, block: int):
    want = hashlib.sha256(content[block * BS:(block + 1) * BS]).digest()
    return lambda b: hashlib.sha256(b).digest() == want


def test_one_bad_block_errors_only(image):
    tmp_path, geo, content = image
    corrupt(tmp_path / "data", [5])
    got = repairer(tmp_path, geo).repair(5, digest_check(content, 5))
    assert got == content[5 * BS:6 * BS]


def test_two_bad_blocks_need_their_erasures(image):
    tmp_path, geo, content = image
    corrupt(tmp_path / "data", [5, 9])
    fixer = repairer(tmp_path, geo)
    assert fixer.repair(5, digest_check(content, 5)) is None
    bad = {5, 9}
    got = fixer.repair(5, digest_check(content, 5), lambda i, _b: i in bad)
    assert got == content[5 * BS:6 * BS]


def test_zero_blocks_are_decoded_as_zeros(image):
    """Three bad blocks exceed roots 2, unless one is a known zero block (the kernel skips
    those under ignore_zero_blocks and decodes them as zeros)."""
    tmp_path, geo, content = image
    corrupt(tmp_path / "data", [5, 9, 13])
    fixer = repairer(tmp_path, geo)
    bad = {5, 9, 13}
    assert fixer.repair(5, digest_check(content, 5), lambda i, _b: i in bad) is None
    got = fixer.repair(5, digest_check(content, 5), lambda i, _b: i in bad,
                       zero=lambda i: i == 13)
    assert got == content[5 * BS:6 * BS]


def test_a_hash_block(image):
    tmp_path, geo, _ = image
    hash_block = 3
    original = (tmp_path / "hash").read_bytes()[hash_block * BS:(hash_block + 1) * BS]
    corrupt(tmp_path / "hash", [hash_block])
    got = repairer(tmp_path, geo).repair(geo.index_of_hash_block(hash_block),
                                         lambda b: b == original)
    assert got == original

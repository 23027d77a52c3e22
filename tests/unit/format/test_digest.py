"""Salted digests: salt order per format, slot padding, salt and algorithm parsing."""

from __future__ import annotations

import hashlib
import os

import pytest

from nbd_verity.errors import ConfigError
from nbd_verity.format.digest import (
    Digester,
    next_pow2,
    normalize_algorithm,
    parse_salt,
    supported_algorithms,
)
from nbd_verity.format.params import VerityParams

SALT = bytes.fromhex("e48da609055204e89ae53b655ca2216dd983cf3cb829f34f63a297d106d53e2d")
BLOCK = bytes(range(256)) * 16


def test_format_1_prepends_the_salt():
    d = Digester("sha256", SALT, 1)
    assert d.digest(BLOCK) == hashlib.sha256(SALT + BLOCK).digest()


def test_format_0_appends_the_salt():
    d = Digester("sha256", SALT, 0)
    assert d.digest(BLOCK) == hashlib.sha256(BLOCK + SALT).digest()


def test_no_salt_is_the_plain_digest():
    for hash_type in (0, 1):
        assert Digester("sha1", b"", hash_type).digest(BLOCK) == hashlib.sha1(BLOCK).digest()


def test_format_1_pads_slots_to_a_power_of_two_and_format_0_packs_them():
    v1, v0 = Digester("sha1", SALT, 1), Digester("sha1", SALT, 0)
    assert (v1.digest_size, v1.slot_size, v0.slot_size) == (20, 32, 20)
    assert v1.slots_of(BLOCK, len(BLOCK)) == hashlib.sha1(SALT + BLOCK).digest() + bytes(12)
    assert v0.slots_of(BLOCK, len(BLOCK)) == hashlib.sha1(BLOCK + SALT).digest()


@pytest.mark.parametrize("hash_type", [0, 1])
@pytest.mark.parametrize("algorithm", ["sha1", "sha256", "md5", "sha512"])
def test_slots_of_equals_one_slot_per_block(algorithm, hash_type):
    d = Digester(algorithm, SALT[:7], hash_type)
    buf = os.urandom(512 * 9)
    pad = bytes(d.slot_size - d.digest_size)
    expected = b"".join(d.digest(buf[i:i + 512]) + pad for i in range(0, len(buf), 512))
    assert d.slots_of(buf, 512) == expected
    assert d.slots_of(memoryview(buf), 512) == expected
    assert d.slots_of_held(buf, 512) == expected


@pytest.mark.parametrize("hash_type", [0, 1])
@pytest.mark.parametrize("block_size", [4096, 65536])
def test_held_slots_cut_blocks_without_changing_digests(block_size, hash_type):
    """slots_of_held feeds a block in pieces below 2048 bytes: same digests."""
    d = Digester("sha256", SALT[:7], hash_type)
    buf = os.urandom(block_size * 3)
    assert d.slots_of_held(buf, block_size) == d.slots_of(buf, block_size)


@pytest.mark.parametrize("hash_type", [0, 1])
def test_differing_slots_compares_only_the_digest_bytes(hash_type):
    """Padding (format 1) never counts; each slot whose digest differs is named, in order."""
    d = Digester("sha1", SALT, hash_type)
    ours = d.slots_of(os.urandom(512 * 4), 512)
    theirs = bytearray(ours)
    if hash_type == 1:
        theirs[d.digest_size] ^= 1  # padding of slot 0: not a difference
    theirs[1 * d.slot_size] ^= 1
    theirs[3 * d.slot_size + d.digest_size - 1] ^= 1
    assert list(d.differing_slots(ours, bytes(theirs))) == [1, 3]
    assert d.verify(bytes(512 * 4), 512, d.slots_of(bytes(512 * 4), 512)) == -1
    assert d.stored(ours, d.slot_size) == ours[d.slot_size:d.slot_size + d.digest_size]


def test_digester_can_be_reused_without_leaking_state():
    d = Digester("sha256", SALT, 1)
    first = d.digest(BLOCK)
    d.digest(b"something else" * 300)
    assert d.digest(BLOCK) == first


def test_every_supported_algorithm_hashes_like_hashlib():
    for name in supported_algorithms():
        d = Digester(name, SALT, 1)
        assert len(d.digest(BLOCK)) == d.digest_size
        assert d.slot_size == next_pow2(d.digest_size)


@pytest.mark.parametrize(("n", "p"), [(1, 1), (16, 16), (20, 32), (28, 32), (32, 32),
                                      (48, 64), (64, 64)])
def test_next_pow2(n, p):
    assert next_pow2(n) == p


@pytest.mark.parametrize(("text", "salt"), [
    ("-", b""), ("", b""), ("dadada", b"\xda\xda\xda"), ("DADADA", b"\xda\xda\xda"),
    ("ab" * 256, b"\xab" * 256),
])
def test_parse_salt(text, salt):
    assert parse_salt(text) == salt


@pytest.mark.parametrize(("text", "message"), [
    ("xyz", "salt: 'xyz' is not a hex string"),
    ("abc", "salt: 'abc' is not a hex string"),
    ("ab" * 257, "salt: 257 bytes exceeds the maximum of 256"),
])
def test_parse_salt_rejects(text, message):
    with pytest.raises(ConfigError) as e:
        parse_salt(text)
    assert str(e.value) == message


def test_normalize_algorithm_lower_cases():
    assert normalize_algorithm("SHA256") == "sha256"


@pytest.mark.parametrize("name", ["whirlpool", "sha257", "", "sha3_256"])
def test_normalize_algorithm_rejects_unknown_names(name):
    with pytest.raises(ConfigError, match=f"hash: unsupported algorithm {name!r}"):
        normalize_algorithm(name)


def test_unknown_hash_type():
    with pytest.raises(ConfigError, match=r"format: unsupported hash type 2 \(0 or 1\)"):
        VerityParams(data_blocks=1, hash_type=2).check()

"""The 512-byte superblock: field offsets, pack/unpack round trip, one message per defect."""

from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import replace

import pytest

from nbd_verity.errors import SuperblockError
from nbd_verity.format.params import params_from_superblock
from nbd_verity.format.superblock import SIGNATURE, SUPERBLOCK_SIZE, Superblock
from nbd_verity.limits import block_size_ok

UUID = uuidlib.UUID("a60c98d2-ae9b-4865-bfcb-b4e3ace11033")


def sample(**changes) -> Superblock:
    sb = Superblock(version=1, hash_type=1, uuid=UUID.bytes, algorithm="sha256",
                    data_block_size=4096, hash_block_size=512, data_blocks=768,
                    salt=bytes.fromhex("e48da609055204e89ae53b655ca2216d"))
    return replace(sb, **changes)


def patched(buf: bytes, offset: int, fmt: str, value) -> bytes:
    """buf with one little-endian field overwritten."""
    out = bytearray(buf)
    struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


def test_pack_puts_each_field_at_cryptsetups_offset():
    buf = sample().pack()
    assert len(buf) == SUPERBLOCK_SIZE
    assert buf[0:8] == b"verity\x00\x00"
    assert struct.unpack_from("<IIxxxxxxxxxxxxxxxx", buf, 8) == (1, 1)
    assert buf[16:32] == UUID.bytes
    assert buf[32:64] == b"sha256".ljust(32, b"\x00")
    assert struct.unpack_from("<IIQH", buf, 64) == (4096, 512, 768, 16)
    assert buf[82:88] == bytes(6)
    assert buf[88:104] == bytes.fromhex("e48da609055204e89ae53b655ca2216d")
    assert buf[104:512] == bytes(408)  # the rest of the salt field and _pad2


@pytest.mark.parametrize("sb", [
    sample(),
    sample(hash_type=0, algorithm="sha1", salt=b""),
    sample(salt=bytes(range(256)), data_blocks=(1 << 64) - 1),
    sample(data_block_size=512 * 1024, hash_block_size=512, algorithm="blake2b-512"),
])
def test_round_trip(sb):
    back = Superblock.unpack(sb.pack()).validate()
    assert back.pack() == sb.pack()
    assert (back.version, back.hash_type, back.uuid, back.algorithm, back.data_block_size,
            back.hash_block_size, back.data_blocks, back.salt) == (
        sb.version, sb.hash_type, sb.uuid, sb.algorithm, sb.data_block_size,
        sb.hash_block_size, sb.data_blocks, sb.salt)


def test_pack_lower_cases_the_algorithm():
    assert Superblock.unpack(sample(algorithm="SHA256").pack()).algorithm == "sha256"


def test_unpack_ignores_bytes_past_512():
    buf = sample().pack() + b"\xff" * 100
    assert Superblock.unpack(buf).pack() == sample().pack()


def test_uuid_text():
    assert params_from_superblock(sample()).uuid_text == str(UUID)


@pytest.mark.parametrize(("offset", "fmt", "value", "message"), [
    (0, "8s", b"verity\x00X", "not a verity superblock (bad signature)"),
    (0, "8s", bytes(8), "not a verity superblock (bad signature)"),
    (8, "I", 2, "unsupported version 2"),
    (8, "I", 0, "unsupported version 0"),
    (12, "I", 2, "unsupported hash type 2"),
    (64, "I", 1000, "unsupported data block size 1000"),
    (64, "I", 256, "unsupported data block size 256"),
    (64, "I", 1 << 20, "unsupported data block size 1048576"),
    (68, "I", 768, "unsupported hash block size 768"),
    (68, "I", 0, "unsupported hash block size 0"),
    (80, "H", 257, "salt_size 257 exceeds 256"),
    (32, "32s", bytes(32), "empty hash algorithm"),
])
def test_each_defect_has_its_own_message(offset, fmt, value, message):
    buf = patched(sample().pack(), offset, fmt, value)
    sb = Superblock.unpack(buf)
    assert sb.defects() == [message]
    with pytest.raises(SuperblockError) as e:
        sb.validate()
    assert str(e.value) == f"superblock: {message}"


def test_several_defects_are_reported_together():
    buf = patched(patched(sample().pack(), 8, "I", 3), 12, "I", 7)
    with pytest.raises(SuperblockError, match="unsupported version 3; unsupported hash type 7"):
        Superblock.unpack(buf).validate()


def test_a_bad_signature_hides_the_other_fields():
    buf = patched(patched(sample().pack(), 0, "8s", b"VERITY\x00\x00"), 8, "I", 9)
    assert Superblock.unpack(buf).defects() == ["not a verity superblock (bad signature)"]


def test_short_buffer():
    with pytest.raises(SuperblockError, match="100 bytes read, 512 needed"):
        Superblock.unpack(SIGNATURE + bytes(92))


def test_pack_refuses_an_invalid_superblock():
    with pytest.raises(SuperblockError, match="unsupported hash type 5"):
        sample(hash_type=5).pack()


def test_pack_refuses_an_algorithm_name_of_32_characters():
    with pytest.raises(SuperblockError, match="too long"):
        sample(algorithm="a" * 32).pack()


@pytest.mark.parametrize(("size", "ok"), [
    (256, False), (511, False), (512, True), (1024, True), (1536, False), (4096, True),
    (65536, True), (512 * 1024, True), (1024 * 1024, False), (0, False), (-512, False),
])
def test_block_size_ok(size, ok):
    assert block_size_ok(size) is ok

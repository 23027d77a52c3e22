"""The GPT reader and the verity triple chooser on tables built here, byte by byte from
the UEFI layout (the repart-built images are in tests/server/test_ddi.py)."""

from __future__ import annotations

import struct
import uuid
import zlib

import pytest

from nbd_verity.errors import PartitionTableError
from nbd_verity.format.ddi import choose, match_triple
from nbd_verity.format.dps import TYPES, partition_type
from nbd_verity.format.gpt import read_partition_table

ROOT_X86_64 = uuid.UUID("4f68bce3-e8cd-4db1-96e7-fbcaf984b709")
ROOT_X86_64_VERITY = uuid.UUID("2c7357ed-ebd2-46d9-aec1-23d437ec2bf5")
USR_ARM64 = uuid.UUID("b0e01050-ee5f-4390-949a-9101b17104e9")
USR_ARM64_VERITY = uuid.UUID("6e11a4e7-fbca-4ded-b9e9-e1a512bb664e")
ROOT_HEX = "71b6468f08b604d56e7794e44cc608fbcafefb2ea9fb81f262f92a801d4ed746"


class Bytes:
    """A source over bytes, with ImageFile's read(size, offset) and size()."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def size(self) -> int:
        return len(self.blob)

    def read(self, size: int, offset: int) -> bytes:
        return self.blob[offset:offset + size]


def disk(parts, ss: int = 512, sectors: int = 2048) -> bytearray:
    """A disk with a primary and a backup GPT of 128 entries holding parts:
    (type, uuid, first_lba, last_lba)."""
    image = bytearray(sectors * ss)
    array = bytearray(128 * 128)
    for i, (kind, unique, first, last) in enumerate(parts):
        struct.pack_into("<16s16sQQQ", array, i * 128, kind.bytes_le, unique.bytes_le,
                         first, last, 0)
    entry_sectors = len(array) // ss
    backup_entries = sectors - 1 - entry_sectors
    for my, alt, entries in ((1, sectors - 1, 2), (sectors - 1, 1, backup_entries)):
        header = bytearray(struct.pack("<8sIIIIQQQQ16sQIII", b"EFI PART", 0x10000, 92, 0, 0,
                                       my, alt, 2 + entry_sectors,
                                       sectors - 2 - entry_sectors, uuid.uuid4().bytes_le,
                                       entries, 128, 128, zlib.crc32(array)))
        struct.pack_into("<I", header, 16, zlib.crc32(header))
        image[my * ss:my * ss + 92] = header
        image[entries * ss:entries * ss + len(array)] = array
    return image


TRIPLE = [(ROOT_X86_64, uuid.UUID(ROOT_HEX[:32]), 100, 199),
          (ROOT_X86_64_VERITY, uuid.UUID(ROOT_HEX[32:]), 200, 299)]


@pytest.mark.parametrize("ss", [512, 4096])
def test_table_is_read_at_its_sector_size(ss):
    table = read_partition_table(Bytes(disk(TRIPLE, ss, 1024)), "d")
    assert table.sector_size == ss and table.header_lba == 1 and table.warning is None
    assert [(p.offset, p.size) for p in table.partitions] == [(100 * ss, 100 * ss),
                                                               (200 * ss, 100 * ss)]


def test_a_damaged_primary_falls_back_to_the_backup():
    image = disk(TRIPLE)
    image[512 + 60] ^= 1  # disk GUID: header CRC mismatch
    table = read_partition_table(Bytes(image), "d")
    assert table.header_lba == 2047 and "using the backup" in table.warning
    assert len(table.partitions) == 2


def test_a_damaged_entry_array_is_a_crc_mismatch():
    image = disk(TRIPLE)
    image[2 * 512 + 40] ^= 1
    image[(2047 - 32) * 512 + 40] ^= 1
    with pytest.raises(PartitionTableError, match="entry array CRC32 mismatch; backup"):
        read_partition_table(Bytes(image), "d")


def test_no_table_is_not_a_disk_image():
    with pytest.raises(PartitionTableError, match="no GPT partition table"):
        read_partition_table(Bytes(bytes(1 << 20)), "d")


def test_a_truncated_disk_is_refused():
    image = disk(TRIPLE)[:1500 * 512]
    with pytest.raises(PartitionTableError, match="truncated"):
        read_partition_table(Bytes(image), "d")


def test_triple_matches_the_root_hash_halves():
    table = read_partition_table(Bytes(disk(TRIPLE)), "d")
    assert choose(table, "d") == ("root", "x86-64")
    triple = match_triple(table, "d", "root", "x86-64", ROOT_HEX, None)
    assert (triple.data.number, triple.verity.number) == (1, 2)
    with pytest.raises(PartitionTableError, match="disagree with the root hash"):
        match_triple(table, "d", "root", "x86-64", "ab" * 32, None)


def test_root_and_usr_need_a_choice():
    parts = [*TRIPLE, (USR_ARM64, uuid.uuid4(), 300, 399),
             (USR_ARM64_VERITY, uuid.uuid4(), 400, 499)]
    table = read_partition_table(Bytes(disk(parts)), "d")
    with pytest.raises(PartitionTableError, match=r"give --partition root\|usr"):
        choose(table, "d")
    assert choose(table, "d", "usr") == ("usr", "arm64")


def test_the_type_table_names_types_as_systemd_repart():
    assert partition_type(ROOT_X86_64_VERITY).name == "root-x86-64-verity"
    assert partition_type(USR_ARM64).name == "usr-arm64"
    assert len(TYPES) == 6 * 24  # the 24 architectures of the specification

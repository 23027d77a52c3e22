"""The GUID Partition Table of a disk image: header and entries, CRCs checked.

Mirrors the UEFI specification (5.3, "GUID Partition Table (GPT) Disk Layout") and what
the Linux kernel's block/partitions/efi.c checks (is_gpt_valid): the signature, the
header's CRC32 over its own header_size bytes (its CRC field taken as zero), my_lba, the
usable range inside the disk, and the CRC32 of the entry array. A damaged primary table
is replaced by the backup at the disk's last sector, as the kernel (find_valid_gpt:
"Primary GPT is invalid, using alternate GPT"), libblkid and libfdisk do; the caller
gets a warning saying so. With neither valid, one line says what is wrong with each.

The sector size is not on disk: the table is looked for at LBA 1 of 512, 1024, 2048 and
4096-byte sectors, as systemd's probe_sector_size() does for an image file. Everything
is read through a source (ImageFile, NbdSource: read(size, offset) and size()), so a DDI
behind nbd:// or http(s):// is read the same way as a file. GUIDs are stored mixed-endian
(uuid.UUID(bytes_le=...)); their text form is what sfdisk and systemd print.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from dataclasses import dataclass

from ..errors import ImageIOError, PartitionTableError

SIGNATURE = b"EFI PART"
SECTOR_SIZES = (512, 1024, 2048, 4096)  # systemd's probe order for an image file
MIN_HEADER_SIZE = 92
MIN_ENTRY_SIZE = 128
HEAD_SIZE = max(SECTOR_SIZES) + len(SIGNATURE)  # bytes that hold LBA 1's signature
MAX_ENTRY_ARRAY_SIZE = 1 << 20  # 8192 entries of 128 bytes; systemd-repart writes 16 KiB

_HEADER = struct.Struct(
    "<"
    "8s"  # signature: "EFI PART"
    "I"  # revision: 0x00010000 for 1.0
    "I"  # header_size: bytes covered by header_crc32, 92 up to the sector size
    "I"  # header_crc32: CRC32 of the header with this field zero
    "I"  # reserved: zero
    "Q"  # my_lba: where this header is (1 primary, last sector backup)
    "Q"  # alternate_lba: where the other header is
    "Q"  # first_usable_lba: first sector a partition may use
    "Q"  # last_usable_lba: last sector a partition may use
    "16s"  # disk_guid
    "Q"  # partition_entry_lba: first sector of the entry array
    "I"  # num_partition_entries
    "I"  # sizeof_partition_entry: 128 * 2^n
    "I"  # partition_entry_array_crc32
)
_ENTRY = struct.Struct(
    "<"
    "16s"  # partition_type_guid: all zero for an unused entry
    "16s"  # unique_partition_guid
    "Q"  # starting_lba
    "Q"  # ending_lba: inclusive
    "Q"  # attributes: bit 60 read-only, 63 no-auto (Discoverable Partitions)
    "72s"  # partition_name: UTF-16LE, NUL-padded
)
if _HEADER.size != MIN_HEADER_SIZE or _ENTRY.size != MIN_ENTRY_SIZE:
    raise ImportError("GPT header or entry layout has the wrong size")


@dataclass(frozen=True)
class GptPartition:
    """One used entry of the table; offsets in bytes."""

    number: int  # 1-based, as sfdisk and the kernel number partitions
    type_uuid: uuid.UUID
    uuid: uuid.UUID
    offset: int
    size: int
    attributes: int
    name: str

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class PartitionTable:
    """A valid GPT: its sector size, which header was used, and its used entries."""

    sector_size: int
    disk_uuid: uuid.UUID
    partitions: tuple[GptPartition, ...]
    header_lba: int  # 1 for the primary, else the backup's LBA
    warning: str | None = None  # set when the backup was used


@dataclass(frozen=True)
class _Header:
    my_lba: int
    alternate_lba: int
    first_usable_lba: int
    last_usable_lba: int
    disk_guid: bytes
    entry_lba: int
    entries: int
    entry_size: int
    entries_crc32: int


def read_partition_table(source, name: str) -> PartitionTable:
    """The GPT of the image read through source (name for messages), or raise
    PartitionTableError in one line; ImageIOError if the image cannot be read."""
    size = source.size()
    sector_size = _sector_size(source, size)
    if sector_size is None:
        raise PartitionTableError(f"{name}: no GPT partition table (not a disk image)")
    sectors = size // sector_size
    try:
        return _table(source, _header(source, sector_size, 1, sectors), sector_size, 1)
    except PartitionTableError as primary:
        backup_lba = sectors - 1
        try:
            header = _header(source, sector_size, backup_lba, sectors)
            table = _table(source, header, sector_size, backup_lba)
        except PartitionTableError as backup:
            raise PartitionTableError(f"{name}: GPT: primary {primary}; backup {backup}"
                                      ) from None
        warning = (f"{name}: the primary GPT is damaged ({primary}); using the backup "
                   f"at LBA {backup_lba}, as the kernel does")
        return PartitionTable(table.sector_size, table.disk_uuid, table.partitions,
                              backup_lba, warning)


def _header(source, sector_size: int, lba: int, sectors: int) -> _Header:
    """The header at LBA, checked (kernel's is_gpt_valid); raises with what is wrong."""
    if lba < 1 or lba >= sectors:
        raise PartitionTableError(f"header at LBA {lba}: past the end of the image "
                                  f"({sectors} sectors of {sector_size} bytes: truncated?)")
    raw = bytes(source.read(sector_size, lba * sector_size))
    (signature, _revision, header_size, header_crc, _reserved, my_lba, alternate_lba,
     first_usable, last_usable, disk_guid, entry_lba, entries, entry_size,
     entries_crc) = _HEADER.unpack_from(raw)
    if signature != SIGNATURE:
        raise PartitionTableError(f"header at LBA {lba}: no GPT signature")
    if not MIN_HEADER_SIZE <= header_size <= sector_size:
        raise PartitionTableError(f"header at LBA {lba}: header_size {header_size} is not "
                                  f"{MIN_HEADER_SIZE}..{sector_size}")
    covered = raw[:16] + b"\0\0\0\0" + raw[20:header_size]
    if zlib.crc32(covered) != header_crc:
        raise PartitionTableError(f"header at LBA {lba}: header CRC32 mismatch")
    if my_lba != lba:
        raise PartitionTableError(f"header at LBA {lba}: my_lba is {my_lba}")
    if first_usable > last_usable:
        raise PartitionTableError(f"header at LBA {lba}: first usable LBA {first_usable} "
                                  f"is after the last, {last_usable}")
    if last_usable >= sectors or alternate_lba >= sectors:
        raise PartitionTableError(
            f"header at LBA {lba}: the table spans {max(last_usable, alternate_lba) + 1} "
            f"sectors, the image has {sectors} of {sector_size} bytes (truncated?)")
    if entry_size < MIN_ENTRY_SIZE or entry_size % 8:
        raise PartitionTableError(f"header at LBA {lba}: entry size {entry_size} is not a "
                                  f"multiple of 8 of at least {MIN_ENTRY_SIZE}")
    if entries * entry_size > MAX_ENTRY_ARRAY_SIZE:
        raise PartitionTableError(f"header at LBA {lba}: {entries} entries of {entry_size} "
                                  f"bytes exceed {MAX_ENTRY_ARRAY_SIZE} bytes")
    return _Header(my_lba, alternate_lba, first_usable, last_usable, disk_guid, entry_lba,
                   entries, entry_size, entries_crc)


def _table(source, header: _Header, sector_size: int, lba: int) -> PartitionTable:
    """The used entries of the array header describes, its CRC32 checked."""
    array_size = header.entries * header.entry_size
    start = header.entry_lba * sector_size
    if header.entry_lba < 1 or start + array_size > source.size():
        raise PartitionTableError(f"header at LBA {lba}: its entry array at LBA "
                                  f"{header.entry_lba} is past the end of the image")
    try:
        array = bytes(source.read(array_size, start))
    except ImageIOError as e:
        raise PartitionTableError(f"header at LBA {lba}: entry array: {e}") from None
    if zlib.crc32(array) != header.entries_crc32:
        raise PartitionTableError(f"header at LBA {lba}: partition entry array CRC32 "
                                  f"mismatch")
    partitions = []
    for index in range(header.entries):
        entry = _entry(array, index, header, sector_size, lba)
        if entry is not None:
            partitions.append(entry)
    return PartitionTable(sector_size, uuid.UUID(bytes_le=header.disk_guid),
                          tuple(partitions), lba)


def _entry(array: bytes, index: int, header: _Header, sector_size: int,
           lba: int) -> GptPartition | None:
    """Entry INDEX, None when unused; its range must lie in the usable area."""
    type_guid, unique, first, last, attributes, name = _ENTRY.unpack_from(
        array, index * header.entry_size)
    if type_guid == bytes(16):
        return None
    number = index + 1
    if not header.first_usable_lba <= first <= last <= header.last_usable_lba:
        raise PartitionTableError(f"header at LBA {lba}: partition {number} spans LBA "
                                  f"{first}..{last}, outside the usable "
                                  f"{header.first_usable_lba}..{header.last_usable_lba}")
    text = name.decode("utf-16-le", "replace").split("\0", 1)[0]
    return GptPartition(number, uuid.UUID(bytes_le=type_guid), uuid.UUID(bytes_le=unique),
                        first * sector_size, (last - first + 1) * sector_size, attributes,
                        text)


def _sector_size(source, size: int) -> int | None:
    """The first sector size with a GPT signature at LBA 1, else at its last sector (a
    primary header wiped whole still leaves the backup); None when neither is found."""
    found = lba1_sector_size(bytes(source.read(min(size, HEAD_SIZE), 0)))
    if found is not None:
        return found
    for ss in SECTOR_SIZES:
        last = (size // ss - 1) * ss
        if last > ss and bytes(source.read(len(SIGNATURE), last)) == SIGNATURE:
            return ss
    return None


def lba1_sector_size(head: bytes) -> int | None:
    """The first sector size whose LBA 1 holds a GPT signature in an image's first
    bytes (HEAD_SIZE of them), or None: the one probe of LBA 1."""
    for ss in SECTOR_SIZES:
        if head[ss:ss + len(SIGNATURE)] == SIGNATURE:
            return ss
    return None


def starts_with_gpt(head: bytes) -> bool:
    """Whether the first bytes of an image hold a GPT signature at LBA 1 (some sector size)."""
    return lba1_sector_size(head) is not None


def has_gpt_signature(source) -> bool:
    """Whether a GPT header signature sits at LBA 1 or the last sector for one of the
    sector sizes (a cheap probe: a disk image rather than a bare file system?)."""
    try:
        return _sector_size(source, source.size()) is not None
    except ImageIOError:
        return False

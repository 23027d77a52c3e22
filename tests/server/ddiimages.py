"""Discoverable Disk Images made by systemd-repart (the oracle), for the DDI tests.

An ext4 file system is made by `mkfs.ext4 -d` from a small tree and copied into the
data partition with CopyBlocks= (repart 252 then needs no mkfs of its own); repart adds
the verity partition and, given a key and certificate, the signature partition. Where
each partition is comes from `sfdisk --json`, never from
nbd_verity's GPT reader, and the root hash from repart's own JSON output. 4 KiB-sector
images are written by repart onto a loop device with 4096-byte logical sectors
(repart 252 has no --sector-size); the loop device is detached by its name.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

REPART = shutil.which("systemd-repart") or "/usr/bin/systemd-repart"
SFDISK = shutil.which("sfdisk") or "/usr/sbin/sfdisk"
LOSETUP = shutil.which("losetup") or "/usr/sbin/losetup"
FILES = {"etc/hello.txt": b"hello from a discoverable disk image\n",
         "usr/payload.bin": bytes(range(256)) * 256}  # 64 KiB


@dataclass(frozen=True)
class Part:
    """One partition as sfdisk reports it, in bytes."""

    number: int
    type: str
    uuid: str
    offset: int
    size: int

    def read(self, image: Path) -> bytes:
        with open(image, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


@dataclass(frozen=True)
class Ddi:
    path: Path
    root: str  # repart's root hash
    sector_size: int
    parts: dict  # "data", "verity", "signature" -> Part

    @property
    def data(self) -> Part:
        return self.parts["data"]


def make_filesystem(directory: Path) -> Path:
    """A 4 MiB ext4 image (4 KiB blocks) holding FILES."""
    tree = directory / "tree"
    for name, content in FILES.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(content)
    image = directory / "fs.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(tree), str(image), "4M"],
                   check=True, capture_output=True, timeout=60)
    return image


def write_definitions(directory: Path, fs: Path, designator: str, signed: bool) -> Path:
    """repart.d: data (CopyBlocks), its verity partition and, if signed, the signature.
    Data and verity are at least 10 MiB, repart 252's default minimum: repart 257 (Debian
    13) otherwise sizes the verity partition of --size=auto below the tree it then writes
    ("Cannot seek to requested position in hash device"), and both give one layout."""
    defs = directory / "repart.d"
    defs.mkdir()
    roles = [("10", designator, "data", f"CopyBlocks={fs}\nSizeMinBytes=10M\n"),
             ("20", f"{designator}-verity", "hash", "SizeMinBytes=10M\n")]
    if signed:
        roles.append(("30", f"{designator}-verity-sig", "signature", ""))
    for prefix, kind, verity, extra in roles:
        (defs / f"{prefix}-{kind}.conf").write_text(
            f"[Partition]\nType={kind}\n{extra}Verity={verity}\n"
            f"VerityMatchKey={designator}\n")
    return defs


def make_ddi(directory: Path, designator: str = "root", signer=None,
             sector_size: int = 512, request=None) -> Ddi:
    """A DDI built by systemd-repart in directory; signer: a tests.pki Identity."""
    directory.mkdir(parents=True, exist_ok=True)
    defs = write_definitions(directory, make_filesystem(directory), designator,
                             signer is not None)
    image = directory / "disk.raw"
    keys = ["--private-key", str(signer.key), "--certificate", str(signer.cert)] if signer \
        else []
    if sector_size == 512:
        target, empty = str(image), ["--empty=create", "--size=auto"]
    else:
        image.write_bytes(b"")
        subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
        target = _loop(image, sector_size, request)
        empty = ["--empty=force"]
    done = subprocess.run([REPART, *empty, "--dry-run=no", "--json=short",
                           f"--definitions={defs}", *keys, target],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    root = next(row["roothash"] for row in rows if row["roothash"])
    return Ddi(image, root, sector_size, sfdisk_parts(target, sector_size))


def _loop(image: Path, sector_size: int, request) -> str:
    name = subprocess.run([LOSETUP, "-f", "--show", "--sector-size", str(sector_size),
                           str(image)], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()
    request.addfinalizer(lambda: subprocess.run([LOSETUP, "-d", name], timeout=60,
                                                check=True))
    return name


def sfdisk_parts(target: str, sector_size: int) -> dict:
    """The verity triple's partitions as sfdisk --json reads the table (of the loop
    device for 4 KiB sectors: sfdisk 2.38 takes the sector size from the device)."""
    out = subprocess.run([SFDISK, "--json", str(target)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    table = json.loads(out)["partitiontable"]
    assert table["sectorsize"] == sector_size, table
    parts = {}
    for number, row in enumerate(table["partitions"], 1):
        role = {0: "data", 1: "verity", 2: "signature"}[number - 1]
        parts[role] = Part(number, row["type"].lower(), row["uuid"].lower(),
                           row["start"] * sector_size, row["size"] * sector_size)
    return parts


# -- damage -----------------------------------------------------------------------------

def set_partition_uuid(image: Path, number: int, new: uuid.UUID, sector_size: int = 512,
                       header_lba: int = 1) -> None:
    """Rewrite partition NUMBER's unique GUID in the GPT at header_lba, with both CRC32s
    recomputed (a well-formed table whose UUIDs no longer match the root hash)."""
    with open(image, "r+b") as f:
        f.seek(header_lba * sector_size)
        header = bytearray(f.read(92))
        entry_lba, count, entry_size = struct.unpack_from("<QII", header, 72)
        f.seek(entry_lba * sector_size)
        array = bytearray(f.read(count * entry_size))
        at = (number - 1) * entry_size + 16
        array[at:at + 16] = new.bytes_le
        struct.pack_into("<I", header, 88, zlib.crc32(array))
        struct.pack_into("<I", header, 16, 0)
        struct.pack_into("<I", header, 16, zlib.crc32(bytes(header[:92])))
        f.seek(entry_lba * sector_size)
        f.write(array)
        f.seek(header_lba * sector_size)
        f.write(header)


def backup_lba(image: Path, sector_size: int = 512) -> int:
    return image.stat().st_size // sector_size - 1

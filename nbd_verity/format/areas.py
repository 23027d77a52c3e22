"""The three areas of a verity layout, and the one rule that no two of them overlap.

An image has a data area (data blocks from byte 0 of the data image), a hash area (the
superblock at hash_offset, then the tree, up to the end of the tree) and, with FEC, a
parity area (from fec_offset). veritysetup refuses a layout whose areas overlap when two
of them sit on the same device ("Data area overlaps with hash area.", "Data area overlaps
with FEC area.", "Hash and FEC device overlaps."); so does every command here, before
anything is read or written, in one line naming both areas and their byte ranges.

"The same device" is decided by what backs the bytes, not by the path: `./img`, `/abs/img`,
a symlink and a hard link are one file (st_dev and st_ino); a block device is itself
(st_rdev), a partition is its disk from the partition's first byte on, and a loop device
is the file behind it from the loop's offset on (LOOP_GET_STATUS64). A path that does not
exist yet (an output format will create) is only the same as itself. Remote images (NBD
URIs, HTTP, S3) are never written and have no local identity: they are not compared.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import dataclass

from ..errors import ConfigError

LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")  # struct loop_info64 (linux/loop.h)


@dataclass(frozen=True)
class Area:
    """One area of a layout: what it is, where it is, and its bytes [start, end)."""

    name: str  # "data area", "hash area", "FEC area"
    key: str  # the option that places it, which a message starts with
    path: str
    start: int
    end: int


def backing(path: str) -> tuple[tuple, int]:
    """(identity of what holds path's bytes, byte of it where path's byte 0 is)."""
    if "://" in path:
        return ("remote", path), 0
    try:
        st = os.stat(path)
    except FileNotFoundError:
        try:
            parent = os.stat(os.path.dirname(os.path.abspath(path)))
        except OSError:
            return ("path", os.path.abspath(path)), 0
        return ("new", parent.st_dev, parent.st_ino, os.path.basename(path)), 0
    except OSError:
        return ("path", os.path.abspath(path)), 0
    if stat.S_ISBLK(st.st_mode):
        return _block_backing(path, st.st_rdev)
    return ("file", st.st_dev, st.st_ino), 0


def _block_backing(path: str, rdev: int) -> tuple[tuple, int]:
    """A block device's backing: a loop device's file, a partition's disk, or itself."""
    sys_dir = f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}"
    loop = _loop_backing(path) if os.path.isdir(f"{sys_dir}/loop") else None
    if loop is not None:
        return loop
    try:
        with open(f"{sys_dir}/partition"):
            pass
        with open(f"{sys_dir}/start") as f:
            start = int(f.read()) * 512
        with open(os.path.join(os.path.realpath(sys_dir), "..", "dev")) as f:
            major, minor = (int(n) for n in f.read().split(":"))
    except (OSError, ValueError):
        return ("block", rdev), 0
    disk, base = _block_backing(f"/dev/block/{major}:{minor}", os.makedev(major, minor))
    return disk, base + start


def _loop_backing(path: str) -> tuple[tuple, int] | None:
    """The file behind a loop device and the loop's offset into it, or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size))
    except OSError:
        return None  # an unbound loop device
    finally:
        os.close(fd)
    lo_device, lo_inode, _, lo_offset = _LOOP_INFO64.unpack(info)[:4]
    major = (lo_device & 0xFFF00) >> 8  # the kernel's huge_encode_dev
    minor = (lo_device & 0xFF) | ((lo_device >> 12) & 0xFFF00)
    return ("file", os.makedev(major, minor), lo_inode), lo_offset


def check_disjoint(areas: list[Area]) -> None:
    """Refuse, in one line, any two areas on the same device whose bytes overlap."""
    placed = []
    for area in areas:
        if area.end <= area.start:
            continue
        where, base = backing(area.path)
        for other, other_where, other_base in placed:
            if where == other_where and (base + area.start < other_base + other.end
                                         and other_base + other.start < base + area.end):
                raise ConfigError(
                    f"{area.key}: the {other.name} (bytes {other.start}-{other.end - 1} of "
                    f"{other.path}) overlaps the {area.name} (bytes {area.start}-"
                    f"{area.end - 1} of {area.path}) on the same device")
        placed.append((area, where, base))


def layout_areas(params, data_path: str, hash_path: str, fec=None,
                 fec_path: str | None = None) -> list[Area]:
    """The areas of a layout: params (VerityParams), fec (a FecGeometry) with fec_path."""
    geo = params.geometry()
    areas = [Area("data area", "data-blocks", data_path, 0, geo.data_size),
             Area("hash area", "hash-offset", hash_path, params.hash_offset,
                  geo.hash_image_size)]
    if fec is not None and fec_path is not None:
        areas.append(Area("FEC area", "fec-offset", fec_path, fec.fec_offset,
                          fec.parity_end))
    return areas


def check_layout(params, data_path: str, hash_path: str, fec=None,
                 fec_path: str | None = None) -> None:
    """The one overlap check every command makes before it reads or writes an image."""
    check_disjoint(layout_areas(params, data_path, hash_path, fec, fec_path))

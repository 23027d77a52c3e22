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
is the file behind it from the loop's offset on (files.backing). A path that does not
exist yet (an output format will create) is only the same as itself. Remote images (NBD
URIs, HTTP, S3) are never written and have no local identity: they are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..files import backing


@dataclass(frozen=True)
class Area:
    """One area of a layout: what it is, where it is, and its bytes [start, end)."""

    name: str  # "data area", "hash area", "FEC area"
    key: str  # the option that places it, which a message starts with
    path: str
    start: int
    end: int


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

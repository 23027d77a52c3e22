"""A Discoverable Disk Image opened for serving or checking: its GPT read through the
source, the verity triple chosen, the root hash settled, the two partitions as sources.

The steps, each in the module that owns it: format/gpt.py reads the partition table
(the backup if the primary is damaged), format/ddi.py chooses the designator and
architecture, trust/root.py settles the root hash from the command line or the verity
signature partition (checked as a verity.sig file is), format/ddi.py matches the data
and verity partitions to that root hash by their UUIDs, and sources/partition.py makes
each partition an image of its own. The superblock at the start of the verity partition
then gives the tree's parameters, as for any hash image.

An image is taken for a DDI when `partition=` is given, or when no hash image is given
or found beside it (IMAGE.verity) and it starts with a GPT (is_ddi).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

from ..errors import ImageIOError, PartitionTableError, SidecarError, VerityError
from ..format.ddi import AUTO, Triple, choose, match_triple, signature_partitions
from ..format.dps import partition_type
from ..format.gpt import GptPartition, PartitionTable, has_gpt_signature, read_partition_table
from ..sources.partition import PartitionSource
from ..sources.remote import is_uri, open_source
from ..trust.root import TrustedRoot, resolve_ddi_root
from ..trust.sidecar import MAX_SIDECAR_SIZE, auxiliary_path, parse_hex, parse_verity_sig


@dataclass
class OpenedDdi:
    """The data and verity partitions as sources, the trusted root, and what was read."""

    data: PartitionSource
    hashes: PartitionSource
    trust: TrustedRoot
    table: PartitionTable
    triple: Triple

    def close(self) -> None:
        self.data.close()
        self.hashes.close()


def is_ddi(location: str, hash_image: str | None) -> bool:
    """Whether an image given without a hash image is to be read as a DDI: no
    IMAGE.verity beside a local image, and a GPT at its start."""
    if hash_image is not None:
        return False
    if not is_uri(location) and os.path.exists(auxiliary_path(location, ".verity")):
        return False
    try:
        with contextlib.closing(open_source(location, "data")) as source:
            return has_gpt_signature(source)
    except ImageIOError:
        return False  # the usual path reports the image itself


def root_hash_in_hash_place(location: str, hash_image: str | None,
                            root_hash: str | None) -> bool:
    """Whether `DATA X` names a DDI and its root hash X (a DDI's second argument is its
    root hash, as with --partition): X is hex and names no file, and DATA is a DDI."""
    if hash_image is None or root_hash is not None or os.path.lexists(hash_image):
        return False
    if "://" in hash_image:
        return False
    try:
        parse_hex(hash_image, "root-hash", "root hash")
    except SidecarError:
        return False
    return is_ddi(location, None)


def label(part: GptPartition) -> str:
    """'partition 2, root-x86-64-verity': how messages name a partition."""
    kind = partition_type(part.type_uuid)
    return f"partition {part.number}, {kind.name if kind else part.type_uuid}"


def open_ddi(location: str, designator: str = AUTO, root_hash: str | None = None,
             signature_path: str | None = None, trusted_certs: str | None = None,
             require_signatures: bool = False, whole=None,
             table: PartitionTable | None = None) -> OpenedDdi:
    """Open the DDI at location (a path or an NBD URI) for serving (see the module).
    whole and table: the image already opened and its table already read (dump), which
    the result then owns."""
    whole = whole or open_source(location, "data")
    try:
        table = table or read_partition_table(whole, location)
        designator, arch = choose(table, location, designator)
        signature = blob = None  # a signature file given replaces the partition's
        if signature_path is None:
            signature, blob = _signature(whole, signature_partitions(table, designator, arch),
                                         root_hash, location)
        trust = resolve_ddi_root(location, location, root_hash, blob,
                                 f"{location} ({label(signature)})" if signature else None,
                                 signature_path, trusted_certs, require_signatures)
        triple = match_triple(table, location, designator, arch, trust.root_hex, signature)
        for part in (triple.data, triple.verity):
            _check_inside(whole, part, location)
        if table.warning:
            trust = replace(trust, warnings=(table.warning, *trust.warnings))
        data = PartitionSource(whole, triple.data.offset, triple.data.size,
                               label(triple.data))
    except BaseException:
        whole.close()
        raise
    try:
        hashes = PartitionSource(open_source(location, "hash"), triple.verity.offset,
                                 triple.verity.size, label(triple.verity))
    except BaseException:
        data.close()
        raise
    trust = replace(trust, hash_image=hashes.path)
    return OpenedDdi(data, hashes, trust, table, triple)


def _signature(source, parts: list[GptPartition], root_hash: str | None,
               name: str) -> tuple[GptPartition | None, bytes | None]:
    """The signature partition to use and its bytes, read once: the only one, or with a
    root hash given the one for that root hash (A/B images carry one per version)."""
    if len(parts) <= 1:
        return (parts[0], _read_partition(source, parts[0], name)) if parts else (None, None)
    if root_hash is None:
        raise PartitionTableError(f"{name}: {len(parts)} verity signature partitions "
                                  f"({', '.join(label(p) for p in parts)}): give the root "
                                  f"hash to choose")
    want = parse_hex(root_hash, "root-hash", "root hash")
    first = None
    for part in parts:
        blob = _read_partition(source, part, name)
        first = first or (part, blob)
        try:
            if parse_verity_sig(blob, f"{name} ({label(part)})").root_hash == want:
                return part, blob
        except SidecarError:  # another version's damaged signature: not this one
            continue
    return first  # none is for it: resolve_ddi_root says so in one line


def _read_partition(source, part: GptPartition, name: str) -> bytes:
    """A signature partition's bytes (systemd refuses one over 4 MiB)."""
    _check_inside(source, part, name)
    if part.size > MAX_SIDECAR_SIZE:
        raise PartitionTableError(f"{name} ({label(part)}): {part.size} bytes, more than "
                                  f"a verity signature partition may hold "
                                  f"({MAX_SIDECAR_SIZE})")
    return bytes(source.read(part.size, part.offset))


def _check_inside(source, part: GptPartition, name: str) -> None:
    """Refuse a partition that ends past the image (a truncated file), before serving."""
    size = source.size()
    if part.end > size:
        raise ImageIOError(f"{name}: {label(part)} ends at byte {part.end}, the image "
                           f"has {size} (truncated?)")



@dataclass
class DdiReport:
    """What `dump` says of a DDI: its table, and the triple that would be served with its
    root (or the one-line reason it would be refused)."""

    table: PartitionTable
    opened: OpenedDdi | None
    problem: str | None


def describe_ddi(location: str, designator: str = AUTO,
                 trusted_certs: str | None = None) -> DdiReport:
    """Read the DDI at location as open_ddi would (the image opened and its table read
    once); a refusal becomes the report's problem (the partition table is still
    listed), a table that cannot be read raises."""
    whole = open_source(location, "data")
    try:
        table = read_partition_table(whole, location)
    except BaseException:
        whole.close()
        raise
    try:
        opened = open_ddi(location, designator, None, None, trusted_certs, whole=whole,
                          table=table)
    except VerityError as e:
        return DdiReport(table, None, str(e))  # open_ddi closed whole
    return DdiReport(table, opened, None)


def partition_lines(table: PartitionTable) -> list[str]:
    """The table as `dump` lists it: number, type, UUID, byte offset and size, name."""
    header = "table" if table.header_lba == 1 else f"backup table (LBA {table.header_lba})"
    lines = [f"GPT {header}, {table.sector_size}-byte sectors, disk UUID {table.disk_uuid}",
             f"{'#':>3}  {'type':<28} {'partition UUID':<36} {'offset':>12} {'size':>12}  name"]
    for part in table.partitions:
        kind = partition_type(part.type_uuid)
        lines.append(f"{part.number:>3}  {kind.name if kind else str(part.type_uuid):<28} "
                     f"{part.uuid!s:<36} {part.offset:>12} {part.size:>12}  {part.name}")
    return lines

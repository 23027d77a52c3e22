"""Which partitions of a Discoverable Disk Image to serve: the data / verity / signature
triple, by type UUID (dps.py), and the partition UUID rule that ties them to a root hash.

Mirrors systemd's dissect_image() (src/shared/dissect-image.c, 252): with a root hash
known, the data partition is the one whose UUID is the root hash's first 128 bits and
the verity partition the one whose UUID is its last 128 bits, which is also how
systemd-repart names them (checked against what repart 252 writes: tests/ddi). A
partition whose UUID does not match is not the root hash's; systemd then finds no
partition, and we refuse in one line naming both UUIDs. Partitions flagged no-auto (GPT
attribute bit 63) are skipped, as systemd skips them.

Choosing: a designator (root, usr) given, or the only one that has both a data and a
verity partition; an architecture: the only one present, else this machine's (systemd
prefers the native architecture). Nothing here reads an image: it works on a
gpt.PartitionTable and a root hash in hex.
"""

from __future__ import annotations

import platform
import uuid
from dataclasses import dataclass

from ..errors import PartitionTableError
from .dps import DATA, DESIGNATORS, SIGNATURE, VERITY, partition_type
from .gpt import GptPartition, PartitionTable

NO_AUTO = 1 << 63  # GPT attribute: not for automatic discovery (the specification)
AUTO = "auto"
# platform.machine() -> the specification's architecture name
_NATIVE = {"x86_64": "x86-64", "amd64": "x86-64", "i686": "x86", "i386": "x86",
           "aarch64": "arm64", "armv7l": "arm", "riscv64": "riscv64", "s390x": "s390x",
           "ppc64le": "ppc64-le", "ppc64": "ppc64", "loongarch64": "loongarch64"}


@dataclass(frozen=True)
class Triple:
    """The partitions to serve: data, its verity (hash) partition, and the signature
    partition if there is one."""

    designator: str
    architecture: str
    data: GptPartition
    verity: GptPartition
    signature: GptPartition | None


def verity_candidates(table: PartitionTable) -> dict[tuple[str, str, str], list]:
    """(designator, architecture, role) -> partitions of that type, no-auto ones left out."""
    found: dict[tuple[str, str, str], list] = {}
    for part in table.partitions:
        kind = partition_type(part.type_uuid)
        if kind is None or part.attributes & NO_AUTO:
            continue
        found.setdefault((kind.designator, kind.architecture, kind.role), []).append(part)
    return found


def choose(table: PartitionTable, name: str, designator: str = AUTO) -> tuple[str, str]:
    """(designator, architecture) of the triple to serve, or one line saying why not."""
    found = verity_candidates(table)
    pairs = sorted({(d, a) for d, a, role in found if role == DATA and (d, a, VERITY) in found})
    if designator != AUTO:
        if designator not in DESIGNATORS:
            raise PartitionTableError(f"partition: {designator!r} is not one of "
                                      f"{', '.join(DESIGNATORS)}")
        pairs = [p for p in pairs if p[0] == designator]
    if not pairs:
        what = "" if designator == AUTO else f"{designator} "
        raise PartitionTableError(f"{name}: no {what}partition with a verity partition "
                                  f"(Discoverable Partitions types) in its GPT")
    designators = sorted({d for d, _ in pairs})
    if len(designators) > 1:
        raise PartitionTableError(f"partition: {name} has verity partitions for "
                                  f"{' and '.join(designators)}: give --partition "
                                  f"{'|'.join(designators)}")
    arches = [a for _, a in pairs]
    if len(arches) > 1:
        native = _NATIVE.get(platform.machine())
        if native not in arches:
            raise PartitionTableError(f"{name}: {designators[0]} partitions for "
                                      f"{', '.join(arches)} and none for this machine")
        arches = [native]
    return designators[0], arches[0]


def signature_partitions(table: PartitionTable, designator: str,
                         architecture: str) -> list[GptPartition]:
    """The verity signature partitions of a designator and architecture."""
    return verity_candidates(table).get((designator, architecture, SIGNATURE), [])


def root_hash_uuids(root_hex: str) -> tuple[uuid.UUID, uuid.UUID]:
    """(data UUID, verity UUID): the root hash's first and last 128 bits, as
    systemd-repart derives the partition UUIDs and dissect_image() matches them."""
    root = bytes.fromhex(root_hex)
    if len(root) < 16:
        raise PartitionTableError(f"root-hash: {len(root)} bytes, too short to name "
                                  f"partitions")
    return uuid.UUID(bytes=root[:16]), uuid.UUID(bytes=root[-16:])


def match_triple(table: PartitionTable, name: str, designator: str, architecture: str,
                 root_hex: str, signature: GptPartition | None) -> Triple:
    """The data and verity partitions whose UUIDs the root hash names; refused in one
    line when none does (the UUIDs disagree with the root hash)."""
    found = verity_candidates(table)
    data_uuid, verity_uuid = root_hash_uuids(root_hex)
    picked = []
    for role, want, half in ((DATA, data_uuid, "first"), (VERITY, verity_uuid, "last")):
        parts = found.get((designator, architecture, role), [])
        match = [p for p in parts if p.uuid == want]
        if not match:
            have = ", ".join(f"{p.number} ({p.uuid})" for p in parts)
            kind = f"{designator}-{architecture}" + ("" if role == DATA else "-verity")
            raise PartitionTableError(
                f"{name}: no {kind} partition has UUID {want}, the {half} 128 bits of "
                f"root hash {root_hex} (found partition {have}): the partition UUIDs "
                f"disagree with the root hash")
        picked.append(match[0])
    return Triple(designator, architecture, picked[0], picked[1], signature)

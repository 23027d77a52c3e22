"""The 512-byte verity superblock: unpack, validate, pack.

Mirrors cryptsetup's `struct verity_sb` (lib/verity/verity.c): packed, little-endian,
written at byte --hash-offset of the hash image. The kernel never reads it; only
userspace (veritysetup, and us) does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import SuperblockError
from ..limits import MAX_SALT_SIZE, block_size_ok, hash_type_ok, salt_size_ok

SIGNATURE = b"verity\x00\x00"
SUPERBLOCK_SIZE = 512
VERSION = 1

_LAYOUT = struct.Struct(
    "<"
    "8s"  # signature: "verity\0\0"
    "I"  # version: superblock version, must be 1
    "I"  # hash_type: 0 = Chrome OS (format 0), 1 = normal (format 1)
    "16s"  # uuid: binary UUID
    "32s"  # algorithm: NUL-terminated, lower-case, at most 31 characters
    "I"  # data_block_size: bytes
    "I"  # hash_block_size: bytes
    "Q"  # data_blocks: number of data blocks
    "H"  # salt_size: bytes of salt used, at most 256
    "6s"  # _pad1: zero
    "256s"  # salt: the first salt_size bytes are used
    "168s"  # _pad2: zero
)
if _LAYOUT.size != SUPERBLOCK_SIZE:  # a size self-check of the on-disk struct at import
    raise ImportError(f"verity superblock layout is {_LAYOUT.size} bytes, not 512")


@dataclass(frozen=True)
class Superblock:
    """The decoded fields of a verity superblock (names as in cryptsetup)."""

    version: int
    hash_type: int
    uuid: bytes
    algorithm: str
    data_block_size: int
    hash_block_size: int
    data_blocks: int
    salt: bytes
    signature: bytes = SIGNATURE
    salt_size: int = -1  # as read from disk; -1 means len(salt)

    @classmethod
    def unpack(cls, buf: bytes) -> Superblock:
        """Decode 512 bytes without judging them; call validate() next."""
        if len(buf) < SUPERBLOCK_SIZE:
            raise SuperblockError(
                f"superblock: {len(buf)} bytes read, {SUPERBLOCK_SIZE} needed (image too small)"
            )
        (sig, version, hash_type, uuid, alg, dbs, hbs, n, salt_size, _p1, salt, _p2) = (
            _LAYOUT.unpack(bytes(buf[:SUPERBLOCK_SIZE]))
        )
        return cls(
            signature=sig,
            version=version,
            hash_type=hash_type,
            uuid=uuid,
            algorithm=alg.split(b"\x00", 1)[0].decode("ascii", "replace"),
            data_block_size=dbs,
            hash_block_size=hbs,
            data_blocks=n,
            salt=salt[:salt_size],
            salt_size=salt_size,
        )

    def defects(self) -> list[str]:
        """Every reason veritysetup would refuse this superblock, one message each."""
        problems = []
        if self.signature != SIGNATURE:
            problems.append("not a verity superblock (bad signature)")
            return problems  # the other fields mean nothing without the magic
        if self.version != VERSION:
            problems.append(f"unsupported version {self.version}")
        if not hash_type_ok(self.hash_type):
            problems.append(f"unsupported hash type {self.hash_type}")
        if not block_size_ok(self.data_block_size):
            problems.append(f"unsupported data block size {self.data_block_size}")
        if not block_size_ok(self.hash_block_size):
            problems.append(f"unsupported hash block size {self.hash_block_size}")
        salt_size = len(self.salt) if self.salt_size < 0 else self.salt_size
        if not salt_size_ok(salt_size):
            problems.append(f"salt_size {salt_size} exceeds {MAX_SALT_SIZE}")
        if not self.algorithm:
            problems.append("empty hash algorithm")
        return problems

    def validate(self) -> Superblock:
        """Raise SuperblockError naming every defect; return self when there is none."""
        problems = self.defects()
        if problems:
            raise SuperblockError("superblock: " + "; ".join(problems))
        return self

    def pack(self) -> bytes:
        """Encode as veritysetup writes it (algorithm lower-cased, padding zeroed)."""
        self.validate()
        alg = self.algorithm.lower().encode("ascii")
        if len(alg) > 31:
            raise SuperblockError(f"superblock: algorithm name {self.algorithm!r} too long")
        return _LAYOUT.pack(
            SIGNATURE, self.version, self.hash_type, self.uuid, alg,
            self.data_block_size, self.hash_block_size, self.data_blocks,
            len(self.salt), bytes(6), self.salt, bytes(168),
        )

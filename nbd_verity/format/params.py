"""The full description of one verity device, from a superblock or from options.

VerityParams is what veritysetup's `struct crypt_params_verity` holds: format, algorithm,
block sizes, data block count, salt, uuid, plus where the tree sits (hash offset, with or
without a superblock). It builds the Digester and the TreeGeometry everything else uses.
"""

from __future__ import annotations

import functools
import os
import uuid as uuidlib
from dataclasses import dataclass, field, replace

from ..errors import ConfigError, FormatError, ImageIOError, SuperblockError
from ..limits import (
    HASH_OFFSET_ALIGN,
    HASH_TYPES,
    MAX_OFFSET,
    block_size_problem,
    hash_offset_ok,
    hash_type_ok,
    salt_size_problem,
)
from ..sources.source import ImageFile
from .digest import Digester, normalize_algorithm
from .geometry import TreeGeometry, hash_start_block
from .superblock import SUPERBLOCK_SIZE, Superblock

DEFAULT_SALT_SIZE = 32


@dataclass(frozen=True)
class VerityParams:
    """Everything needed to build, read or verify one verity tree."""

    data_blocks: int
    hash_type: int = 1
    algorithm: str = "sha256"
    data_block_size: int = 4096
    hash_block_size: int = 4096
    salt: bytes = b""
    uuid: bytes = field(default=bytes(16))
    hash_offset: int = 0
    superblock: bool = True

    def check(self) -> VerityParams:
        """Validate each field with its own message; return self. The one entry that
        validates parameters: Digester and TreeGeometry trust what passed it."""
        if not hash_type_ok(self.hash_type):
            raise ConfigError(f"format: unsupported hash type {self.hash_type} "
                              f"({' or '.join(map(str, HASH_TYPES))})")
        normalize_algorithm(self.algorithm)
        for problem in (block_size_problem("data-block-size", self.data_block_size),
                        block_size_problem("hash-block-size", self.hash_block_size),
                        salt_size_problem(len(self.salt))):
            if problem:
                raise ConfigError(problem)
        check_hash_offset(self.hash_offset)
        self.geometry()  # raises on impossible sizes
        return self

    def digester(self) -> Digester:
        """The Digester of these parameters, built once (it holds no per-call state)."""
        return self._digester

    def geometry(self) -> TreeGeometry:
        """The TreeGeometry of these parameters, built once."""
        return self._geometry

    @functools.cached_property
    def _digester(self) -> Digester:
        return Digester(self.algorithm, self.salt, self.hash_type)

    @functools.cached_property
    def _geometry(self) -> TreeGeometry:
        d = self.digester()
        return TreeGeometry.from_params(
            self.data_blocks, self.data_block_size, self.hash_block_size,
            d.digest_size, d.slot_size,
            hash_start_block(self.hash_offset, self.hash_block_size, self.superblock),
        )

    def to_superblock(self) -> Superblock:
        return Superblock(version=1, hash_type=self.hash_type, uuid=self.uuid,
                          algorithm=self.algorithm, data_block_size=self.data_block_size,
                          hash_block_size=self.hash_block_size, data_blocks=self.data_blocks,
                          salt=self.salt)

    @property
    def uuid_text(self) -> str:
        """The UUID as veritysetup prints it."""
        return str(uuidlib.UUID(bytes=self.uuid))


def parse_uuid(text: str) -> bytes:
    """A UUID given as text, as veritysetup's --uuid takes it."""
    try:
        return uuidlib.UUID(text).bytes
    except ValueError:
        raise ConfigError(f"uuid: {text!r} is not a UUID") from None


def random_salt() -> bytes:
    return os.urandom(DEFAULT_SALT_SIZE)


def random_uuid() -> bytes:
    return uuidlib.uuid4().bytes


def check_hash_offset(hash_offset: int) -> int:
    """veritysetup's rule (limits.hash_offset_ok), and room for the superblock."""
    if not hash_offset_ok(hash_offset):
        raise ConfigError(f"hash-offset: {hash_offset} is not a multiple of "
                          f"{HASH_OFFSET_ALIGN}")
    if hash_offset + SUPERBLOCK_SIZE > MAX_OFFSET:
        raise ConfigError(f"hash-offset: {hash_offset} is past the largest file offset "
                          f"(2**63 - 1)")
    return hash_offset


def read_superblock(hash_path: str, hash_offset: int = 0, source=None) -> Superblock:
    """Read and validate the superblock at hash_offset of the hash image (through source,
    an opened image such as remote.NbdSource, when given)."""
    check_hash_offset(hash_offset)
    try:
        if source is not None:
            buf = _superblock_bytes(source, hash_offset)
        else:
            with ImageFile(hash_path, "hash") as image:
                buf = _superblock_bytes(image, hash_offset)
    except OSError as e:
        where = f": cannot read a superblock at offset {hash_offset}" if hash_offset else ""
        raise ImageIOError(f"{hash_path}{where}: {e.strerror}") from None
    if len(buf) < SUPERBLOCK_SIZE:
        raise ImageIOError(
            f"{hash_path}: too small to hold a superblock at offset {hash_offset}"
        )
    try:
        return Superblock.unpack(buf).validate()
    except SuperblockError as e:
        raise SuperblockError(f"{hash_path}: {e}") from None


def _superblock_bytes(source, hash_offset: int) -> bytes:
    """The superblock's bytes at hash_offset, fewer where the image ends before them."""
    end = min(source.size(), hash_offset + SUPERBLOCK_SIZE)
    return bytes(source.read(max(0, end - hash_offset), hash_offset))


def params_from_superblock(sb: Superblock, hash_offset: int = 0) -> VerityParams:
    """Parameters described by a valid superblock."""
    try:
        return VerityParams(
            data_blocks=sb.data_blocks, hash_type=sb.hash_type,
            algorithm=normalize_algorithm(sb.algorithm), data_block_size=sb.data_block_size,
            hash_block_size=sb.hash_block_size, salt=sb.salt, uuid=sb.uuid,
            hash_offset=hash_offset, superblock=True,
        ).check()
    except (ConfigError, FormatError) as e:  # a field the superblock itself got wrong
        raise SuperblockError(f"superblock: {e}") from None


def read_params(hash_path: str, hash_offset: int = 0, source=None) -> VerityParams:
    """Parameters from the superblock at hash_offset; errors name the hash image."""
    sb = read_superblock(hash_path, hash_offset, source)
    try:
        return params_from_superblock(sb, hash_offset)
    except SuperblockError as e:
        raise SuperblockError(f"{hash_path}: {e}") from None


def load_params(hash_path: str, options: dict, data_size: int | None = None,
                source=None) -> VerityParams:
    """Parameters of an existing tree: from its superblock, or from options without one.

    options holds what the user gave (None for unset): hash_type, algorithm,
    data_block_size, hash_block_size, data_blocks, salt, hash_offset, no_superblock.
    A superblock wins, but an option that contradicts it is an error, as it is a mistake.
    source is the opened hash image, if it is not a local file (read_superblock).
    """
    hash_offset = check_hash_offset(options.get("hash_offset") or 0)
    if not options.get("no_superblock"):
        params = read_params(hash_path, hash_offset, source)
        for key, option in (("hash_type", "format"), ("algorithm", "hash"),
                            ("data_block_size", "data-block-size"),
                            ("hash_block_size", "hash-block-size"),
                            ("data_blocks", "data-blocks"), ("salt", "salt")):
            given = options.get(key)
            if key == "algorithm" and given is not None:
                given = given.lower()  # veritysetup lower-cases algorithm names
            have = getattr(params, key)
            if given is not None and given != have:
                shown = (given.hex() or "-", have.hex() or "-") if key == "salt" else (
                    given, have)
                raise ConfigError(
                    f"{option}: {shown[0]!r} contradicts the superblock's {shown[1]!r}"
                )
        return params
    given = {k: v for k, v in options.items() if v is not None and k in (
        "hash_type", "algorithm", "data_block_size", "hash_block_size", "salt")}
    if "algorithm" in given:
        given["algorithm"] = normalize_algorithm(given["algorithm"])
    params = VerityParams(data_blocks=1, hash_offset=hash_offset, superblock=False, **given)
    params.check()  # every field but the block count, before a block size divides anything
    blocks = options.get("data_blocks")
    if blocks is None:
        if data_size is None:
            raise ConfigError("data-blocks: required with no-superblock")
        blocks = data_size // params.data_block_size
    return replace(params, data_blocks=blocks).check()

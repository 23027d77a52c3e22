"""Pure tree geometry: levels, where each level sits, and which slot holds a digest.

Mirrors cryptsetup's hash_levels() and the kernel's verity_hash_at_level(): the number of
digests per hash block is a power of two in both formats, levels are stored root-most
first from the hash start block, and data block b's digest at level i sits in hash block
level_start[i] + (b >> ((i+1)·bits)) at slot (b >> (i·bits)) & (2**bits - 1).
Nothing here does I/O; every other module asks this one for offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError
from ..limits import MAX_LEVELS, MAX_OFFSET
from .superblock import SUPERBLOCK_SIZE


def hash_start_block(hash_offset: int, hash_block_size: int, superblock: bool) -> int:
    """First block of the tree, in hash-block units (veritysetup's VERITY_hash_offset_block),
    for a hash offset and block size VerityParams.check() accepted."""
    if superblock:
        return (hash_offset + SUPERBLOCK_SIZE + hash_block_size - 1) // hash_block_size
    return hash_offset // hash_block_size


@dataclass(frozen=True)
class TreeGeometry:
    """The shape of one verity tree, built once by from_params()."""

    data_blocks: int
    data_block_size: int
    hash_block_size: int
    slot_size: int  # bytes per digest slot inside a hash block
    hpb_bits: int  # log2 of digests per hash block
    hash_start_block: int  # where the root-most level starts, in hash blocks
    level_blocks: tuple[int, ...]  # number of blocks at level 0 (leaves) .. L-1 (top)
    level_start: tuple[int, ...]  # absolute hash-image block of each level's first block

    @classmethod
    def from_params(
        cls,
        data_blocks: int,
        data_block_size: int,
        hash_block_size: int,
        digest_size: int,
        slot_size: int,
        hash_start_block: int = 0,
    ) -> TreeGeometry:
        """Compute every level's size and place; raise FormatError on impossible input.
        The block sizes are ones VerityParams.check() accepted (limits.block_size_ok)."""
        if data_blocks < 1:
            raise FormatError(f"data-blocks: {data_blocks} (at least one block is needed)")
        if data_blocks * data_block_size > MAX_OFFSET:
            raise FormatError(f"data-blocks: {data_blocks} blocks of {data_block_size} bytes "
                              f"end past the largest file offset (2**63 - 1)")
        if hash_block_size < 2 * digest_size:
            raise FormatError(
                f"hash-block-size: {hash_block_size} is too small for {digest_size}-byte digests"
            )
        hpb_bits = (hash_block_size // digest_size).bit_length() - 1
        levels = 0
        while (data_blocks - 1) >> (hpb_bits * levels):
            levels += 1
            if hpb_bits * levels >= 64 or levels > MAX_LEVELS:
                raise FormatError(f"data-blocks: {data_blocks} needs more than {MAX_LEVELS} "
                                  f"levels")
        sizes = tuple(-(-data_blocks // (1 << (hpb_bits * (i + 1)))) for i in range(levels))
        starts = [0] * levels
        position = hash_start_block
        for i in reversed(range(levels)):  # the root-most level comes first on disk
            starts[i] = position
            position += sizes[i]
        if position * hash_block_size > MAX_OFFSET:
            raise FormatError("hash-offset: the tree would end past the largest file offset "
                              "(2**63 - 1)")
        return cls(data_blocks, data_block_size, hash_block_size, slot_size, hpb_bits,
                   hash_start_block, sizes, tuple(starts))

    @property
    def levels(self) -> int:
        """Number of hash levels; 0 when the single data block's digest is the root."""
        return len(self.level_blocks)

    @property
    def hashes_per_block(self) -> int:
        return 1 << self.hpb_bits

    @property
    def hash_blocks(self) -> int:
        """Blocks of the tree itself (veritysetup's "Hash blocks")."""
        return sum(self.level_blocks)

    @property
    def hash_end_block(self) -> int:
        """One past the last tree block, in hash-block units."""
        return self.hash_start_block + self.hash_blocks

    @property
    def hash_image_size(self) -> int:
        """Bytes the hash image needs (from its byte 0, offset and superblock included)."""
        return self.hash_end_block * self.hash_block_size

    @property
    def data_size(self) -> int:
        """Bytes of data covered by the tree."""
        return self.data_blocks * self.data_block_size

    def parent_slot(self, child_index: int) -> tuple[int, int]:
        """Where the digest of child_index (a data block, or a hash block's index in its
        level) sits in the level above it: (the parent's index in that level, byte
        offset of the slot inside the parent). The one home of the slot arithmetic."""
        return (child_index >> self.hpb_bits,
                (child_index & (self.hashes_per_block - 1)) * self.slot_size)

    def first_child(self, parent_index: int) -> int:
        """The index (in the level below) of the first child of a block: parent_slot's
        inverse at slot 0."""
        return parent_index << self.hpb_bits

    def run_under_parent(self, first: int, count: int) -> int:
        """How many of the count children from first share first's parent."""
        return min(count, self.hashes_per_block - (first & (self.hashes_per_block - 1)))

    def slot_of(self, level: int, child_index: int) -> tuple[int, int]:
        """Where the digest of child_index (a data block for level 0, else a block of
        level-1) is stored: (absolute hash block, byte offset inside it)."""
        index, offset = self.parent_slot(child_index)
        return self.level_start[level] + index, offset

    def level_of_block(self, hash_block: int) -> int:
        """The level holding an absolute hash block number."""
        for level, start in enumerate(self.level_start):
            if start <= hash_block < start + self.level_blocks[level]:
                return level
        raise ValueError(f"hash block {hash_block} is outside the tree")

    def index_in_level(self, hash_block: int) -> tuple[int, int]:
        """(level, index within that level) of an absolute hash block number."""
        level = self.level_of_block(hash_block)
        return level, hash_block - self.level_start[level]

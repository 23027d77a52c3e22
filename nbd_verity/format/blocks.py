"""The one helper that splits a byte range into whole data blocks.

An NBD request may start and end anywhere; verification works on whole blocks. A request
becomes at most three segments: an unaligned head (part of one block), an aligned body
(whole blocks read straight into the client's buffer), and an unaligned tail. Head and
tail need a scratch block because only part of the block is sent, yet all of it is
hashed (as nbdkit's filters split head/body/tail, written once here).
"""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """A run of whole blocks and the part of them the request wants."""

    first_block: int  # first data block of the run
    blocks: int  # number of whole blocks
    buf_offset: int  # where the wanted bytes go in the request buffer
    skip: int  # bytes of the first block before the wanted bytes
    length: int  # wanted bytes
    whole: bool  # the wanted bytes are exactly the blocks: read in place, no scratch


def split_request(offset: int, length: int, block_size: int) -> list[Segment]:
    """Head/body/tail segments of [offset, offset+length); empty for length 0."""
    segments: list[Segment] = []
    pos, end, done = offset, offset + length, 0
    while pos < end:
        block, skip = divmod(pos, block_size)
        if skip or end - pos < block_size:  # partial block: head or tail
            take = min(block_size - skip, end - pos)
            segments.append(Segment(block, 1, done, skip, take, False))
        else:  # the aligned body: as many whole blocks as fit
            count = (end - pos) // block_size
            take = count * block_size
            segments.append(Segment(block, count, done, 0, take, True))
        pos += take
        done += take
    return segments


def block_span(offset: int, length: int, block_size: int) -> tuple[int, int]:
    """(first block, number of blocks) touched by a non-empty byte range."""
    first = offset // block_size
    return first, (offset + length - 1) // block_size - first + 1

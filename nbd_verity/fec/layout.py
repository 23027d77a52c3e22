"""Forward error correction as dm-verity has it: geometry, encoding, and repairing a block.

Mirrors cryptsetup's lib/verity/verity_fec.c (VERITY_FEC_process, VERITY_FEC_blocks) and
the kernel's drivers/md/dm-verity-fec.c (fec_decode_rsb, verity_fec_decode). The code
covers a message of fec_blocks blocks: the data blocks, then the hash image from the tree's
first block (the superblock is not covered) up to its end, or up to --fec-offset when the
parity sits inside the hash image. With rsn = 255 - roots and rounds = ceil(fec_blocks /
rsn), the message is cut into rsn regions of `rounds` blocks (blocks past fec_blocks are
zeros); codeword (n, b) takes byte b of block i·rounds + n for i in 0..rsn-1, and its
`roots` parity bytes sit at (n·bs + b)·roots from the start of the parity area. So each
block belongs to one round n, together with rsn - 1 others spread over the whole image,
and a burst of bad blocks touches each codeword at most once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ConfigError, ImageIOError
from ..format.params import VerityParams
from ..limits import MAX_OFFSET
from ..sources.source import ImageFile
from . import rs

RSM = 255  # symbols per codeword
MIN_ROOTS, MAX_ROOTS = 2, 24  # cryptsetup's FEC_MIN_RSN 231, FEC_MAX_RSN 253
DEFAULT_ROOTS = 2  # veritysetup's default --fec-roots
ROW_SIZE = 128 << 10  # bytes of each of the rsn rows one encode step reads (all: ~32 MiB)
Progress = Callable[[int], None]


def check_roots(roots: int) -> int:
    if not MIN_ROOTS <= roots <= MAX_ROOTS:
        raise ConfigError(f"fec-roots: {roots} is outside {MIN_ROOTS}..{MAX_ROOTS} "
                          "(veritysetup: Invalid number of parity bytes.)")
    return roots


@dataclass(frozen=True)
class FecGeometry:
    """Where every message block and every parity byte is, built once by from_params()."""

    roots: int
    block_size: int
    data_blocks: int
    hash_start_block: int  # hash-image block of message block data_blocks
    fec_blocks: int  # message blocks: data, then hash image (veritysetup's fec_blocks)
    fec_offset: int  # byte offset of the parity area on its device
    on_hash_device: bool  # parity inside the hash image at fec_offset

    @classmethod
    def from_params(cls, params: VerityParams, roots: int, hash_image_size: int,
                    fec_offset: int = 0, on_hash_device: bool = False) -> FecGeometry:
        """VERITY_FEC_blocks: with a separate FEC device the code covers the whole hash
        image; inside it, the hash image up to fec_offset. hash_image_size is the size of
        the hash image once the tree is written."""
        if params.data_block_size != params.hash_block_size:  # checked first, as veritysetup
            raise ConfigError("fec-device: data and hash block sizes differ "
                              "(veritysetup: Block sizes must match for FEC.)")
        check_roots(roots)
        if fec_offset < 0 or fec_offset % 512 or fec_offset > MAX_OFFSET:
            raise ConfigError(f"fec-offset: {fec_offset} is not a multiple of 512 "
                              "(veritysetup: Unsupported VERITY FEC offset.)")
        tree = params.geometry()
        bs = params.data_block_size
        covered = (fec_offset if on_hash_device else hash_image_size) // bs
        if covered:
            covered -= tree.hash_start_block
        if on_hash_device and fec_offset < tree.hash_image_size:
            raise ConfigError(f"fec-offset: {fec_offset} is inside the hash tree, which "
                              f"ends at byte {tree.hash_image_size}")
        if covered < tree.hash_blocks:
            raise ImageIOError(f"hash image is {hash_image_size} bytes, "
                               f"its tree needs {tree.hash_image_size}")
        geo = cls(roots, bs, params.data_blocks, tree.hash_start_block,
                  params.data_blocks + covered, fec_offset, on_hash_device)
        if geo.parity_end > MAX_OFFSET:
            raise ConfigError(f"fec-offset: the parity would end past the largest file "
                              f"offset (2**63 - 1) at byte {geo.parity_end}")
        return geo

    @property
    def rsn(self) -> int:
        """Message symbols per codeword (blocks per codeword group)."""
        return RSM - self.roots

    @property
    def rounds(self) -> int:
        """Blocks per region, and codeword groups (the kernel's fec->rounds)."""
        return -(-self.fec_blocks // self.rsn)

    @property
    def parity_blocks(self) -> int:
        """Parity blocks: what veritysetup prints as "FEC blocks"."""
        return self.rounds * self.roots

    @property
    def parity_size(self) -> int:
        return self.parity_blocks * self.block_size

    @property
    def parity_end(self) -> int:
        return self.fec_offset + self.parity_size

    def locate(self, index: int) -> tuple[int, int]:
        """(region, round) of message block index: its symbol and its codeword group."""
        if not 0 <= index < self.fec_blocks:
            raise ValueError(f"message block {index} is outside 0..{self.fec_blocks - 1}")
        return divmod(index, self.rounds)

    def group(self, round_index: int) -> range:
        """The message blocks of one codeword group, in symbol order."""
        return range(round_index, self.rsn * self.rounds, self.rounds)

    def index_of_hash_block(self, hash_block: int) -> int:
        """Message block of an absolute hash-image block (the kernel's block - hash_start
        + data_blocks)."""
        return hash_block - self.hash_start_block + self.data_blocks

    def source_run(self, first: int, count: int) -> tuple[str | None, int, int]:
        """Where the message blocks from first lie, as far as one source goes (at most
        count): ("data", data block, n), ("hash", absolute hash block, n), or
        (None, 0, n) for zero blocks past fec_blocks."""
        if first < self.data_blocks:
            return "data", first, min(count, self.data_blocks - first)
        if first < self.fec_blocks:
            return ("hash", self.hash_start_block + first - self.data_blocks,
                    min(count, self.fec_blocks - first))
        return None, 0, count

    def parity_span(self, round_index: int) -> tuple[int, int]:
        """(byte offset on the FEC device, size) of one group's parity."""
        size = self.block_size * self.roots
        return self.fec_offset + round_index * size, size

    def dump_lines(self) -> list[str]:
        """The lines veritysetup dump adds with --fec-device (after "Hash algorithm:")."""
        return [f"FEC RS roots:   \t{self.roots}", f"FEC blocks:     \t{self.parity_blocks}"]


class MessageReader:
    """Message blocks read from the data and hash images (zeros past fec_blocks)."""

    def __init__(self, geo: FecGeometry, data: ImageFile, hash_image: ImageFile) -> None:
        self.geo, self.data, self.hash = geo, data, hash_image

    def read_into(self, first: int, buf: memoryview) -> None:
        """Fill buf with the message blocks from first on (len(buf) is whole blocks)."""
        bs = self.geo.block_size
        pos, end = first, first + len(buf) // bs
        while pos < end:
            kind, block, n = self.geo.source_run(pos, end - pos)
            out = buf[(pos - first) * bs:(pos - first + n) * bs]
            if kind is None:
                out[:] = bytes(n * bs)
            else:
                (self.data if kind == "data" else self.hash).read_into(out, block * bs)
            pos += n

    def block(self, index: int) -> bytes | None:
        """One message block, or None when it cannot be read (an erasure)."""
        buf = bytearray(self.geo.block_size)
        try:
            self.read_into(index, memoryview(buf))
        except ImageIOError:
            return None
        return bytes(buf)


def encode(geo: FecGeometry, reader: MessageReader, fec,
           progress: Progress | None = None, workers: int | None = None) -> None:
    """Write every group's parity at geo.fec_offset of fec (an ImageWriter, whose errors
    name it, or an open file descriptor). Groups are encoded a stripe of rounds at a
    time: each of the rsn rows is ROW_SIZE bytes of one region, read with one pread, and
    the C codec releases the GIL, so `workers` threads encode stripes side by side."""
    write = (fec.pwrite_all if hasattr(fec, "pwrite_all")
             else lambda buf, offset: _pwrite_all(fec, buf, offset))
    bs = geo.block_size
    per_stripe = max(1, ROW_SIZE // bs)
    stripes = [(n, min(per_stripe, geo.rounds - n)) for n in range(0, geo.rounds, per_stripe)]

    def one(stripe: tuple[int, int]) -> int:
        first, count = stripe
        width = count * bs
        rows = bytearray(geo.rsn * width)
        view = memoryview(rows)
        for i in range(geo.rsn):
            reader.read_into(i * geo.rounds + first, view[i * width:(i + 1) * width])
        parity = rs.encode(geo.roots, [view[i * width:(i + 1) * width]
                                       for i in range(geo.rsn)], width)
        write(parity, geo.parity_span(first)[0])
        return count

    workers = workers or max(1, min(4, len(os.sched_getaffinity(0))))
    if not rs.NATIVE:
        workers = 1  # the pure-Python codec holds the GIL
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for count in pool.map(one, stripes):
            if progress:
                progress(count * bs * geo.rsn)


def _pwrite_all(fd: int, buf: bytes, offset: int) -> None:
    view = memoryview(buf)
    while view:
        try:
            done = os.pwrite(fd, view, offset)
        except OSError as e:
            raise ImageIOError(f"fec: {e.strerror} (writing at byte {offset})") from None
        view, offset = view[done:], offset + done


def decode_block(geo: FecGeometry, index: int, group: Sequence[bytes | None], parity: bytes,
                 erasures: Sequence[int] | set[int] = (),
                 check: Callable[[bytes], bool] | None = None) -> bytes | None:
    """Rebuild message block index from its group as fec_decode_rsb does.

    group holds the rsn blocks of the index's codeword group in symbol order (None: could
    not be read, decoded as zeros and an erasure); parity is that group's parity. First
    errors-only (up to roots/2 bad bytes per codeword), then with erasures (the group
    positions known bad, up to roots). check(block) says whether a rebuilt block matches
    its trusted digest; a rebuilt block is returned only if it does (or, without check,
    if every codeword decoded). Returns None when the block cannot be rebuilt."""
    region, _ = geo.locate(index)
    rows = [b if b is not None else bytes(geo.block_size) for b in group]
    missing = {i for i, b in enumerate(group) if b is None}
    block = _attempt(geo, region, rows, parity, (), check)
    known = sorted(set(erasures) | missing)
    if block is None and known:
        block = _attempt(geo, region, rows, parity, known, check)
    return block


def _attempt(geo: FecGeometry, region: int, rows: Sequence[bytes], parity: bytes,
             erasures: Sequence[int], check: Callable[[bytes], bool] | None) -> bytes | None:
    """One decode of the whole group; the rebuilt row, if every codeword decoded and it
    passes check. More than roots erasures cannot decode (the kernel stops at roots + 1)."""
    if len(erasures) > geo.roots:
        return None
    _, failed, block = rs.decode(geo.roots, rows, parity, list(erasures), region)
    if failed or block is None or (check is not None and not check(block)):
        return None
    return block


class FecRepairer:
    """Reads a block's group and parity and rebuilds it: the call a verifier makes."""

    def __init__(self, geo: FecGeometry, reader: MessageReader, fec: ImageFile,
                 keep_group: bool = False) -> None:
        self.geo, self.reader, self.fec = geo, reader, fec
        self.keep_group = keep_group
        self._last: tuple[int, list[bytes | None]] = (-1, [])

    def group(self, round_index: int) -> list[bytes | None]:
        """The blocks of one group (None: unreadable). With keep_group (an offline check,
        where bad blocks often share a group) the last group is kept; a server re-reads,
        as the kernel does, so that a block fixed on disk is seen."""
        if not self.keep_group or self._last[0] != round_index:
            self._last = (round_index, [self.reader.block(i)
                                        for i in self.geo.group(round_index)])
        return self._last[1]

    def parity(self, round_index: int) -> bytes:
        offset, size = self.geo.parity_span(round_index)
        return bytes(self.fec.read(size, offset))

    def repair(self, index: int, check: Callable[[bytes], bool] | None = None,
               suspect: Callable[[int, bytes], bool] | None = None,
               zero: Callable[[int], bool] | None = None) -> bytes | None:
        """Rebuild message block index; check(block) says whether it matches its trusted
        digest. suspect(message index, block) says whether a block of the group fails its
        own hash (the kernel asks it of data blocks): those and unreadable blocks are the
        erasures of the second attempt. zero(message index) marks blocks whose wanted
        digest is the zero-block digest under ignore_zero_blocks: the kernel decodes them
        as zeros, whatever is on disk."""
        _, round_index = self.geo.locate(index)
        try:
            parity = self.parity(round_index)
        except ImageIOError:
            return None
        members = self.geo.group(round_index)
        group = list(self.group(round_index))
        zeros = {pos for pos, i in enumerate(members)
                 if zero is not None and i < self.geo.fec_blocks and i != index and zero(i)}
        for pos in zeros:
            group[pos] = bytes(self.geo.block_size)
        block = decode_block(self.geo, index, group, parity, (), check)
        if block is not None or suspect is None:
            return block
        erasures: set[int] = set()  # located only now: hashing the group is slow
        for pos, msg_index in enumerate(members):
            if len(erasures) > self.geo.roots:
                break
            if pos not in zeros and group[pos] is not None and \
                    msg_index < self.geo.fec_blocks and suspect(msg_index, group[pos]):
                erasures.add(pos)
        return decode_block(self.geo, index, group, parity, erasures, check) if erasures \
            else None

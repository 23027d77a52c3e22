"""FEC images for the guest runs: veritysetup's own parity, and damage placed by codeword.

The parity always comes from `veritysetup format --fec-device --fec-roots`, never from
nbd-verity: the guest's kernel and the server under test must agree on the tool's output.
Which blocks share a codeword group, and where a codeword's parity bytes are, is worked
out here from the kernel's dm-verity-fec.c, in a few lines kept apart from the project's
own FEC code on purpose (an oracle must not share the code it checks):

- the message blocks are the data blocks, then the hash image's blocks from the first tree
  block after the superblock (hash_start) to the end of the hash image
  (v->fec->blocks = data blocks + hash blocks; fec_read_bufs);
- rsn = 255 - roots; rounds = ceil(fec_blocks / rsn); message block k is symbol k // rounds
  of the codewords of round k mod rounds, whose group is {n + i * rounds} (fec_interleave);
- byte b of every block of round n's group forms one codeword, whose roots parity bytes
  sit at (n * block_size + b) * roots in the FEC file (fec_read_parity).

The arithmetic is checked against what veritysetup wrote (the FEC file is rounds * roots
blocks) when an image is made, and against the kernel's own table in the guest
(`dmsetup table` shows fec_blocks).
"""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from .images import BLOCK_SIZE, HASH_START_BLOCK, level0_hash_block, random_file

RS_SYMBOLS = 255  # GF(2^8): a codeword has 255 bytes, roots of them parity


@dataclass(frozen=True)
class FecImage:
    """A data image, its hash image, its FEC file, the roots and the trusted root hash."""

    data: Path
    hash: Path
    fec: Path
    original: Path  # the data as veritysetup saw it (data is a copy once damaged)
    roots: int
    root_hash: str
    data_blocks: int
    hash_image_blocks: int

    # -- the kernel's arithmetic (dm-verity-fec.c) --------------------------------------

    @property
    def fec_blocks(self) -> int:
        """Message blocks: data blocks, then the hash image after its superblock."""
        return self.data_blocks + self.hash_image_blocks - HASH_START_BLOCK

    @property
    def rsn(self) -> int:
        return RS_SYMBOLS - self.roots

    @property
    def rounds(self) -> int:
        return -(-self.fec_blocks // self.rsn)

    def round_of(self, message_block: int) -> int:
        return message_block % self.rounds

    def group(self, round_index: int) -> list[int]:
        """The message blocks of round round_index's codewords (past fec_blocks: zeros)."""
        return [b for b in range(round_index, self.rsn * self.rounds, self.rounds)
                if b < self.fec_blocks]

    def data_group(self, round_index: int) -> list[int]:
        """The data blocks of a round's group."""
        return [b for b in self.group(round_index) if b < self.data_blocks]

    def message_of_hash_block(self, hash_block: int) -> int:
        """Message block of a hash-image block (the kernel's block - hash_start +
        data_blocks)."""
        return self.data_blocks + hash_block - HASH_START_BLOCK

    def level0(self, k: int):
        """The k-th level-0 hash block (images.level0_hash_block) of this image."""
        return level0_hash_block(self.data_blocks, k)

    def parity_span(self, round_index: int, first_byte: int, end_byte: int) -> tuple[int, int]:
        """(offset, length) in the FEC file of the parity of round round_index's codewords
        for byte positions first_byte .. end_byte - 1 (contiguous: roots bytes each)."""
        start = (round_index * BLOCK_SIZE + first_byte) * self.roots
        return start, (end_byte - first_byte) * self.roots

    # -- damage ----------------------------------------------------------------------

    def copy(self, folder: Path, name: str) -> FecImage:
        """Private copies of the three files, to damage."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = {}
        for part in ("data", "hash", "fec"):
            paths[part] = folder / f"{name}.{part}"
            shutil.copyfile(getattr(self, part), paths[part])
        return replace(self, **paths)

    def damage_data(self, block: int, first_byte: int = 0, length: int = 16) -> None:
        flip(self.data, block * BLOCK_SIZE + first_byte, length)

    def damage_hash(self, hash_block: int, first_byte: int = 0, length: int = 16) -> None:
        flip(self.hash, hash_block * BLOCK_SIZE + first_byte, length)

    def smash_parity(self, round_index: int, first_byte: int = 0,
                     end_byte: int = BLOCK_SIZE, seed: int = 0) -> None:
        """Change every parity byte of round round_index's codewords for byte positions
        first_byte .. end_byte - 1 (each XORed with a non-zero pseudo-random byte, so
        that codewords differ in how they are broken)."""
        offset, length = self.parity_span(round_index, first_byte, end_byte)
        rng = random.Random(seed)
        with open(self.fec, "r+b") as f:
            f.seek(offset)
            old = f.read(length)
            f.seek(offset)
            f.write(bytes(b ^ rng.randrange(1, 256) for b in old))


def flip(path: Path, offset: int, length: int) -> None:
    """Invert length bytes of path at offset, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def fec_format(folder: Path, name: str, size: int, roots: int, seed: int) -> FecImage:
    """Random data of size bytes, then veritysetup's hash tree and FEC file with roots."""
    folder.mkdir(parents=True, exist_ok=True)
    data = random_file(folder / f"{name}.data", size, seed)
    hash_image, fec = folder / f"{name}.hash", folder / f"{name}.fec"
    root_file = folder / f"{name}.root"
    subprocess.run(["veritysetup", "format", str(data), str(hash_image),
                    f"--root-hash-file={root_file}", f"--fec-device={fec}",
                    f"--fec-roots={roots}"], check=True, capture_output=True)
    image = FecImage(data=data, hash=hash_image, fec=fec, original=data, roots=roots,
                     root_hash=root_file.read_text().strip(),
                     data_blocks=size // BLOCK_SIZE,
                     hash_image_blocks=hash_image.stat().st_size // BLOCK_SIZE)
    # veritysetup wrote rounds * roots parity blocks: the arithmetic above agrees.
    want = image.rounds * roots * BLOCK_SIZE
    assert fec.stat().st_size == want, (
        f"{fec}: {fec.stat().st_size} bytes, the kernel's arithmetic says {want}")
    return image


def sha256_with_zeros(path: Path, zero_blocks: list[int]) -> str:
    """SHA-256 of path with the given blocks read as zeros (as block_scan_sha counts a
    block that failed)."""
    content = bytearray(path.read_bytes())
    for block in zero_blocks:
        content[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE] = bytes(BLOCK_SIZE)
    return hashlib.sha256(content).hexdigest()


def ddrescue_map(path: Path, size: int, bad: list[int]) -> Path:
    """A GNU ddrescue mapfile of a size-byte image whose blocks `bad` were not rescued:
    nbdkit's ddrescue filter fails (EIO) every read that touches one of them."""
    lines = ["# Mapfile. Created by GNU ddrescue", "0x00000000     +               1"]
    pos = 0
    for block in sorted(set(bad)):
        if block * BLOCK_SIZE > pos:
            lines.append(f"0x{pos:08X}  0x{block * BLOCK_SIZE - pos:08X}  +")
        lines.append(f"0x{block * BLOCK_SIZE:08X}  0x{BLOCK_SIZE:08X}  -")
        pos = (block + 1) * BLOCK_SIZE
    if pos < size:
        lines.append(f"0x{pos:08X}  0x{size - pos:08X}  +")
    path.write_text("\n".join(lines) + "\n")
    return path


def error_table(device: str, sectors: int, bad: list[int]) -> str:
    """A device-mapper table: device linear, but an `error` segment over each block of
    bad (512-byte sectors, 8 to a block)."""
    per_block = BLOCK_SIZE // 512
    rows, pos = [], 0
    for block in sorted(set(bad)):
        start = block * per_block
        if start > pos:
            rows.append(f"{pos} {start - pos} linear {device} {pos}")
        rows.append(f"{start} {per_block} error")
        pos = start + per_block
    if pos < sectors:
        rows.append(f"{pos} {sectors - pos} linear {device} {pos}")
    return "\n".join(rows) + "\n"

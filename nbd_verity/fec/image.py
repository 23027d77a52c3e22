"""FEC for whole images: write the parity (`format --fec-device`) and check with repair
(`verify --fec-device`), as veritysetup 2.6.1 does.

veritysetup verify with a FEC device (lib/verity/verity.c, VERITY_activate or
VERITY_verify_params): it checks the tree first; only if that fails does it decode every
codeword of the image errors-only (VERITY_FEC_process with check set) and count the
symbols corrected. One codeword that does not decode fails the command ("Errors cannot be
repaired with FEC device."); otherwise it succeeds and says "Found N repairable errors
with FEC device." when N > 0. A root hash that does not match the top block while the
tree below it is consistent fails whatever FEC finds. FecVerifyReport.veritysetup_ok is
that verdict. On top of it, each bad block is rebuilt as the kernel would (errors-only,
then with the other bad blocks of its group as erasures, kept only if it then matches its
digest): FecVerifyReport.repaired and .unrepaired, what a reader of the device would see.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import DataCorruption, HashCorruption
from ..format.areas import check_layout
from ..format.builder import VerifyReport, build_tree, verify_image
from ..format.params import VerityParams
from ..sources.source import ImageFile, ImageWriter, image_size
from . import rs
from .layout import FecGeometry, FecRepairer, MessageReader, encode

SCAN_ROUNDS = 32  # groups decoded per step of the full scan


def same_file(a: str, b: str) -> bool:
    """veritysetup's device_is_identical: the same inode (or the same path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def fec_geometry(params: VerityParams, hash_path: str, fec_path: str, roots: int,
                 fec_offset: int = 0) -> FecGeometry:
    """The geometry of an image's FEC, from the hash image as it is on disk; the FEC
    image must be one that opens (veritysetup dump and verify refuse it otherwise)."""
    ImageFile(fec_path, "fec").close()
    return FecGeometry.from_params(params, roots, image_size(hash_path, "hash"), fec_offset,
                                   same_file(hash_path, fec_path))


def write_fec(data_path: str, hash_path: str, fec_path: str, params: VerityParams,
              roots: int, fec_offset: int = 0, progress=None) -> FecGeometry:
    """Write the parity of an image whose tree is already in hash_path; a FEC file this
    call created is removed again if writing it fails (no partial parity stays)."""
    fec = ImageWriter(fec_path, "fec")  # created first: same_file needs it
    try:
        geo = fec_geometry(params, hash_path, fec_path, roots, fec_offset)
        fec.check_room(geo.parity_end)
        with ImageFile(data_path, "data") as data, ImageFile(hash_path, "hash") as hashes:
            encode(geo, MessageReader(geo, data, hashes), fec, progress)
        fec.sync()
    except BaseException:
        fec.discard()
        raise
    fec.close()
    return geo


def format_with_fec(data_path: str, hash_path: str, fec_path: str, params: VerityParams,
                    roots: int, fec_offset: int = 0) -> tuple[bytes, FecGeometry]:
    """`veritysetup format --fec-device`: the tree, then the parity; (root, geometry)."""
    root = build_tree(data_path, hash_path, params)
    return root, write_fec(data_path, hash_path, fec_path, params, roots, fec_offset)


@dataclass
class FecVerifyReport:
    """What an offline verify with FEC found and what it could rebuild."""

    tree: VerifyReport
    geometry: FecGeometry
    scanned: bool = False  # the full codeword scan ran (only when the tree check failed)
    errors: int = 0  # symbols the scan corrected: veritysetup's "Found N repairable errors"
    failed_codewords: int = 0  # codewords the scan could not decode
    root_only: bool = False  # only the top block's digest differs from the root hash
    repaired: list[tuple[str, int]] = field(default_factory=list)  # ("data"/"hash", block)
    unrepaired: list[tuple[str, int]] = field(default_factory=list)

    @property
    def untried(self) -> int:
        """Bad blocks past the limit, not rebuilt (each rebuild reads rsn blocks)."""
        return self.tree.bad_count - len(self.tree.bad)

    @property
    def veritysetup_ok(self) -> bool:
        """veritysetup verify --fec-device's exit status 0."""
        if self.tree.ok:
            return True
        return self.scanned and not self.failed_codewords and not self.root_only

    @property
    def ok(self) -> bool:
        """Every bad block was rebuilt and matches its digest: a reader sees no error."""
        return self.tree.ok or (not self.unrepaired and not self.untried
                                and bool(self.repaired))

    def messages(self) -> list[str]:
        """veritysetup's lines for the FEC part of its verdict."""
        if self.tree.ok or not self.scanned:
            return []
        if self.failed_codewords:
            return ["Errors cannot be repaired with FEC device."]
        return [f"Found {self.errors} repairable errors with FEC device."] if self.errors else []


def verify_with_fec(data_path: str, hash_path: str, fec_path: str, params: VerityParams,
                    root: bytes, roots: int, fec_offset: int = 0,
                    limit: int = 1024) -> FecVerifyReport:
    """Check the tree; if it fails, scan every codeword as veritysetup does and rebuild
    the first `limit` bad blocks as the kernel would (a salt that does not match makes
    every block bad: rebuilding them all would read the image rsn times over)."""
    geo = fec_geometry(params, hash_path, fec_path, roots, fec_offset)
    check_layout(params, data_path, hash_path, geo, fec_path)
    report = FecVerifyReport(verify_image(data_path, hash_path, params, root, limit=limit), geo)
    if report.tree.ok:
        return report
    files = [ImageFile(data_path, "data"), ImageFile(hash_path, "hash"),
             ImageFile(fec_path, "fec")]
    try:
        reader = MessageReader(geo, files[0], files[1])
        report.scanned = True
        report.errors, report.failed_codewords = scan(geo, reader, files[2])
        report.root_only = _root_only(data_path, hash_path, params, root, report.tree)
        repairer = FecRepairer(geo, reader, files[2], keep_group=True)
        _rebuild_bad_blocks(report, params, root, repairer, files[1])
    finally:
        for f in files:
            f.close()
    return report


def scan(geo: FecGeometry, reader: MessageReader, fec: ImageFile) -> tuple[int, int]:
    """Decode every codeword errors-only: (symbols corrected, codewords that failed)."""
    bs, corrected, failed = geo.block_size, 0, 0
    for first in range(0, geo.rounds, SCAN_ROUNDS):
        count = min(SCAN_ROUNDS, geo.rounds - first)
        width = count * bs
        rows = bytearray(geo.rsn * width)
        view = memoryview(rows)
        for i in range(geo.rsn):
            reader.read_into(i * geo.rounds + first, view[i * width:(i + 1) * width])
        parity = fec.read(width * geo.roots, geo.parity_span(first)[0])
        n, bad, _ = rs.decode(geo.roots, [view[i * width:(i + 1) * width]
                                          for i in range(geo.rsn)], bytes(parity), [], -1)
        corrected, failed = corrected + n, failed + bad
    return corrected, failed


def _root_only(data_path: str, hash_path: str, params: VerityParams, root: bytes,
               tree: VerifyReport) -> bool:
    """veritysetup's "Verification of root hash failed." case: the top block is the only
    bad one and everything below it agrees with it."""
    geo = params.geometry()
    if not geo.levels or [(type(e), e.block_index) for e in tree.bad] != [
            (HashCorruption, geo.level_start[-1])]:
        return bool(not geo.levels and tree.bad_count)
    with open(hash_path, "rb") as f:
        f.seek(geo.level_start[-1] * geo.hash_block_size)
        top = f.read(geo.hash_block_size)
    return verify_image(data_path, hash_path, params, params.digester().digest(top),
                        limit=1).ok


def _rebuild_bad_blocks(report: FecVerifyReport, params: VerityParams, root: bytes,
                        repairer: FecRepairer, hashes: ImageFile) -> None:
    """Rebuild each reported bad block, hash blocks top-down first, with the other bad
    blocks of its group as erasures; a rebuilt hash block supplies its children's digests."""
    geo, tree, digester = report.geometry, params.geometry(), params.digester()
    bad: dict[int, tuple[str, int]] = {}
    for e in report.tree.bad:
        kind = "data" if isinstance(e, DataCorruption) else "hash"
        index = e.block_index if kind == "data" else geo.index_of_hash_block(e.block_index)
        bad[index] = (kind, e.block_index)
    rebuilt: dict[int, bytes] = {}  # hash block -> its rebuilt content
    for index, (kind, block) in sorted(bad.items(), key=lambda kv: (kv[1][0] == "data",
                                                                    kv[1][1])):
        want = _wanted_digest(kind, block, tree, digester, root, rebuilt, hashes)
        fixed = repairer.repair(index, lambda b, want=want: digester.digest(b) == want,
                                lambda i, _b: i in bad)
        if fixed is None:
            report.unrepaired.append((kind, block))
            continue
        report.repaired.append((kind, block))
        if kind == "hash":
            rebuilt[block] = fixed


def _wanted_digest(kind: str, block: int, tree, digester, root: bytes,
                   rebuilt: dict[int, bytes], hashes: ImageFile) -> bytes:
    """The digest a block must have: its slot in the parent (rebuilt or on disk), or the
    root hash for the top block."""
    if kind == "data":
        level, child = 0, block
    else:
        level, index = tree.index_in_level(block)
        if level == tree.levels - 1:
            return root
        level, child = level + 1, index
    parent, offset = tree.slot_of(level, child)
    if parent in rebuilt:
        return digester.stored(rebuilt[parent], offset)
    return bytes(hashes.read(digester.digest_size, parent * tree.hash_block_size + offset))

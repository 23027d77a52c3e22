"""Serving with FEC through a real nbdkit: what a client reads from a damaged image whose
parity veritysetup (or `nbd-verity format`) wrote, and what the server counts.

Codeword groups are found from veritysetup's own header ("FEC blocks" is rounds * roots,
and blocks b and b + rounds share every codeword), not from nbd_verity's geometry. The
same damage is shown to `veritysetup verify --fec-device` where its verdict differs from
a reader's: veritysetup decodes errors-only, the kernel (and this server) also with
erasures. Unreadable blocks come from a real NBD source: nbdkit's ddrescue filter, which
fails with EIO every read that touches a block its mapfile lists as not rescued (the error
filter fails reads at a rate, not chosen blocks: it serves the case where all of them fail).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from .serverlib import (
    ENGINES,
    MIB,
    NBD_VERITY,
    VERITYSETUP,
    Image,
    control_request,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    run_refusal,
    write_at,
)
from .upstreams import NbdkitFile

BAD = 300  # a data block of the 4 MiB image; 1024 data blocks + 9 hash blocks
CONTENT = random_bytes(7, 4 * MIB)  # what every served image must read back


def want(offset: int = 0, length: int = len(CONTENT)) -> bytes:
    return CONTENT[offset:offset + length]


@dataclass
class FecImage:
    image: Image
    fec: Path
    roots: int
    rounds: int  # blocks b and b + rounds are in one codeword group
    offset: int = 0

    def keys(self, **extra) -> dict:
        keys = {"fec_device": self.fec, "fec_roots": self.roots, **extra}
        if self.offset:
            keys["fec_offset"] = self.offset
        return keys


def fec_image(directory: Path, roots: int = 2, on_hash: bool = False) -> FecImage:
    """A 4 MiB image, its tree and parity made by veritysetup (the parity inside the hash
    image right after the tree when on_hash)."""
    image = make_image(directory, CONTENT)
    hash_size = image.hash.stat().st_size  # the tree alone
    fec = image.hash if on_hash else directory / "fec.img"
    # the same tree again (same salt), now with its parity
    options = [f"--fec-device={fec}", f"--fec-roots={roots}", f"--salt={image.salt.hex()}"]
    if on_hash:
        options.append(f"--fec-offset={hash_size}")
    out = subprocess.run([VERITYSETUP, "format", *options, str(image.data), str(image.hash)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    parity_blocks = int(re.search(r"^FEC blocks:\s*(\d+)", out, re.MULTILINE).group(1))
    return FecImage(image, fec, roots, parity_blocks // roots, hash_size if on_hash else 0)


@pytest.fixture(scope="module")
def shared_fec(tmp_path_factory) -> FecImage:
    return fec_image(tmp_path_factory.mktemp("fec"))


@pytest.fixture
def damaged(shared_fec, tmp_path) -> FecImage:
    """A private copy of the shared image and its parity, for a test to damage."""
    image = shared_fec.image.copy(tmp_path)
    fec = tmp_path / "fec.img"
    shutil.copyfile(shared_fec.fec, fec)
    return FecImage(image, fec, shared_fec.roots, shared_fec.rounds)


def totals(control: str, reset: bool = False) -> dict:
    return control_request(control, {"cmd": "stats", "reset": reset})["stats"]


def spoil(image: Image, block: int, seed: int) -> None:
    dbs = image.data_block_size
    write_at(image.data, block * dbs, random.Random(seed).randbytes(dbs))


def read_block(h, image: Image, block: int) -> bytes:
    dbs = image.data_block_size
    return h.pread(dbs, block * dbs)


def veritysetup_verify(fec: FecImage) -> subprocess.CompletedProcess:
    image = fec.image
    args = [VERITYSETUP, "verify", str(image.data), str(image.hash), image.root,
            f"--fec-device={fec.fec}", f"--fec-roots={fec.roots}"]
    if fec.offset:
        args.append(f"--fec-offset={fec.offset}")
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("damage", ["byte", "block"])
def test_a_corrupted_data_block_reads_back_intact(damaged, servers, sockdir, damage):
    image, dbs = damaged.image, damaged.image.data_block_size
    if damage == "byte":
        flip_byte(image.data, BAD * dbs + 7)
    else:
        spoil(image, BAD, 1)
    control = os.path.join(sockdir, "c.sock")
    server = servers.start(image, control=control, **damaged.keys())
    h = server.connect()
    assert h.pread(image.size, 0) == want()
    assert h.pread(3, BAD * dbs + 6) == want(BAD * dbs + 6, 3)  # unaligned
    stats = totals(control)
    assert stats["totals"]["fec_corrected"] == 2 and stats["totals"]["fec_failed"] == 0
    assert stats["status"] == "V" and stats["corruptions"] == 0
    assert f"data block {BAD} repaired with FEC" in server.log()
    assert veritysetup_verify(damaged).returncode == 0


def test_blocks_of_one_group_within_and_past_the_limit(damaged, servers, sockdir):
    """roots 2: two bad blocks of a group are rebuilt with each other as erasures (which
    veritysetup verify, errors-only, cannot); a third is past the limit: EIO for the
    three, and every other block still reads."""
    image, rounds = damaged.image, damaged.rounds
    group = [BAD, BAD + rounds, BAD + 2 * rounds]
    for seed, block in enumerate(group[:2]):
        spoil(image, block, seed)
    control = os.path.join(sockdir, "c.sock")
    server = servers.start(image, control=control, **damaged.keys())
    h = server.connect()
    for block in group[:2]:
        assert read_block(h, image, block) == want(block * 4096, 4096)
    assert totals(control)["status"] == "V"
    assert veritysetup_verify(damaged).returncode != 0
    spoil(image, group[2], 2)
    for block in group:
        expect_eio(h, 4096, block * 4096)
    assert read_block(h, image, BAD + 1) == want((BAD + 1) * 4096, 4096)
    stats = totals(control)
    assert stats["totals"]["fec_corrected"] == 2
    assert stats["totals"]["fec_failed"] == 3 and stats["status"] == "C"
    assert f"data block {group[2]} is corrupted" in server.log()


def test_bad_blocks_in_different_groups_all_repair(damaged, servers):
    image, rounds = damaged.image, damaged.rounds
    blocks = [BAD + i for i in range(rounds)]  # one per group, side by side
    for seed, block in enumerate(blocks):
        spoil(image, block, seed)
    h = servers.start(image, **damaged.keys()).connect()
    assert h.pread(len(blocks) * 4096, BAD * 4096) == want(BAD * 4096,
                                                                     len(blocks) * 4096)


@pytest.mark.parametrize("which", ["leaf", "top"])
def test_a_corrupted_hash_block_is_repaired_and_cached(damaged, servers, sockdir, which):
    """A leaf is repaired on the read that needs it and then cached as verified (one
    repair for many reads); the top block already at start-up."""
    image = damaged.image
    offset = image.leaf_offset(BAD) if which == "leaf" else image.top_block_offset()
    write_at(image.hash, offset, random.Random(5).randbytes(image.hash_block_size))
    control = os.path.join(sockdir, "c.sock")
    server = servers.start(image, control=control, **damaged.keys())
    h = server.connect()
    assert h.pread(image.size, 0) == want()
    stats = totals(control, reset=True)
    # pool workers that need the leaf at once may each repair it (as the kernel's race)
    assert stats["totals"]["fec_corrected"] >= 1 and stats["status"] == "V"
    assert h.pread(image.size, 0) == want()
    assert totals(control)["totals"]["fec_corrected"] == 0  # cached as verified
    assert f"metadata block {offset // 4096} repaired with FEC" in server.log()


def test_corrupted_parity_is_harmless_until_needed(damaged, servers):
    """Damaged parity of one group: that group's blocks cannot be repaired (EIO), while a
    block of another group still is."""
    image, rounds = damaged.image, damaged.rounds
    write_at(damaged.fec, (BAD % rounds) * 4096 * damaged.roots,
             random.Random(9).randbytes(4096 * damaged.roots))
    spoil(image, BAD, 1)
    spoil(image, BAD + 1, 2)
    h = servers.start(image, **damaged.keys()).connect()
    expect_eio(h, 4096, BAD * 4096)
    assert read_block(h, image, BAD + 1) == want((BAD + 1) * 4096, 4096)


def test_parity_inside_the_hash_image(tmp_path, servers):
    fec = fec_image(tmp_path / "img", roots=4, on_hash=True)
    image = fec.image
    for seed, block in enumerate([BAD, BAD + fec.rounds, BAD + 2 * fec.rounds]):
        spoil(image, block, seed)  # three erasures: within roots 4
    h = servers.start(image, **fec.keys()).connect()
    assert h.pread(image.size, 0) == want()


def test_parity_from_our_own_format_served(tmp_path, servers, sockdir):
    """`nbd-verity format --fec-device` then `nbd-verity serve --fec-device`."""
    data = tmp_path / "data.img"
    data.write_bytes(random_bytes(8, 4 * MIB))
    hash_path, fec = tmp_path / "hash.img", tmp_path / "fec.img"
    out = subprocess.run([str(NBD_VERITY), "format", str(data), str(hash_path),
                          f"--fec-device={fec}", "--fec-roots=6"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    root = re.search(r"^Root hash:\s*(\S+)", out, re.MULTILINE).group(1)
    original = data.read_bytes()
    write_at(data, BAD * 4096, random.Random(1).randbytes(3 * 4096))  # three groups
    control = os.path.join(sockdir, "c.sock")
    server = servers.serve_cli([str(data), str(hash_path), root, f"--fec-device={fec}",
                                "--fec-roots=6", f"--control={control}"])
    assert server.connect().pread(len(original), 0) == original
    assert totals(control)["totals"]["fec_corrected"] == 3


def test_refusals_at_start_up(damaged, tmp_path, servers):
    """Block sizes that differ, parity shorter than its geometry and a roots count out of
    range refuse to start, with veritysetup's reason where it has one."""
    fake = tmp_path / "fake.fec"
    fake.write_bytes(bytes(4096))
    mixed = make_image(tmp_path / "mixed", random_bytes(3, MIB), "--hash-block-size=1024")
    cases = [(mixed, {"fec_device": fake}, "Block sizes must match for FEC."),
             (damaged.image, {"fec_device": fake, "fec_roots": 2}, "its parity ends"),
             (damaged.image, {"fec_device": damaged.fec, "fec_roots": 25},
              "Invalid number of parity bytes.")]
    for image, keys, message in cases:
        argv = servers.plugin_argv(image.pairs(**keys), str(tmp_path / "x.sock"),
                                   str(tmp_path / "x.pid"))
        done = run_refusal(argv)
        assert done.returncode != 0 and message in done.stderr, done.stderr


# -- unreadable blocks: an NBD source that fails reads of chosen blocks -------------------


def ddrescue_map(path: Path, size: int, bad: list[int], bs: int = 4096) -> Path:
    """A GNU ddrescue mapfile of size bytes in which the blocks `bad` were not rescued."""
    lines = ["# Mapfile. Created by GNU ddrescue", "0x00000000     +               1"]
    pos = 0
    for block in sorted(set(bad)):
        if block * bs > pos:
            lines.append(f"0x{pos:08X}  0x{block * bs - pos:08X}  +")
        lines.append(f"0x{block * bs:08X}  0x{bs:08X}  -")
        pos = (block + 1) * bs
    if pos < size:
        lines.append(f"0x{pos:08X}  0x{size - pos:08X}  +")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def failing(sockdir, tmp_path):
    """Upstreams that fail reads: nbdkit's file plugin serving a file behind a filter,
    each returned as its URI and stopped by its pid at teardown (after the servers, their
    clients, when a test names this fixture before `servers`)."""
    started: list[NbdkitFile] = []

    class Upstreams:
        def blocks(self, path: Path, bad: list[int]) -> str:
            """The ddrescue filter: every read touching a block of `bad` fails (EIO)."""
            mapfile = ddrescue_map(tmp_path / f"up{len(started)}.map", path.stat().st_size,
                                   bad)
            return self._start(path, ("ddrescue",), (f"ddrescue-mapfile={mapfile}",))

        def all_while(self, path: Path, trigger: Path) -> str:
            """The error filter: every read fails (EIO) while the file trigger exists."""
            return self._start(path, ("error",),
                               ("error-pread-rate=100%", f"error-pread-file={trigger}"))

        def _start(self, path: Path, filters: tuple[str, ...], keys: tuple[str, ...]) -> str:
            upstream = NbdkitFile(path, sockdir, f"up{len(started)}", filters, keys)
            started.append(upstream)
            return upstream.start().uri

    yield Upstreams()
    for upstream in started:
        upstream.stop()


def control_path(sockdir: str, name: str) -> str:
    return os.path.join(sockdir, f"{name}.sock")


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_unreadable_data_blocks_are_rebuilt(damaged, failing, servers, sockdir):
    """The data source fails reads of three blocks (each in its own group): with FEC each
    is rebuilt from its group and verified, block by block, while the blocks around it are
    read from the source; without FEC the same reads fail with EIO."""
    bad = [BAD, BAD + 1, BAD + 2]
    image = replace(damaged.image, data=failing.blocks(damaged.image.data, bad))
    control = control_path(sockdir, "fec")
    server = servers.start(image, control=control, **damaged.keys())
    h = server.connect()
    assert h.pread(len(CONTENT), 0) == want()
    stats = totals(control, reset=True)
    counts = stats["totals"]
    assert counts["fec_corrected"] == 3 and counts["io_errors_repaired"] == 3
    assert counts["fec_failed"] == 0 and counts["io_errors"] == 0
    assert counts["source_errors"] >= 4  # the whole read, then each bad block alone
    assert stats["status"] == "V" and stats["corruptions"] == 0
    assert h.pread(3, BAD * 4096 + 6) == want(BAD * 4096 + 6, 3)  # unaligned, in one
    span = (BAD - 1) * 4096 + 50, 5 * 4096  # unaligned, over all three and their neighbours
    assert h.pread(span[1], span[0]) == want(*span)
    counts = totals(control)["totals"]
    assert counts["fec_corrected"] == 4 and counts["io_errors_repaired"] == 4
    assert f"data block {BAD} repaired with FEC after a read error" in server.log()

    plain = control_path(sockdir, "plain")
    h = servers.start(image, control=plain).connect()
    for block in bad:
        expect_eio(h, 4096, block * 4096)
    expect_eio(h, span[1], span[0])
    for block in (BAD - 1, BAD + 3):
        assert read_block(h, image, block) == want(block * 4096, 4096)
    counts = totals(plain)["totals"]
    assert counts["io_errors"] == 4 and counts["corruptions"] == 0
    assert counts["fec_corrected"] == counts["io_errors_repaired"] == 0


def test_unreadable_blocks_of_one_group_within_and_past_the_roots(damaged, failing,
                                                                  servers, sockdir):
    """roots 2: two unreadable blocks of one group are rebuilt with each other as
    erasures; with a third the group is past its roots: EIO for exactly the reads that
    touch one of the three, counted as I/O errors and not as corruption (the kernel
    returns the read's error when FEC fails), while every other block still reads."""
    rounds = damaged.rounds
    group = [BAD + k * rounds for k in range(3)]
    control = control_path(sockdir, "within")
    h = servers.start(replace(damaged.image, data=failing.blocks(damaged.image.data, group[:2])),
                      control=control, **damaged.keys()).connect()
    for block in group[:2]:
        assert read_block(h, damaged.image, block) == want(block * 4096, 4096)
    counts = totals(control)["totals"]
    assert counts["fec_corrected"] == counts["io_errors_repaired"] == 2

    control = control_path(sockdir, "past")
    h = servers.start(replace(damaged.image, data=failing.blocks(damaged.image.data, group)),
                      control=control, **damaged.keys()).connect()
    for block in group:
        expect_eio(h, 4096, block * 4096)
    expect_eio(h, 3 * 4096, (group[1] - 1) * 4096)
    for block in (BAD - 1, BAD + 1, group[1] + 1, group[2] + rounds):
        assert read_block(h, damaged.image, block) == want(block * 4096, 4096)
    stats = totals(control)
    counts = stats["totals"]
    assert counts["fec_failed"] == 4 and counts["io_errors"] == 4
    assert counts["fec_corrected"] == 0 and counts["corruptions"] == 0
    assert stats["status"] == "V"


def test_an_unreadable_block_is_an_erasure_of_its_group(damaged, failing, servers, sockdir):
    """roots 2: one block of a group cannot be read, another is corrupted. Errors-only
    decoding cannot fix two bad symbols per codeword, but as erasures (the unreadable one,
    and the one that fails its digest) both rebuild."""
    unreadable, corrupted = BAD, BAD + damaged.rounds
    spoil(damaged.image, corrupted, 3)
    control = control_path(sockdir, "c")
    h = servers.start(replace(damaged.image, data=failing.blocks(damaged.image.data, [unreadable])),
                      control=control, **damaged.keys()).connect()
    for block in (unreadable, corrupted):
        assert read_block(h, damaged.image, block) == want(block * 4096, 4096)
    stats = totals(control)
    counts = stats["totals"]
    assert counts["fec_corrected"] == 2 and counts["io_errors_repaired"] == 1
    assert counts["fec_failed"] == 0 and stats["status"] == "V"


def test_an_unreadable_hash_block_is_rebuilt(damaged, failing, servers, sockdir):
    """The hash source fails reads of the level-0 block over BAD: with FEC it is rebuilt
    and the device reads back; without FEC the blocks under it fail with EIO."""
    leaf = damaged.image.leaf_offset(BAD) // 4096
    image = replace(damaged.image, hash=failing.blocks(damaged.image.hash, [leaf]))
    control = control_path(sockdir, "fec")
    h = servers.start(image, control=control, **damaged.keys()).connect()
    assert h.pread(len(CONTENT), 0) == want()
    counts = totals(control)["totals"]
    # pool workers that need the leaf at once may each rebuild it (as the kernel's race)
    assert counts["io_errors_repaired"] >= 1 and counts["fec_failed"] == 0
    assert counts["io_errors_repaired"] == counts["fec_corrected"]
    h = servers.start(image).connect()
    expect_eio(h, 4096, BAD * 4096)
    assert read_block(h, damaged.image, 0) == want(0, 4096)


def test_a_source_failing_every_read_fails_cleanly(damaged, failing, servers, sockdir,
                                                   tmp_path):
    """nbdkit's error filter failing every data read while its trigger file exists: the
    groups cannot be read either, so each request fails with EIO (an I/O error, not a
    corruption) and the server serves again once the source does."""
    trigger = tmp_path / "inject"
    control = control_path(sockdir, "c")
    h = servers.start(replace(damaged.image, data=failing.all_while(damaged.image.data,
                                                                    trigger)),
                      control=control, **damaged.keys()).connect()
    trigger.touch()
    expect_eio(h, 4096, BAD * 4096)
    expect_eio(h, 2 * 4096, (BAD + 1) * 4096)
    stats = totals(control)
    counts = stats["totals"]
    assert counts["io_errors"] == 2 and counts["fec_failed"] == 2
    assert counts["fec_corrected"] == 0 and stats["status"] == "V"
    trigger.unlink()
    assert h.pread(3 * 4096, BAD * 4096) == want(BAD * 4096, 3 * 4096)

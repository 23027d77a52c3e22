"""Serving with FEC through a real nbdkit: what a client reads from a damaged image whose
parity veritysetup (or `nbd-verity format`) wrote, and what the server counts.

Codeword groups are found from veritysetup's own header ("FEC blocks" is rounds * roots,
and blocks b and b + rounds share every codeword), not from nbd_verity's geometry. The
same damage is shown to `veritysetup verify --fec-device` where its verdict differs from
a reader's: veritysetup decodes errors-only, the kernel (and this server) also with
erasures.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from serverlib import (
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

"""The real veritysetup as the oracle, in both directions.

For every case both tools format the same data with the same --salt and --uuid into fresh
files (veritysetup does not truncate an existing hash image): the root hashes, the header
fields and the hash images must be identical; veritysetup must accept our tree, and we
must accept veritysetup's; `dump` must print the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from nbd_verity.format.digest import supported_algorithms

from ..damage import flip_byte
from ..golden import GOLDEN, IDS, SALT

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Case:
    """One geometry: the data size and the options both tools get."""

    name: str
    size: int
    options: tuple[str, ...] = ()
    salt: str = "e48da609055204e89ae53b655ca2216dd983cf3cb829f34f63a297d106d53e2d"
    same_file: bool = False  # the tree goes into the data file, at --hash-offset

    @property
    def superblock(self) -> bool:
        return "--no-superblock" not in self.options

    def hash_offset_options(self) -> list[str]:
        return [o for o in self.options if o.startswith("--hash-offset=")]

    def verify_options(self) -> list[str]:
        """With a superblock only its place is needed; without one, every parameter."""
        if self.superblock:
            return self.hash_offset_options()
        return [*self.options, f"--salt={self.salt}"]


CASES = [
    Case("defaults", 1 * MIB),
    Case("spec-example-3-levels", 3 * MIB, ("--hash-block-size=512",)),
    Case("dbs512-hbs512-3-levels", 1 * MIB, ("--data-block-size=512", "--hash-block-size=512")),
    Case("one-block-0-levels", 4 * KIB),
    Case("one-block-512", 512, ("--data-block-size=512", "--hash-block-size=512")),
    Case("one-block-no-superblock", 4 * KIB, ("--no-superblock",)),
    Case("one-block-offset", 4 * KIB, ("--hash-offset=8192",)),
    Case("one-block-hash-block-8192", 512, ("--data-block-size=512", "--hash-block-size=8192")),
    Case("one-block-hash-block-65536-offset", 4 * KIB,
         ("--hash-block-size=65536", "--hash-offset=65536")),
    Case("one-block-no-superblock-offset", 4 * KIB, ("--no-superblock", "--hash-offset=8192")),
    Case("129-blocks-past-a-hash-block", 129 * 4 * KIB),
    Case("257-blocks-past-two-levels", 257 * 4 * KIB, ("--hash-block-size=512",)),
    Case("16385-blocks-past-two-levels", 16385 * 512,
         ("--data-block-size=512", "--hash-block-size=4096")),
    Case("data-block-65536", 4 * MIB, ("--data-block-size=65536",)),
    Case("several-windows-hashed-by-forked-workers", 100 * MIB + 3 * 4096,
         ("--hash-block-size=1024", "--format=0", "--hash=sha1")),
    Case("hash-block-65536", 2 * MIB, ("--hash-block-size=65536",)),
    Case("format0-sha256", 1 * MIB, ("--format=0",)),
    Case("format0-sha1-packed-512", 1 * MIB,
         ("--format=0", "--hash=sha1", "--hash-block-size=512")),
    Case("format1-sha1-padded-512", 1 * MIB, ("--hash=sha1", "--hash-block-size=512")),
    Case("no-salt", 1 * MIB, salt="-"),
    Case("salt-256-bytes", 1 * MIB, salt="a5" * 256),
    Case("salt-dadada-format0", 1 * MIB, ("--format=0",), salt="dadada"),
    Case("hash-offset-same-file", 1 * MIB, ("--hash-offset=1048576",), same_file=True),
    Case("hash-offset-same-file-data-blocks", 1 * MIB + 64 * KIB,
         ("--hash-offset=1048576", "--data-blocks=256"), same_file=True),
    Case("hash-offset-same-file-no-superblock", 1 * MIB,
         ("--hash-offset=1052672", "--data-blocks=256", "--no-superblock"), same_file=True),
    Case("hash-offset-separate-1024", 1 * MIB,
         ("--hash-offset=8192", "--hash-block-size=1024")),
    Case("hash-offset-1536-unaligned-to-hbs", 1 * MIB, ("--hash-offset=1536",)),
    Case("no-superblock", 1 * MIB, ("--no-superblock",)),
    Case("no-superblock-offset-format0", 1 * MIB,
         ("--no-superblock", "--hash-offset=4096", "--format=0", "--hash=sha1")),
    Case("data-blocks-smaller-than-file", 1 * MIB, ("--data-blocks=100",)),
    Case("data-blocks-smaller-no-superblock", 1 * MIB, ("--data-blocks=77", "--no-superblock")),
    Case("data-not-whole-blocks", 1 * MIB + 1000),
    Case("data-not-whole-blocks-512", 100 * 512 + 1,
         ("--data-block-size=512", "--hash-block-size=512")),
]
CASES += [Case(f"{alg}-format{fmt}", 512 * KIB,
               (f"--hash={alg}", f"--format={fmt}", "--data-block-size=1024",
                "--hash-block-size=1024"))
          for alg in supported_algorithms() for fmt in (1, 0)]


def both_formats(tools, tmp_path: Path, case: Case):
    """Format one data image with each tool; return (data, theirs, ours, their, our run)."""
    data = tools.write_image(tmp_path / "data.img", case.size, seed=len(case.name))
    if case.same_file:
        theirs, ours = tmp_path / "theirs.img", tmp_path / "ours.img"
        theirs.write_bytes(data.read_bytes())
        ours.write_bytes(data.read_bytes())
        data_theirs, data_ours = theirs, ours
    else:
        theirs, ours = tmp_path / "theirs.hash", tmp_path / "ours.hash"
        data_theirs = data_ours = data
    common = [*case.options, f"--salt={case.salt}", f"--uuid={tools.uuid}"]
    their_run = tools.theirs("format", data_theirs, theirs, *common)
    our_run = tools.ours("format", data_ours, ours, *common)
    assert their_run.returncode == 0, their_run.stderr
    assert our_run.returncode == 0, our_run.stderr
    return data, data_theirs, data_ours, theirs, ours, their_run, our_run


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_format_verify_dump_match_veritysetup(tools, tmp_path, case):
    data, data_theirs, data_ours, theirs, ours, their_run, our_run = both_formats(
        tools, tmp_path, case)
    data_sum = tools.sha256(data)
    root = tools.root_hash(their_run.stdout)
    assert tools.root_hash(our_run.stdout) == root
    assert tools.fields(our_run.stdout) == tools.fields(their_run.stdout)
    assert ours.read_bytes() == theirs.read_bytes()

    accepted = tools.theirs("verify", data_ours, ours, root, *case.verify_options())
    assert accepted.returncode == 0, accepted.stderr
    our_verify = tools.ours("verify", data_theirs, theirs, root, *case.verify_options())
    assert our_verify.returncode == 0, our_verify.stderr
    assert our_verify.stdout.startswith("Verified ")
    assert our_verify.stderr == ""

    if case.superblock:
        their_dump = tools.theirs("dump", theirs, *case.hash_offset_options())
        our_dump = tools.ours("dump", theirs, *case.hash_offset_options())
        assert their_dump.returncode == 0 and our_dump.returncode == 0, our_dump.stderr
        assert tools.fields(our_dump.stdout) == tools.fields(their_dump.stdout)
    if not case.same_file:
        assert tools.sha256(data) == data_sum  # neither tool wrote to the data image


def test_one_block_superblock_at_an_offset_veritysetup_cannot_write(tools, tmp_path):
    # veritysetup 2.6.1 cannot write this superblock into an empty file ("Error during
    # update of verity header"); we can, and veritysetup reads and verifies the result.
    data = tools.write_image(tmp_path / "data.img", 4 * KIB)
    hash_image = tmp_path / "hash.img"
    run = tools.ours("format", data, hash_image, "--hash-offset=1536", f"--uuid={tools.uuid}")
    assert run.returncode == 0, run.stderr
    assert hash_image.stat().st_size == 4096
    root = tools.root_hash(run.stdout)
    check = tools.theirs("verify", data, hash_image, root, "--hash-offset=1536")
    assert check.returncode == 0, check.stderr
    dump = tools.theirs("dump", hash_image, "--hash-offset=1536")
    assert tools.fields(dump.stdout) == tools.fields(
        tools.ours("dump", hash_image, "--hash-offset=1536").stdout)


def test_data_not_whole_blocks_gives_one_warning(tools, tmp_path):
    data = tools.write_image(tmp_path / "data.img", 1 * MIB + 1000)
    run = tools.ours("format", data, tmp_path / "hash", "--salt=-")
    assert run.returncode == 0
    assert run.stderr.splitlines() == [
        f"nbd-verity: warning: {data}: the last 1000 bytes are not a whole block and are "
        "not protected"]




@pytest.mark.parametrize(("block_size", "salt", "hash_type", "algorithm", "root"), GOLDEN,
                         ids=IDS)
def test_golden_vectors_with_both_tools(tools, tmp_path, block_size, salt, hash_type,
                                        algorithm, root):
    zeros = tmp_path / "zeros.img"
    with open(zeros, "wb") as f:
        f.truncate(8 * MIB)
    options = [f"--format={hash_type}", f"--data-block-size={block_size}",
               f"--hash-block-size={block_size}", f"--hash={algorithm}", f"--salt={salt}"]
    for run_tool, name in ((tools.theirs, "theirs"), (tools.ours, "ours")):
        run = run_tool("format", zeros, tmp_path / name, *options)
        assert run.returncode == 0, run.stderr
        assert tools.root_hash(run.stdout) == root


def test_root_hash_file_is_read_by_veritysetup(tools, tmp_path):
    data = tools.write_image(tmp_path / "data.img", 256 * KIB)
    root_file = tmp_path / "root.hex"
    run = tools.ours("format", data, tmp_path / "hash", f"--root-hash-file={root_file}")
    assert run.returncode == 0
    assert root_file.read_text() == tools.root_hash(run.stdout)
    check = tools.theirs("verify", data, tmp_path / "hash", f"--root-hash-file={root_file}")
    assert check.returncode == 0, check.stderr
    ours = tools.ours("verify", data, tmp_path / "hash", f"--root-hash-file={root_file}")
    assert ours.returncode == 0, ours.stderr


@pytest.mark.parametrize(("where", "offset", "message"), [
    ("data", 3456, "data block 0 is corrupted"),               # verity-compat-test's spot
    ("data", 200 * 4096 + 17, "data block 200 is corrupted"),
    ("hash", 8193, "metadata block 2 is corrupted (level 0)"),  # first leaf block (sb, top)
    ("hash", 4096 + 5, "metadata block 1 is corrupted (level 1)"),
])
def test_corruption_of_a_veritysetup_tree(tools, tmp_path, where, offset, message):
    data = tools.write_image(tmp_path / "data.img", 1 * MIB)  # 256 blocks: levels [2, 1]
    hash_image = tmp_path / "hash.img"
    run = tools.theirs("format", data, hash_image, f"--salt={SALT}")
    root = tools.root_hash(run.stdout)
    flip_byte(data if where == "data" else hash_image, offset, 0x5A)
    assert tools.theirs("verify", data, hash_image, root).returncode != 0
    ours = tools.ours("verify", data, hash_image, root)
    assert ours.returncode == 1
    assert ours.stderr.splitlines()[0] == f"nbd-verity: {message}"
    assert "Traceback" not in ours.stderr

"""Block devices as images, with veritysetup on the same loop devices as the oracle.

Data images are attached read-only (`losetup -r`); each tool formats into its own writable
loop device over a zeroed scratch file of the same size. The root hashes, the headers, the
dumps and the bytes of the two hash devices must be identical, each tool must accept the
other's tree on the devices, and nothing may be written to the data device.
"""

from __future__ import annotations

from pathlib import Path

import pytest

KIB, MIB = 1 << 10, 1 << 20
SCRATCH = 2 * MIB  # each hash device: larger than any tree below


def device_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def scratch_device(loop_device, path: Path, size: int = SCRATCH) -> Path:
    """A writable loop device over a fresh file of size zero bytes."""
    with open(path, "wb") as f:
        f.truncate(size)
    return loop_device(path, writable=True)


@pytest.mark.parametrize("options", [
    (),
    ("--hash-block-size=512",),  # three levels
    ("--data-block-size=1024", "--hash-block-size=1024", "--format=0"),
    ("--hash-offset=8192",),
], ids=["defaults", "hbs512-3-levels", "format0-1024", "hash-offset"])
def test_format_verify_dump_on_loop_devices_match_veritysetup(tools, tmp_path, loop_device,
                                                              options):
    data_file = tools.write_image(tmp_path / "data.img", 4 * MIB, seed=len(options))
    data_sum = tools.sha256(data_file)
    data = loop_device(data_file)
    theirs = scratch_device(loop_device, tmp_path / "theirs.hash")
    ours = scratch_device(loop_device, tmp_path / "ours.hash")
    common = [*options, f"--salt={tools.salt}", f"--uuid={tools.uuid}"]
    their_run = tools.theirs("format", data, theirs, *common)
    our_run = tools.ours("format", data, ours, *common)
    assert their_run.returncode == 0, their_run.stderr
    assert our_run.returncode == 0, our_run.stderr
    root = tools.root_hash(their_run.stdout)
    assert tools.root_hash(our_run.stdout) == root
    assert tools.fields(our_run.stdout) == tools.fields(their_run.stdout)
    assert device_bytes(ours) == device_bytes(theirs)

    offset = [o for o in options if o.startswith("--hash-offset")]
    accepted = tools.theirs("verify", data, ours, root, *offset)
    assert accepted.returncode == 0, accepted.stderr
    our_verify = tools.ours("verify", data, theirs, root, *offset)
    assert (our_verify.returncode, our_verify.stderr) == (0, ""), our_verify.stderr
    assert our_verify.stdout == f"Verified {4 * MIB // _dbs(options)} data blocks: OK\n"

    their_dump = tools.theirs("dump", theirs, *offset)
    our_dump = tools.ours("dump", theirs, *offset)
    assert their_dump.returncode == 0 and our_dump.returncode == 0, our_dump.stderr
    assert our_dump.stdout == their_dump.stdout  # the same device name, so every line
    assert tools.sha256(data_file) == data_sum


def _dbs(options) -> int:
    return next((int(o.split("=")[1]) for o in options if o.startswith("--data-block")), 4096)


def test_a_corrupted_block_device_fails_as_veritysetup_says(tools, tmp_path, loop_device):
    data_file = tools.write_image(tmp_path / "data.img", 1 * MIB, seed=3)
    hash_file = tmp_path / "hash.img"
    run = tools.theirs("format", data_file, hash_file, f"--salt={tools.salt}")
    assert run.returncode == 0, run.stderr
    root = tools.root_hash(run.stdout)
    with open(data_file, "r+b") as f:  # block 37, before the device exists: no stale cache
        f.seek(37 * 4096 + 100)
        f.write(b"\xff")
    data, hashes = loop_device(data_file), loop_device(hash_file)
    assert tools.theirs("verify", data, hashes, root).returncode != 0
    ours = tools.ours("verify", data, hashes, root)
    assert ours.returncode == 1
    assert ours.stderr.splitlines() == ["nbd-verity: data block 37 is corrupted",
                                        "nbd-verity: verification failed: 1 corrupted block(s)"]


@pytest.mark.parametrize("on_hash", [False, True], ids=["fec-device", "in-hash-device"])
def test_fec_on_loop_devices_matches_veritysetup(tools, tmp_path, loop_device, on_hash):
    data = loop_device(tools.write_image(tmp_path / "data.img", 3 * MIB, seed=11))
    tool = {"theirs": tools.theirs, "ours": tools.ours}
    runs, devices = {}, {}
    for who, run in tool.items():
        hashes = scratch_device(loop_device, tmp_path / f"{who}.hash")
        fec = hashes if on_hash else scratch_device(loop_device, tmp_path / f"{who}.fec")
        options = ["--fec-device", fec, "--fec-roots", "3",
                   *(["--fec-offset", str(MIB)] if on_hash else [])]
        done = run("format", data, hashes, *options, "--salt", tools.salt, "--uuid",
                   tools.uuid)
        assert done.returncode == 0, done.stderr
        dump = run("dump", hashes, *options)
        assert dump.returncode == 0, dump.stderr
        runs[who] = (tools.root_hash(done.stdout), tools.fields(done.stdout),
                     tools.fields(dump.stdout), device_bytes(hashes), device_bytes(fec))
        devices[who] = (hashes, options)
    assert runs["ours"] == runs["theirs"]
    assert any(line.startswith("FEC RS roots:") for line in runs["ours"][1])
    root = runs["ours"][0]
    for who, other in (("theirs", "ours"), ("ours", "theirs")):
        hashes, options = devices[other]
        checked = tool[who]("verify", data, hashes, root, *options)
        assert checked.returncode == 0, checked.stderr


def test_format_refuses_a_hash_device_too_small_for_the_tree(tools, tmp_path, loop_device):
    data = loop_device(tools.write_image(tmp_path / "data.img", 4 * MIB, seed=5))
    small = scratch_device(loop_device, tmp_path / "small.hash", 32 * KIB)  # tree: 40 KiB
    run = tools.ours("format", data, small)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"nbd-verity: hash: {small} is 32768 bytes, 40960 needed\n"
    assert device_bytes(small) == bytes(32 * KIB)  # refused before anything was written


def test_format_refuses_a_fec_device_too_small_for_the_parity(tools, tmp_path, loop_device):
    data = loop_device(tools.write_image(tmp_path / "data.img", 4 * MIB, seed=6))
    hashes = scratch_device(loop_device, tmp_path / "hash")
    small = scratch_device(loop_device, tmp_path / "small.fec", 16 * KIB)
    run = tools.ours("format", data, hashes, "--fec-device", small)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.startswith(f"nbd-verity: fec: {small} is 16384 bytes, ")
    assert run.stderr.endswith(" needed\n") and len(run.stderr.splitlines()) == 1
    assert device_bytes(hashes) == bytes(SCRATCH)  # not even the tree was written

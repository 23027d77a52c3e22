"""FEC against veritysetup: the parity bytes, and the verdict of `verify --fec-device`.

Parity: veritysetup and nbd_verity.fec.image write the FEC of the same image (same salt
and UUID), on a separate device and inside the hash image at an offset; the files must be
identical. Verify: an image is corrupted in one way, then veritysetup's exit status and its
"Found N repairable errors" line are compared with FecVerifyReport; the kernel-style
rebuild of each bad block (erasures from the other bad blocks) is checked separately.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nbd_verity.fec import image as fec_image
from nbd_verity.format.params import VerityParams, parse_uuid

from ..damage import flip_byte, write_at


def make_params(tools, size: int, bs: int) -> VerityParams:
    return VerityParams(data_blocks=size // bs, data_block_size=bs, hash_block_size=bs,
                        salt=bytes.fromhex(tools.salt), uuid=parse_uuid(tools.uuid))


def theirs_format(tools, data: Path, hash_path: Path, fec_path: Path, bs: int, roots: int,
                  offset: int) -> str:
    done = tools.theirs("format", data, hash_path, "--fec-device", fec_path,
                        "--fec-roots", roots, "--fec-offset", offset, "--salt", tools.salt,
                        "--uuid", tools.uuid, "--data-block-size", bs, "--hash-block-size", bs)
    assert done.returncode == 0, done.stderr
    return tools.root_hash(done.stdout)


@pytest.mark.parametrize(("size", "bs", "roots"), [
    (3 << 20, 4096, 2),
    (3 << 20, 4096, 3),
    (3 << 20, 4096, 8),
    (5 << 20, 4096, 24),
    ((3 << 20) + 4096, 4096, 7),  # fec_blocks not a multiple of rsn, rounds padded
    (1000 * 512, 512, 2),
    (777 * 1024, 1024, 8),
    (40 * 4096, 4096, 24),  # fewer blocks than rsn: one round, mostly zero regions
])
@pytest.mark.parametrize("on_hash", [False, True], ids=["fec-device", "in-hash-image"])
def test_parity_is_identical(tools, tmp_path, size, bs, roots, on_hash):
    data = tools.write_image(tmp_path / "data", size, seed=size + roots)
    params = make_params(tools, size, bs)
    offset = params.geometry().hash_image_size if on_hash else 0
    theirs_fec = tmp_path / ("h1" if on_hash else "f1")
    ours_fec = tmp_path / ("h2" if on_hash else "f2")
    root = theirs_format(tools, data, tmp_path / "h1", theirs_fec, bs, roots, offset)
    ours_root, geo = fec_image.format_with_fec(str(data), str(tmp_path / "h2"), str(ours_fec),
                                               params, roots, offset)
    assert ours_root.hex() == root
    assert tools.sha256(ours_fec) == tools.sha256(theirs_fec)
    assert ours_fec.stat().st_size == offset + geo.parity_size


ROOTS = 2
SIZE = 3 << 20  # 768 data blocks, 7 hash blocks: fec_blocks 775, 4 rounds for roots 2


@pytest.fixture
def image(tools, tmp_path):
    """A 3 MiB image with roots-2 FEC on a separate device, made by veritysetup."""
    data = tools.write_image(tmp_path / "data", SIZE, seed=12)
    root = theirs_format(tools, data, tmp_path / "hash", tmp_path / "fec", 4096, ROOTS, 0)
    return data, tmp_path / "hash", tmp_path / "fec", root


def random_block(seed: int) -> bytes:
    return random.Random(seed).randbytes(4096)


# (name, corruption, kernel-style outcome: repaired and unrepaired (kind, block) lists)
CASES = {
    "data-byte": ([("data", 5 * 4096 + 17, None)], [("data", 5)], []),
    "data-block": ([("data", 5 * 4096, 1)], [("data", 5)], []),
    "data-blocks-other-groups": ([("data", 5 * 4096, 1), ("data", 6 * 4096, 2)],
                                 [("data", 5), ("data", 6)], []),
    # rounds 4: blocks 5 and 9 share every codeword; errors-only cannot fix two symbols
    # with roots 2 (veritysetup fails), erasures can (the kernel rebuilds both)
    "two-blocks-one-group": ([("data", 5 * 4096, 1), ("data", 9 * 4096, 2)],
                             [("data", 5), ("data", 9)], []),
    "three-blocks-one-group": ([("data", b * 4096, b) for b in (5, 9, 13)], [],
                               [("data", 5), ("data", 9), ("data", 13)]),
    "two-bytes-one-codeword": ([("data", 5 * 4096 + 3, None), ("data", 9 * 4096 + 3, None)],
                               [("data", 5), ("data", 9)], []),
    "leaf-hash-byte": ([("hash", 3 * 4096 + 100, None)], [("hash", 3)], []),
    "leaf-hash-block": ([("hash", 4 * 4096, 7)], [("hash", 4)], []),
    "top-hash-block": ([("hash", 1 * 4096, 8)], [("hash", 1)], []),
    "parity-byte": ([("fec", 100, None)], [], []),
}


def damage(image, case: str) -> tuple[list, list]:
    """Apply CASES[case]'s corruption to the image's files; its expected (repaired,
    unrepaired) blocks."""
    data, hash_path, fec_path, _root = image
    corruption, repaired, unrepaired = CASES[case]
    files = {"data": data, "hash": hash_path, "fec": fec_path}
    for where, offset, seed in corruption:
        if seed is None:
            flip_byte(files[where], offset)
        else:
            write_at(files[where], offset, random_block(seed))
    return repaired, unrepaired


@pytest.mark.parametrize("case", list(CASES))
def test_verify_agrees_with_veritysetup(tools, image, case):
    data, hash_path, fec_path, root = image
    repaired, unrepaired = damage(image, case)
    theirs = tools.theirs("verify", data, hash_path, root, "--fec-device", fec_path,
                          "--fec-roots", ROOTS)
    params = make_params(tools, SIZE, 4096)
    report = fec_image.verify_with_fec(str(data), str(hash_path), str(fec_path), params,
                                       bytes.fromhex(root), ROOTS)
    assert report.veritysetup_ok == (theirs.returncode == 0), theirs.stderr
    for line in report.messages():
        assert line in theirs.stderr
    assert ("repairable errors" in theirs.stderr) == any(
        "repairable errors" in m for m in report.messages())
    assert (sorted(report.repaired), sorted(report.unrepaired)) == (repaired, unrepaired)


def test_wrong_root_hash_fails_whatever_fec_finds(tools, image):
    data, hash_path, fec_path, _ = image
    wrong = "00" * 32
    theirs = tools.theirs("verify", data, hash_path, wrong, "--fec-device", fec_path,
                          "--fec-roots", ROOTS)
    report = fec_image.verify_with_fec(str(data), str(hash_path), str(fec_path),
                                       make_params(tools, SIZE, 4096), bytes(32), ROOTS)
    assert theirs.returncode != 0 and not report.veritysetup_ok
    assert report.root_only and not report.ok


def test_verify_with_fec_inside_the_hash_image(tools, tmp_path):
    data = tools.write_image(tmp_path / "data", SIZE, seed=3)
    offset = 8 * 4096
    root = theirs_format(tools, data, tmp_path / "hash", tmp_path / "hash", 4096, 8, offset)
    write_at(data, 100 * 4096, random_block(1))
    write_at(data, 104 * 4096, random_block(2))  # same group (rounds 4): 2 errors, roots 8
    theirs = tools.theirs("verify", data, tmp_path / "hash", root, "--fec-device",
                          tmp_path / "hash", "--fec-roots", 8, "--fec-offset", offset)
    report = fec_image.verify_with_fec(str(data), str(tmp_path / "hash"),
                                       str(tmp_path / "hash"), make_params(tools, SIZE, 4096),
                                       bytes.fromhex(root), 8, offset)
    assert theirs.returncode == 0 and report.veritysetup_ok
    assert report.messages() == [f"Found {report.errors} repairable errors with FEC device."]
    assert report.messages()[0] in theirs.stderr
    assert report.repaired == [("data", 100), ("data", 104)] and report.ok


def test_pure_python_codec_matches_veritysetup(tools, tmp_path, monkeypatch):
    """The fallback used without a compiler writes and repairs the same bytes."""
    from nbd_verity.fec import rs

    monkeypatch.setattr(rs, "encode", rs.py_encode)
    monkeypatch.setattr(rs, "decode", rs.py_decode)
    monkeypatch.setattr(rs, "NATIVE", False)
    size, bs = 600 * 512, 512
    data = tools.write_image(tmp_path / "data", size, seed=9)
    params = make_params(tools, size, bs)
    root = theirs_format(tools, data, tmp_path / "h1", tmp_path / "f1", bs, 3, 0)
    fec_image.format_with_fec(str(data), str(tmp_path / "h2"), str(tmp_path / "f2"), params, 3)
    assert tools.sha256(tmp_path / "f2") == tools.sha256(tmp_path / "f1")
    write_at(data, 7 * bs, random.Random(1).randbytes(bs))
    report = fec_image.verify_with_fec(str(data), str(tmp_path / "h1"), str(tmp_path / "f1"),
                                       params, bytes.fromhex(root), 3)
    assert report.repaired == [("data", 7)] and report.veritysetup_ok


@pytest.mark.parametrize(("extra", "kw"), [
    (["--hash-offset", "8192"], {"hash_offset": 8192}),
    (["--no-superblock"], {"superblock": False}),
], ids=["hash-offset", "no-superblock"])
def test_parity_follows_the_tree_start(tools, tmp_path, extra, kw):
    """The code covers the hash image from the tree's first block (VERITY_hash_offset_block)."""
    data = tools.write_image(tmp_path / "data", 2 << 20, seed=8)
    done = tools.theirs("format", data, tmp_path / "h1", "--fec-device", tmp_path / "f1",
                        "--fec-roots", 5, "--salt", tools.salt, "--uuid", tools.uuid, *extra)
    assert done.returncode == 0, done.stderr
    params = make_params(tools, 2 << 20, 4096)
    params = VerityParams(**{**params.__dict__, **kw})
    fec_image.format_with_fec(str(data), str(tmp_path / "h2"), str(tmp_path / "f2"), params, 5)
    assert tools.sha256(tmp_path / "f2") == tools.sha256(tmp_path / "f1")


# -- the command line: `nbd-verity format/dump/verify --fec-device` against veritysetup --


def header(stdout: str, path: Path) -> str:
    """A header with its file name taken out (the two tools write to different files)."""
    return stdout.replace(f"VERITY header information for {path}", "VERITY header")


@pytest.mark.parametrize("options", [
    ["--fec-roots", "3"],
    [],
    ["--fec-roots", "5", "--fec-offset", "4096"],
    ["--hash-offset", "8192", "--fec-roots", "4"],
    ["--fec-offset", "32768", "on-hash"],
], ids=["roots-3", "defaults", "fec-offset", "hash-offset", "in-hash-image"])
def test_format_and_dump_print_what_veritysetup_prints(tools, tmp_path, options):
    data = tools.write_image(tmp_path / "data", SIZE, seed=21)
    on_hash = "on-hash" in options
    options = [o for o in options if o != "on-hash"]
    runs = {}
    for who, run in (("theirs", tools.theirs), ("ours", tools.ours)):
        hash_path = tmp_path / f"{who}.hash"
        fec_path = hash_path if on_hash else tmp_path / f"{who}.fec"
        fec = ["--fec-device", fec_path, *options]
        done = run("format", data, hash_path, *fec, "--salt", tools.salt, "--uuid", tools.uuid)
        assert done.returncode == 0, done.stderr
        dump = run("dump", hash_path, *fec)
        assert dump.returncode == 0, dump.stderr
        runs[who] = (header(done.stdout, hash_path), header(dump.stdout, hash_path),
                     tools.sha256(fec_path))
    assert runs["ours"] == runs["theirs"]
    assert "FEC RS roots:" in runs["ours"][0]


@pytest.mark.parametrize(("options", "message"), [
    (["--data-block-size", "1024"], "Block sizes must match for FEC."),
    (["--fec-roots", "1"], "Invalid number of parity bytes."),
    (["--fec-roots", "25"], "Invalid number of parity bytes."),
])
def test_format_refuses_what_veritysetup_refuses(tools, tmp_path, options, message):
    data = tools.write_image(tmp_path / "data", 1 << 20, seed=22)
    theirs = tools.theirs("format", data, tmp_path / "h1", "--fec-device", tmp_path / "f1",
                          *options)
    ours = tools.ours("format", data, tmp_path / "h2", "--fec-device", tmp_path / "f2",
                      *options)
    assert theirs.returncode != 0 and message in theirs.stderr
    assert ours.returncode == 2 and message in ours.stderr
    assert not (tmp_path / "h2").exists() and not (tmp_path / "f2").exists()


@pytest.mark.parametrize("case", ["data-byte", "two-blocks-one-group",
                                  "three-blocks-one-group", "top-hash-block", "parity-byte"])
def test_verify_command_agrees_with_veritysetup(tools, image, case):
    data, hash_path, fec_path, root = image
    repaired, unrepaired = damage(image, case)
    args = (data, hash_path, root, "--fec-device", fec_path, "--fec-roots", ROOTS)
    theirs, ours = tools.theirs("verify", *args), tools.ours("verify", *args)
    assert (ours.returncode == 0) == (theirs.returncode == 0), (ours.stderr, theirs.stderr)
    for line in ("repairable errors with FEC device", "Errors cannot be repaired"):
        assert (line in ours.stderr) == (line in theirs.stderr), (ours.stderr, theirs.stderr)
    found = [line for line in theirs.stderr.splitlines() if line.startswith("Found ")]
    assert all(f"nbd-verity: {line}" in ours.stderr for line in found)
    names = {"data": "data", "hash": "metadata"}
    if repaired:
        shown = ", ".join(f"{names[k]} {b}" for k, b in repaired)
        assert f"FEC repairs {len(repaired)} block(s): {shown}" in ours.stdout
    if unrepaired:
        shown = ", ".join(f"{names[k]} {b}" for k, b in unrepaired)
        assert f"FEC cannot repair {len(unrepaired)} block(s): {shown}" in ours.stdout

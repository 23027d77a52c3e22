"""Overlapping areas on one device, with veritysetup as the oracle: both refuse or both
accept, and a refused run changes no byte of the image and leaves no file behind.

The cases are those of cryptsetup's verity-compat-test (checkOverlapBug, on a 2 MiB image
of 350 data blocks ending at byte 1433600) with the FEC ones added. Each one is then run
again with the data image named through a symlink, a hard link and a read-only loop
device: the device holding the bytes decides, not the path (veritysetup accepts the loop
device and writes its tree into the data; we refuse it).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

SIZE = 2 << 20
DATA_END = 350 * 4096  # 1433600
BLOCKS = ("--data-block-size=4096", "--hash-block-size=4096")

# name: (format arguments after DATA, with "IMG" for the image and "OUT" for a fresh file)
CASES = {
    "whole-device-hash-inside": ["IMG", f"--hash-offset={DATA_END}"],
    "hash-at-data-end": ["IMG", *BLOCKS, "--data-blocks=350", f"--hash-offset={DATA_END}"],
    "hash-inside-data": ["IMG", *BLOCKS, "--data-blocks=350", "--hash-offset=1228800"],
    "fec-inside-data": ["OUT", *BLOCKS, "--data-blocks=350", "--fec-device=IMG",
                        "--fec-offset=1228800"],
    "fec-inside-hash": ["OUT", *BLOCKS, "--data-blocks=350", "--fec-device=OUT",
                        "--fec-offset=4096"],
    "hash-offset-unaligned": ["IMG", *BLOCKS, "--data-blocks=350", "--hash-offset=1434000"],
    "fec-offset-unaligned": ["OUT", *BLOCKS, "--data-blocks=350", "--fec-device=IMG",
                             "--fec-offset=1433700"],
    "fec-at-data-end": ["OUT", *BLOCKS, "--data-blocks=350", "--fec-device=IMG",
                        f"--fec-offset={DATA_END}"],
    "fec-one-sector-into-data": ["OUT", *BLOCKS, "--data-blocks=350", "--fec-device=IMG",
                                 f"--fec-offset={DATA_END - 512}"],
    "hash-and-fec-after-data": ["IMG", *BLOCKS, "--data-blocks=350",
                                f"--hash-offset={DATA_END}", "--fec-device=IMG",
                                f"--fec-offset={DATA_END + 65536}"],
}


def digest(path: Path, size: int | None = None) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(size) if size else f.read()).hexdigest()


def fresh_image(directory: Path) -> Path:
    directory.mkdir()
    image = directory / "ov"
    with open(image, "wb") as f:  # random bytes: a write anywhere changes the digest
        f.write(os.urandom(SIZE))
    return image


def argv(case: str, data: Path | str, image: Path, out: Path) -> list[str]:
    return [str(data)] + [a.replace("IMG", str(image)).replace("OUT", str(out))
                          for a in CASES[case]]


def verdict(run) -> bool:
    return run.returncode == 0


def oracle(tools, tmp_path: Path, case: str) -> bool:
    image = fresh_image(tmp_path / "theirs")
    return verdict(tools.theirs("format", *argv(case, image, image, tmp_path / "theirs/out")))


def assert_refused_cleanly(run, image: Path, before: str, files: set[str]) -> None:
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert digest(image) == before  # not one byte written
    assert {p.name for p in image.parent.iterdir()} == files  # no partial output


@pytest.mark.parametrize("case", sorted(CASES))
def test_format_refuses_overlaps_as_veritysetup_does(tools, tmp_path, case):
    accepted = oracle(tools, tmp_path, case)
    image = fresh_image(tmp_path / "ours")
    before, data_before = digest(image), digest(image, DATA_END)
    run = tools.ours("format", *argv(case, image, image, image.parent / "out"))
    assert verdict(run) == accepted, run
    if accepted:
        assert digest(image, DATA_END) == data_before  # the data area is never written
    else:
        assert_refused_cleanly(run, image, before, {"ov"})
        if "overlap" in run.stderr:
            assert "bytes 0-1433599 of" in run.stderr or "bytes 0-2097151" in run.stderr \
                or "hash area (bytes" in run.stderr, run.stderr


ALIASES = ["symlink", "hardlink", "loop"]


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_alias_of_the_image_is_the_same_device(tools, tmp_path, loop_device, case,
                                                  alias):
    accepted = oracle(tools, tmp_path, case)
    image = fresh_image(tmp_path / "ours")
    if alias == "symlink":
        (image.parent / "link").symlink_to(image)
        data = image.parent / "link"
    elif alias == "hardlink":
        os.link(image, image.parent / "link")
        data = image.parent / "link"
    else:
        data = loop_device(image)  # read-only
    names = {p.name for p in image.parent.iterdir()}
    before, data_before = digest(image), digest(image, DATA_END)
    run = tools.ours("format", *argv(case, data, image, image.parent / "out"))
    assert verdict(run) == accepted, run
    if accepted:
        assert digest(image, DATA_END) == data_before
    else:
        assert_refused_cleanly(run, image, before, names)


@pytest.mark.parametrize("loop_offset, accepted", [(DATA_END, True), (DATA_END - 1, False)])
def test_fec_area_touching_the_data_areas_last_byte(tools, tmp_path, loop_device,
                                                    loop_offset, accepted):
    """A FEC device that is a loop device on the data image from byte loop_offset on:
    parity from its byte 0 starts exactly after the data area (accepted), or one byte
    inside it (refused: the offset of a FEC area cannot be that fine any other way)."""
    image = fresh_image(tmp_path / "ours")
    data_before = digest(image, DATA_END)
    fec = loop_device(image, writable=True, offset=loop_offset)
    run = tools.ours("format", image, tmp_path / "ours/out", *BLOCKS, "--data-blocks=350",
                     f"--fec-device={fec}")
    assert verdict(run) == accepted, run
    assert digest(image, DATA_END) == data_before
    if not accepted:
        assert f"bytes 0-{DATA_END - 1} of {image}" in run.stderr, run.stderr
        assert "FEC area (bytes 0-" in run.stderr, run.stderr
        assert not (tmp_path / "ours/out").exists()


def test_verify_and_serve_refuse_an_overlapping_fec_area(tools, tmp_path):
    """A tree built with its parity elsewhere, then named with the data image as its FEC
    device: our verify and serve refuse it in one line, as format does. (veritysetup
    verify passes it: with an intact tree it never reads the parity; a layout that could
    not have been formatted is refused here before a byte is read.)"""
    image = fresh_image(tmp_path / "img")
    hashes, parity = tmp_path / "img/hash", tmp_path / "img/fec"
    made = tools.ours("format", image, hashes, *BLOCKS, "--data-blocks=350",
                      f"--fec-device={parity}")
    assert made.returncode == 0, made.stderr
    root = tools.root_hash(made.stdout)
    before = digest(image)
    fec = [f"--fec-device={image}", "--fec-offset=1228800"]
    ours = tools.ours("verify", image, hashes, root, *fec)
    assert ours.returncode == 2 and "overlaps the FEC area" in ours.stderr, ours
    served = tools.ours("serve", image, hashes, root, *fec, "--unix", tmp_path / "s.sock",
                        timeout=60)
    assert served.returncode == 2, served
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1 and "overlaps the FEC area" in lines[0], served.stderr
    assert digest(image) == before
    assert tools.ours("verify", image, hashes, root, f"--fec-device={parity}").returncode == 0

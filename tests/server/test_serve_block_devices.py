"""Serving block devices: data, hash and FEC images on read-only loop devices.

The images are made by veritysetup as files, damaged (where a test wants damage) before
they are attached, then attached with `losetup -r`; `veritysetup verify` on the same
devices is the oracle for what a reader must see.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace

import pytest

from .serverlib import (
    MIB,
    VERITYSETUP,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
)

BAD = 300  # a data block of the 4 MiB image


def on_devices(image, loop_device):
    """The image with its data and hash files replaced by read-only loop devices."""
    return replace(image, data=loop_device(image.data), hash=loop_device(image.hash))


def veritysetup_verify(*args) -> subprocess.CompletedProcess:
    return subprocess.run([VERITYSETUP, "verify", *map(str, args)], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("front", ["plugin", "serve"])
def test_loop_devices_are_served_in_full(default_image, tmp_path, servers, loop_device,
                                         front):
    image = on_devices(default_image.copy(tmp_path), loop_device)
    assert veritysetup_verify(image.data, image.hash, image.root).returncode == 0
    if front == "plugin":
        server = servers.start(image)
    else:
        server = servers.serve_cli([str(image.data), str(image.hash), image.root])
    h = server.connect()
    assert h.get_size() == image.size == 4 * MIB
    assert h.pread(image.size, 0) == image.expected()
    assert h.pread(5, image.size - 5) == image.expected(image.size - 5, 5)
    if front == "serve":
        assert f"serving {image.size} bytes" in server.log()


def test_a_corrupted_block_of_a_loop_device_fails_alone(default_image, tmp_path, servers,
                                                       loop_device):
    copy = default_image.copy(tmp_path)
    dbs = copy.data_block_size
    flip_byte(copy.data, BAD * dbs + 9)
    image = on_devices(copy, loop_device)
    assert veritysetup_verify(image.data, image.hash, image.root).returncode != 0
    server = servers.start(image)
    h = server.connect()
    expect_eio(h, dbs, BAD * dbs)
    expect_eio(h, 1, BAD * dbs + 9)
    assert h.pread(BAD * dbs, 0) == image.expected(0, BAD * dbs)
    rest = (BAD + 1) * dbs
    assert h.pread(image.size - rest, rest) == image.expected(rest)
    assert f"data block {BAD}" in server.log()


def test_fec_on_a_loop_device_repairs_a_block(tmp_path, servers, loop_device):
    content = random_bytes(8, 4 * MIB)
    files = make_image(tmp_path / "image", content)
    fec_file = tmp_path / "image" / "fec.img"
    made = subprocess.run([VERITYSETUP, "format", f"--fec-device={fec_file}", "--fec-roots=2",
                           f"--salt={files.salt.hex()}", str(files.data), str(files.hash)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert re.search(r"^Root hash:\s*" + files.root, made.stdout, re.MULTILINE)
    dbs = files.data_block_size
    flip_byte(files.data, BAD * dbs + 100)
    image, fec = on_devices(files, loop_device), loop_device(fec_file)
    fec_args = [f"--fec-device={fec}", "--fec-roots=2"]
    assert veritysetup_verify(image.data, image.hash, image.root, *fec_args).returncode == 0
    server = servers.start(image, fec_device=fec, fec_roots=2)
    h = server.connect()
    assert h.pread(image.size, 0) == content
    assert f"data block {BAD} repaired with FEC" in server.log()

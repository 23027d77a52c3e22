"""Small files read whole (root hash files, signatures, certificates, keys, sidecars)
are read only when they are regular files: a FIFO, a directory or a character device
there is refused in one line instead of blocking the open or reading without end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def image(tmp_path_factory, tools):
    """A 1 MiB data image with its tree, and odd files beside it: (dir, data, hash, root)."""
    where = tmp_path_factory.mktemp("small")
    data = tools.write_image(where / "d.img", 1 << 20)
    run = tools.ours("format", data, where / "h.img")
    assert run.returncode == 0, run.stderr
    os.mkfifo(where / "fifo")
    (where / "dir").mkdir()
    return where, data, where / "h.img", tools.root_hash(run.stdout)


ODD = {"fifo": lambda w: w / "fifo", "directory": lambda w: w / "dir",
       "dev-zero": lambda w: Path("/dev/zero")}


@pytest.mark.parametrize("kind", ODD)
def test_root_hash_file(tools, image, kind):
    where, data, hash_image, _ = image
    odd = ODD[kind](where)
    run = tools.ours("verify", data, hash_image, "--root-hash-file", odd, timeout=30)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"nbd-verity: root-hash-file: {odd}: not a regular file\n"


@pytest.mark.parametrize("kind", ODD)
def test_root_hash_signature(tools, image, kind):
    where, data, hash_image, root = image
    odd = ODD[kind](where)
    run = tools.ours("verify", data, hash_image, root, "--root-hash-signature", odd,
                     timeout=30)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"nbd-verity: {odd}: not a regular file\n"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_signing_key(tools, image, kind):
    where, _, _, root = image
    odd = ODD[kind](where)
    run = tools.ours("sign", "--key", odd, "--cert", odd, "-o", where / "out.p7s", root,
                     timeout=30)
    assert run.returncode == 2
    assert run.stderr == f"nbd-verity: sign-key: {odd}: not a regular file\n"
    assert not (where / "out.p7s").exists()


def test_roothash_sidecar_beside_the_image(tools, image, tmp_path):
    """`serve IMAGE` finds IMAGE.verity and IMAGE.roothash beside it; a FIFO there is
    refused at start-up, before anything listens."""
    _, data, hash_image, _ = image
    served = tmp_path / "s.img"
    served.write_bytes(data.read_bytes())
    (tmp_path / "s.img.verity").write_bytes(hash_image.read_bytes())
    os.mkfifo(tmp_path / "s.img.roothash")
    run = tools.ours("serve", served, "--unix", tmp_path / "x.sock", timeout=30)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"nbd-verity: {tmp_path / 's.img.roothash'}: not a regular file\n"
    assert not (tmp_path / "x.sock").exists()

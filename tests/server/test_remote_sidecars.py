"""Sidecars found beside an image served over HTTP: `nbd-verity serve URL` alone, with
URL.verity, URL.roothash and URL.roothash.p7s on the same lighttpd (the layout of
tests/server/test_signed.py, signed with `nbd-verity sign --sidecars`, keys from openssl).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..pki import Identity, make_identity
from .serverlib import MIB, NBD_VERITY, random_bytes, run_refusal, veritysetup_format
from .upstreams import Lighttpd

SIZE = 2 * MIB


@dataclass(frozen=True)
class SignedImage:
    directory: Path  # disk.raw, disk.verity, disk.roothash, disk.roothash.p7s
    content: bytes
    root: str
    signer: Identity


@pytest.fixture(scope="module")
def signed_image(tmp_path_factory) -> SignedImage:
    directory = tmp_path_factory.mktemp("remote-signed")
    content = random_bytes(17, SIZE)
    data = directory / "disk.raw"
    data.write_bytes(content)
    out = veritysetup_format(data, directory / "disk.verity")
    root = next(line.split()[-1] for line in out.splitlines() if line.startswith("Root hash:"))
    keys = tmp_path_factory.mktemp("remote-keys")
    signer = make_identity(keys, "url-signer")
    subprocess.run([str(NBD_VERITY), "sign", root, "--key", str(signer.key), "--cert",
                    str(signer.cert), "--sidecars", str(data)], check=True,
                   capture_output=True)
    assert (directory / "disk.roothash.p7s").stat().st_size > 0
    return SignedImage(directory, content, root, signer)


@pytest.fixture
def web(tmp_path, signed_image, sockdir, monkeypatch):
    """lighttpd serving a private copy of disk.raw and its sidecars; the captive
    upstreams and the fetched signature go in sockdir (RUNTIME_DIRECTORY)."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    docroot = tmp_path / "www"
    shutil.copytree(signed_image.directory, docroot)
    server = Lighttpd(docroot, tmp_path / "lighttpd").start()
    yield server
    server.stop()


def test_serve_url_alone_finds_its_signed_sidecars(web, signed_image, servers, sockdir):
    server = servers.serve_cli([web.url("disk.raw"), "--require-signatures",
                                "--trusted-certs", str(signed_image.signer.cert)])
    h = server.connect()
    assert h.get_size() == SIZE
    assert b"".join(h.pread(256 << 10, o) for o in range(0, SIZE, 256 << 10)) == \
        signed_image.content
    line = next(x for x in server.log().splitlines() if "serving" in x)
    assert f"root hash {signed_image.root} signed by CN=url-signer" in line
    assert f"({web.url('disk.roothash.p7s')})" in line  # named by where it came from
    # The fetched signature is handed over in memory: no file of it is left anywhere.
    leftovers = [n for d in (sockdir, tempfile.gettempdir()) for n in os.listdir(d)
                 if n.startswith("nbd-verity-sig-")]
    assert leftovers == []
    memfds = [os.readlink(f"/proc/{server.pid}/fd/{fd}")
              for fd in os.listdir(f"/proc/{server.pid}/fd")]
    assert f"/memfd:{web.url('disk.roothash.p7s')} (deleted)" in memfds


def _refused(argv: list[str]) -> str:
    result = run_refusal(argv)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_serve_url_without_its_signature_is_refused(web, signed_image, sockdir):
    (web.docroot / "disk.roothash.p7s").unlink()
    line = _refused([str(NBD_VERITY), "serve", web.url("disk.raw"), "--require-signatures",
                     "--trusted-certs", str(signed_image.signer.cert),
                     "--unix", os.path.join(sockdir, "refused.sock")])
    assert "require-signatures" in line and "not signed" in line, line


def test_serve_url_without_its_hash_image_is_refused(web, sockdir):
    (web.docroot / "disk.verity").unlink()
    line = _refused([str(NBD_VERITY), "serve", web.url("disk.raw"),
                     "--unix", os.path.join(sockdir, "refused.sock")])
    assert line == f"nbd-verity: hash: missing (give the hash image, or put " \
                   f"{web.url('disk.verity')} beside the image)"

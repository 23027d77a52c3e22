"""A root of trust is never read from a local path built out of an image's URL.

`nbd-verity serve 'nbd+unix:///?socket=/abs/up.sock'` once looked for the sidecars
`nbd+unix:///?socket=/abs/up.sock.roothash` (and `.verity`, `.roothash.p7s`) as paths
relative to the directory it started in: whoever could write that directory chose the
root hash. Here those paths are planted with the image's own (correct) root hash and
tree, so the only thing that can make the server refuse is that it does not read them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from .serverlib import NBD_VERITY, PLUGIN, PROJECT
from .upstreams import NbdkitFile

NBDKIT = shutil.which("nbdkit") or "/usr/sbin/nbdkit"


@pytest.fixture
def upstream(default_image, sockdir, tmp_path):
    server = NbdkitFile(default_image.data, sockdir, "up").start()
    yield server
    server.stop()


def plant(directory, uri: str, suffix: str, payload: bytes) -> str:
    """The file a local lookup of URI + suffix would open, relative to directory."""
    path = os.path.join(directory, uri + suffix)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(payload)
    return path


def run_in(directory, argv: list[str]) -> subprocess.CompletedProcess:
    """argv run from directory; a server that starts is killed by the timeout (the test
    fails then: it must refuse)."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    return subprocess.run([str(a) for a in argv], cwd=directory, capture_output=True,
                          text=True, timeout=30, check=False, env=env)


def test_serve_reads_no_root_hash_from_a_path_made_of_the_uri(default_image, upstream,
                                                              tmp_path, sockdir):
    planted = plant(tmp_path, upstream.uri, ".roothash", default_image.root.encode())
    assert os.path.isfile(planted)
    run = run_in(tmp_path, [NBD_VERITY, "serve", upstream.uri, default_image.hash,
                            "--unix", os.path.join(sockdir, "v.sock")])
    assert run.returncode == 2, run
    assert run.stderr.strip() == ("nbd-verity: root-hash: missing (give a root hash or a "
                                  "root-hash-file)"), run.stderr


def test_serve_reads_no_hash_image_from_a_path_made_of_the_uri(default_image, upstream,
                                                               tmp_path, sockdir):
    plant(tmp_path, upstream.uri, ".verity", default_image.hash.read_bytes())
    root_file = tmp_path / "root.txt"
    root_file.write_text(default_image.root)
    run = run_in(tmp_path, [NBD_VERITY, "serve", upstream.uri, "--root-hash-file", root_file,
                            "--unix", os.path.join(sockdir, "v.sock")])
    assert run.returncode == 2, run
    assert run.stderr.strip() == "nbd-verity: hash: missing (give the hash image)", run.stderr


def test_the_plugin_reads_no_signature_from_a_path_made_of_the_uri(default_image, upstream,
                                                                   tmp_path, sockdir):
    """With the root hash given, a signature would still be looked up beside the image:
    a planted (unparseable) one must not even be opened."""
    plant(tmp_path, upstream.uri, ".roothash.p7s", b"not a signature")
    run = run_in(tmp_path, [NBDKIT, "-f", "-r", "-U", os.path.join(sockdir, "p.sock"),
                            "--run", "true", "python", PLUGIN, f"data={upstream.uri}",
                            f"hash={default_image.hash}", f"root-hash={default_image.root}",
                            "require-signatures=true"])
    assert run.returncode != 0, run
    assert run.stderr.strip().endswith("require-signatures: the root hash is not signed "
                                       "(give root-hash-signature)"), run.stderr

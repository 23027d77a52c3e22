"""`ctl status` and `ctl stats` say whether the root hash is signed, and by whom.

The signature and certificate are made by the real openssl (tests/pki.py); the server is
the installed `nbd-verity serve` with --root-hash-signature and --trusted-certs.
"""

from __future__ import annotations

import json

import pytest

from ..pki import make_identity, smime_sign
from .harness import ctl


@pytest.fixture(scope="module")
def signer_files(image, tmp_path_factory):
    """(identity, signature file) for the image's root hash."""
    directory = tmp_path_factory.mktemp("trust")
    identity = make_identity(directory, "status-signer", "ec")
    text = directory / "roothash"
    text.write_text(image.root)
    return identity, smime_sign(identity, text, directory / "roothash.p7s")


def test_status_and_stats_name_the_signer(servers, image, signer_files):
    identity, signature = signer_files
    fingerprint = identity.fingerprint()
    server = servers.start(image, "--root-hash-signature", str(signature),
                           "--trusted-certs", str(identity.cert), "--require-signatures")

    trust = server.ask({"cmd": "status"})["status"]["trust"]
    assert trust["signed"] is True
    assert (trust["subject"], trust["fingerprint"]) == ("CN=status-signer", fingerprint)
    assert (trust["root_hash"], trust["root_hash_source"]) == (image.root, "given")
    assert (trust["signature"], trust["certificate"]) == (str(signature), str(identity.cert))
    assert trust["expired"] is False
    assert server.stats()["trust"] == trust

    want = f"trust  root hash {image.root} signed by CN=status-signer (sha256 {fingerprint})"
    status = ctl(server.control, "status")
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[1] == want
    stats = ctl(server.control, "stats")
    assert stats.stdout.splitlines()[-1] == want
    assert json.loads(ctl(server.control, "status", "--json").stdout)["status"]["trust"] == trust


def test_status_says_unsigned(servers, image):
    server = servers.start(image)
    assert server.ask({"cmd": "status"})["status"]["trust"] == {
        "signed": False, "root_hash": image.root, "root_hash_source": "given"}
    status = ctl(server.control, "status")
    assert status.stdout.splitlines()[1] == f"trust  root hash {image.root} unsigned (given)"

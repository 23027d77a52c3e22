"""Signed root hashes on a real server: served from sidecars, or refused in one line.

The image and its tree come from `veritysetup format`, the keys, certificates and
signatures from the real `openssl` (tests/pki.py), laid out as systemd-dissect expects:
IMAGE.raw, IMAGE.verity, IMAGE.roothash and IMAGE.roothash.p7s in one directory. Each
case runs both front ends: `nbdkit python plugin.py data=IMAGE.raw ...` and
`nbd-verity serve IMAGE.raw ...`, with no hash image and no root hash given.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..pki import ROOT_HEX, Identity, make_identity, smime_sign
from .serverlib import (
    MIB,
    NBD_VERITY,
    NBDKIT,
    PLUGIN,
    random_bytes,
    run_refusal,
    veritysetup_format,
)

SIZE = 4 * MIB


@dataclass(frozen=True)
class Sidecars:
    """IMAGE.raw with its sidecars; pairs() names only the data (nbdkit's keys)."""

    data: Path
    content: bytes

    def pairs(self, **extra) -> list[tuple[str, str]]:
        return [("data", str(self.data)), *((k.replace("_", "-"), str(v))
                                             for k, v in extra.items())]

    def sidecar(self, suffix: str) -> Path:
        return self.data.with_suffix(suffix)


@dataclass(frozen=True)
class Signed:
    directory: Path
    image: Sidecars
    root: str
    signer: Identity
    other: Identity

    def variant(self, name: str, signer: Identity | None, content: str | None = None
                ) -> Sidecars:
        """A copy named NAME.raw with the same tree and root hash file, signed by SIGNER
        over CONTENT (default: the root hash), or unsigned when SIGNER is None."""
        data = self.directory / f"{name}.raw"
        shutil.copyfile(self.image.data, data)
        for suffix in (".verity", ".roothash"):
            shutil.copyfile(self.image.sidecar(suffix), data.with_suffix(suffix))
        if signer is not None:
            text = self.directory / f"{name}.signed-text"
            text.write_text(content or self.root)
            smime_sign(signer, text, data.with_suffix(".roothash.p7s"))
        return Sidecars(data, self.image.content)


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Signed:
    """disk.raw, disk.verity (veritysetup), disk.roothash (no newline) and
    disk.roothash.p7s (`openssl smime -sign -noattr -nocerts -binary`)."""
    directory = tmp_path_factory.mktemp("signed")
    content = random_bytes(11, SIZE)
    data = directory / "disk.raw"
    data.write_bytes(content)
    out = veritysetup_format(data, directory / "disk.verity")
    root = next(line.split()[-1] for line in out.splitlines() if line.startswith("Root hash:"))
    (directory / "disk.roothash").write_text(root)
    signer = make_identity(directory, "image-signer")
    other = make_identity(directory, "someone-else")
    smime_sign(signer, directory / "disk.roothash", directory / "disk.roothash.p7s")
    return Signed(directory, Sidecars(data, content), root, signer, other)


def test_plugin_serves_a_signed_image_from_its_sidecars(signed, servers):
    server = servers.start(signed.image, trusted_certs=signed.signer.cert,
                           require_signatures="true")
    h = server.connect()
    assert h.get_size() == SIZE
    assert h.pread(SIZE, 0) == signed.image.content


def test_serve_needs_only_the_data_image(signed, servers):
    server = servers.serve_cli([str(signed.image.data), "--trusted-certs",
                                str(signed.signer.cert), "--require-signatures"])
    h = server.connect()
    assert h.pread(SIZE, 0) == signed.image.content
    line = next(x for x in server.log().splitlines() if "serving" in x)
    assert (f"root hash {signed.root} signed by CN=image-signer "
            f"(sha256 {signed.signer.fingerprint()})") in line
    assert str(signed.image.sidecar(".roothash.p7s")) in line


def test_serve_with_an_explicit_signature_file(signed, servers, tmp_path):
    """The three options given outright, the signature kept elsewhere."""
    sig = tmp_path / "elsewhere.p7s"
    shutil.copyfile(signed.image.sidecar(".roothash.p7s"), sig)
    unsigned = signed.variant("explicit", None)
    server = servers.serve_cli([str(unsigned.data), str(unsigned.sidecar(".verity")),
                                signed.root, "--root-hash-signature", str(sig),
                                "--trusted-certs", str(signed.signer.cert),
                                "--require-signatures"])
    assert server.connect().pread(4096, SIZE - 4096) == signed.image.content[-4096:]
    assert "signed by CN=image-signer" in server.log()


def plugin_argv(image: Sidecars, sockdir: str, **keys) -> list[str]:
    return [NBDKIT, "-f", "-r", "-U", os.path.join(sockdir, "refused.sock"), "python",
            str(PLUGIN), *[f"{k}={v}" for k, v in image.pairs(**keys)]]


def serve_argv(image: Sidecars, sockdir: str, **keys) -> list[str]:
    options = []
    for name, value in keys.items():
        flag = "--" + name.replace("_", "-")
        options += [flag] if value is True else [flag, str(value)]
    return [str(NBD_VERITY), "serve", str(image.data), *options,
            "--unix", os.path.join(sockdir, "refused.sock"),
            "--pid-file", os.path.join(sockdir, "refused.pid")]


def refusal(front: str, image: Sidecars, sockdir: str, require: bool, certs: Path) -> str:
    """Start FRONT on IMAGE; it must exit non-zero with one line and no traceback."""
    if front == "plugin":
        keys = {"trusted_certs": certs, **({"require_signatures": "true"} if require else {})}
        argv = plugin_argv(image, sockdir, **keys)
    else:
        keys = {"trusted_certs": certs, **({"require_signatures": True} if require else {})}
        argv = serve_argv(image, sockdir, **keys)
    result = run_refusal(argv)
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    if front == "serve":
        assert result.returncode == 2  # the CLI's "bad input"
        assert not os.path.exists(os.path.join(sockdir, "refused.pid"))
    return lines[0]


FRONTS = ["plugin", "serve"]


@pytest.mark.parametrize("front", FRONTS)
def test_unsigned_image_is_refused_under_require_signatures(signed, sockdir, front):
    unsigned = signed.variant(f"unsigned-{front}", None)
    line = refusal(front, unsigned, sockdir, True, signed.signer.cert)
    assert "require-signatures: the root hash is not signed" in line


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("require", [True, False], ids=["required", "not-required"])
def test_wrongly_signed_image_is_refused(signed, sockdir, front, require):
    """A signature by an untrusted key is refused, required or not: never a warning."""
    wrong = signed.variant(f"wrong-{front}-{require}", signed.other)
    line = refusal(front, wrong, sockdir, require, signed.signer.cert)
    assert "root-hash-signature: signer (issuer Common Name: someone-else" in line
    assert "is not a trusted certificate" in line


@pytest.mark.parametrize("front", FRONTS)
def test_signature_for_another_root_hash_is_refused(signed, sockdir, front):
    """The trusted key signed a root hash, but not this one."""
    replayed = signed.variant(f"replayed-{front}", signed.signer, content=ROOT_HEX)
    line = refusal(front, replayed, sockdir, True, signed.signer.cert)
    assert "signature by CN=image-signer does not match the root hash" in line


def test_unsigned_image_is_served_without_require_signatures(signed, servers):
    unsigned = signed.variant("plain", None)
    server = servers.serve_cli([str(unsigned.data)])
    assert server.connect().pread(SIZE, 0) == signed.image.content
    assert f"root hash {signed.root} unsigned ({unsigned.sidecar('.roothash')})" in server.log()

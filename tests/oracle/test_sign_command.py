"""`nbd-verity sign` checked by the real openssl, and `verify` with sidecars.

Signatures made by the installed command must pass `openssl smime -verify -binary -inform
DER -noverify -nointern -certfile CERT -content ROOTHASH` (systemd's check); for an RSA
key they are the very bytes `openssl smime -sign -nocerts -noattr -binary` writes.
`verify IMAGE` then finds IMAGE.verity, IMAGE.roothash and IMAGE.roothash.p7s itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ..pki import make_identity, oracle_verify, smime_sign


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    d = tmp_path_factory.mktemp("sign-ids")
    return {"rsa": make_identity(d, "rsa-signer"), "ec": make_identity(d, "ec-signer", "ec"),
            "other": make_identity(d, "other-signer")}


@pytest.fixture(scope="module")
def image(tools, tmp_path_factory):
    """disk.raw (1 MiB) and disk.verity; the root hash format printed."""
    d = tmp_path_factory.mktemp("sign-image")
    data = tools.write_image(d / "disk.raw", 1 << 20, seed=7)
    run = tools.ours("format", data, d / "disk.verity")
    assert run.returncode == 0, run.stderr
    return data, tools.root_hash(run.stdout)


@pytest.mark.parametrize("kind", ["rsa", "ec"])
def test_signature_passes_openssl(tools, ids, image, tmp_path, kind):
    _data, root = image
    out = tmp_path / "root.p7s"
    run = tools.ours("sign", "--key", ids[kind].key, "--cert", ids[kind].cert, root.upper(),
                     "-o", out)
    assert run.returncode == 0, run.stderr
    assert f"signed root hash {root} as CN={kind}-signer" in run.stdout
    content = tmp_path / "roothash"
    content.write_text(root)  # the lowercase hex, no newline: what was signed
    assert oracle_verify(out, ids[kind].cert, content)
    assert not oracle_verify(out, ids["other"].cert, content)
    if kind == "rsa":  # PKCS#1 v1.5 is deterministic: the same bytes as openssl's
        theirs = smime_sign(ids[kind], content, tmp_path / "theirs.p7s")
        assert out.read_bytes() == theirs.read_bytes()


def test_sidecars_then_verify_finds_them(tools, ids, image, tmp_path):
    data = tmp_path / "disk.raw"
    shutil.copyfile(image[0], data)
    shutil.copyfile(image[0].with_suffix(".verity"), tmp_path / "disk.verity")
    root_file = tmp_path / "root.txt"
    root_file.write_text(image[1].upper() + "\n")  # as systemd reads it: case, newline
    run = tools.ours("sign", "--key", ids["rsa"].key, "--cert", ids["rsa"].cert,
                     "--root-hash-file", root_file, "--sidecars", data)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "disk.roothash").read_text() == image[1]
    assert oracle_verify(tmp_path / "disk.roothash.p7s", ids["rsa"].cert,
                         tmp_path / "disk.roothash")

    ok = tools.ours("verify", data, "--trusted-certs", ids["rsa"].cert, "--require-signatures")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [
        "Verified 256 data blocks: OK",
        f"Trust: root hash {image[1]} signed by CN=rsa-signer "
        f"(sha256 {ids['rsa'].fingerprint()}) ({tmp_path / 'disk.roothash.p7s'})"]

    untrusted = tools.ours("verify", data, "--trusted-certs", ids["other"].cert)
    assert untrusted.returncode == 2 and untrusted.stdout == ""
    assert untrusted.stderr.startswith("nbd-verity: root-hash-signature: signer (issuer "
                                       "Common Name: rsa-signer")
    assert len(untrusted.stderr.splitlines()) == 1

    (tmp_path / "disk.roothash.p7s").unlink()
    unsigned = tools.ours("verify", data, "--require-signatures")
    assert unsigned.returncode == 2
    assert unsigned.stderr == ("nbd-verity: require-signatures: the root hash is not signed "
                               "(give root-hash-signature, or put IMAGE.roothash.p7s beside "
                               "it)\n")
    plain = tools.ours("verify", data)
    assert plain.returncode == 0, plain.stderr
    assert f"root hash {image[1]} unsigned ({tmp_path / 'disk.roothash'})" in plain.stdout


@pytest.mark.parametrize("args, message", [
    ([], "output: give -o FILE or --sidecars IMAGE"),
    (["--sidecars", "nowhere.raw"], "sidecars: nowhere.raw: no such image"),
    (["--sidecars", "/dev/null"],
     "sidecars: /dev/null: a character device, not a regular file or a block device"),
    (["--sidecars", "."], "sidecars: .: a directory, not a regular file or a block device"),
    (["-o", "x.p7s", "--root-hash-file", "root.txt"],
     "root-hash: give it directly or with root-hash-file, not both"),
    (["-o", "x.p7s", "--cert", "{other}"], "sign-cert: {other} is not the certificate of"),
], ids=["no-output", "no-image", "character-device", "directory", "two-roots", "wrong-cert"])
def test_sign_refusals_are_one_line(tools, ids, image, tmp_path, args, message):
    other = str(ids["other"].cert)
    (tmp_path / "root.txt").write_text(image[1])
    args = [a.format(other=other) for a in args]
    cert = [] if "--cert" in args else ["--cert", ids["rsa"].cert]
    run = _in(tools, tmp_path, ["sign", "--key", ids["rsa"].key, *cert, image[1], *args])
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith(f"nbd-verity: {message.format(other=other)}"), run.stderr
    assert len(run.stderr.splitlines()) == 1
    assert not (tmp_path / "x.p7s").exists()


def test_sidecars_of_a_block_device(tools, ids, image, tmp_path, loop_device):
    """A block device is an image: sign --sidecars writes beside the name it is given (here
    a link to a loop device, as /dev/disk/by-label/ names are), and verify finds them."""
    shutil.copyfile(image[0].with_suffix(".verity"), tmp_path / "disk.verity")
    disk = tmp_path / "disk"
    disk.symlink_to(loop_device(image[0]))
    run = tools.ours("sign", "--key", ids["rsa"].key, "--cert", ids["rsa"].cert, image[1],
                     "--sidecars", disk)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "disk.roothash").read_text() == image[1]
    assert oracle_verify(tmp_path / "disk.roothash.p7s", ids["rsa"].cert,
                         tmp_path / "disk.roothash")
    ok = tools.ours("verify", disk, "--trusted-certs", ids["rsa"].cert, "--require-signatures")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0] == "Verified 256 data blocks: OK"
    assert "signed by CN=rsa-signer" in ok.stdout


def _in(tools, directory, args):
    """`nbd-verity ARGS` run in DIRECTORY (relative names are the user's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBD_VERITY_")}
    return subprocess.run([tools.nbd_verity_path, *map(str, args)], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_format_signs_in_one_step(tools, ids, tmp_path):
    """format --sign-key/--sign-cert: the tree, then DATA.roothash and .p7s beside DATA,
    which openssl accepts and `verify DATA --require-signatures` finds."""
    data = tools.write_image(tmp_path / "disk.raw", 1 << 20, seed=11)
    run = tools.ours("format", data, tmp_path / "disk.verity", "--sign-key", ids["ec"].key,
                     "--sign-cert", ids["ec"].cert)
    assert run.returncode == 0, run.stderr
    root = tools.root_hash(run.stdout)
    assert (tmp_path / "disk.roothash").read_text() == root
    assert oracle_verify(tmp_path / "disk.roothash.p7s", ids["ec"].cert,
                         tmp_path / "disk.roothash")
    checked = tools.ours("verify", data, "--require-signatures", "--trusted-certs",
                         ids["ec"].cert)
    assert checked.returncode == 0, checked.stderr
    assert "signed by CN=ec-signer" in checked.stdout
    half = tools.ours("format", data, tmp_path / "other.verity", "--sign-key", ids["ec"].key)
    assert half.returncode == 2
    assert half.stderr.strip() == ("nbd-verity: sign-key: give --sign-key and --sign-cert "
                                   "together")

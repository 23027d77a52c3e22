"""Discoverable Disk Images built by systemd-repart 252, served by `nbd-verity serve
IMAGE.raw` alone: from a file, a read-only loop device, an nbd:// and an http:// URL.

The oracle is repart itself (its JSON root hash, the partition UUIDs it derives) and
sfdisk (where each partition is): every export must equal the data partition's bytes as
sfdisk locates them, and every refusal is one line.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import struct
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ..pki import make_identity
from .ddiimages import FILES, backup_lba, make_ddi, set_partition_uuid
from .serverlib import NBD_VERITY, expect_eio, flip_byte, run_refusal
from .upstreams import Lighttpd, MotoS3, NbdkitFile, stop_fuse


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    return make_identity(tmp_path_factory.mktemp("ddi-keys"), "ddi-signer")


@pytest.fixture(scope="module")
def signed(tmp_path_factory, signer):
    return make_ddi(tmp_path_factory.mktemp("ddi-root"), "root", signer)


def copy_of(ddi, directory: Path):
    """The DDI in a fresh file (for damage); partitions and root hash as before."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk.raw"
    shutil.copyfile(ddi.path, path)
    return type(ddi)(path, ddi.root, ddi.sector_size, ddi.parts)


def data_block_size(ddi) -> int:
    """From the verity superblock at the start of the hash partition (cryptsetup's layout:
    data_block_size is the u32 at byte 64)."""
    with open(ddi.path, "rb") as f:
        f.seek(ddi.parts["verity"].offset)
        sb = f.read(512)
    assert sb[:8] == b"verity\0\0"
    return struct.unpack_from("<I", sb, 64)[0]


def refused(argv: list[str]) -> str:
    """The one line a refused command prints (exit status 2, no traceback)."""
    result = run_refusal([str(NBD_VERITY), *argv])
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def serve_refused(ddi_path, sockdir, *options) -> str:
    return refused(["serve", str(ddi_path), *options, "--unix", f"{sockdir}/refused.sock"])


def test_repart_names_the_partitions_by_the_root_hash(signed):
    """systemd-repart's rule, which the server checks: data UUID = first 128 bits of the
    root hash, verity UUID = last 128 bits."""
    assert signed.parts["data"].uuid == str(uuid.UUID(signed.root[:32]))
    assert signed.parts["verity"].uuid == str(uuid.UUID(signed.root[-32:]))
    assert signed.parts["data"].type == "4f68bce3-e8cd-4db1-96e7-fbcaf984b709"


@pytest.mark.parametrize("designator, sign, sector_size", [
    ("root", True, 512), ("usr", True, 512), ("root", False, 512), ("root", True, 4096)])
def test_served_ddi_reads_back_its_data_partition(tmp_path, servers, signer, request,
                                                  designator, sign, sector_size):
    ddi = make_ddi(tmp_path / "ddi", designator, signer if sign else None, sector_size,
                   request)
    args = [str(ddi.path), "--trusted-certs", str(signer.cert)]
    if sign:
        args.append("--require-signatures")
    else:
        args[1:1] = ["--partition", "auto", ddi.root]  # no signature: the root hash given
    server = servers.serve_cli(args)
    h = server.connect()
    expected = ddi.data.read(ddi.path)
    assert h.get_size() == len(expected)
    assert h.pread(len(expected), 0) == expected
    line = server.log()
    assert f"root hash {ddi.root}" in line
    assert ("signed by CN=ddi-signer" in line) == sign


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory):
    return make_ddi(tmp_path_factory.mktemp("ddi-unsigned"), "root", None)


def test_unsigned_ddi_and_its_root_hash_as_the_second_argument(unsigned, servers, tools):
    """`serve DDI ROOT_HASH` and `verify DDI ROOT_HASH`, as the help says, without
    --partition: the second argument of a DDI is its root hash."""
    server = servers.serve_cli([str(unsigned.path), unsigned.root])
    h = server.connect()
    expected = unsigned.data.read(unsigned.path)
    assert h.pread(len(expected), 0) == expected
    assert f"root hash {unsigned.root} unsigned" in server.log()
    run = tools.ours("verify", unsigned.path, unsigned.root)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Verified "), run.stdout
    wrong = unsigned.root[:-1] + ("0" if unsigned.root[-1] != "0" else "1")
    run = tools.ours("verify", unsigned.path, wrong)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run


def test_flipped_byte_in_the_data_partition_fails_exactly_there(signed, tmp_path, servers,
                                                                signer):
    ddi = copy_of(signed, tmp_path / "bad")
    dbs = data_block_size(ddi)
    bad = 5
    flip_byte(ddi.path, ddi.data.offset + bad * dbs + 7)
    server = servers.serve_cli([str(ddi.path), "--trusted-certs", str(signer.cert)])
    h = server.connect()
    expected = ddi.data.read(signed.path)
    expect_eio(h, 1, bad * dbs + 7)
    expect_eio(h, dbs, bad * dbs)
    assert h.pread(bad * dbs, 0) == expected[:bad * dbs]
    rest = (bad + 1) * dbs
    assert h.pread(len(expected) - rest, rest) == expected[rest:]
    assert f"data block {bad} is corrupted" in server.log()


def test_ddi_on_a_loop_device(signed, servers, signer, loop_device):
    device = loop_device(signed.path)
    server = servers.serve_cli([str(device), "--trusted-certs", str(signer.cert),
                                "--require-signatures"])
    h = server.connect()
    assert h.pread(h.get_size(), 0) == signed.data.read(signed.path)


def test_ddi_behind_nbd(signed, servers, signer, sockdir):
    upstream = NbdkitFile(signed.path, sockdir, "ddi-upstream").start()
    try:
        server = servers.serve_cli([upstream.uri, "--trusted-certs", str(signer.cert),
                                    "--require-signatures"])
        h = server.connect()
        assert h.pread(h.get_size(), 0) == signed.data.read(signed.path)
    finally:
        upstream.stop()


def test_ddi_behind_http(signed, servers, signer, tmp_path, sockdir, monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    docroot = tmp_path / "www"
    docroot.mkdir()
    shutil.copyfile(signed.path, docroot / "disk.raw")
    web = Lighttpd(docroot, tmp_path / "lighttpd").start()
    try:
        server = servers.serve_cli([web.url("disk.raw"), "--trusted-certs",
                                    str(signer.cert), "--require-signatures"])
        h = server.connect()
        assert h.pread(h.get_size(), 0) == signed.data.read(signed.path)
        assert "signed by CN=ddi-signer" in server.log()
    finally:
        web.stop()


def test_ddi_in_s3_is_found_by_its_gpt(signed, servers, signer, tmp_path, sockdir,
                                       monkeypatch):
    """`serve s3://BUCKET/disk.raw` alone, with no sidecars in the bucket: its start is a
    GPT, so it is served as a DDI (as an http:// one is), with its signature checked."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    store = MotoS3(tmp_path / "moto").start()
    try:
        store.fill("images", {"disk.raw": signed.path})
        server = servers.serve_cli(["s3://images/disk.raw", "--s3-endpoint", store.endpoint,
                                    "--trusted-certs", str(signer.cert),
                                    "--require-signatures"])
        h = server.connect()
        assert h.pread(h.get_size(), 0) == signed.data.read(signed.path)
        assert "signed by CN=ddi-signer" in server.log()
    finally:
        store.stop()


def test_damaged_primary_gpt_uses_the_backup(signed, tmp_path, servers, signer):
    ddi = copy_of(signed, tmp_path / "primary")
    flip_byte(ddi.path, 512 + 40)  # first_usable_lba: the header CRC no longer matches
    server = servers.serve_cli([str(ddi.path), "--trusted-certs", str(signer.cert)])
    h = server.connect()
    assert h.pread(h.get_size(), 0) == signed.data.read(signed.path)
    assert "primary GPT is damaged (header at LBA 1: header CRC32 mismatch); using the " \
           "backup" in server.log()


# -- refusals, each one line ------------------------------------------------------------

def test_unsigned_ddi_under_require_signatures_is_refused(tmp_path, sockdir):
    ddi = make_ddi(tmp_path / "unsigned", "root", None)
    line = serve_refused(ddi.path, sockdir, "--partition", "root", ddi.root,
                         "--require-signatures")
    assert "require-signatures: the root hash is not signed" in line, line


def test_wrong_certificate_is_refused(signed, tmp_path, sockdir):
    other = make_identity(tmp_path, "stranger")
    line = serve_refused(signed.path, sockdir, "--trusted-certs", str(other.cert))
    assert line.startswith("nbd-verity: ") and "root-hash-signature" in line, line


def test_signature_over_another_root_hash_is_refused(signed, signer, tmp_path, sockdir):
    """A signature partition whose rootHash is this image's, with the signature of
    another image's root hash by the same signer."""
    other = make_ddi(tmp_path / "other", "root", signer)
    ddi = copy_of(signed, tmp_path / "swapped")
    sig_part = signed.parts["signature"]
    theirs = json.loads(other.parts["signature"].read(other.path).rstrip(b"\0"))
    blob = json.dumps({"rootHash": signed.root, "signature": theirs["signature"]}).encode()
    with open(ddi.path, "r+b") as f:
        f.seek(sig_part.offset)
        f.write(blob.ljust(sig_part.size, b"\0"))
    base64.b64decode(theirs["signature"])  # a real signature, just not over this hash
    line = serve_refused(ddi.path, sockdir, "--trusted-certs", str(signer.cert))
    assert "root-hash-signature" in line, line


def test_uuids_disagreeing_with_the_signed_root_hash_are_refused(signed, signer, tmp_path,
                                                                 sockdir):
    ddi = copy_of(signed, tmp_path / "uuid")
    stranger = uuid.uuid4()
    set_partition_uuid(ddi.path, ddi.data.number, stranger)
    line = serve_refused(ddi.path, sockdir, "--trusted-certs", str(signer.cert))
    assert "disagree with the root hash" in line and str(stranger) in line, line


def test_truncated_ddi_is_refused(signed, signer, tmp_path, sockdir):
    ddi = copy_of(signed, tmp_path / "short")
    with open(ddi.path, "r+b") as f:
        f.truncate(ddi.parts["verity"].offset + 4096)
    line = serve_refused(ddi.path, sockdir, "--trusted-certs", str(signer.cert))
    assert "truncated?" in line, line


def test_corrupted_gpt_is_refused(signed, signer, tmp_path, sockdir):
    """Primary and backup both damaged: nothing to read the partitions from."""
    ddi = copy_of(signed, tmp_path / "gpt")
    flip_byte(ddi.path, 512 + 40)
    flip_byte(ddi.path, backup_lba(ddi.path) * 512 + 40)
    line = serve_refused(ddi.path, sockdir, "--trusted-certs", str(signer.cert))
    assert "GPT: primary header at LBA 1: header CRC32 mismatch; backup header" in line, line


# -- verify and dump -------------------------------------------------------------------

def test_verify_and_dump_a_ddi(signed, signer, tmp_path):
    ok = subprocess.run([str(NBD_VERITY), "verify", str(signed.path), "--trusted-certs",
                         str(signer.cert), "--require-signatures"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout and "signed by CN=ddi-signer" in ok.stdout
    dump = subprocess.run([str(NBD_VERITY), "dump", str(signed.path), "--trusted-certs",
                           str(signer.cert)], capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    for part in signed.parts.values():
        assert part.uuid in dump.stdout and str(part.offset) in dump.stdout
    assert f"Root hash:       \t{signed.root}" in dump.stdout
    assert "Signed by:       \tCN=ddi-signer" in dump.stdout
    assert "VERITY header information for" in dump.stdout
    bad = copy_of(signed, tmp_path / "verify-bad")
    flip_byte(bad.path, bad.data.offset + 3 * data_block_size(bad))
    failed = subprocess.run([str(NBD_VERITY), "verify", str(bad.path), "--trusted-certs",
                             str(signer.cert)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "data block 3 is corrupted" in failed.stderr


# -- mounted ---------------------------------------------------------------------------

def test_ext4_of_a_served_ddi_mounts_and_reads(signed, servers, signer, tmp_path):
    server = servers.serve_cli([str(signed.path), "--trusted-certs", str(signer.cert),
                                "--require-signatures"])
    with mounted(server.socket, tmp_path) as mnt:
        for name, content in FILES.items():
            assert (mnt / name).read_bytes() == content


@contextlib.contextmanager
def mounted(socket_path: str, directory: Path):
    """nbdfuse exposes the export as a file, `losetup -r` makes it a block device, ext4
    is mounted read-only from it; undone in reverse, each step by its own name or pid."""
    fuse_dir, mnt = directory / "fuse", directory / "mnt"
    fuse_dir.mkdir()
    mnt.mkdir()
    with contextlib.ExitStack() as undo:
        fuse = subprocess.Popen(["nbdfuse", "-r", str(fuse_dir), "--unix", socket_path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        undo.callback(stop_fuse, fuse, fuse_dir)
        deadline = time.monotonic() + 20
        while not (fuse_dir / "nbd").exists():
            assert fuse.poll() is None, "nbdfuse exited"
            assert time.monotonic() < deadline, "nbdfuse did not mount"
            time.sleep(0.05)
        loop = subprocess.run(["losetup", "-r", "-f", "--show", str(fuse_dir / "nbd")],
                              capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip()
        undo.callback(subprocess.run, ["losetup", "-d", loop], check=False, timeout=60)
        subprocess.run(["mount", "-t", "ext4", "-o", "ro,noload", loop, str(mnt)],
                       check=True, capture_output=True, timeout=60)
        undo.callback(subprocess.run, ["umount", str(mnt)], check=False, timeout=60)
        yield mnt

"""Images in a real S3 store: moto's S3 server on 127.0.0.1, read by `nbd-verity serve
s3://...` through nbdkit's S3 plugin (endpoint-url), with the sidecars KEY.verity,
KEY.roothash and KEY.roothash.p7s beside the image in the bucket. As for HTTP
(test_remote_sources.py): whatever the store does, a client gets the original bytes or
EIO, and a store that cannot give the image is one line at start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ..pki import make_identity
from .serverlib import (
    MIB,
    NBD_VERITY,
    control_request,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    reads_across_an_outage,
    run_refusal,
)
from .upstreams import MotoS3

BUCKET = "images"
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def s3_image(tmp_path_factory):
    """2 MiB, 4096/4096 sha256 (512 data blocks, 4 level-0 blocks), its root hash signed
    with `nbd-verity sign --sidecars`: data.img, hash.img, data.img.roothash(.p7s)."""
    image = make_image(tmp_path_factory.mktemp("s3"), random_bytes(23, 2 * MIB))
    signer = make_identity(tmp_path_factory.mktemp("s3-keys"), "s3-signer")
    subprocess.run([str(NBD_VERITY), "sign", image.root, "--key", str(signer.key),
                    "--cert", str(signer.cert), "--sidecars", str(image.data)], check=True,
                   capture_output=True)
    image.signer = signer
    return image


def objects(image) -> dict[str, Path]:
    """The bucket's keys: disk.raw and the sidecars `serve s3://.../disk.raw` looks for."""
    return {"disk.raw": image.data, "disk.verity": image.hash,
            "disk.roothash": Path(f"{image.data}.roothash"),
            "disk.roothash.p7s": Path(f"{image.data}.roothash.p7s")}


@pytest.fixture
def no_aws_config(tmp_path, monkeypatch):
    """No credentials but the test's own: not the machine's ~/.aws, nor its variables."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture
def store(tmp_path, s3_image, sockdir, monkeypatch, no_aws_config):
    """moto without authentication, holding the image; any key pair is accepted."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = MotoS3(tmp_path / "moto").start()
    server.fill(BUCKET, objects(s3_image))
    yield server
    server.stop()


@pytest.fixture
def served(store, servers, sockdir):
    """`nbd-verity serve s3://... --s3-endpoint URL` with a control socket."""
    def start(*args: str):
        control = os.path.join(sockdir, f"ctl{len(os.listdir(sockdir))}.sock")
        server = servers.serve_cli([*args, "--s3-endpoint", store.endpoint,
                                    "--control", control])
        server.control_path = control
        return server
    return start


def url(key: str) -> str:
    return f"s3://{BUCKET}/{key}"


def read_all(h, size: int, chunk: int = CHUNK) -> bytes:
    return b"".join(h.pread(min(chunk, size - o), o) for o in range(0, size, chunk))


def totals(server) -> dict:
    return control_request(server.control_path, {"cmd": "stats"})["stats"]["totals"]


def test_s3_reads_back_the_original(served, s3_image):
    server = served(url("disk.raw"), url("disk.verity"), s3_image.root)
    h = server.connect()
    assert h.get_size() == s3_image.size
    assert read_all(h, s3_image.size) == s3_image.expected()
    counts = totals(server)
    assert counts["source_errors"] == 0 and counts["corruptions"] == 0


def test_s3_url_alone_finds_its_signed_sidecars(served, s3_image):
    """KEY.verity, KEY.roothash and KEY.roothash.p7s from the bucket; the signature
    checked against the trusted certificate, as beside a local file."""
    server = served(url("disk.raw"), "--require-signatures",
                    "--trusted-certs", str(s3_image.signer.cert))
    h = server.connect()
    assert read_all(h, s3_image.size, 256 << 10) == s3_image.expected()
    line = next(x for x in server.log().splitlines() if "serving" in x)
    assert f"root hash {s3_image.root} signed by CN=s3-signer" in line


def _put_flipped(store, tmp_path, key: str, source: Path, offset: int) -> None:
    damaged = tmp_path / f"damaged-{key}"
    shutil.copyfile(source, damaged)
    flip_byte(damaged, offset)
    store.client().put_object(Bucket=BUCKET, Key=key, Body=damaged.read_bytes())


def test_s3_corrupt_data_byte_fails_exactly_its_block(served, store, s3_image, tmp_path):
    block = 77
    _put_flipped(store, tmp_path, "disk.raw", s3_image.data, block * 4096 + 1234)
    server = served(url("disk.raw"), url("disk.verity"), s3_image.root)
    h = server.connect()
    expect_eio(h, 4096, block * 4096)
    expect_eio(h, 3 * 4096, (block - 1) * 4096)
    for neighbour in (0, block - 1, block + 1, 511):
        assert h.pread(4096, neighbour * 4096) == s3_image.expected(neighbour * 4096, 4096)
    assert totals(server)["corruptions"] >= 2


def test_s3_corrupt_hash_byte_fails_exactly_its_leaf(served, store, s3_image, tmp_path):
    leaf = s3_image.leaf_offset(300)  # covers data blocks 256..383
    _put_flipped(store, tmp_path, "disk.verity", s3_image.hash, leaf + 100)
    server = served(url("disk.raw"), url("disk.verity"), s3_image.root)
    h = server.connect()
    for block in (256, 300, 383):
        expect_eio(h, 4096, block * 4096)
    for block in (0, 255, 384, 511):
        assert h.pread(4096, block * 4096) == s3_image.expected(block * 4096, 4096)


def test_s3_server_restarted_mid_read(served, store, s3_image):
    """Stop moto while a client reads, start it again on its port and fill it again:
    each read is EIO or correct, and reads go on afterwards."""
    server = served(url("disk.raw"), url("disk.verity"), s3_image.root,
                    "--cache-size", "4K")  # hash blocks are re-read too
    h = server.connect()
    expected = s3_image.expected()

    def outage():
        store.stop()
        store.start()  # in memory: the bucket is gone until it is filled again
        store.fill(BUCKET, objects(s3_image))

    outcomes = reads_across_an_outage(h, expected, outage, CHUNK)
    print(f"reads across the restart: {outcomes}")
    assert read_all(h, s3_image.size) == expected


# -- refusals at start-up: one line each ----------------------------------------------


def _refused(argv: list[str]) -> str:
    result = run_refusal([str(NBD_VERITY), "serve", *argv])
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "reason"), [
    ((url("missing.raw"), url("disk.verity")), "s3://images/missing.raw: no such key"),
    ((url("missing.raw"),), "s3://images/missing.raw: no such key"),
    (("s3://no-such-bucket/disk.raw", url("disk.verity")),
     "s3://no-such-bucket/disk.raw: no such bucket"),
    ((url("disk.raw"), url("missing.verity")), "s3://images/missing.verity: no such key"),
])
def test_s3_missing_object_is_refused(store, s3_image, sockdir, args, reason):
    root = [s3_image.root] if len(args) == 2 else []
    line = _refused([*args, *root, "--s3-endpoint", store.endpoint,
                     "--unix", os.path.join(sockdir, "refused.sock")])
    assert line == f"nbd-verity: {reason}", line


def test_s3_unreachable_endpoint_is_refused(store, s3_image, sockdir):
    store.stop()
    line = _refused([url("disk.raw"), url("disk.verity"), s3_image.root,
                     "--s3-endpoint", store.endpoint,
                     "--unix", os.path.join(sockdir, "refused.sock")])
    assert line.startswith("nbd-verity: s3://images/disk.raw: ") and \
        "Could not connect" in line, line


@pytest.fixture
def authenticating_store(tmp_path, s3_image, sockdir, monkeypatch, no_aws_config):
    """moto checking every request's signature against its IAM users (after the three
    that create the user, its policy and its key): (server, credentials file)."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    server = MotoS3(tmp_path / "moto-auth", auth_free=3).start()
    iam = server.client("iam")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    server.fill(BUCKET, objects(s3_image),
                server.client(key_id=key["AccessKeyId"], secret=key["SecretAccessKey"]))
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(f"[reader]\naws_access_key_id = {key['AccessKeyId']}\n"
                           f"aws_secret_access_key = {key['SecretAccessKey']}\n")
    credentials.chmod(0o600)
    yield server, credentials, key
    server.stop()


def test_s3_credentials_file_and_profile(authenticating_store, servers, s3_image, sockdir):
    """--s3-credentials and --s3-profile reach our own check and the captive plugin."""
    store, credentials, _key = authenticating_store
    server = servers.serve_cli([url("disk.raw"), "--s3-endpoint", store.endpoint,
                                "--s3-credentials", str(credentials),
                                "--s3-profile", "reader",
                                "--trusted-certs", str(s3_image.signer.cert)])
    h = server.connect()
    assert read_all(h, s3_image.size) == s3_image.expected()
    for pid_file in Path(sockdir).glob("nbd-verity-up-*/*.pid"):  # no secret in argv
        argv = Path(f"/proc/{pid_file.read_text().strip()}/cmdline").read_bytes()
        assert b"secret" not in argv and _key["SecretAccessKey"].encode() not in argv


@pytest.mark.parametrize(("key_id", "secret", "reason"), [
    ("AKIAWRONGWRONGWRONG0", "wrong", "the access key is unknown to the store"),
    (None, "wrong", "the secret key does not match the access key"),
])
def test_s3_wrong_credentials_are_refused(authenticating_store, s3_image, sockdir,
                                          monkeypatch, key_id, secret, reason):
    store, _credentials, key = authenticating_store
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id or key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    line = _refused([url("disk.raw"), "--s3-endpoint", store.endpoint,
                     "--unix", os.path.join(sockdir, "refused.sock")])
    assert line.startswith(f"nbd-verity: s3://images/disk.raw: {reason}"), line


def test_s3_without_credentials_is_refused(store, s3_image, sockdir, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    line = _refused([url("disk.raw"), url("disk.verity"), s3_image.root,
                     "--s3-endpoint", store.endpoint,
                     "--unix", os.path.join(sockdir, "refused.sock")])
    assert line == "nbd-verity: s3://images/disk.raw: Unable to locate credentials", line

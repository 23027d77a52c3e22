"""No secret on any command line, none in any message (issue 29, item 7).

/proc/PID/cmdline is readable by every user, so a URL's password, a presigned URL's
token and an S3 secret key must never be in the argv of a process nbd-verity starts, nor
in the verifying nbdkit's (which `serve` becomes by exec). Two checks of that rule, for
each way a secret reaches `serve` (a user part, a query token, both; S3 keys from the
environment or a credentials file):
- every execve of `serve` and of all its descendants, recorded by strace from the start:
  no argv but the caller's own holds a secret (the rule, over every process started);
- the processes of the running server tree (the verifying nbdkit and each captive
  upstream), their cmdline read as another user (setpriv to nobody), hold none either.
The servers are real (lighttpd requiring the password and the token, moto checking S3
signatures), so a read of the original bytes shows the secrets did reach them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nbd_verity.sources.remote import redact
from nbd_verity.sources.upstream import plugin_args, secret_of, write_secret

from . import test_s3_sources
from .serverlib import (
    MIB,
    NBD_VERITY,
    Server,
    make_image,
    random_bytes,
    reads_across_an_outage,
    run_refusal,
)
from .upstreams import GuardedLighttpd

# The S3 suite's fixtures, by name: moto checking signatures, the signed image.
authenticating_store = test_s3_sources.authenticating_store
no_aws_config = test_s3_sources.no_aws_config
s3_image = test_s3_sources.s3_image
url = test_s3_sources.url

USER = "reader"  # a user name is not a secret (it goes as curl's user=)
PASSWORD = f"pw-{secrets.token_hex(8)}"
TOKEN = f"tok{secrets.token_hex(8)}"
STRACE = shutil.which("strace") or "/usr/bin/strace"
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
CHUNK = 64 << 10

# How a secret reaches `serve` over HTTP: (user part, query) of both image URLs.
HTTP_CASES = {
    "password": (f"{USER}:{PASSWORD}@", ""),  # curl: user= and password=+FILE
    "token": ("", f"?token={TOKEN}"),  # httpread.py: url-file=FILE
    "both": (f"{USER}:{PASSWORD}@", f"?token={TOKEN}&x=1"),
}

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="reading /proc as another user needs root to be one")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_image(tmp_path_factory.mktemp("secrets"), random_bytes(29, 2 * MIB))


@pytest.fixture
def web(tmp_path, image, request):
    """lighttpd serving data.img and hash.img only with the case's password and token."""
    userinfo, query = HTTP_CASES[request.param]
    docroot = tmp_path / "www"
    docroot.mkdir()
    shutil.copyfile(image.data, docroot / "data.img")
    shutil.copyfile(image.hash, docroot / "hash.img")
    server = GuardedLighttpd(docroot, tmp_path / "lighttpd",
                             *((USER, PASSWORD) if userinfo else (None, None)),
                             token=TOKEN if query else None).start()
    server.secret_url = lambda name: (f"http://{userinfo}127.0.0.1:{server.port}/"
                                      f"{name}{query}")
    yield server
    server.stop()


@pytest.fixture
def traced(sockdir, tmp_path, monkeypatch):
    """start(args): `nbd-verity serve ARGS` under `strace -f -e trace=execve`, ready; each
    stopped at the end by the pid in its pid file (the verifying nbdkit), then strace."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    started: list[Server] = []

    def start(args: list[str]) -> Server:
        n = len(started)
        sock, pid_file = os.path.join(sockdir, f"v{n}.sock"), os.path.join(sockdir, f"v{n}.pid")
        trace = tmp_path / f"execve{n}.txt"
        argv = [STRACE, "-f", "-qq", "-e", "trace=execve", "-e", "signal=none", "-s", "65536",
                "-o", str(trace), str(NBD_VERITY), "serve", *args, "--unix", sock,
                "--pid-file", pid_file, "--exit-with-parent"]
        server = Server(argv, sock, pid_file, tmp_path / f"serve{n}.log")
        server.trace = trace
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        with contextlib.suppress(OSError, ValueError):  # not started, or gone
            os.kill(int(Path(server.pid_file).read_text()), signal.SIGTERM)
        server.stop()


def children(pid: int) -> list[int]:
    """The pids whose parent is pid, and theirs, from /proc/*/stat."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        todo += kids
    return found


def cmdline_as_nobody(pid: int) -> bytes:
    """/proc/PID/cmdline as user nobody reads it."""
    result = subprocess.run([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                             "cat", f"/proc/{pid}/cmdline"], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout, f"pid {pid}: empty cmdline"
    return result.stdout


def assert_no_secret_in_tree(server: Server, sockdir: str, hidden: list[str]) -> None:
    """The verifying nbdkit and every process below it (the captive upstreams, found by
    their pid files too), read as nobody: no secret in any argv."""
    top = int(Path(server.pid_file).read_text())
    tree = [top, *children(top)]
    upstreams = [int(p.read_text()) for p in Path(sockdir).glob("nbd-verity-up-*/*.pid")]
    assert upstreams and set(upstreams) <= set(tree), (upstreams, tree)
    for pid in tree:
        argv = cmdline_as_nobody(pid)
        for secret in hidden:
            assert secret.encode() not in argv, (pid, argv)
    private = next(Path(sockdir).glob("nbd-verity-up-*"))
    assert private.stat().st_mode & 0o777 == 0o700
    assert not list(private.glob("*.secret")), "a secret file outlived its upstream's start"


def assert_no_secret_in_execve(trace: Path, hidden: list[str], started: int) -> None:
    """Of every execve strace saw, only the first (the caller's own `nbd-verity serve`
    command line) may hold a secret; at least `started` more were made."""
    calls = [line for line in trace.read_text().splitlines() if " execve(" in line]
    assert "serve" in calls[0]
    assert len(calls) >= 1 + started, calls
    for call in calls[1:]:
        for secret in hidden:
            assert secret not in call, call


def read_all(h, size: int) -> bytes:
    return b"".join(h.pread(min(CHUNK, size - o), o) for o in range(0, size, CHUNK))


# -- the rule, for each way a secret reaches serve ------------------------------------


@pytest.mark.parametrize("web", list(HTTP_CASES), indirect=True)
def test_http_secrets_on_no_command_line(web, traced, image, sockdir):
    server = traced([web.secret_url("data.img"), web.secret_url("hash.img"), image.root])
    assert read_all(server.connect(), image.size) == image.expected()
    assert_no_secret_in_tree(server, sockdir, [PASSWORD, TOKEN])
    assert_no_secret_in_execve(server.trace, [PASSWORD, TOKEN], started=3)
    log = server.log()
    assert PASSWORD not in log and TOKEN not in log, log


@pytest.mark.parametrize("via", ["environment", "credentials-file"])
def test_s3_keys_on_no_command_line(authenticating_store, traced, s3_image, sockdir,
                                    monkeypatch, via):
    store, credentials, key = authenticating_store
    args = [url("disk.raw"), "--s3-endpoint", store.endpoint,
            "--trusted-certs", str(s3_image.signer.cert)]
    if via == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    else:
        args += ["--s3-credentials", str(credentials), "--s3-profile", "reader"]
    server = traced(args)
    assert read_all(server.connect(), s3_image.size) == s3_image.expected()
    hidden = [key["SecretAccessKey"], key["AccessKeyId"]]
    assert_no_secret_in_tree(server, sockdir, hidden)
    assert_no_secret_in_execve(server.trace, hidden, started=3)


@pytest.mark.parametrize("web", ["both"], indirect=True)
def test_presigned_url_across_a_server_restart(web, servers, image, sockdir, monkeypatch):
    """httpread.py (the captive of a URL with a query) rides out a restart of the server
    as curl does: each read is EIO or correct, and reads go on afterwards."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    server = servers.serve_cli([web.secret_url("data.img"), web.secret_url("hash.img"),
                                image.root, "--cache-size", "4K"])
    h = server.connect()
    expected = image.expected()

    def outage():
        web.stop()
        time.sleep(0.5)  # the outage itself
        web.start()

    print(f"reads across the restart: {reads_across_an_outage(h, expected, outage, CHUNK)}")
    assert read_all(h, image.size) == expected


@pytest.mark.parametrize("web", list(HTTP_CASES), indirect=True)
def test_sidecars_beside_a_url_with_secrets(web, servers, image, sockdir, monkeypatch):
    """DATA alone, its URL with a password or a token in the query or both: the sidecars
    are looked up as data.img.verity and data.img.roothash with the same password and
    query (which the store asks of every object), and the image is served verified."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    docroot = Path(web.docroot)
    shutil.copyfile(image.hash, docroot / "data.img.verity")
    (docroot / "data.img.roothash").write_text(image.root + "\n")
    server = servers.serve_cli([web.secret_url("data.img")])
    assert read_all(server.connect(), image.size) == image.expected()


def test_secret_file_is_private(tmp_path):
    path = tmp_path / "x.secret"
    write_secret(str(path), PASSWORD)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == PASSWORD
    with pytest.raises(FileExistsError):  # never into a file someone else made
        write_secret(str(path), PASSWORD)


# -- messages: a refusal names the URL redacted ---------------------------------------


@pytest.mark.parametrize("web", list(HTTP_CASES), indirect=True)
@pytest.mark.parametrize("hash_given", [True, False], ids=["hash-given", "sidecars"])
def test_refusals_name_urls_redacted(web, image, sockdir, monkeypatch, hash_given):
    """A missing image (404: through the captive's start, or the sidecar lookup) is
    refused with the URL shown without its password and token."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    args = [web.secret_url("missing.img")]
    if hash_given:
        args += [web.secret_url("hash.img"), image.root]
    result = run_refusal([str(NBD_VERITY), "serve", *args,
                          "--unix", os.path.join(sockdir, "refused.sock")])
    assert result.returncode != 0, result
    assert PASSWORD not in result.stderr and TOKEN not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"127.0.0.1:{web.port}/missing.img" in result.stderr, result.stderr


ROOT_ZERO = "0" * 64
SECRET_DATA = f"http://{USER}:{PASSWORD}@127.0.0.1:9/d.img?token={TOKEN}"
SECRET_HASH = f"https://127.0.0.1:9/h.img?X-Amz-Signature={TOKEN}"


@pytest.mark.parametrize("argv", [
    ["verify", SECRET_DATA, SECRET_HASH, ROOT_ZERO],
    ["dump", SECRET_HASH],
    ["format", SECRET_DATA, "/nonexistent-dir/h.img"],
    ["tune", SECRET_DATA, SECRET_HASH, ROOT_ZERO],
    ["tune", "--duration", SECRET_DATA, "/d.img", "/h.img", ROOT_ZERO],
], ids=["verify", "dump", "format", "tune", "tune-option"])
def test_other_commands_name_urls_redacted(argv):
    """The commands that read DATA and HASH as paths refuse a URL with its one line naming
    it without the password and the token (tune: refused as a URL, not as a path made
    absolute), as serve does."""
    result = subprocess.run([str(NBD_VERITY), *argv], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2, result
    assert PASSWORD not in result.stderr and TOKEN not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "127.0.0.1:9/" in result.stderr and "***" in result.stderr, result.stderr


@pytest.mark.parametrize(("url_text", "shown"), [
    ("http://u:pw@h:80/d.img?token=t", "http://***@h:80/d.img?***"),
    ("https://h/d.img?X-Amz-Signature=s&X-Amz-Credential=c", "https://h/d.img?***"),
    ("https://h/d.img", "https://h/d.img"),
    ("nbds://alice@h/e?tls-psk-file=/k", "nbds://***@h/e?tls-psk-file=/k"),
    ("nbd+unix:///?socket=/run/x.sock", "nbd+unix:///?socket=/run/x.sock"),
    ("/images/disk.raw", "/images/disk.raw"),
])
def test_redact(url_text, shown):
    assert redact(url_text) == shown


@pytest.mark.parametrize(("data", "line"), [
    (f"s3://AKIAEXAMPLE:{PASSWORD}@images/disk.raw",
     "nbd-verity: s3://***@images/disk.raw: an S3 URL holds no credentials (give them in "
     "the environment or --s3-credentials)"),
    (f"s3://images/disk.raw?X-Amz-Signature={TOKEN}",
     "nbd-verity: s3://images/disk.raw?***: an S3 URL is s3://BUCKET/KEY"),
])
def test_s3_url_with_secrets_is_refused_redacted(sockdir, data, line):
    """Credentials in an s3:// URL would be the S3 plugin's bucket= (its command line):
    refused before anything starts, in one line that does not repeat them."""
    result = run_refusal([str(NBD_VERITY), "serve", data, "s3://images/disk.verity",
                          "00" * 32, "--unix", os.path.join(sockdir, "refused.sock")])
    assert result.returncode == 2 and result.stderr.strip() == line, result


@pytest.mark.parametrize("web", ["password", "both"], indirect=True)
def test_wrong_password_is_refused_redacted(web, image, sockdir, monkeypatch):
    """A 401 (curl at the first connection, or httpread.py at its start) names the URL
    without the password that was refused."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", sockdir)
    wrong = f"no-{secrets.token_hex(8)}"
    args = [web.secret_url(name).replace(PASSWORD, wrong) for name in ("data.img", "hash.img")]
    result = run_refusal([str(NBD_VERITY), "serve", *args, image.root,
                          "--unix", os.path.join(sockdir, "refused.sock")])
    assert result.returncode != 0, result
    assert "401" in result.stderr, result.stderr
    for secret in (wrong, PASSWORD, TOKEN):
        assert secret not in result.stderr, result.stderr


@pytest.mark.parametrize(("url_text", "args", "secret"), [
    ("http://u%40x:p%3Aw@h:8/d.img",
     ["curl", "url=http://h:8/d.img", "protocols=http,https", "user=u@x", "password=+F"],
     "p:w"),
    ("https://u@h/d.img", ["curl", "url=https://h/d.img", "protocols=http,https", "user=u"],
     None),
    ("https://h/d.img#part", ["curl", "url=https://h/d.img", "protocols=http,https"], None),
    ("https://u:p@h/d.img?X-Amz-Signature=s", ["python", "HTTPREAD", "url-file=F"],
     "https://u:p@h/d.img?X-Amz-Signature=s"),
])
def test_plugin_args_hold_no_secret(url_text, args, secret):
    """The captive's plugin keys for each kind of http(s) URL, and what goes in FILE."""
    got = plugin_args(url_text, secret_file="F")
    assert [a if not a.endswith("httpread.py") else "HTTPREAD" for a in got] == args
    assert secret_of(url_text) == secret

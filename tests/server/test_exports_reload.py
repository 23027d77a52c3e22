"""What a reload of a many-export server may not do: stall the other exports or the
control socket on a slow upstream, keep an export whose trust is gone, leave a file
descriptor or a directory behind for a refused remote export, or repeat a secret. Real
nbdkit, real clients (libnbd), real reloads over the control socket (`ctl exports
reload`), a silent NBD upstream and a dripping HTTP server made here."""

from __future__ import annotations

import contextlib
import http.server
import os
import secrets
import select
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import nbd
import pytest

from nbd_verity.demo.remote import Lighttpd

from ..pki import make_identity, smime_sign
from .serverlib import MIB, NBD_VERITY, control_request, make_image, random_bytes, wait_for
from .test_exports import connect, exports, images, read_all, reload, write_export  # noqa: F401

DEADLINE = 4  # seconds: the reload's deadline in these tests (the default is 30)


def serve_exports(servers, directory: Path, *args: str):
    control = str(directory.parent / "ctl.sock")
    server = servers.serve_cli(["--exports", str(directory), "--control", control, *args])
    server.control = control
    return server


def ctl_reload(server, deadline: float = DEADLINE) -> tuple[subprocess.CompletedProcess, float]:
    """`nbd-verity ctl exports reload --deadline S`, as `systemctl reload` runs it."""
    start = time.monotonic()
    run = subprocess.run([str(NBD_VERITY), "ctl", "--control", server.control, "exports",
                          "reload", "--deadline", str(deadline)], capture_output=True,
                         text=True, timeout=120, check=False)
    return run, time.monotonic() - start


def timed(function):
    start = time.monotonic()
    result = function()
    return result, time.monotonic() - start


def reload_beside_a_stall(server, stalled: str, pending) -> None:
    """Reload while stalled.conf's upstream stalls: another export's new client and the
    control socket answer at once, and the reload ends by its deadline, saying so."""
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(zip(("run", "took"),
                                                                ctl_reload(server),
                                                                strict=True)))
    thread.start()
    try:
        wait_for(pending, "the reload to reach the stalled upstream", timeout=30)
        data, took = timed(lambda: connect(server, "one").pread(4096, 0))
        assert data == server.expected_head, "export one read back wrong"
        assert took < 3.0, f"a new client of another export waited {took:.1f} s"
        status, took = timed(lambda: control_request(server.control, {"cmd": "status"}))
        assert status["ok"] and took < 3.0, f"status took {took:.1f} s"
    finally:
        thread.join(120)
    run, took = outcome["run"], outcome["took"]
    assert took < DEADLINE + 5, f"the reload took {took:.1f} s for a {DEADLINE} s deadline"
    assert run.returncode == 1 and "1 export file(s) refused" in run.stderr, run
    assert f"refused: {stalled}: still opening after {DEADLINE} s" in run.stdout, run
    assert "Traceback" not in run.stdout + run.stderr
    assert sorted(exports(server)) == ["one"]


@pytest.fixture
def one_served(tmp_path, images, servers):  # noqa: F811 - the fixture
    directory = tmp_path / "exports"
    directory.mkdir()
    write_export(directory, "one", images["one"])
    server = serve_exports(servers, directory)
    server.expected_head = images["one"].expected()[:4096]
    return directory, server


def test_a_silent_nbd_upstream_stalls_neither_other_exports_nor_the_control_socket(
        one_served, images, tmp_path):  # noqa: F811 - the fixture
    """An export whose NBD upstream accepts and never speaks: while its reload waits,
    export one serves a new client and `status` answers; the reload ends by its deadline
    and says the file was not served (before: 18 s for a new client, 7 s for status)."""
    directory, server = one_served
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "silent.sock")
    listener.bind(path)
    listener.listen(16)  # connections wait in the backlog: nothing is ever said
    uri = f"nbd+unix:///?socket={path}"
    stalled = directory / "stalled.conf"
    stalled.write_text(f"DATA={uri}\nHASH={uri}\nROOT_HASH={images['two'].root}\n"
                       f"ARGS=--source-timeout 60\n")
    try:
        reload_beside_a_stall(server, str(stalled),
                              lambda: select.select([listener], [], [], 0)[0])
    finally:
        listener.close()


class Drip(http.server.BaseHTTPRequestHandler):
    """Every answer a 200 whose body comes one byte every 0.5 s: no read ever times out."""

    def do_GET(self):
        self.server.asked.set()
        self.send_response(200)
        self.send_header("Content-Length", "4096")
        self.end_headers()
        for _ in range(120):  # at most a minute, then the handler ends by itself
            if self.server.stopping.wait(0.5):
                return
            try:
                self.wfile.write(b"0")
                self.wfile.flush()
            except OSError:
                return

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def dripping():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    server.asked, server.stopping = threading.Event(), threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_a_dripping_http_sidecar_stalls_neither_other_exports_nor_the_control_socket(
        one_served, dripping):
    """An http image whose sidecars come one byte every half second (no per-read timeout
    trips): the same, where a reload held every export for over 40 s before."""
    directory, server = one_served
    stalled = directory / "drip.conf"
    stalled.write_text(f"DATA=http://127.0.0.1:{dripping.server_port}/disk.raw\n")
    reload_beside_a_stall(server, str(stalled), dripping.asked.is_set)


# -- a reload re-checks trust ------------------------------------------------------------

def test_a_reload_after_the_certificate_is_removed_refuses_new_clients(servers, tmp_path):
    """--trusted-certs DIR: once the signer's certificate leaves DIR, a reload does not
    call the export unchanged; new clients are refused, a client it has reads on, and
    the certificate put back serves it again."""
    signer = make_identity(tmp_path, "reload-signer")
    image = make_image(tmp_path / "img", random_bytes(61, 2 * MIB))
    text = tmp_path / "img.roothash"
    text.write_text(image.root)
    signature = smime_sign(signer, text, tmp_path / "img.roothash.p7s")
    certs = tmp_path / "certs"
    certs.mkdir()
    shutil.copyfile(signer.cert, certs / "signer.crt")
    directory = tmp_path / "exports"
    directory.mkdir()
    write_export(directory, "signed", image, f"--root-hash-signature {signature}")
    server = serve_exports(servers, directory, "--require-signatures",
                           "--trusted-certs", str(certs))
    h = connect(server, "signed")
    assert read_all(h) == image.expected()

    (certs / "signer.crt").unlink()
    report = reload(server)
    assert "signed" not in report["unchanged"] and report["removed"] == ["signed"], report
    assert str(directory / "signed.conf") in report["refused"], report
    with pytest.raises(nbd.Error):
        connect(server, "signed")
    assert read_all(h) == image.expected()  # its client keeps what it was given

    shutil.copyfile(signer.cert, certs / "signer.crt")
    assert reload(server)["added"] == ["signed"]
    assert read_all(connect(server, "signed")) == image.expected()

    (directory / "signed.conf").write_text("not an export file\n")  # a broken edit...
    assert reload(server)["unchanged"] == [] and exports(server).keys() == {"signed"}
    (certs / "signer.crt").unlink()  # ...keeps the export only while its trust holds
    assert reload(server)["removed"] == ["signed"]
    with pytest.raises(nbd.Error):
        connect(server, "signed")


# -- a refused remote export leaves nothing behind ---------------------------------------

def open_fds(pid: int) -> list[str]:
    fds = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # closed meanwhile
            targets.append(os.readlink(fds / fd))
    return targets


def test_a_refused_remote_export_leaks_no_descriptor_and_no_directory(servers, sockdir,
                                                                      tmp_path, monkeypatch):
    """An http image with a garbage .roothash.p7s beside it, refused on every reload:
    the server's descriptors and its upstream directories stay as they were."""
    runtime = Path(sockdir) / "run"
    runtime.mkdir()
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))  # the captive upstreams' home
    image = make_image(tmp_path / "img", random_bytes(62, 2 * MIB))
    docroot = tmp_path / "www"
    docroot.mkdir()
    shutil.copyfile(image.data, docroot / "disk.raw")
    shutil.copyfile(image.hash, docroot / "disk.verity")
    (docroot / "disk.roothash").write_text(image.root)
    (docroot / "disk.roothash.p7s").write_bytes(b"0\x03\x02\x01\x00")  # not PKCS#7
    web = Lighttpd(docroot, tmp_path / "lighttpd").start()
    try:
        directory = tmp_path / "exports"
        directory.mkdir()
        write_export(directory, "local", image)
        server = serve_exports(servers, directory)
        broken = directory / "broken.conf"
        broken.write_text(f"DATA={web.url('disk.raw')}\n")
        files = None  # what the server holds but sockets (a control client's comes and goes)
        for _ in range(4):
            report = reload(server)
            assert str(broken) in report["refused"], report
            now = sorted(t for t in open_fds(server.pid) if not t.startswith("socket:"))
            files = files or now
            assert now == files
            assert os.listdir(runtime) == []  # no nbd-verity-up-* directory left
        assert not [t for t in files if "memfd" in t], files
        assert read_all(connect(server, "local")) == image.expected()
    finally:
        web.stop()


def test_an_export_refused_after_its_images_opened_leaks_no_descriptor(
        one_served, images, tmp_path):  # noqa: F811 - the fixture
    """A local export whose root hash is not its tree's: its data and hash images are open
    when the root is found wrong, and every reload refuses it again. The server's files
    stay as they were (each refusal closes what it opened)."""
    directory, server = one_served
    wrong = "0" * len(images["two"].root)
    (directory / "wrong.conf").write_text(f"DATA={images['two'].data}\n"
                                          f"HASH={images['two'].hash}\nROOT_HASH={wrong}\n")
    files = None
    for _ in range(4):
        report = reload(server)
        assert "does not match the top of the tree" in report["refused"][
            str(directory / "wrong.conf")], report
        now = sorted(t for t in open_fds(server.pid) if not t.startswith("socket:"))
        files = files or now
        assert now == files
    assert str(images["two"].data) not in files and str(images["two"].hash) not in files
    assert sorted(exports(server)) == ["one"]


# -- refusals never repeat a secret ------------------------------------------------------

def test_a_refused_export_never_shows_its_urls_secrets(one_served, images, tmp_path):  # noqa: F811 - the fixture
    """An http image with a password and a token in its URL, whose .roothash beside it
    is no root hash: the reload's reply, the command's output and the server's log name
    the sidecar's URL without either (lighttpd ignores both)."""
    directory, server = one_served
    password, token = f"pw{secrets.token_hex(6)}", f"tok{secrets.token_hex(6)}"
    docroot = tmp_path / "www"
    docroot.mkdir()
    shutil.copyfile(images["one"].data, docroot / "disk.raw")
    shutil.copyfile(images["one"].hash, docroot / "disk.verity")
    (docroot / "disk.roothash").write_text("not a root hash\n")
    web = Lighttpd(docroot, tmp_path / "lighttpd").start()
    try:
        (directory / "secret.conf").write_text(
            f"DATA=http://alice:{password}@127.0.0.1:{web.port}/disk.raw?token={token}\n")
        run, _ = ctl_reload(server)
        reply = control_request(server.control, {"cmd": "exports", "reload": True})
    finally:
        web.stop()
    why = reply["reload"]["refused"][str(directory / "secret.conf")]
    assert f"127.0.0.1:{web.port}/disk.roothash" in why, why  # the URL is named...
    shown = why + run.stdout + run.stderr + server.log()
    assert password not in shown and token not in shown, shown  # ...without its secrets

"""The demo's remote step: the same image on an HTTP server (lighttpd on 127.0.0.1), served
verified by `nbd-verity serve http://...`, which starts nbdkit's curl plugin itself.

lighttpd runs with a private configuration in the work directory and is stopped by its
pid; the verifying server too (its captive upstreams follow it: --exit-with-parent).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

from ..control.protocol import checked_request
from ..errors import VerityError
from ..launch import Launched
from .serving import READY_TIMEOUT_S, sha256_of, shell
from .walkthrough import CORRUPT_DATA_BLOCK, StepFailed, Walkthrough, flip_byte

LIGHTTPD = shutil.which("lighttpd") or "/usr/sbin/lighttpd"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lighttpd(Launched):
    """lighttpd serving one directory on 127.0.0.1:port (it serves byte ranges)."""

    def __init__(self, docroot: Path, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        conf = workdir / "lighttpd.conf"
        conf.write_text(f'server.document-root = "{docroot}"\n'
                        f"server.port = {self.port}\n"
                        'server.bind = "127.0.0.1"\n'
                        f'server.errorlog = "{workdir / "lighttpd-error.log"}"\n'
                        "server.modules = ()\n")
        self.docroot = docroot
        super().__init__([LIGHTTPD, "-D", "-f", conf], log_path=workdir / "lighttpd.log",
                         name="lighttpd")

    def is_ready(self) -> bool:
        """Ready when the port accepts a connection."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def web_server(w: Walkthrough, docroot: Path):
    """lighttpd on a free port, stopped by its pid."""
    if not os.path.exists(LIGHTTPD):
        raise StepFailed("lighttpd is not installed (`make setup` installs it)")
    server = Lighttpd(docroot, w.workdir / "www-conf")
    w.say(f"$ lighttpd -D -f {server.argv[-1]} &   # 127.0.0.1:{server.port}, {docroot.name}/")
    try:
        server.start(timeout=READY_TIMEOUT_S)
    except VerityError as e:
        raise StepFailed(str(e)) from None
    with server:
        yield server


@contextlib.contextmanager
def served_from(w: Walkthrough, name: str, data_url: str, hash_url: str, root: str):
    """`nbd-verity serve URL URL ROOT` in the background; yields (socket, control)."""
    sock, ctl, pid_file = (w.workdir / f"{name}.sock", w.workdir / f"{name}.ctl",
                           w.workdir / f"{name}.pid")
    for path in (sock, pid_file):
        path.unlink(missing_ok=True)
    runtime = tempfile.mkdtemp(prefix="nvd-")  # the upstream sockets (short: sun_path)
    argv = ["serve", data_url, hash_url, root, "--unix", sock.name, "--control", ctl.name,
            "--pid-file", pid_file.name]
    w.say(f"$ nbd-verity {' '.join(argv)} &")
    server = Launched([w.cli, *argv], socket=sock, pid_file=pid_file, control=ctl,
                      log_path=w.workdir / f"{name}.log", cwd=w.workdir,
                      env={**os.environ, "RUNTIME_DIRECTORY": runtime}, name="the server")
    try:
        try:
            server.start(timeout=READY_TIMEOUT_S)
        except VerityError as e:
            raise StepFailed(str(e)) from None
        with server:
            yield sock, ctl
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def serve_from_http(w: Walkthrough) -> None:
    """Serve the image from an HTTP server: nbdkit's curl plugin below, verified above;
    then flip a byte on the HTTP side: only that block fails."""
    docroot = w.workdir / "www"
    docroot.mkdir(exist_ok=True)
    for source, name in ((w.data, "disk.raw"), (w.hash, "disk.verity")):
        shutil.copyfile(source, docroot / name)
    w.say(f"copied the image to {docroot.name}/disk.raw and {docroot.name}/disk.verity")
    with web_server(w, docroot) as web, served_from(
            w, "remote", web.url("disk.raw"), web.url("disk.verity"), w.root) as (sock, ctl):
        out = w.workdir / "remote-read.img"
        shell(w, "nbdcopy", f"nbd+unix:///?socket={sock}", out)
        ours, theirs = sha256_of(out), sha256_of(w.data)
        out.unlink()
        w.say(f"sha256 read over NBD from HTTP: {ours}\nsha256 of data.img:             "
              f"{theirs}")
        if ours != theirs:
            raise StepFailed("the bytes served differ from the image")
        flip_byte(docroot / "disk.raw", CORRUPT_DATA_BLOCK * 4096 + 7)
        w.say(f"flipped one byte of data block {CORRUPT_DATA_BLOCK} in "
              f"{docroot.name}/disk.raw, on the HTTP server")
        _compare_around_the_corruption(w, sock)
        w.run("ctl", "--control", ctl.name, "stats")
        totals = checked_request(str(ctl), {"cmd": "stats"})["stats"]["totals"]
        w.say(f"corruptions {totals['corruptions']}, hash reads {totals['hash_reads']}, "
              f"source errors {totals['source_errors']}")
        if totals["corruptions"] < 1 or totals["source_errors"]:
            raise StepFailed("the corrupted block was not caught, or the source failed")


def _compare_around_the_corruption(w: Walkthrough, sock: Path) -> None:
    """Block by block near the damage: only the flipped block fails, the rest matches."""
    import errno

    import nbd
    h = nbd.NBD()
    h.connect_unix(str(sock))
    with open(w.data, "rb") as original:
        for block in range(CORRUPT_DATA_BLOCK - 2, CORRUPT_DATA_BLOCK + 3):
            original.seek(block * 4096)
            want = original.read(4096)
            try:
                ok = h.pread(4096, block * 4096) == want
                w.say(f"read data block {block} over HTTP: {'ok' if ok else 'WRONG BYTES'}")
                if not ok:
                    raise StepFailed(f"block {block} differs from the image")
            except nbd.Error as e:
                w.say(f"read data block {block} over HTTP: {os.strerror(e.errnum)}")
                if block != CORRUPT_DATA_BLOCK or e.errnum != errno.EIO:
                    raise StepFailed(f"block {block}: {e}") from None
    h.shutdown()


STEPS = (serve_from_http,)

"""The demo's remote steps: the same image on an HTTP server (lighttpd on 127.0.0.1) and in
an S3 bucket (moto's S3 server on 127.0.0.1), served verified by `nbd-verity serve
http://...` and `serve s3://...`, which start nbdkit's curl and S3 plugins themselves.

lighttpd and moto run with a private configuration in the work directory and are stopped
by their pids; the verifying server too (its captive upstreams follow it:
--exit-with-parent).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import sys
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


def port_accepts(port: int) -> bool:
    """Whether a server on 127.0.0.1:port accepts a connection now (its readiness)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


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
        return port_accepts(self.port)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"


class MotoS3(Launched):
    """moto's S3 server on 127.0.0.1:port (in memory: a restart empties it), with a
    boto3 client to fill it. With auth_free, moto checks signatures against its IAM
    users after that many requests (INITIAL_NO_AUTH_ACTION_COUNT)."""

    REGION = "us-east-1"

    def __init__(self, workdir: Path, port: int | None = None,
                 auth_free: int | None = None) -> None:
        self.port = port or free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if auth_free is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(auth_free)
        super().__init__([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                          str(self.port)], log_path=workdir / f"moto-{self.port}.log",
                         env=env, name="moto_server")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def is_ready(self) -> bool:
        return port_accepts(self.port)

    def client(self, service: str = "s3", key_id: str = "testing", secret: str = "testing"):
        import boto3
        return boto3.client(service, endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id=key_id, aws_secret_access_key=secret)

    def fill(self, bucket: str, objects: dict[str, Path], s3=None) -> None:
        """Create bucket and upload each object (key -> local file)."""
        s3 = s3 or self.client()
        s3.create_bucket(Bucket=bucket)
        for key, path in objects.items():
            s3.put_object(Bucket=bucket, Key=key, Body=Path(path).read_bytes())


def started(server: Launched) -> Launched:
    """server started and ready (a context manager that stops it by its pid), or the
    step fails with the reason in one line."""
    try:
        server.start(timeout=READY_TIMEOUT_S)
    except VerityError as e:
        raise StepFailed(str(e)) from None
    return server


@contextlib.contextmanager
def web_server(w: Walkthrough, docroot: Path):
    """lighttpd on a free port, stopped by its pid."""
    if not os.path.exists(LIGHTTPD):
        raise StepFailed("lighttpd is not installed (`make setup` installs it)")
    server = Lighttpd(docroot, w.workdir / "www-conf")
    w.say(f"$ lighttpd -D -f {server.argv[-1]} &   # 127.0.0.1:{server.port}, {docroot.name}/")
    with started(server):
        yield server


@contextlib.contextmanager
def served_from(w: Walkthrough, name: str, data_url: str, hash_url: str, root: str,
                *extra: str, env: dict | None = None):
    """`nbd-verity serve URL URL ROOT` in the background; yields (socket, control)."""
    sock, ctl, pid_file = (w.workdir / f"{name}.sock", w.workdir / f"{name}.ctl",
                           w.workdir / f"{name}.pid")
    for path in (sock, pid_file):
        path.unlink(missing_ok=True)
    runtime = tempfile.mkdtemp(prefix="nvd-")  # the upstream sockets (short: sun_path)
    argv = ["serve", data_url, hash_url, root, "--unix", sock.name, "--control", ctl.name,
            "--pid-file", pid_file.name, *extra]
    w.say(f"$ nbd-verity {' '.join(argv)} &")
    server = Launched([w.cli, *argv], socket=sock, pid_file=pid_file, control=ctl,
                      log_path=w.workdir / f"{name}.log", cwd=w.workdir,
                      env={**(env or os.environ), "RUNTIME_DIRECTORY": runtime},
                      name="the server")
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


def serve_from_s3(w: Walkthrough) -> None:
    """Serve the image from an S3 bucket (moto's S3 server here; any S3 store with
    --s3-endpoint): nbdkit's S3 plugin below, verified above; then replace the object
    with one that has a flipped byte: only that block fails."""
    if importlib.util.find_spec("moto") is None:
        raise StepFailed("moto is not installed (`make setup` installs it)")
    store = MotoS3(w.workdir / "s3-conf")
    w.say(f"$ python -m moto.server -H 127.0.0.1 -p {store.port} &   # a local S3 store")
    with started(store):
        store.fill("demo-images", {"disk.raw": w.data, "disk.verity": w.hash})
        w.say("uploaded the image to s3://demo-images/disk.raw and disk.verity")
        damaged = w.workdir / "s3-disk.raw"
        shutil.copyfile(w.data, damaged)
        flip_byte(damaged, CORRUPT_DATA_BLOCK * 4096 + 7)
        store.client().put_object(Bucket="demo-images", Key="disk.raw",
                                  Body=damaged.read_bytes())
        damaged.unlink()
        w.say(f"replaced it with a copy that has one byte of data block "
              f"{CORRUPT_DATA_BLOCK} flipped")
        w.say("$ export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing")
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing"}
        with served_from(w, "s3", "s3://demo-images/disk.raw", "s3://demo-images/disk.verity",
                         w.root, "--s3-endpoint", store.endpoint, env=env) as (sock, ctl):
            _compare_around_the_corruption(w, sock, "S3")
            totals = checked_request(str(ctl), {"cmd": "stats"})["stats"]["totals"]
            w.say(f"corruptions {totals['corruptions']}, source errors "
                  f"{totals['source_errors']}")
            if totals["corruptions"] < 1 or totals["source_errors"]:
                raise StepFailed("the corrupted block was not caught, or the source failed")


def _compare_around_the_corruption(w: Walkthrough, sock: Path, where: str = "HTTP") -> None:
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
                w.say(f"read data block {block} over {where}: "
                      f"{'ok' if ok else 'WRONG BYTES'}")
                if not ok:
                    raise StepFailed(f"block {block} differs from the image")
            except nbd.Error as e:
                w.say(f"read data block {block} over {where}: {os.strerror(e.errnum)}")
                if block != CORRUPT_DATA_BLOCK or e.errnum != errno.EIO:
                    raise StepFailed(f"block {block}: {e}") from None
    h.shutdown()


STEPS = (serve_from_http, serve_from_s3)

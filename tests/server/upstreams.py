"""Real upstream servers for the remote-source tests: lighttpd serving image files over
HTTP on 127.0.0.1, moto's S3 server on 127.0.0.1, plain nbdkit `file` servers
(optionally behind nbdkit filters), and an NBD export as a local file (nbdfuse).

Each is a process started in the foreground with a private configuration in the test's
temporary directory, awaited by a check of the server itself (its pid file, its socket
or TCP port accepting) and stopped by its pid (nbd_verity.launch.Launched).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from nbd_verity.demo.remote import Lighttpd, MotoS3, free_port
from nbd_verity.launch import NBDKIT, Launched

# the demo's lighttpd and moto as they are, and that lighttpd behind a password and a token
__all__ = ["GuardedLighttpd", "Lighttpd", "MotoS3", "NbdkitFile", "fuse_file", "stop_fuse"]


class GuardedLighttpd(Lighttpd):
    """The demo's lighttpd answering only requests with HTTP basic auth as user:password
    (mod_auth: 401 otherwise) and, with a token, whose query holds token=TOKEN
    (mod_access: 403 otherwise), so that a read shows the secrets reached the server."""

    def __init__(self, docroot: Path, workdir: Path, user: str | None = None,
                 password: str | None = None, token: str | None = None) -> None:
        super().__init__(docroot, workdir)
        conf = workdir / "lighttpd.conf"
        text = conf.read_text().replace(
            "server.modules = ()", 'server.modules = ("mod_access", "mod_auth", "mod_authn_file")')
        if user is not None:
            users = workdir / "users"
            users.write_text(f"{user}:{password}\n")
            text += (f'auth.backend = "plain"\nauth.backend.plain.userfile = "{users}"\n'
                     'auth.require = ("/" => ("method" => "basic", "realm" => "images", '
                     '"require" => "valid-user"))\n')
        if token is not None:
            text += (f'$HTTP["querystring"] !~ "(^|&)token={token}(&|$)" '
                     '{ url.access-deny = ("") }\n')
        conf.write_text(text)


class NbdkitFile(Launched):
    """nbdkit's C `file` plugin on a Unix socket (or TCP port), read-only, with filters."""

    def __init__(self, path: Path, directory: str, name: str, filters: tuple[str, ...] = (),
                 keys: tuple[str, ...] = (), tcp: bool = False) -> None:
        self.sock = os.path.join(directory, f"{name}.sock")
        pid_file = os.path.join(directory, f"{name}.pid")
        self.port = free_port() if tcp else None
        listen = ["-p", str(self.port), "-i", "127.0.0.1"] if tcp else ["-U", self.sock]
        argv = [NBDKIT, "-f", "-r", "--exit-with-parent", *listen, "-P", pid_file,
                *[f"--filter={f}" for f in filters], "file", str(path), *keys]
        super().__init__(argv, socket=None if tcp else self.sock, pid_file=pid_file,
                         log_path=os.path.join(directory, f"{name}.log"), name=name)
        self.pid_path = pid_file

    def start(self, ready: bool = True, timeout: float = 30.0) -> NbdkitFile:
        for stale in (self.sock, self.pid_path):  # a killed nbdkit leaves them behind
            if os.path.exists(stale):
                os.unlink(stale)
        super().start(ready, timeout)
        return self

    @property
    def uri(self) -> str:
        if self.port is not None:
            return f"nbd://127.0.0.1:{self.port}/"
        return f"nbd+unix:///?socket={self.sock}"


@contextlib.contextmanager
def fuse_file(socket_path: str, directory: Path, connections: int | None = None):
    """The NBD export at socket_path as the FUSE file directory/nbd (nbdfuse; with
    connections, that many to the export: nbdfuse's reads in flight at once are bounded by
    its connections, 4 by default). Unmounted at the end, lazily if it is still busy."""
    directory.mkdir()
    more = ["-C", str(connections)] if connections else []
    fuse = subprocess.Popen(["nbdfuse", *more, "-r", str(directory), "--unix", socket_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (directory / "nbd").exists():
            assert fuse.poll() is None, "nbdfuse exited"
            assert time.monotonic() < deadline, "nbdfuse did not mount"
            time.sleep(0.05)
        yield directory / "nbd"
    finally:
        stop_fuse(fuse, directory)


def stop_fuse(fuse: subprocess.Popen, directory: Path) -> None:
    """Unmount an nbdfuse mount (lazily if it is still busy) and end its process."""
    unmount = subprocess.run(["fusermount3", "-u", str(directory)], check=False,
                             stderr=subprocess.DEVNULL, timeout=60)
    if unmount.returncode and fuse.poll() is None:
        subprocess.run(["fusermount3", "-u", "-z", str(directory)], check=False,
                       stderr=subprocess.DEVNULL, timeout=60)
    try:
        fuse.wait(10)
    except subprocess.TimeoutExpired:
        fuse.kill()
        fuse.wait()

"""Real upstream servers for the remote-source tests: lighttpd serving image files over
HTTP on 127.0.0.1, moto's S3 server on 127.0.0.1, and plain nbdkit `file` servers
(optionally behind nbdkit filters).

Each is a process started in the foreground with a private configuration in the test's
temporary directory, awaited by a check of the server itself (its pid file, its socket
or TCP port accepting) and stopped by its pid (nbd_verity.launch.Launched).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from nbd_verity.demo.remote import Lighttpd, free_port
from nbd_verity.launch import NBDKIT, Launched

__all__ = ["Lighttpd", "MotoS3", "NbdkitFile"]  # lighttpd's helper is the demo's, used as it is


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


class MotoS3(Launched):
    """moto's S3 server on 127.0.0.1:port (in memory: a restart empties it), with a
    boto3 client to fill it. With auth, moto checks signatures against its IAM users
    after the first `auth_free` requests (INITIAL_NO_AUTH_ACTION_COUNT)."""

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
        """Ready when the port accepts a connection."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

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

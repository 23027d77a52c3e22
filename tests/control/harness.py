"""A real `nbd-verity serve` with a control socket, and the clients that talk to it.

Every server here is the installed `nbd-verity serve` (which execs nbdkit), started in the
foreground with `--exit-with-parent` and a pid file by nbd_verity.launch, and stopped by
its pid. It is ready when its pid file is written, its NBD socket accepts and its control
socket answers `status` (start-up binds the control socket in get_ready but accepts on it
only from after_fork, so a reply proves the whole server is up). Malformed control lines
go out with control.exchange, which sends raw bytes exactly as written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbd

from nbd_verity.control.protocol import exchange  # noqa: F401  (the tests send raw lines with it)
from nbd_verity.control.protocol import request as control_request
from nbd_verity.launch import Launched, run_to_end

PROJECT = Path(__file__).resolve().parents[2]
NBD_VERITY = str(Path(sys.executable).parent / "nbd-verity")
VERITYSETUP = shutil.which("veritysetup") or "/usr/sbin/veritysetup"
START_TIMEOUT = 30.0  # seconds: the machine is small and shared
STOP_TIMEOUT = 10.0
CLASSES = ("none", "rt", "be", "idle")  # linux/ioprio.h order, written out independently


def clean_env() -> dict:
    """Our environment without NBD_VERITY_* defaults (ctl reads NBD_VERITY_CONTROL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBD_VERITY_")}
    env["LC_ALL"] = "C"
    return env


@dataclass(frozen=True)
class Image:
    """A data image and the tree veritysetup built for it."""

    data: Path
    hash: Path
    root: str

    @property
    def size(self) -> int:
        return self.data.stat().st_size

    def expected(self, offset: int, length: int) -> bytes:
        with open(self.data, "rb") as f:
            f.seek(offset)
            return f.read(length)


def veritysetup_format(data: Path, hash_path: Path) -> str:
    """`veritysetup format` (4096/4096, sha256); the root hash it prints."""
    result = subprocess.run([VERITYSETUP, "format", str(data), str(hash_path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"veritysetup format failed: {result.stderr}"
    for line in result.stdout.splitlines():
        if line.startswith("Root hash:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"veritysetup printed no root hash:\n{result.stdout}")


# -- control socket -------------------------------------------------------------------


def request(path, message: dict) -> dict:
    """One JSON request, one decoded reply (ok or not)."""
    return control_request(path, message)


def checked(path, message: dict) -> dict:
    reply = request(path, message)
    assert reply.get("ok") is True, f"{message} -> {reply}"
    return reply


# -- NBD clients ----------------------------------------------------------------------


@contextlib.contextmanager
def nbd_client(socket_path, export_name: str = ""):
    """A libnbd handle on the server's Unix socket, shut down when the block ends."""
    h = nbd.NBD()
    if export_name:
        h.set_export_name(export_name)
    h.connect_unix(str(socket_path))
    try:
        yield h
    finally:
        with contextlib.suppress(nbd.Error):
            h.shutdown()


# -- servers --------------------------------------------------------------------------


class Server(Launched):
    """One `nbd-verity serve` on a Unix socket, with a control socket and a pid file."""

    def __init__(self, image: Image, directory: Path, name: str, *options: str,
                 control: Path | None = None, wrapper: tuple[str, ...] = (),
                 env: dict | None = None) -> None:
        """wrapper goes before the command (it must exec it: the pid stays the server's);
        env is added to the clean environment."""
        self.image = image
        control = control or directory / f"{name}.ctl"
        sock, pid_file = directory / f"{name}.sock", directory / f"{name}.pid"
        super().__init__([*wrapper, NBD_VERITY, "serve", str(image.data), str(image.hash),
                          image.root, "--unix", str(sock), "--control", str(control),
                          "--pid-file", str(pid_file), "--exit-with-parent", *options],
                         socket=sock, pid_file=pid_file, control=control,
                         log_path=directory / f"{name}.log", env={**clean_env(), **(env or {})})
        self.start(ready=False)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        return super().wait_ready(timeout)

    # control shortcuts
    def ask(self, message: dict) -> dict:
        return checked(self.control, message)

    def thresholds(self) -> dict:
        return self.ask({"cmd": "thresholds"})["thresholds"]

    def set_thresholds(self, **values: int) -> dict:
        return self.ask({"cmd": "thresholds", "set": values})["thresholds"]

    def stats(self) -> dict:
        return self.ask({"cmd": "stats"})["stats"]

    def reset_stats(self) -> None:
        self.ask({"cmd": "stats", "reset": True})

    def counts(self) -> dict:
        """{(class, path): requests} from `stats`."""
        classes = self.stats()["classes"]
        return {(c, p): classes[c][p]["requests"] for c in CLASSES for p in ("inline", "pool")}

    def client(self, export_name: str = ""):
        return nbd_client(self.socket, export_name)


class Servers:
    """Starts servers in one directory and stops every one of them at teardown."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Server] = []

    def start(self, image: Image, *options: str, control: Path | None = None,
              ready: bool = True, wrapper: tuple[str, ...] = (),
              env: dict | None = None) -> Server:
        server = Server(image, self.directory, f"s{len(self.started)}", *options,
                        control=control, wrapper=wrapper, env=env)
        self.started.append(server)
        return server.wait_ready() if ready else server

    def stop_all(self) -> None:
        """Stop every server, even if stopping one of them fails; then report that."""
        errors = []
        for server in self.started:
            try:
                server.stop()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


def run(argv: list, timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
    """Run a command that must end by itself; killed by pid (and failed) if it does not."""
    return run_to_end(argv, timeout, **kwargs)


def ctl(control, *args: str) -> subprocess.CompletedProcess:
    """`nbd-verity ctl --control PATH ARGS...` as a user runs it."""
    return run([NBD_VERITY, "ctl", "--control", str(control), *args], env=clean_env())


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single stderr line of a failed command (non-zero, nothing on stdout)."""
    assert result.returncode != 0, f"expected a failure, got 0:\n{result.stdout}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert result.stdout == "", result.stdout
    assert "Traceback" not in result.stderr
    return lines[0]

"""Fixtures for `nbd-verity tune`: one small image, and real servers that always stop.

The image is 4 MiB of seeded random data with its tree from `nbd-verity format`. A server
is `nbd-verity serve` (which execs nbdkit) on a Unix socket with a control socket, started
in the foreground and stopped by its pid when the test ends, whatever happened. Ready means
the pid file exists and the control socket answers (polled, never slept on).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbd_verity.cli_ctl import control_request
from nbd_verity.procs import stop_process

START_TIMEOUT = 30.0  # the machine is shared and small
PROJECT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Image:
    data: Path
    hash: Path
    root: str


@dataclass
class Server:
    proc: subprocess.Popen
    socket: str
    control: str

    def ctl(self, request: dict) -> dict:
        """One control request, answered."""
        return control_request(self.control, request)

    def table(self) -> dict[str, int]:
        return self.ctl({"cmd": "thresholds"})["thresholds"]


@pytest.fixture(scope="session")
def tune_image(tools, tmp_path_factory) -> Image:
    directory = tmp_path_factory.mktemp("tune")
    data = tools.write_image(directory / "data.img", 4 << 20, seed=7)
    hash_path, root_file = directory / "hash.img", directory / "root"
    result = tools.ours("format", "--root-hash-file", root_file, data, hash_path)
    assert result.returncode == 0, result.stderr
    return Image(data, hash_path, root_file.read_text().strip())


@pytest.fixture
def server(tools, tune_image):
    """A running `nbd-verity serve` with a control socket; stopped by pid afterwards."""
    workdir = tempfile.mkdtemp(prefix="nvt-")  # short: sun_path holds 108 bytes
    sock, ctl, pid = (os.path.join(workdir, n) for n in ("nbd.sock", "ctl.sock", "pid"))
    log = open(os.path.join(workdir, "log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([tools.nbd_verity_path, "serve", tune_image.data, tune_image.hash,
                             tune_image.root, "--unix", sock, "--control", ctl, "--pid-file",
                             pid], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    running = Server(proc, sock, ctl)
    try:
        _wait_ready(running, pid, workdir)
        yield running
    finally:
        stop_process(proc)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(server: Server, pid_file: str, workdir: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited: {Path(workdir, 'log').read_text()}")
        with contextlib.suppress(OSError, ValueError):
            if os.path.exists(pid_file) and server.ctl({"cmd": "status"})["ok"]:
                return
        time.sleep(0.01)  # polling interval: the loop checks the control socket
    raise AssertionError(f"server not ready within {START_TIMEOUT} s")

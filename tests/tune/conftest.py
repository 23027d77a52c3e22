"""Fixtures for `nbd-verity tune`: one small image, and real servers that always stop.

The image is 4 MiB of seeded random data with its tree from `nbd-verity format`. A server
is `nbd-verity serve` (which execs nbdkit) on a Unix socket with a control socket, started
and stopped by its pid by nbd_verity.launch when the test ends, whatever happened.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbd_verity.control.protocol import request as control_request
from nbd_verity.launch import Launched

PROJECT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Image:
    data: Path
    hash: Path
    root: str


@dataclass
class Server:
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
    """A running `nbd-verity serve` with a control socket, its clients allowed to name
    rt (tune measures every class); stopped by pid afterwards."""
    yield from serving(tools, tune_image, "--allow-class", "rt")


@pytest.fixture
def server_without_rt(tools, tune_image):
    """The same, where naming rt is not allowed (the default)."""
    yield from serving(tools, tune_image)


def serving(tools, tune_image, *options: str):
    workdir = tempfile.mkdtemp(prefix="nvt-")  # short: sun_path holds 108 bytes
    sock, ctl, pid = (os.path.join(workdir, n) for n in ("nbd.sock", "ctl.sock", "pid"))
    launched = Launched([tools.nbd_verity_path, "serve", tune_image.data, tune_image.hash,
                         tune_image.root, "--unix", sock, "--control", ctl, "--pid-file", pid,
                         *options],
                        socket=sock, pid_file=pid, control=ctl,
                        log_path=os.path.join(workdir, "log"))
    try:
        with launched.start():
            yield Server(sock, ctl)
    finally:
        launched.stop()
        shutil.rmtree(workdir, ignore_errors=True)

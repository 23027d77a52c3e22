"""Fixtures for the server tests: images made by veritysetup, servers that always stop.

The helpers themselves live in serverlib.py (a unique module name: several test folders
have a conftest.py, so tests must not import from "conftest").
"""

from __future__ import annotations

import os
import shutil
import tempfile

import nbd
import pytest

from .serverlib import (
    DEFAULT_ENGINE,
    MIB,
    NBD_VERITY,
    NBDKIT,
    PLUGIN,
    PROJECT,
    Image,
    Server,
    close_handle,
    make_image,
    random_bytes,
)


@pytest.fixture
def sockdir():
    """A short directory for sockets (sun_path holds 108 bytes; tmp_path can be longer)."""
    path = tempfile.mkdtemp(prefix="nvsrv-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine(request) -> str:
    """The engine servers hash with: DEFAULT_ENGINE, or each of serverlib.ENGINES in a test
    parametrised with `@pytest.mark.parametrize("engine", ENGINES, indirect=True)`."""
    return getattr(request, "param", DEFAULT_ENGINE)


@pytest.fixture
def servers(sockdir, tmp_path, engine):
    """Factory fixture: start(image, **keys) runs `nbdkit python plugin.py` on a socket,
    serve_cli(args) runs `nbd-verity serve`; all are stopped by pid at teardown. They run
    on the `engine` fixture's engine."""
    started: list[Server] = []

    class Factory:
        count = 0

        def _paths(self):
            Factory.count += 1
            n = Factory.count
            return (os.path.join(sockdir, f"{n}.sock"), os.path.join(sockdir, f"{n}.pid"),
                    tmp_path / f"server{n}.log")

        def plugin_argv(self, pairs, socket_path, pid_file) -> list[str]:
            return [NBDKIT, "-f", "-r", "--exit-with-parent", "-U", socket_path, "-P",
                    pid_file, "python", str(PLUGIN), *[f"{k}={v}" for k, v in pairs]]

        def start(self, image: Image, ready: bool = True, **keys) -> Server:
            sock, pid, log = self._paths()
            server = Server(self.plugin_argv(image.pairs(**keys), sock, pid), sock, pid, log,
                            engine)
            started.append(server)
            return server.wait_ready() if ready else server

        def serve_cli(self, args: list[str], ready: bool = True) -> Server:
            sock, pid, log = self._paths()
            argv = [str(NBD_VERITY), "serve", *args, "--unix", sock, "--pid-file", pid,
                    "--exit-with-parent"]
            server = Server(argv, sock, pid, log, engine)
            started.append(server)
            return server.wait_ready() if ready else server

    yield Factory()
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def shared_server(default_image, tmp_path_factory):
    """One server for a whole module (for hypothesis, which reruns a test many times)."""
    directory = tempfile.mkdtemp(prefix="nvsrv-")
    sock, pid = os.path.join(directory, "s.sock"), os.path.join(directory, "s.pid")
    argv = [NBDKIT, "-f", "-r", "--exit-with-parent", "-U", sock, "-P", pid, "python",
            str(PLUGIN),
            *[f"{k}={v}" for k, v in default_image.pairs()]]
    server = Server(argv, sock, pid, tmp_path_factory.mktemp("shared") / "server.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def captive():
    """connect_command as libnbd's own tests do: `nbdkit -s --exit-with-parent` per handle."""
    handles = []

    def connect(image: Image, **keys):
        h = nbd.NBD()
        handles.append(h)
        argv = ["env", f"PYTHONPATH={PROJECT}", NBDKIT, "-s", "--exit-with-parent", "-r",
                "python", str(PLUGIN), *[f"{k}={v}" for k, v in image.pairs(**keys)]]
        h.connect_command(argv)
        return h

    yield connect
    for h in handles:
        close_handle(h)  # libnbd waits for the captive nbdkit to exit


# -- shared images (read-only: tests that damage one use image.copy()) -----------------


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="session")
def default_image(images_dir) -> Image:
    """4 MiB of random data, 4096/4096 sha256, superblock: 8 level-0 blocks, 2 levels."""
    return make_image(images_dir / "default", random_bytes(1, 4 * MIB))


@pytest.fixture(scope="session")
def small_block_image(images_dir) -> Image:
    """256 KiB in 512-byte data and hash blocks: 16 digests per block, 3 levels."""
    return make_image(images_dir / "small", random_bytes(2, 256 << 10),
                      "--data-block-size=512", "--hash-block-size=512")

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
    DEFAULT_PATH,
    FAST_PATH_ENV,
    MIB,
    NBD_VERITY,
    NBDKIT,
    PATHS,
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


# Suites whose every server test runs on both read paths (the fast path's answers, errors
# and counters must be the general path's): the rest run on DEFAULT_PATH.
FAST_PATH_BOTH = {"test_corruption", "test_readback", "test_stats", "test_engine",
                  "test_cache", "test_hostile", "test_faults", "test_truncation"}


def pytest_generate_tests(metafunc):
    suite = metafunc.module.__name__.rpartition(".")[2]  # tests.server.test_x: test_x
    if ("read_path" in metafunc.fixturenames and suite in FAST_PATH_BOTH
            and not any(m.name == "parametrize" and "read_path" in m.args[0]
                        for m in metafunc.definition.iter_markers())):
        metafunc.parametrize("read_path", PATHS, indirect=True)


@pytest.fixture
def read_path(request) -> str:
    """The read path servers take: 'fast' (the fast path where it applies) or 'general'
    (NBD_VERITY_FAST_PATH=0); both in the FAST_PATH_BOTH suites."""
    return getattr(request, "param", DEFAULT_PATH)


@pytest.fixture
def servers(sockdir, tmp_path, engine, read_path):
    """Factory fixture: start(image, **keys) runs `nbdkit python plugin.py` on a socket,
    serve_cli(args) runs `nbd-verity serve`; all are stopped by pid at teardown. They run
    on the `engine` fixture's engine and the `read_path` fixture's path."""
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

        def start(self, image: Image, ready: bool = True, path: str | None = None,
                  **keys) -> Server:
            """path: the read path of this server, if not the fixture's."""
            sock, pid, log = self._paths()
            server = Server(self.plugin_argv(image.pairs(**keys), sock, pid), sock, pid, log,
                            engine, path or read_path)
            started.append(server)
            return server.wait_ready() if ready else server

        def serve_cli(self, args: list[str], ready: bool = True) -> Server:
            sock, pid, log = self._paths()
            argv = [str(NBD_VERITY), "serve", *args, "--unix", sock, "--pid-file", pid,
                    "--exit-with-parent"]
            server = Server(argv, sock, pid, log, engine, read_path)
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
def captive(read_path):
    """connect_command as libnbd's own tests do: `nbdkit -s --exit-with-parent` per handle."""
    handles = []
    general = [f"{FAST_PATH_ENV}=0"] if read_path == "general" else []

    def connect(image: Image, **keys):
        h = nbd.NBD()
        handles.append(h)
        argv = ["env", f"PYTHONPATH={PROJECT}", *general, NBDKIT, "-s", "--exit-with-parent", "-r",
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


@pytest.fixture
def upstreams():
    """Upstream servers a test starts (tests/server/upstreams.py), stopped after it."""
    started = []
    yield started
    for server in started:
        server.stop()

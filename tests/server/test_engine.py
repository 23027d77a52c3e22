"""The engine a real server hashes with, and the same verdicts from both engines.

Servers run on the native engine unless NBD_VERITY_PURE=1 is set (in the test run, or by
a test parametrised with both ENGINES); which one ran is read from the server process
itself: the pure engine never imports nbd_verity.format._native, so its .so is not mapped.
"""

from __future__ import annotations

import pytest

from nbd_verity.format.digest import engine_name
from nbd_verity.launch import NBDKIT, run_to_end
from nbd_verity.serve.nbdkit_compat import nbdkit_version, version_text

from .serverlib import (
    DEFAULT_ENGINE,
    ENGINES,
    MIB,
    NBD_VERITY,
    expect_eio,
    flip_byte,
    make_image,
    random_bytes,
    server_env,
)

BAD = 200  # a corrupted data block, inside the second 256 KiB pool chunk of a 1 MiB read


def test_the_suite_runs_on_the_native_engine_by_default(default_image, servers):
    """Without NBD_VERITY_PURE in the test run, every server test exercises native code."""
    if DEFAULT_ENGINE == "python":
        pytest.skip("this run forces the pure engine (NBD_VERITY_PURE=1)")
    assert engine_name().startswith("native (OpenSSL "), engine_name()
    server = servers.start(default_image)
    assert server.connect().pread(4096, 0) == default_image.expected(0, 4096)
    assert server.loaded_native()


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_the_engine_is_the_one_asked_for(default_image, servers, engine):
    server = servers.start(default_image)
    assert server.connect().pread(4096, 0) == default_image.expected(0, 4096)
    assert server.loaded_native() == (engine == "native")


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("path", ["inline", "pool"])
def test_both_engines_fail_the_same_requests(default_image, servers, tmp_path, path):
    """Inline (one native call per leaf) and pool (chunks verified in parallel) reads of a
    corrupted block get EIO; every request that does not cover it reads back."""
    image = default_image.copy(tmp_path)
    dbs = image.data_block_size
    flip_byte(image.data, BAD * dbs + 100)
    keys = {"threshold": "be=0"} if path == "pool" else {"threshold": f"be={32 * MIB}"}
    h = servers.start(image, readahead="false", **keys).connect()
    bad = BAD * dbs
    for count, offset in [(dbs, bad), (1, bad + 100), (1 * MIB, 0), (2 * MIB, 0),
                          (64 * dbs, bad - 63 * dbs), (8 * dbs, bad - 7 * dbs + 1)]:
        expect_eio(h, count, offset)
    for count, offset in [(dbs, bad - dbs), (dbs, bad + dbs), (bad, 0), (1 * MIB, 1 * MIB),
                          (2 * MIB, 2 * MIB), (3 * dbs, bad + dbs + 5)]:
        assert h.pread(count, offset) == image.expected(offset, count), (offset, count)


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_both_engines_read_a_format0_sha1_image(servers, tmp_path):
    """Packed 20-byte slots (format 0), the salt after the block."""
    image = make_image(tmp_path, random_bytes(7, 1 * MIB), "--format=0", "--hash=sha1",
                       "--salt=0011223344")
    h = servers.start(image).connect()
    assert h.pread(image.size, 0) == image.expected()
    flip_byte(image.data, 5 * 4096)
    expect_eio(h, 4096, 5 * 4096)


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_version_and_start_up_line_name_the_engine(default_image, servers, engine):
    """`nbd-verity --version` and serve's start-up line say which engine hashes, and on
    which nbdkit."""
    server = servers.serve_cli([str(default_image.data), str(default_image.hash),
                                default_image.root])
    assert f", {engine} engine)" in server.log(), server.log()
    running = version_text(nbdkit_version(NBDKIT))
    assert running != "unknown" and f"on nbdkit {running}\n" in server.log(), server.log()
    done = run_to_end([NBD_VERITY, "--version"], env=server_env(engine))
    assert done.returncode == 0, done.stderr
    expected = "hashing engine: native (OpenSSL " if engine == "native" else \
        "hashing engine: python"
    assert expected in done.stdout
    assert f"\nnbdkit: {running} ({NBDKIT})\n" in done.stdout, done.stdout

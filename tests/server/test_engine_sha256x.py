"""serve's start-up line and `--version` say which SHA-256 path a real server runs.

On a CPU with the SHA extensions a sha256 device hashes on "SHA-NI x2"; with
NBD_VERITY_NO_SHANI=1 (or without them) on "OpenSSL EVP"; a sha1 device always on EVP.
"""

from __future__ import annotations

import pytest

from nbd_verity.format import digest
from nbd_verity.launch import run_to_end

from .serverlib import DEFAULT_ENGINE, NBD_VERITY, make_image, random_bytes, server_env

pytestmark = pytest.mark.skipif(DEFAULT_ENGINE == "python" or digest._native is None,
                                reason="this run forces the pure engine (NBD_VERITY_PURE=1)")
MIB = 1 << 20


def has_shani() -> bool:
    return digest._native.cpu_has_sha()


@pytest.mark.parametrize("no_shani", [False, True], ids=["default", "NBD_VERITY_NO_SHANI=1"])
def test_start_up_line_and_version_name_the_sha256_path(default_image, servers, monkeypatch,
                                                        no_shani):
    if no_shani:
        monkeypatch.setenv("NBD_VERITY_NO_SHANI", "1")
    else:
        monkeypatch.delenv("NBD_VERITY_NO_SHANI", raising=False)
    fast = has_shani() and not no_shani
    server = servers.serve_cli([str(default_image.data), str(default_image.hash),
                                default_image.root])
    assert server.connect().pread(8192, 0) == default_image.expected(0, 8192)
    path = "SHA-NI x2" if fast else "OpenSSL EVP"
    assert f"(sha256, 2 levels, {path}, native engine)" in server.log(), server.log()
    done = run_to_end([NBD_VERITY, "--version"], env=server_env("native"))
    assert done.returncode == 0, done.stderr
    assert f", sha256: {'SHA-NI x2' if fast else 'EVP'})" in done.stdout, done.stdout


def test_a_sha1_device_says_openssl_evp(servers, tmp_path):
    image = make_image(tmp_path, random_bytes(9, 1 * MIB), "--hash=sha1")
    server = servers.serve_cli([str(image.data), str(image.hash), image.root])
    assert server.connect().pread(4096, 0) == image.expected(0, 4096)
    assert ", OpenSSL EVP, native engine)" in server.log(), server.log()
